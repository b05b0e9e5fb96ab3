"""The `polar-mitm` command. Each feature module registers its own sub-command."""

from __future__ import annotations

import argparse
import importlib
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
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-mitm", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
