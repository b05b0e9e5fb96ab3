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
from pathlib import Path
from typing import Any

from polar_mitm.errors import ClientError
from polar_mitm.gateway import options

DEFAULT_PORT = 8070
DEFAULT_SERVER = f"http://127.0.0.1:{DEFAULT_PORT}"
# the node's gateway options land in args.gateway_<name> (--port is the API's)
GATEWAY = "gateway_"
# gateway options GatewayNode sets itself (rollout/node.py NODE_OPTIONS), so not flags here
NODE_SETS = ("host", "require_auth", "web", "web_port")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollout", help="the rollout server: tasks -> sandboxed harness sessions -> evaluated trajectories", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="rollout_command", required=True)

    serve = commands.add_parser("serve", help="run the rollout HTTP API with its own gateway node")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"API port on 127.0.0.1 (default {DEFAULT_PORT})")
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
    submit.add_argument("--server", default=os.environ.get("POLAR_MITM_ROLLOUT", DEFAULT_SERVER), help=f"rollout server URL (default $POLAR_MITM_ROLLOUT or {DEFAULT_SERVER})")
    submit.add_argument("--wait", action="store_true", help="follow the task with a progress bar and print its summary")
    submit.set_defaults(func=_submit)

    run = commands.add_parser("run", help="serve + submit + wait for one task file; prints a summary, leaves the store")
    run.add_argument("task", type=Path, help="TaskRequest as YAML or JSON")
    _node_arguments(run, upstream_required=False)
    run.set_defaults(func=_run, hosts_proxy=True)


def _node_arguments(parser: argparse.ArgumentParser, upstream_required: bool = True) -> None:
    """The node's gateway options (every one of gateway/options.py but those the node sets itself), then its own."""
    overrides: dict[str, dict[str, Any]] = {
        "port": {"flags": ("--gateway-port",), "metavar": "GATEWAY_PORT", "default": 0, "help": "the node's gateway proxy port (default: a free one)"},
    }
    if not upstream_required:
        overrides["upstream"] = {"required": False, "default": None, "help": "engine base URL (default: the local engine, started or reused as by `polar-mitm engine start`)"}
    options.add_arguments(parser, exclude=NODE_SETS, overrides=overrides, prefix=GATEWAY)
    parser.add_argument("--output", type=Path, help="harness logs and Parquet files (default: <db>.rollouts/)")
    for stage, default in (("prepare", 2), ("run", 2), ("build", 1), ("evaluate", 2)):
        parser.add_argument(f"--{stage}-limit", type=int, default=default, help=f"sessions in the {stage} stage at once (default {default})")


def _node_config(args: argparse.Namespace):
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.scheduler import StageLimits

    return NodeConfig(
        gateway=GatewayConfig(**options.from_arguments(args, prefix=GATEWAY)), output_dir=args.output,
        limits=StageLimits(prepare=args.prepare_limit, run=args.run_limit, build=args.build_limit, evaluate=args.evaluate_limit),
    )


def _uvicorn_server(args: argparse.Namespace, port: int):
    import uvicorn

    from polar_mitm.rollout.server import create_app

    if getattr(args, "ray", None):
        from polar_mitm.rollout.ray_cluster import ClusterConfig, create_ray_app

        app = create_ray_app(ClusterConfig(address=args.ray, node=_node_config(args), head_db=args.head_db, node_data=args.node_data))
    else:
        app = create_app(_node_config(args))
    return uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info" if args.gateway_verbose else "warning", timeout_graceful_shutdown=10))


def _serve(args: argparse.Namespace) -> int:
    server = _uvicorn_server(args, args.port)
    print(f"polar-mitm rollout: serving on http://127.0.0.1:{args.port} (store {args.gateway_db})", file=sys.stderr, flush=True)
    server.run()
    return 0


def _submit(args: argparse.Namespace) -> int:
    import httpx

    from polar_mitm.rollout.client import load_task, submit_and_follow, summary_table

    try:
        task = load_task(args.task)
        result = asyncio.run(submit_and_follow(args.server.rstrip("/"), task, args.wait))
    except ClientError as error:
        print(f"polar-mitm rollout: {error}", file=sys.stderr)
        return 2
    except (OSError, httpx.HTTPError) as error:
        print(f"polar-mitm rollout: cannot reach the rollout server at {args.server}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    if not args.wait:
        print(result["task_id"])
        return 0
    print(summary_table(result))
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1


def _run(args: argparse.Namespace) -> int:
    from polar_mitm.rollout.client import load_task, submit_and_follow, summary_table
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
            args.gateway_upstream = LocalEngine().start()
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
            return await submit_and_follow(f"http://127.0.0.1:{port}", task, wait=True)
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
    db = Path(args.gateway_db).resolve()
    print(f"store: {db}  (e.g. polar-mitm sql --db {db} \"SELECT session_id, status, reward FROM sessions WHERE task_id = '{result['task_id']}'\")")
    return 0 if all(s["status"] == "completed" for s in result["sessions"]) else 1
