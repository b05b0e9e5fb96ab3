"""What `polar-mitm rollout submit|run` does around the rollout API client: read a task file, submit it, follow it
with a progress bar, print its summary. The HTTP calls, their errors and the wait are `AsyncRolloutClient`'s
(polar_mitm/api_clients.py); nothing here talks to the server by itself.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from polar_mitm.api_clients import AsyncRolloutClient
from polar_mitm.errors import ClientError, ServerRefused
from polar_mitm.rollout.models import FINAL_STATUSES

JSON = dict[str, Any]


def load_task(path: Path) -> JSON:
    """The task file as a dict, relative paths resolved against its directory."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ClientError(f"cannot read task file {path}: {error}") from error
    if not isinstance(data, dict):
        raise ClientError(f"{path}: a task file is a mapping (a TaskRequest)")
    base = path.resolve().parent
    for step in (data.get("runtime") or {}).get("prepare") or []:
        upload = step.get("upload") if isinstance(step, dict) else None
        if isinstance(upload, dict) and isinstance(upload.get("source"), str) and not os.path.isabs(upload["source"]):
            upload["source"] = str(base / upload["source"])
    evaluator = data.get("evaluator")
    if isinstance(evaluator, dict) and isinstance(evaluator.get("python"), str):
        target, _, name = evaluator["python"].rpartition(":")
        if target.endswith(".py") and not os.path.isabs(target):
            evaluator["python"] = f"{base / target}:{name}"
    return data


def progress_line(result: JSON, started: float, width: int = 30) -> str:
    sessions = result["sessions"]
    done = sum(s["status"] in FINAL_STATUSES for s in sessions)
    filled = round(width * done / max(len(sessions), 1))
    counts = ", ".join(f"{status} {n}" for status, n in sorted(result["counts"].items()))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{len(sessions)} sessions done  ({counts})  {time.monotonic() - started:.0f}s"


class Progress:
    """The wait's `on_poll`: a bar redrawn in place on a terminal; elsewhere (a log) one line per change."""

    def __init__(self, out: TextIO):
        self.out = out
        self.interactive = out.isatty()
        self.started = time.monotonic()
        self.last = ""

    def __call__(self, result: JSON) -> None:
        line = progress_line(result, self.started)
        if self.interactive:
            print(f"\r{line}\x1b[K", end="", file=self.out, flush=True)
        elif line.split("  ")[0:2] != self.last.split("  ")[0:2]:
            print(line, file=self.out, flush=True)  # bar and counts changed (not only the seconds)
        self.last = line
        if result["status"] != "running" and self.interactive:
            print(file=self.out)


def summary_table(result: JSON) -> str:
    header = ("session", "status", "reward", "exchanges", "sequences", "prepare_s", "run_s", "error")
    rows = []
    for s in result["sessions"]:
        timings = s.get("timings") or {}
        rows.append((
            s["session_id"], s["status"], "" if s.get("reward") is None else f"{s['reward']:g}", str(s.get("n_exchanges", 0)),
            str((s.get("trajectory") or {}).get("sequences", "")),
            _seconds(timings.get("preparing")), _seconds(timings.get("running")), (s.get("error") or "")[:70],
        ))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    stats = result.get("trajectory_stats") or {}
    lines.append("")
    lines.append(task_line(result))
    lines.append(reward_line(result))
    if result.get("trajectories"):
        lines.append(f"trajectories: {result['trajectories']} ({stats.get('sequences', 0)} sequences, {stats.get('sampled_tokens', 0)} sampled tokens)")
    elif stats.get("error"):
        lines.append(f"trajectories: not written ({stats['error']})")
    lines.extend(delivery_lines(result))
    return "\n".join(lines)


def task_line(result: JSON) -> str:
    """The task in one line. A task's own status says only whether its sessions are all over (`completed`), so the
    line says how many of them completed: a task whose sessions all timed out did not complete. Callbacks that
    failed are said too: a task whose results never reached the trainer is not done with."""
    sessions = len(result["sessions"])
    completed = result["counts"].get("completed", 0)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items()))
    if result["status"] == "completed":
        state = f"all sessions ended, {completed} of {sessions} completed" if completed < sessions else f"completed ({sessions} of {sessions} sessions)"
    else:
        state = result["status"]
    deliveries = result.get("deliveries") or []
    failed = sum(d["status"] == "failed" for d in deliveries)
    undelivered = f"; {failed} of {len(deliveries)} callback deliveries failed" if failed else ""
    return f"task {result['task_id']}: {state}; {counts}{undelivered}"


def reward_line(result: JSON) -> str:
    """The group's rewards: mean ± std over the sessions its advantages are taken over, from the task's
    trajectory stats (the assembler's GroupStats), and whether the group has any signal: with fewer than two
    scored sessions or all their rewards equal, every advantage is 0 and the group trains nothing. Without group
    stats (nothing assembled): mean ± std of the completed sessions' rewards."""
    group = (result.get("trajectory_stats") or {}).get("group")
    if isinstance(group, dict) and group.get("scored_sessions") is not None:
        scored, mean, std, no_signal = group["scored_sessions"], group.get("mean"), group.get("std"), bool(group.get("no_signal"))
    else:
        rewards = [s["reward"] for s in result["sessions"] if s["status"] == "completed" and s.get("reward") is not None]
        scored, no_signal = len(rewards), False
        mean = statistics.fmean(rewards) if rewards else None
        std = statistics.stdev(rewards) if len(rewards) > 1 else None
    if not scored or mean is None:
        return "rewards: none scored (no evaluator, or no session completed with a reward)"
    spread = f" ± {std:.3g}" if std is not None else ""
    line = f"rewards: mean {mean:.3g}{spread} over {scored} scored session{'s' if scored != 1 else ''}"
    if no_signal:
        why = "fewer than two sessions scored" if scored < 2 else "every reward is the same"
        line += f"; no signal: {why}, so every advantage is 0"
    return line


def delivery_lines(result: JSON) -> list[str]:
    """The callbacks: counts by status, then each one not delivered, by its delivery id. (The TaskResult's own
    delivery starts when the task ends, so a summary printed then shows it pending.)"""
    deliveries = result.get("deliveries") or []
    if not deliveries:
        return []
    counts = Counter(d["status"] for d in deliveries)
    urls = sorted({d["url"] for d in deliveries})
    lines = [f"callbacks to {', '.join(urls)}: " + ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))]
    for d in deliveries:
        if d["status"] != "delivered":
            error = f": {d['last_error']}" if d.get("last_error") else ""
            lines.append(f"  {d['status']} {d['delivery_id']} after {d.get('attempts', 0)} attempt{'s' if d.get('attempts') != 1 else ''}{error}"[:300])
    return lines


def _seconds(timing: JSON | None) -> str:
    return "" if not timing or timing.get("seconds") is None else f"{timing['seconds']:.1f}"


async def submit_and_follow(server: str, task: JSON, wait: bool, out: TextIO | None = None, token: str | None = None) -> JSON:
    """Submit `task`; with `wait`, follow it to its end on `out` (default: stderr as it is then) and return its
    TaskResult (else the TaskAccepted). Raises ClientError (the server refused the task, could not be reached, or
    stopped answering)."""
    out = out or sys.stderr
    async with AsyncRolloutClient(server, timeout=60, token=token) as client:
        try:
            accepted = await client.submit(task)
        except ServerRefused as refused:
            raise ClientError(f"the server refused the task (HTTP {refused.status}): {refused.server_message}") from refused
        print(f"task {accepted['task_id']}: {len(accepted['session_ids'])} sessions ({', '.join(accepted['session_ids'])})", file=out, flush=True)
        if not wait:
            return accepted
        return await client.wait(accepted["task_id"], timeout=None, poll_seconds=1.0, on_poll=Progress(out))
