"""`polar-mitm rollout`: serve the rollout API, submit tasks to it, or do both for one task file.

    polar-mitm rollout serve --port 8070 --upstream http://127.0.0.1:8011/v1 --db polar.duckdb
    polar-mitm rollout submit examples/hello-task.yaml --wait
    polar-mitm rollout run examples/hello-task.yaml --db polar.duckdb      # the local engine by default

A task file is a TaskRequest in YAML (or JSON). Relative paths in it (upload sources, a 'file.py:function'
evaluator) are resolved against the file's directory before it is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from polar_mitm.errors import ClientError
from polar_mitm.gateway.config import DEFAULT_CONFDIR
from polar_mitm.rollout.models import FINAL_STATUSES

DEFAULT_PORT = 8070
DEFAULT_SERVER = f"http://127.0.0.1:{DEFAULT_PORT}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollout", help="the rollout server: tasks -> sandboxed harness sessions -> evaluated trajectories", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="rollout_command", required=True)

    serve = commands.add_parser("serve", help="run the rollout HTTP API with its own gateway node")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"API port on 127.0.0.1 (default {DEFAULT_PORT})")
    _node_arguments(serve)
    serve.add_argument(
        "--ray", nargs="?", const="auto", metavar="ADDRESS",
        help="scale out: one gateway node per Ray node with the polar_node resource (ADDRESS: the Ray cluster, default auto); each node's store is <db stem>.<node>.duckdb",
    )
    serve.add_argument("--head-db", type=Path, help="--ray: the head's durable store of tasks, sessions and callbacks (default <db stem>.head.duckdb)")
    serve.set_defaults(func=_serve, hosts_proxy=True)

    submit = commands.add_parser("submit", help="submit a task file to a running rollout server")
    submit.add_argument("task", type=Path, help="TaskRequest as YAML or JSON")
    submit.add_argument("--server", default=os.environ.get("POLAR_MITM_ROLLOUT", DEFAULT_SERVER), help=f"rollout server URL (default $POLAR_MITM_ROLLOUT or {DEFAULT_SERVER})")
    submit.add_argument("--wait", action="store_true", help="follow the task with a progress bar and print its summary")
    submit.set_defaults(func=_submit)

    run = commands.add_parser("run", help="serve + submit + wait for one task file; prints a summary, leaves the store")
    run.add_argument("task", type=Path, help="TaskRequest as YAML or JSON")
    _node_arguments(run, upstream_required=False)
    run.set_defaults(func=_run, hosts_proxy=True)


def _node_arguments(parser: argparse.ArgumentParser, upstream_required: bool = True) -> None:
    several = "; repeat it for several engines (each session stays on one, new sessions go to the least busy)"
    if upstream_required:
        parser.add_argument("--upstream", required=True, action="append", help=f"engine base URL, e.g. http://127.0.0.1:8011/v1{several}")
    else:
        parser.add_argument("--upstream", action="append", help=f"engine base URL (default: the local engine, started or reused as by `polar-mitm engine start`){several}")
    parser.add_argument("--db", type=Path, default=Path("polar.duckdb"), help="DuckDB store (default polar.duckdb)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, help=f"the gateway's confdir: CA and session secret (default {DEFAULT_CONFDIR})")
    parser.add_argument("--gateway-port", type=int, default=0, help="the node's gateway proxy port (default: a free one)")
    parser.add_argument("--output", type=Path, help="harness logs and Parquet files (default: <db>.rollouts/)")
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--engine-model", help="engine's served model name (default: discovered)")
    parser.add_argument("--engine-hook", default="", metavar="MODULE:FUNC", help="function applied to each engine request (see `polar-mitm gateway`)")
    for stage, default in (("prepare", 2), ("run", 2), ("build", 1), ("evaluate", 2)):
        parser.add_argument(f"--{stage}-limit", type=int, default=default, help=f"sessions in the {stage} stage at once (default {default})")
    parser.add_argument("-v", "--verbose", action="store_true", help="the gateway's own log on the terminal")


def _node_config(args: argparse.Namespace):
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.scheduler import StageLimits

    upstream = args.upstream if isinstance(args.upstream, str) else ",".join(args.upstream)
    return NodeConfig(
        upstream=upstream, db=args.db, confdir=args.confdir, gateway_port=args.gateway_port, engine=args.engine,
        engine_model=args.engine_model, engine_hook=args.engine_hook, output_dir=args.output, verbose=args.verbose,
        limits=StageLimits(prepare=args.prepare_limit, run=args.run_limit, build=args.build_limit, evaluate=args.evaluate_limit),
    )


def _uvicorn_server(args: argparse.Namespace, port: int):
    import uvicorn

    from polar_mitm.rollout.server import create_app

    if getattr(args, "ray", None):
        from polar_mitm.rollout.ray_cluster import ClusterConfig, create_ray_app

        app = create_ray_app(ClusterConfig(address=args.ray, node=_node_config(args), head_db=args.head_db))
    else:
        app = create_app(_node_config(args))
    return uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info" if args.verbose else "warning", timeout_graceful_shutdown=10))


def _serve(args: argparse.Namespace) -> int:
    server = _uvicorn_server(args, args.port)
    print(f"polar-mitm rollout: serving on http://127.0.0.1:{args.port} (store {args.db})", file=sys.stderr, flush=True)
    server.run()
    return 0


# -- the client side




def load_task(path: Path) -> dict[str, Any]:
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


async def submit_task(client, server: str, task: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{server}/tasks", json=task)
    if response.status_code != 202:
        try:
            message = response.json().get("message") or response.text
        except ValueError:
            message = response.text
        raise ClientError(f"the server refused the task (HTTP {response.status_code}): {message}")
    return response.json()


def progress_line(result: dict[str, Any], started: float, width: int = 30) -> str:
    sessions = result["sessions"]
    done = sum(s["status"] in FINAL_STATUSES for s in sessions)
    filled = round(width * done / max(len(sessions), 1))
    counts = ", ".join(f"{status} {n}" for status, n in sorted(result["counts"].items()))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{len(sessions)} sessions done  ({counts})  {time.monotonic() - started:.0f}s"


async def wait_task(client, server: str, task_id: str, interval: float = 1.0, out=sys.stderr) -> dict[str, Any]:
    started = time.monotonic()
    interactive = out.isatty()
    last = ""
    while True:
        response = await client.get(f"{server}/tasks/{task_id}")
        response.raise_for_status()
        result = response.json()
        line = progress_line(result, started)
        if interactive:
            print(f"\r{line}\x1b[K", end="", file=out, flush=True)
        elif line.split("  ")[0:2] != last.split("  ")[0:2]:
            print(line, file=out, flush=True)  # a log-friendly bar: one line per change
        last = line
        if result["status"] != "running":
            if interactive:
                print(file=out)
            return result
        await asyncio.sleep(interval)


def summary_table(result: dict[str, Any]) -> str:
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
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    stats = result.get("trajectory_stats") or {}
    lines.append("")
    lines.append(f"task {result['task_id']}: {result['status']}; " + ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items())))
    if result.get("trajectories"):
        lines.append(f"trajectories: {result['trajectories']} ({stats.get('sequences', 0)} sequences, {stats.get('sampled_tokens', 0)} sampled tokens)")
    elif stats.get("error"):
        lines.append(f"trajectories: not written ({stats['error']})")
    return "\n".join(lines)


def _seconds(timing: dict[str, Any] | None) -> str:
    return "" if not timing or timing.get("seconds") is None else f"{timing['seconds']:.1f}"


async def _submit_and_follow(server: str, task: dict[str, Any], wait: bool) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        accepted = await submit_task(client, server, task)
        print(f"task {accepted['task_id']}: {len(accepted['session_ids'])} sessions ({', '.join(accepted['session_ids'])})", file=sys.stderr, flush=True)
        if not wait:
            return accepted
        return await wait_task(client, server, accepted["task_id"])


def _submit(args: argparse.Namespace) -> int:
    try:
        task = load_task(args.task)
        result = asyncio.run(_submit_and_follow(args.server.rstrip("/"), task, args.wait))
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"polar-mitm rollout: cannot reach the rollout server at {args.server}: {error}", file=sys.stderr)
        return 2
    if not args.wait:
        print(result["task_id"])
        return 0
    print(summary_table(result))
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1


def _run(args: argparse.Namespace) -> int:
    from polar_mitm.rollout.node import free_port

    try:
        task = load_task(args.task)
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    if not args.upstream:
        from polar_mitm.local_engine import LocalEngine

        print("polar-mitm rollout: starting the local engine (first run builds it; later runs reuse it)...", file=sys.stderr, flush=True)
        try:
            args.upstream = LocalEngine().start()
        except Exception as error:  # noqa: BLE001 - any way the engine fails to start ends this command the same
            print(f"polar-mitm rollout: the local engine did not start ({error}); pass --upstream URL", file=sys.stderr)
            return 2
    port = free_port()
    server = _uvicorn_server(args, port)

    async def main() -> dict[str, Any] | None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
                return None
            await asyncio.sleep(0.05)
        try:
            return await _submit_and_follow(f"http://127.0.0.1:{port}", task, wait=True)
        finally:
            server.should_exit = True
            await serving

    try:
        result = asyncio.run(main())
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    if result is None:
        print("polar-mitm rollout: the server did not start", file=sys.stderr)
        return 2
    print(summary_table(result))
    print(f"store: {args.db}  (e.g. polar-mitm sql --db {args.db} \"SELECT session_id, status, reward FROM sessions WHERE task_id = '{result['task_id']}'\")")
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1
