"""`polar-mitm control pause|resume|status`: drive a gateway's /control/* API around a weight update."""

from __future__ import annotations

import argparse
import json
import os
import sys

from polar_mitm.gateway.options import DEFAULT_CONFDIR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("control", help="pause/resume a gateway's engine calls and set its policy version")
    parser.add_argument("action", choices=["pause", "resume", "status"])
    parser.add_argument("--gateway", help="gateway URL (default: $POLAR_MITM_GATEWAY, the gateway file in --confdir, else http://127.0.0.1:8080)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, help=f"the gateway's confdir (default {DEFAULT_CONFDIR})")
    parser.add_argument("--token", default=os.environ.get("POLAR_MITM_CONTROL_TOKEN"), help="bearer token (default $POLAR_MITM_CONTROL_TOKEN)")
    parser.add_argument("--mode", choices=["drain", "abort"], default="drain", help="pause: drain waits for in-flight calls; abort cancels them (re-issued after resume)")
    parser.add_argument("--timeout", type=float, default=300.0, help="pause --mode drain: seconds before giving up with 504 (default 300)")
    parser.add_argument("--policy-version", type=int, help="resume: the policy version served from now on")
    parser.add_argument("--engine-model", help="resume: the engine model / LoRA adapter to serve from now on")
    parser.set_defaults(func=_control)


def _control(args: argparse.Namespace) -> int:
    from polar_mitm.client import GatewayControl
    from polar_mitm.errors import ClientError, ControlError
    from polar_mitm.routing import gateway_url

    control = GatewayControl(gateway_url(args.confdir, args.gateway), token=args.token)
    try:
        if args.action == "pause":
            result = control.pause(args.mode, args.timeout)
        elif args.action == "resume":
            result = control.resume(args.policy_version, args.engine_model)
        else:
            result = control.status()
    except (ControlError, ClientError) as error:
        print(f"polar-mitm control {args.action}: {error}", file=sys.stderr)
        return 1
    finally:
        control.close()
    print(json.dumps(result))
    return 0
