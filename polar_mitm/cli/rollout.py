"""`polar-mitm rollout`: serve the rollout API, submit tasks to it, or do both for one task file.

    polar-mitm rollout serve --port 8070 --upstream http://127.0.0.1:8011/v1 --db polar.duckdb
    polar-mitm rollout submit examples/hello-task.yaml --wait
    polar-mitm rollout run examples/hello-task.yaml --db polar.duckdb      # the local engine by default
    polar-mitm rollout list | status TASK_ID [--wait] | cancel TASK_ID

Ctrl-C stops what the command itself does, in one line: `submit --wait` (and `status --wait`) stop following and
the task goes on on the server (re-running `submit` with a task file that names its task_id re-attaches to it);
`serve` cancels its unfinished sessions and stops; `run` cancels its task, waits for the sessions to end (their
sandboxes removed, what they recorded kept in the store), then stops. Exit status 130.

A task file is a TaskRequest in YAML (or JSON). Relative paths in it (upload sources, a 'file.py:function'
evaluator) are resolved against the file's directory before it is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from polar_mitm import api_auth
from polar_mitm.cli import rollout_tasks
from polar_mitm.cli.rollout_tasks import DEFAULT_PORT, add_server_argument
from polar_mitm.errors import ClientError
from polar_mitm.gateway import options

# the node's gateway options land in args.gateway_<name> (--port is the API's)
GATEWAY = "gateway_"
# gateway options GatewayNode sets itself (rollout/node.py NODE_OPTIONS), so not flags here
NODE_SETS = ("host", "require_auth", "web", "web_port")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollout", help="the rollout server: tasks -> sandboxed harness sessions -> evaluated trajectories", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="rollout_command", required=True)

    serve = commands.add_parser("serve", help="run the rollout HTTP API with its own gateway node")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"API port (default {DEFAULT_PORT})")
    serve.add_argument("--host", default="127.0.0.1", help="API listen address (default 127.0.0.1; beyond loopback --api-token is required)")
    serve.add_argument(
        "--api-token", default=api_auth.env_token(api_auth.ROLLOUT_TOKEN_ENV), metavar="TOKEN",
        help=f"bearer token every API call must carry (default ${api_auth.ROLLOUT_TOKEN_ENV}; required beyond loopback)",
    )
    _node_arguments(serve)
    serve.add_argument(
        "--ray", nargs="?", const="auto", metavar="ADDRESS",
        help="scale out: one gateway node per Ray node with the polar_node resource (ADDRESS: the Ray cluster, default auto); node N's store is <db stem>.N.duckdb",
    )
    serve.add_argument("--head-db", type=Path, help="with --ray: the head's durable store of tasks, session states and callbacks (default <db stem>.head.duckdb)")
    serve.add_argument(
        "--node-data", choices=("auto", "shared", "pull"), default="auto",
        help="with --ray: read each node's store in place (shared: one machine or a shared file system), pull it to the head's disk through the node (pull), or in place where the head sees the same file, else pulled (auto, the default)",
    )
    serve.set_defaults(func=_serve, hosts_proxy=True)

    submit = commands.add_parser("submit", help="submit a task file to a running rollout server")
    submit.add_argument("task", type=Path, help="TaskRequest as YAML or JSON")
    add_server_argument(submit)
    submit.add_argument("--wait", action="store_true", help="follow the task with a progress bar and print its summary")
    submit.set_defaults(func=_submit)

    run = commands.add_parser("run", help="serve + submit + wait for one task file; prints a summary, leaves the store")
    run.add_argument("task", type=Path, help="TaskRequest as YAML or JSON")
    _node_arguments(run, upstream_required=False)
    run.set_defaults(func=_run, hosts_proxy=True)
    rollout_tasks.register(commands)


def _node_arguments(parser: argparse.ArgumentParser, upstream_required: bool = True) -> None:
    """The node's gateway options (every one of gateway/options.py but those the node sets itself), then its own."""
    overrides: dict[str, dict[str, Any]] = {
        "port": {"flags": ("--gateway-port",), "metavar": "GATEWAY_PORT", "default": 0, "help": "the node's gateway proxy port (default: a free one)"},
    }
    if not upstream_required:
        overrides["upstream"] = {"required": False, "default": None, "help": "engine base URL (default: the local engine, started or reused as by `polar-mitm engine start`)"}
    options.add_arguments(parser, exclude=NODE_SETS, overrides=overrides, prefix=GATEWAY)
    parser.add_argument("--output", type=Path, help="harness logs and Parquet files (default: <db>.rollouts/)")
    parser.add_argument(
        "--state", type=Path,
        help="the server's durable state: tasks, session states, callback deliveries; a server restarted on it reports its tasks again (serve: default <db>.rollout.duckdb; run: only when given, so a task file run again runs again; with --ray: --head-db)",
    )
    for stage, default in (("prepare", 2), ("run", 2), ("build", 1), ("evaluate", 2)):
        parser.add_argument(f"--{stage}-limit", type=int, default=default, help=f"sessions in the {stage} stage at once (default {default})")


def _node_config(args: argparse.Namespace):
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.session_run import StageLimits

    return NodeConfig(
        gateway=GatewayConfig(**options.from_arguments(args, prefix=GATEWAY)), output_dir=args.output,
        limits=StageLimits(prepare=args.prepare_limit, run=args.run_limit, build=args.build_limit, evaluate=args.evaluate_limit),
    )


def _uvicorn_server(args: argparse.Namespace, port: int, host: str = "127.0.0.1", api_token: str | None = None):
    import uvicorn

    from polar_mitm.rollout.server import LocalBackend, create_app

    if getattr(args, "ray", None):
        from polar_mitm.rollout.ray import ClusterConfig, RolloutCluster

        app = create_app(RolloutCluster(ClusterConfig(address=args.ray, node=_node_config(args), head_db=args.head_db, node_data=args.node_data)), api_token)
    else:
        app = create_app(LocalBackend(_node_config(args), state=state_path(args)), api_token)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info" if args.gateway_verbose else "warning", timeout_graceful_shutdown=10))


def state_path(args: argparse.Namespace) -> Path | None:
    """The single-machine server's state file: --state, else for `serve` <db>.rollout.duckdb beside the node's store.
    `run` is one task to its end: without --state it keeps none, so running a task file (with its task_id) again
    runs it again rather than answering with the task the last run left."""
    if args.state is not None:
        return args.state.resolve()
    return Path(args.gateway_db).with_suffix(".rollout.duckdb").resolve() if args.rollout_command == "serve" else None


def _serve(args: argparse.Namespace) -> int:
    from polar_mitm.rollout.server import serve

    if refusal := api_auth.refusal_to_listen(args.host, args.api_token, "the rollout server", f"--api-token or ${api_auth.ROLLOUT_TOKEN_ENV}"):
        print(f"polar-mitm rollout: {refusal}", file=sys.stderr)
        return 2
    server = _uvicorn_server(args, args.port, args.host, args.api_token)
    unfinished, signals = _unfinished_at_stop(server)
    try:
        # the backend (gateway node, or Ray cluster) first: one that cannot start is one line and exit 2
        if serve(server, f"polar-mitm rollout: serving on http://{args.host}:{args.port}{' (bearer token required)' if args.api_token else ''} (store {args.gateway_db})"):
            return 2
    except KeyboardInterrupt:  # uvicorn shut down cleanly first, then raised the Ctrl-C it had caught
        pass
    if signal.SIGINT not in signals:
        return 0
    # also where SIGINT was ignored before uvicorn caught it (a shell's background job): uvicorn's re-raise did nothing
    print(_serve_stopped_line(unfinished, args), file=sys.stderr)
    return 130


def _unfinished_at_stop(server: Any) -> tuple[dict[str, list[str]], list[int]]:
    """(task id -> its sessions not ended at the first Ctrl-C or SIGTERM, which the shutdown that follows cancels (the
    scheduler's close), the signals uvicorn stopped on). Read at the signal, before uvicorn starts shutting down."""
    unfinished: dict[str, list[str]] = {}
    signals: list[int] = []
    handle_exit = server.handle_exit

    def on_signal(sig: int, frame: Any) -> None:
        backend = getattr(server.config.app.state, "backend", None)  # the app's Backend (rollout/server.py)
        if not server.should_exit and backend is not None:
            for task in backend.scheduler.tasks.values():
                if pending := [session.session_id for session in task.sessions.values() if not session.done]:
                    unfinished[task.task_id] = pending
        signals.append(sig)
        handle_exit(sig, frame)

    server.handle_exit = on_signal
    return unfinished, signals


def _serve_stopped_line(unfinished: dict[str, list[str]], args: argparse.Namespace) -> str:
    """The one line Ctrl-C on `serve` ends with: the backend's close cancelled the sessions that had not ended."""
    sessions = sum(len(ids) for ids in unfinished.values())
    if not unfinished:
        return "polar-mitm rollout: stopped (Ctrl-C); no task was running"
    tasks = next(iter(unfinished)) if len(unfinished) == 1 else ", ".join(f"{task} ({len(ids)})" for task, ids in unfinished.items())
    stores = "the nodes' stores" if getattr(args, "ray", None) else str(Path(args.gateway_db).resolve())
    return f"polar-mitm rollout: stopped (Ctrl-C): cancelled {sessions} unfinished session{'s' if sessions != 1 else ''} of {'task' if len(unfinished) == 1 else 'tasks'} {tasks}; what they recorded is in {stores}; a new server does not resume them (submit the task again)"


def _submit(args: argparse.Namespace) -> int:
    import httpx

    from polar_mitm.client import RolloutClient
    from polar_mitm.rollout.console import Progress, load_task, submit_and_follow, summary_table

    task: dict[str, Any] = {}
    accepted: dict[str, Any] | None = None
    try:
        task = load_task(args.task)
        accepted = asyncio.run(submit_and_follow(args.server.rstrip("/"), task, wait=False, token=args.api_token))
        if not args.wait:
            print(accepted["task_id"])
            return 0
        with RolloutClient(args.server, timeout=60, token=args.api_token) as client:
            result = client.wait(accepted["task_id"], timeout=None, on_poll=Progress(sys.stderr))
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    except (OSError, httpx.HTTPError) as error:
        print(f"polar-mitm rollout: cannot reach the rollout server at {args.server}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        rollout_tasks.end_progress_bar()
        print(_submit_interrupted_line(args, task, accepted), file=sys.stderr)
        return 130
    print(summary_table(result))
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1


def _submit_interrupted_line(args: argparse.Namespace, task: dict[str, Any], accepted: dict[str, Any] | None) -> str:
    """What Ctrl-C on `submit` left. The server answers a task_id it holds, submitted again with the same request,
    with that task: so re-running the command re-attaches exactly when the task file names its task_id."""
    again = f"`polar-mitm rollout submit {args.task}{rollout_tasks.server_flag(args.server)} --wait`"
    if accepted is None:
        if task.get("task_id"):
            return f"polar-mitm rollout: interrupted before the server answered; task {task['task_id']} may have been accepted: {again} re-attaches to it (or submits it)"
        return f"polar-mitm rollout: interrupted before the server answered; the task may have been accepted: `polar-mitm rollout list{rollout_tasks.server_flag(args.server)}` shows the server's tasks"
    if task.get("task_id"):
        reattach = f"re-running {again} re-attaches to it"
    else:
        reattach = f"`polar-mitm rollout status {accepted['task_id']}{rollout_tasks.server_flag(args.server)} --wait` follows it again (re-running submit would start a new task: the file names no task_id)"
    return rollout_tasks.still_running_line(accepted["task_id"], args.server, reattach)


def _run(args: argparse.Namespace) -> int:
    """`rollout run`: the task to its end; then, when it used the local engine (left up for the next run, on purpose),
    one line saying so, with what it holds and how to stop it."""
    code = _run_task(args)
    if (engine := getattr(args, "local_engine", None)) is not None and (note := engine.left_running()):
        print(f"polar-mitm rollout: {note}", file=sys.stderr)
    return code


def _run_task(args: argparse.Namespace) -> int:
    from polar_mitm.client import AsyncRolloutClient
    from polar_mitm.rollout.console import Progress, load_task, submit_and_follow, summary_table
    from polar_mitm.util import free_port

    try:
        task = load_task(args.task)
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    if not args.gateway_upstream:
        from polar_mitm.local_engine import LocalEngine

        print("polar-mitm rollout: starting the local engine (first run builds it; later runs reuse it)...", file=sys.stderr, flush=True)
        try:
            args.local_engine = LocalEngine()
            args.gateway_upstream = args.local_engine.start()
        except Exception as error:  # noqa: BLE001 - any way the engine fails to start ends this command the same
            print(f"polar-mitm rollout: the local engine did not start ({error}); pass --upstream URL", file=sys.stderr)
            return 2
    port = free_port()
    server = _uvicorn_server(args, port)

    interrupted = False

    async def main() -> dict[str, Any] | None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
                return None
            await asyncio.sleep(0.05)
        # Ctrl-C from here on is ours, not uvicorn's (which would stop the server under the task): the first cancels
        # the task and waits for its sessions to end, a second stops at once
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_interrupt() -> None:
            nonlocal interrupted
            if stop.is_set():
                raise KeyboardInterrupt
            interrupted = True
            stop.set()

        loop.add_signal_handler(signal.SIGINT, on_interrupt)
        url = f"http://127.0.0.1:{port}"
        try:
            accepted = await submit_and_follow(url, task, wait=False)
            async with AsyncRolloutClient(url, timeout=60) as client:
                following = asyncio.create_task(client.wait(accepted["task_id"], timeout=None, on_poll=Progress(sys.stderr)))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not stop.is_set():
                    stopping.cancel()
                    return following.result()
                following.cancel()
                rollout_tasks.end_progress_bar()
                await client.cancel(accepted["task_id"])
                return await client.wait(accepted["task_id"], timeout=None, poll_seconds=0.2)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            server.should_exit = True
            await serving

    db = Path(args.gateway_db).resolve()
    try:
        result = asyncio.run(main())
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if interrupted:
            print(f"polar-mitm rollout run: stopped at once (second Ctrl-C), without waiting for the task's sessions to end: their sandboxes may be left; what they recorded is in {db}", file=sys.stderr)
        else:  # while the server was starting
            print("polar-mitm rollout run: interrupted while the server started; no task was submitted", file=sys.stderr)
        return 130
    if result is None:
        print("polar-mitm rollout: the server did not start", file=sys.stderr)
        return 2
    if interrupted:
        counts = ", ".join(f"{status} {n}" for status, n in sorted(result["counts"].items()))
        print(f"polar-mitm rollout run: interrupted: cancelled task {result['task_id']}'s unfinished sessions and waited for them to end, sandboxes removed ({counts}); what they recorded is in {db}", file=sys.stderr)
        return 130
    print(summary_table(result))
    print(f"store: {db}  (e.g. polar-mitm sql --db {db} \"SELECT session_id, status, reward FROM sessions WHERE task_id = '{result['task_id']}'\")")
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1
