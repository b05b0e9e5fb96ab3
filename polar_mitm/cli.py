"""The `polar-mitm` command. Each feature module registers its own sub-command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# module path -> it exposes register(subparsers); keeps this file free of feature logic
COMMAND_MODULES = [
    "polar_mitm.local_engine.cli",
    "polar_mitm.gateway.cli",
    "polar_mitm.store_cli",
    "polar_mitm.diff_cli",
    "polar_mitm.run_cli",
    "polar_mitm.demo",
    "polar_mitm.assembler.cli",
    "polar_mitm.rollout.cli",
    "polar_mitm.control_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-mitm", description=__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
