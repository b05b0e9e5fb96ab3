"""`polar-mitm gateway`: the intercepting proxy in front of the training engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from polar_mitm.gateway.config import DEFAULT_CONFDIR, GatewayConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway", help="run the intercepting gateway (mitmproxy + polar addon)")
    parser.add_argument("--port", type=int, default=8080, help="proxy port on 127.0.0.1 (default 8080)")
    parser.add_argument("--upstream", required=True, help="engine base URL, e.g. http://127.0.0.1:8011/v1")
    parser.add_argument("--db", type=Path, default=Path("polar.duckdb"), help="DuckDB store (default polar.duckdb)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, help="mitmproxy confdir, where its CA lands (default ~/.mitmproxy)")
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="engine kind (default vllm)")
    parser.add_argument("--engine-model", help="engine's served model name (default: discovered from /models)")
    parser.add_argument("--engine-timeout", type=float, default=600.0, help="seconds per engine call (default 600)")
    parser.add_argument("--keepalive-interval", type=float, default=5.0, metavar="SECONDS", help="streamed replies send status, headers and opening events at once, then a provider-native keepalive event every SECONDS until the reply is ready (default 5; 0: no keepalives)")
    parser.add_argument("--split-reasoning", action="store_true", help="split inline <think>...</think> from engine content into reasoning (engines without a reasoning parser)")
    parser.add_argument("--model-map", action="append", default=[], metavar="GLOB[=MODEL]", help="serve only these requested model names (repeatable)")
    parser.add_argument("--require-auth", action="store_true", help="407 unless the proxy URL carries valid session credentials")
    parser.add_argument("--passthrough", action="append", default=[], metavar="HOST_GLOB", help="forward non-model traffic to these hosts (repeatable)")
    parser.add_argument("--engine-hook", default="", metavar="MODULE:FUNC", help="function applied to each engine request (sampling params, structured outputs)")
    parser.add_argument("--sql-port", type=int, default=0, help="loopback port for read-only SQL from other processes (default: any)")
    parser.add_argument("--web", action="store_true", help="serve mitmweb's UI too")
    parser.add_argument("--web-port", type=int, default=8081)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.set_defaults(func=_gateway, hosts_proxy=True)


def _gateway(args: argparse.Namespace) -> int:
    from polar_mitm.gateway import server

    config = GatewayConfig(
        port=args.port, upstream=args.upstream, db=args.db, confdir=args.confdir, engine=args.engine,
        engine_model=args.engine_model, engine_timeout=args.engine_timeout, keepalive_interval=args.keepalive_interval, split_reasoning=args.split_reasoning, model_map=args.model_map,
        require_auth=args.require_auth, passthrough=args.passthrough, engine_hook=args.engine_hook, sql_port=args.sql_port,
        web=args.web, web_port=args.web_port, verbose=args.verbose,
    )
    server.run(config)
    return 0
