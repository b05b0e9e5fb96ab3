"""`polar-mitm rollout list | status ID | cancel ID`: a rollout server's tasks from the command line.

    polar-mitm rollout list                    every task: status, sessions per status
    polar-mitm rollout status hello [--wait]   one task's sessions and summary; --wait follows it to its end
    polar-mitm rollout cancel hello            cancel its unfinished sessions (what they recorded stays in the store)

The calls are `polar_mitm.client.RolloutClient`'s (GET /tasks, GET /tasks/{id}, DELETE /tasks/{id}); --server
defaults to $POLAR_MITM_ROLLOUT, else the port `rollout serve` listens on by default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

DEFAULT_PORT = 8070
DEFAULT_SERVER = f"http://127.0.0.1:{DEFAULT_PORT}"
# how long `cancel` waits for the cancelled sessions to end (their sandboxes removed) before it answers anyway
CANCEL_WAIT_S = 60.0


def add_server_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("POLAR_MITM_ROLLOUT", DEFAULT_SERVER), help=f"rollout server URL (default $POLAR_MITM_ROLLOUT or {DEFAULT_SERVER})")
    # the default is read from the environment, never shown in --help
    parser.add_argument("--api-token", default=os.environ.get("POLAR_MITM_API_TOKEN") or None, metavar="TOKEN", help="the server's bearer token (default $POLAR_MITM_API_TOKEN)")


def register(commands: argparse._SubParsersAction) -> None:
    """Add list, status and cancel to `polar-mitm rollout`'s sub-commands."""
    listing = commands.add_parser("list", help="the server's tasks: status and sessions per status", description="Every task the rollout server holds, newest last.")
    add_server_argument(listing)
    listing.add_argument("--json", action="store_true", help="print the TaskResults as JSON")
    listing.set_defaults(func=_list)

    status = commands.add_parser("status", help="one task: its sessions and summary (--wait: follow it to its end)", description="One task's sessions and summary, as `rollout submit --wait` prints them.")
    status.add_argument("task_id")
    add_server_argument(status)
    status.add_argument("--wait", action="store_true", help="follow the task with a progress bar until it ends (exit 1 unless every session completed)")
    status.add_argument("--json", action="store_true", help="print the TaskResult as JSON")
    status.set_defaults(func=_status)

    cancel = commands.add_parser("cancel", help="cancel a task's unfinished sessions", description="Cancel a task's unfinished sessions: their sandboxes are removed, what they recorded stays in the store, sessions that had ended keep their results.")
    cancel.add_argument("task_id")
    add_server_argument(cancel)
    cancel.set_defaults(func=_cancel)


def _list(args: argparse.Namespace) -> int:
    from polar_mitm.client import RolloutClient

    with RolloutClient(args.server, token=args.api_token) as client:
        tasks = _call(args, lambda: client.tasks())
    if tasks is None:
        return 2
    if args.json:
        print(json.dumps(tasks))
        return 0
    if not tasks:
        print(f"no tasks on the rollout server at {client.url}")
        return 0
    print(task_table(tasks))
    return 0


def task_table(tasks: list[dict[str, Any]]) -> str:
    """One row per task: id, status, sessions done of all, sessions per status, when it was accepted."""
    from polar_mitm.rollout.models import FINAL_STATUSES

    header = ("task", "status", "done", "sessions", "created")
    rows = [header]
    for task in sorted(tasks, key=lambda t: t["created_at"]):
        sessions = task["sessions"]
        done = sum(s["status"] in FINAL_STATUSES for s in sessions)
        counts = ", ".join(f"{status} {n}" for status, n in sorted(task["counts"].items()))
        rows.append((task["task_id"], task["status"], f"{done}/{len(sessions)}", counts, str(task["created_at"])[:19].replace("T", " ")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows)


def _status(args: argparse.Namespace) -> int:
    from polar_mitm.client import RolloutClient
    from polar_mitm.rollout.console import Progress, summary_table

    with RolloutClient(args.server, timeout=60, token=args.api_token) as client:
        if args.wait:
            try:
                result = _call(args, lambda: client.wait(args.task_id, timeout=None, on_poll=Progress(sys.stderr)))
            except KeyboardInterrupt:
                end_progress_bar()
                print(still_running_line(args.task_id, args.server, reattach=f"`polar-mitm rollout status {args.task_id}{server_flag(args.server)} --wait` follows it again"), file=sys.stderr)
                return 130
        else:
            result = _call(args, lambda: client.task(args.task_id))
    if result is None:
        return 1 if getattr(args, "not_found", False) else 2
    if args.json:
        print(json.dumps(result))
    else:
        print(summary_table(result))
        if result["status"] == "running" and not args.wait:
            print(f"still running: `polar-mitm rollout status {args.task_id}{server_flag(args.server)} --wait` follows it to its end")
    if args.wait:
        return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from polar_mitm.client import RolloutClient
    from polar_mitm.errors import ClientError
    from polar_mitm.rollout.console import task_line
    from polar_mitm.rollout.models import FINAL_STATUSES

    with RolloutClient(args.server, timeout=60, token=args.api_token) as client:
        before = _call(args, lambda: client.task(args.task_id))
        if before is None:
            return 1 if getattr(args, "not_found", False) else 2
        if before["status"] != "running":
            print(f"task {args.task_id}: already ended, nothing to cancel ({task_line(before)})")
            return 0
        unfinished = [s["session_id"] for s in before["sessions"] if s["status"] not in FINAL_STATUSES]
        if _call(args, lambda: client.cancel(args.task_id)) is None:
            return 2
        try:
            after = client.wait(args.task_id, timeout=CANCEL_WAIT_S, poll_seconds=0.5)
        except ClientError:
            print(f"task {args.task_id}: cancelling {len(unfinished)} unfinished sessions ({', '.join(unfinished)}); they had not all ended after {CANCEL_WAIT_S:.0f}s")
            return 0
    print(f"task {args.task_id}: cancelled {len(unfinished)} unfinished session{'s' if len(unfinished) != 1 else ''}; what they recorded stays in the store")
    print(task_line(after))
    return 0


def _call[T](args: argparse.Namespace, call: Callable[[], T]) -> T | None:
    """call(), or None after printing why it failed (a 404 sets args.not_found: exit 1, else 2)."""
    from polar_mitm.errors import ClientError, ServerRefused

    try:
        return call()
    except ServerRefused as refused:
        args.not_found = refused.status == 404
        where = f"on the rollout server at {args.server}" if args.not_found else f"(the rollout server at {args.server}, HTTP {refused.status})"
        print(f"polar-mitm rollout {args.rollout_command}: {refused.server_message} {where}", file=sys.stderr)
    except ClientError as error:
        print(f"polar-mitm rollout {args.rollout_command}: {error}", file=sys.stderr)
    return None


def server_flag(server: str) -> str:
    """` --server URL` when `server` is not the one the commands default to, so that a printed command runs as is."""
    return "" if server.rstrip("/") == os.environ.get("POLAR_MITM_ROLLOUT", DEFAULT_SERVER).rstrip("/") else f" --server {server}"


def still_running_line(task_id: str, server: str, reattach: str) -> str:
    """What Ctrl-C on a command that follows a task leaves: the task runs on, on the server; how to see it again."""
    return f"polar-mitm rollout: stopped following task {task_id}; it goes on on the rollout server at {server}: `polar-mitm rollout status {task_id}{server_flag(server)}` shows it, {reattach}"


def end_progress_bar() -> None:
    """On a terminal the progress bar is redrawn in place without a newline: end its line before printing another."""
    if sys.stderr.isatty():
        print(file=sys.stderr)
