"""The `polar-mitm` command. Each feature module registers its own sub-command.

Each module of this package registers one sub-command and stays thin: it parses flags and calls library code
(gateway, store, assembler, rollout, debug, routing), which never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
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
    "polar_mitm.cli.notebook",
    "polar_mitm.cli.control",
    "polar_mitm.cli.ui",
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
    logging.getLogger("transformers").addFilter(_no_torch_notice)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # a command with more to say about an interrupt (rollout) says it itself; the rest stop without a traceback
        print(f"polar-mitm {args.command}: interrupted", file=sys.stderr)
        return 130


def _no_torch_notice(record: logging.LogRecord) -> bool:
    """transformers' import-time notice that PyTorch is missing: polar-mitm uses only its tokenizers and chat templates
    (tokens mode renders prompts), never its models, so every tokens-mode start would print it for nothing."""
    return not record.getMessage().startswith("PyTorch was not found")


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
