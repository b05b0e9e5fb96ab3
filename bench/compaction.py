"""The store alone, journals to segments: what one layout costs against another, interleaved in one run.

    python -m bench.compaction [--rows 1024] [--pairs 5] [--baseline DIR] [--shape chat|tokens]

Each run is a process of its own that imports `polar_mitm` from a source tree (this one, or `--baseline DIR`, e.g. a
`git worktree` of an older commit), builds `--rows` exchange rows shaped like the gateway's (a 4,096-id prompt, 256
sampled ids and logprobs, the engine reply as its wire text with per-token logprobs, a real Qwen Code request body),
then commits them through `Store` 64 at a time and closes it (every journal compacted). `--shape tokens`: rows as
tokens mode makes them, the engine request a completions call carrying the prompt's ids, the reply echoing them.
It prints the process CPU of the commits and compactions alone (building the rows is not counted), the store's size
on disk (the file and anything beside it), and each compaction's timings from the store's log. Runs alternate tree
by tree; medians.

What it answered (bench/README.md, "The store alone"): segments as tables inside the `.duckdb` file against
schema 2's Parquet files beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def exchange_rows(count: int, shape: str = "chat", prompt_ids: int = 4096) -> list[dict]:
    """`count` exchange rows shaped like the gateway's (see the top), with `prompt_ids` prompt token ids each."""
    from bench.common import STUB_MODEL, load_requests
    from polar_mitm.engines.base import WireJSON, _decode
    from polar_mitm.store import now

    spec = load_requests()[0]
    rng = random.Random(1)

    def row(index: int) -> dict:
        prompt = [rng.randrange(151_000) for _ in range(prompt_ids)]
        sampled = [rng.randrange(151_000) for _ in range(256)]
        logprobs = [round(-rng.random() * 3, 6) for _ in sampled]
        if shape == "tokens":  # vLLM's completions: the prompt's ids in, echoed in the choice
            request = {"temperature": 1.0, "model": STUB_MODEL, "prompt": prompt, "max_tokens": 4096, "logprobs": 0, "return_token_ids": True, "stream": False}
            reply = {"id": f"cmpl-{index}", "choices": [{"index": 0, "text": "x" * 500, "prompt_token_ids": prompt, "token_ids": sampled, "finish_reason": "stop",
                     "logprobs": {"tokens": ["tok"] * len(sampled), "token_logprobs": logprobs}}]}
        else:
            request = {**spec["body"], "model": STUB_MODEL}
            reply = {"id": f"chatcmpl-{index}", "prompt_token_ids": prompt, "choices": [{"index": 0, "finish_reason": "stop", "token_ids": sampled,
                     "message": {"role": "assistant", "content": "x" * 500},
                     "logprobs": {"content": [{"token": "tok", "logprob": lp, "bytes": [116, 111, 107], "top_logprobs": []} for lp in logprobs]}}]}
        return {
            "exchange_id": f"e{index}-{rng.random()}", "session_id": f"s{index % 64}", "seq": index // 64 + 1, "api": "openai_chat", "status": "ok",
            "http_status": 200, "request_headers": spec["headers"], "request_body": json.dumps(spec["body"]),
            "engine_request": WireJSON(request) if shape == "tokens" else WireJSON(request, json.dumps(request)),
            "engine_response": (reply_wire := _decode(json.dumps(reply, separators=(",", ":")))),
            # from the reply's echo, as the gateway reads them (until 2026-12-05 a copy, which the gateway never has)
            "prompt_token_ids": reply_wire["choices"][0]["prompt_token_ids"] if shape == "tokens" else reply_wire["prompt_token_ids"], "completion_token_ids": sampled, "completion_logprobs": logprobs, "started_at": now(), "ended_at": now(),
        }

    return [row(index) for index in range(count)]


def run(rows: int, shape: str = "chat") -> dict[str, float]:
    """One run in this process, with the `polar_mitm` on sys.path."""
    from polar_mitm.store import Store

    built = exchange_rows(rows, shape)
    folder = Path(tempfile.mkdtemp(prefix="polar-compaction-"))
    try:
        started = time.process_time()
        store = Store(folder / "b.duckdb")

        async def commit_all() -> None:
            for first in range(0, rows, 64):
                await asyncio.gather(*(store.commit_exchange(r) for r in built[first : first + 64]))

        asyncio.run(commit_all())
        # the compactor done (and, in a tree that merges, its merges) before the close, as in a running node
        while store._compacting or getattr(store, "_merging", False) or not store._compactions.empty():
            time.sleep(0.01)
        store.close()
        cpu = time.process_time() - started
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # ~60 MB a run
    return {"cpu_s": round(cpu, 3), "store_mb": round(size / 2**20, 1)}


def measure(source: Path, rows: int, shape: str = "chat") -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "bench.compaction", "--one", str(source), "--rows", str(rows), "--shape", shape], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"a run of {source} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # "segment 000003: 192 exchanges written ... in 251 ms, installed in 12 ms, checkpoint in 3 ms"
    result["slowest_install_ms"] = max((int(line.split("installed in ")[1].split()[0]) for line in done.stderr.splitlines() if "installed in " in line), default=0)
    # "exchange_merged_000001: 4096 exchanges of 16 tables merged in 2512 ms, installed in ..." (trees with merges)
    merges = [line for line in done.stderr.splitlines() if " tables merged in " in line]
    result["merges"], result["merge_ms"] = len(merges), sum(int(line.split(" tables merged in ")[1].split()[0]) for line in merges)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another polar_mitm source tree, run in turn with this one")
    parser.add_argument("--shape", choices=["chat", "tokens"], default="chat", help="rows as chat mode or tokens mode makes them")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a single run, in this process, of that tree
    args = parser.parse_args()
    if args.one is not None:
        sys.path.insert(0, str(args.one))  # before polar_mitm is first imported
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        print(json.dumps(run(args.rows, args.shape)))
        return
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.pairs):
        for name, source in trees.items():
            results[name].append(measure(source, args.rows, args.shape))
            print(f"  {name}: {results[name][-1]}", flush=True)
    print(f"\n{args.rows} rows shaped as {args.shape} mode makes them, {args.pairs} runs each, medians ({os.cpu_count()} cores):")
    print("| tree | CPU of commits + compactions (s) | per exchange (ms) | store on disk (MB) | slowest segment install (ms) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        cpu = statistics.median(r["cpu_s"] for r in runs)
        print(f"| {name} | {cpu:.2f} | {1000 * cpu / args.rows:.2f} | {statistics.median(r['store_mb'] for r in runs):.1f} | {max(r['slowest_install_ms'] for r in runs)} |")


if __name__ == "__main__":
    main()
