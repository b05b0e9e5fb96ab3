"""`polar-mitm gateway`: the intercepting proxy in front of the training engine."""

from __future__ import annotations

import argparse
import sys

from polar_mitm.gateway import options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gateway", help="run the intercepting gateway (mitmproxy + polar addon)")
    options.add_arguments(parser)  # every gateway option, from gateway/options.py
    parser.set_defaults(func=_gateway, hosts_proxy=True)


def _gateway(args: argparse.Namespace) -> int:
    from mitmproxy.exceptions import OptionsError

    from polar_mitm import api_auth
    from polar_mitm.gateway import server
    from polar_mitm.gateway.config import GatewayConfig

    values = options.from_arguments(args)
    values["control_token"] = values.get("control_token") or api_auth.env_token(api_auth.GATEWAY_TOKEN_ENV) or ""
    if refusal := api_auth.refusal_to_listen(values["host"], values["control_token"], "the gateway", f"--control-token or ${api_auth.GATEWAY_TOKEN_ENV}"):
        print(f"polar-mitm gateway: {refusal}", file=sys.stderr)
        return 2
    try:
        server.run(GatewayConfig(**values))
    except OptionsError as error:
        # the addon checks values before it opens anything: nothing was written
        print(f"polar-mitm gateway: {options.flag_message(str(error))}", file=sys.stderr)
        return 2
    return 0
