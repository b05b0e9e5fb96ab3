"""`polar-mitm control pause|resume|status`: drive a gateway's /control/* API around a weight update.

    polar-mitm control pause [--mode drain|abort] [--timeout S]
    polar-mitm control resume [--policy-version N] [--engine-model NAME]
    polar-mitm control status

Which gateway: --gateway, else $POLAR_MITM_GATEWAY, else the newest live gateway listed in --confdir (a rollout
server's own gateway nodes are left out: drive those with the rollout server's /control/*), else
http://127.0.0.1:8080. The one chosen is named on stderr; the gateway's answer is printed as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from polar_mitm.session import DEFAULT_CONFDIR

ACTIONS = {
    "pause": "stop new engine calls (drain: wait for the calls in flight; abort: cancel them, re-issued after resume)",
    "resume": "serve again, optionally under a new policy version and engine model",
    "status": "the gateway's control state: paused or serving, calls in flight, policy version, engine model",
}
WHERE = ("gateway", "confdir", "token")
FLAGS_OF = {"pause": (*WHERE, "mode", "timeout"), "resume": (*WHERE, "policy_version", "engine_model"), "status": WHERE}


def _defaults() -> dict[str, object]:
    return {
        "gateway": None, "confdir": DEFAULT_CONFDIR, "token": os.environ.get("POLAR_MITM_CONTROL_TOKEN"),
        "mode": "drain", "timeout": 300.0, "policy_version": None, "engine_model": None,
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "control", help="pause/resume a gateway's engine calls and set its policy version",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # every flag is taken before the action too (`control --gateway URL pause`), and by every action, as before the
    # actions were sub-commands; each --help shows its own. Defaults are filled in by _control: an action's
    # sub-parser would otherwise overwrite a flag given before it with its default.
    _flags(parser, shown=WHERE)
    actions = parser.add_subparsers(dest="action", required=True, metavar="{pause,resume,status}")
    for action, about in ACTIONS.items():
        _flags(actions.add_parser(action, help=about, description=about), shown=FLAGS_OF[action])
    parser.set_defaults(func=_control)


def _flags(parser: argparse.ArgumentParser, shown: tuple[str, ...]) -> None:
    helps = {
        "gateway": "gateway URL (default: $POLAR_MITM_GATEWAY, the newest live gateway in --confdir's gateway file, else http://127.0.0.1:8080)",
        "confdir": f"the gateway's confdir (default {DEFAULT_CONFDIR})",
        "token": "bearer token (default $POLAR_MITM_CONTROL_TOKEN)",
        "mode": "drain (the default) waits for the calls in flight; abort cancels them (re-issued after resume)",
        "timeout": "with --mode drain: seconds before giving up with 504, the gateway serving on (default 300)",
        "policy_version": "the policy version stamped on every engine call from now on",
        "engine_model": "the engine model / LoRA adapter to serve from now on",
    }
    kinds: dict[str, dict[str, Any]] = {"mode": {"choices": ["drain", "abort"]}, "timeout": {"type": float}, "policy_version": {"type": int}}
    for name, text in helps.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, default=argparse.SUPPRESS, help=text if name in shown else argparse.SUPPRESS, **kinds.get(name, {}))


def _control(args: argparse.Namespace) -> int:
    from polar_mitm.client import GatewayControl
    from polar_mitm.errors import ClientError, ControlError, RunError
    from polar_mitm.routing import find_gateway

    for name, value in _defaults().items():
        if not hasattr(args, name):
            setattr(args, name, value)
    try:
        url, picked = find_gateway(args.confdir, args.gateway)
    except RunError as error:  # an unreadable gateway file
        print(f"polar-mitm control {args.action}: {error}", file=sys.stderr)
        return 2
    print(f"polar-mitm control {args.action}: gateway {url} ({picked})", file=sys.stderr, flush=True)
    control = GatewayControl(url, token=args.token)
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
