"""`polar-mitm engine build|start|stop|status`: the local vLLM engine used as a real upstream."""

from __future__ import annotations

import argparse
import signal
import sys

from polar_mitm.local_engine import build
from polar_mitm.local_engine.serve import DEFAULT_PORT, EngineError, LocalEngine


def register(subparsers: argparse._SubParsersAction) -> None:
    engine = subparsers.add_parser("engine", help="build and run the local vLLM engine (CPU)", description=__doc__)
    commands = engine.add_subparsers(dest="engine_command", required=True)

    def add(name: str, func, help: str, with_model: bool = True, with_port: bool = True) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help)
        if with_model:
            parser.add_argument("--model", choices=list(build.MAX_MODEL_LEN), default=build.DEFAULT_MODEL)
        if with_port:
            parser.add_argument("--port", type=int, default=DEFAULT_PORT)
        parser.add_argument("--home", default=None, help="engine home (default: $POLAR_MITM_HOME or ~/.cache/polar-mitm)")
        parser.set_defaults(func=func)
        return parser

    built = add("build", run_build, "build the engine venv and a model (once; cached)", with_port=False)
    built.add_argument("--with-trainer", action="store_true", help="also install what a trainer step needs into the engine venv (peft, pyarrow, matplotlib, trl, datasets: examples/grpo_loop.py, polar_mitm.integrations.trl) and print its python")
    built.add_argument("--with-verl", action="store_true", help="also build verl's own venv (verl 0.9, Python 3.11: polar_mitm.integrations.verl) and print its python")
    start = add("start", run_start, "start the engine (or reuse a live one) and print its base URL")
    start.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the engine to answer")
    start.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the engine")
    start.add_argument("--lora-rank", type=int, default=0, help="serve runtime-loaded LoRA adapters up to this rank (weight sync for training; default off)")
    start.add_argument("--max-loras", type=int, default=2, help="with --lora-rank: adapters held at once (default 2)")
    start.add_argument("--max-model-len", type=int, default=None, help="serve with a shorter context (default: the model's; qwen3-tiny 65536)")
    add("stop", run_stop, "stop the engine on --port", with_model=False)
    add("status", run_status, "show whether an engine runs on --port (exit 1 if not)", with_model=False)


def run_build(args: argparse.Namespace) -> int:
    engine = LocalEngine(model=args.model, home=args.home)
    print(engine.build())
    if args.with_trainer:
        print(build.ensure_trainer_packages(engine.home))
    if args.with_verl:
        print(build.build_verl_venv(engine.home))
    return 0


def run_start(args: argparse.Namespace) -> int:
    try:
        engine = LocalEngine(
            model=args.model, port=args.port, home=args.home, max_model_len=args.max_model_len, lora_rank=args.lora_rank, max_loras=args.max_loras,
        )
        print(engine.start(timeout=args.timeout), flush=True)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.foreground:
        return 0
    if not engine.started_here:
        print("error: an engine was already running on this port; not attaching to it", file=sys.stderr)
        return 1
    # A supervisor's SIGTERM must also reach the engine, which runs in its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return engine.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        engine.stop()


def run_stop(args: argparse.Namespace) -> int:
    engine = LocalEngine(port=args.port, home=args.home)
    stopped = engine.stop()
    # exit 0 either way: after `stop`, no engine runs on the port, which is what was asked
    print(f"polar-mitm engine: {stopped.describe()}" if stopped else f"polar-mitm engine: no engine on port {args.port}; nothing to stop")
    return 0


def run_status(args: argparse.Namespace) -> int:
    engine = LocalEngine(port=args.port, home=args.home)
    record = engine.status()
    if record is None:
        print(f"no engine on port {args.port}")
        return 1
    answering = "answering" if engine.running() else "starting (not answering yet)"
    print(f"{record.model} at {record.url}, pid {record.pid}, {answering}; log {record.log}")
    return 0
