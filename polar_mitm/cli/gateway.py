"""`polar-mitm gateway`: the intercepting proxy in front of the training engine."""

from __future__ import annotations

import argparse

from polar_mitm.gateway import options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway", help="run the intercepting gateway (mitmproxy + polar addon)")
    options.add_arguments(parser)  # every gateway option, from gateway/options.py
    parser.set_defaults(func=_gateway, hosts_proxy=True)


def _gateway(args: argparse.Namespace) -> int:
    from polar_mitm.gateway import server
    from polar_mitm.gateway.config import GatewayConfig

    server.run(GatewayConfig(**options.from_arguments(args)))
    return 0
