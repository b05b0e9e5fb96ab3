"""The `polar-mitm` command. Each feature module registers its own sub-command.

Each module of this package registers one sub-command and stays thin: it parses flags and calls library code
(gateway, store, assembler, rollout, debug, routing), which never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# module path -> it exposes register(subparsers); keeps this file free of feature logic
# imported only to build the parser: each command's heavy imports happen inside its function
COMMAND_MODULES = [
    "polar_mitm.cli.engine",
    "polar_mitm.cli.gateway",
    "polar_mitm.cli.sql",
    "polar_mitm.cli.diff",
    "polar_mitm.cli.run",
    "polar_mitm.cli.demo",
    "polar_mitm.cli.assemble",
    "polar_mitm.cli.rollout",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-mitm", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and getattr(args, "hosts_proxy", False):
        _run_optimized()
    return int(args.func(args) or 0)


def _run_optimized() -> None:
    """Start this command line again under `python -O` (same process, same arguments), unless POLAR_MITM_DEBUG is set.

    mitmproxy keeps per-flow self-checks under `if __debug__` (every Request and Response field type-checked when
    made, every proxy-layer event checked); without them the gateway spends ~5% less CPU per exchange and serves ~6%
    more exchanges/s at 64 sessions (measured with bench/run.py's throughput phase).
    """
    if sys.flags.optimize or os.environ.get("POLAR_MITM_DEBUG"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-O", *sys.orig_argv[1:]])
