"""What tokens mode's lineages hold in memory as sessions grow: `python bench/lineage_bench.py [--baseline DIR]`.

In-process, no gateway: `--sessions` sessions of `--turns` turns each, starting with a system prompt of
`--system-chars` characters and a user message, every turn the previous history plus a tool result of
`--tool-chars` characters and an answer, its prompt `--growth` token ids longer than the last one's prompt
plus sampled ids (`--sampled` per turn), remembered the way render/serve.py does (find the parent, bridge, make
the turn, remember it). Reported: the bytes Python holds for the lineages (tracemalloc, after the builder's own
lists are gone), the budget's own count (`Lineages.nbytes`), and the CPU time per turn for find + make + remember.
With `--baseline DIR`, the same run with another source tree's polar_mitm (e.g. `git archive` of an earlier commit),
each in its own process, side by side. Results: bench/lineage_results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(sessions: int, turns: int, growth: int, sampled: int, tool_chars: int, system_chars: int = 0) -> dict[str, float]:
    from polar_mitm.render import bridge

    lineages = bridge.Lineages(max_bytes=2**40)  # unbounded here: what the turns themselves cost
    setup = "setup"
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cpu = 0.0
    for session in range(sessions):
        # each request is parsed anew, so its system prompt is a str of its own (as a gateway holds it)
        system = [{"role": "system", "content": f"{session}:" + "s" * system_chars}] if system_chars else []
        messages = [*system, {"role": "user", "content": f"task {session}"}]
        prompt = list(range(growth))
        for turn in range(turns):
            started = time.process_time()
            parent, _, _ = lineages.find(f"s{session}", messages, setup)
            bridged = None
            if parent is not None:
                tail = list(range(growth))
                parent_prompt = parent.prompt_ids() if callable(parent.prompt_ids) else parent.prompt_ids.tolist()
                bridged = bridge.Bridged(prompt_ids=parent_prompt + parent.completion_ids.tolist() + tail, tail_ids=tail, parent=parent)
                prompt = bridged.prompt_ids
            answer = bridge.answer_message(f"step {turn}", [])
            made = bridge.make_turn(f"s{session}-{turn}", messages, answer, setup, prompt, list(range(sampled)), bridged)
            lineages.remember(f"s{session}", made)
            cpu += time.process_time() - started
            messages = [*messages, answer, {"role": "tool", "content": f"{turn}:" + "x" * tool_chars}]
    del prompt, messages, bridged, parent, made, system
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"held_mb": held / 2**20, "counted_mb": lineages.nbytes / 2**20, "cpu_ms_per_turn": 1000 * cpu / (sessions * turns)}


def run_in(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """measure() (this file's) in a process of its own importing `tree`'s polar_mitm."""
    code = (
        f"import json, sys, runpy; sys.path.insert(0, {str(tree)!r}); measure = runpy.run_path({__file__!r})['measure']; "
        f"print(json.dumps(measure({args.sessions}, {args.turns}, {args.growth}, {args.sampled}, {args.tool_chars}, {args.system_chars})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="memory held by tokens mode's lineages (see the docstring)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--growth", type=int, default=700, help="prompt ids a turn adds (a tool result and an answer)")
    parser.add_argument("--sampled", type=int, default=150)
    parser.add_argument("--tool-chars", type=int, default=2500)
    parser.add_argument("--system-chars", type=int, default=0, help="a system prompt each session starts with (a harness's: 10-20k)")
    parser.add_argument("--baseline", type=Path, help="also run another source tree's polar_mitm, as `before`")
    args = parser.parse_args()
    trees = {"this tree": ROOT, **({"before": args.baseline.resolve()} if args.baseline else {})}
    print(f"{args.sessions} sessions x {args.turns} turns, +{args.growth} prompt ids and {args.sampled} sampled a turn, {args.tool_chars}-char tool results, {args.system_chars}-char system prompt")
    print("| tree | held by lineages (MB) | budget's count (MB) | CPU per turn (ms) |\n|---|---|---|---|")
    for name, tree in trees.items():
        result = run_in(tree, args)
        print(f"| {name} | {result['held_mb']:.1f} | {result['counted_mb']:.1f} | {result['cpu_ms_per_turn']:.3f} |")


if __name__ == "__main__":
    main()
