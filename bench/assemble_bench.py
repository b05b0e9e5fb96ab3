"""Assembly throughput on a SYNTHETIC store (not recorded data): tokens/s and sessions/s.

    .venv/bin/python bench/assemble_bench.py [--sessions 10000] [--turns 30] [--db /tmp/assemble-bench.duckdb]

The store has the real schema (polar_mitm.store), filled with store.add_segment (segment rows), not through a
gateway. Each session is an agent loop shaped like a harness run: a 400-token system prompt + tools, then `turns`
calls, each sampling 40 tokens (the last one an end-of-turn token) and getting a 60-token tool result.
Besides the main lineage every session has a side call (a title request after turn 1) and an SDK retry
(turn 10 sent twice); every 10th session has its history rewritten at turn 15 (a break). Token ids are
random (seeded), logprobs random negatives; no tokenizer is needed (breaks are diagnosed as 'unknown'
unless --tokenizer is given, which only matters for the few break sessions).

Prints the size of the store and, per builder, sessions/s, exchange tokens/s (prompt + sampled tokens
read and assembled) and sequence tokens/s (tokens written out), plus the run statistics. Assembly is
timed to the end of writing Parquet; building the store is not timed. Rates are given per wall-clock
second and per CPU second of this process (the latter is what a shared, busy machine does not distort).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from polar_mitm import store
from polar_mitm.assembler import Assembler
from polar_mitm.assembler.export import ParquetSink

SYSTEM_TOKENS = 400
SAMPLED_TOKENS = 40
TOOL_RESULT_TOKENS = 60
END_OF_TURN = 151645
VOCAB = 150_000
SESSIONS_PER_CHUNK = 250


def session_rows(rng: np.random.Generator, session_id: str, turns: int, rewritten: bool) -> list[dict]:
    """The exchanges of one synthetic session, in seq order."""
    rows = []
    prompt = rng.integers(0, VOCAB, SYSTEM_TOKENS, dtype=np.int32)
    main: list[tuple[np.ndarray, np.ndarray]] = []
    for turn in range(1, turns + 1):
        if rewritten and turn == 15:
            prompt = prompt.copy()
            prompt[SYSTEM_TOKENS + 50] += 1  # an early tool result edited by the harness
        sample = np.append(rng.integers(0, VOCAB, SAMPLED_TOKENS - 1, dtype=np.int32), np.int32(END_OF_TURN))
        main.append((prompt, sample))
        if turn == 10:
            main.append((prompt, np.append(rng.integers(0, VOCAB, SAMPLED_TOKENS - 1, dtype=np.int32), np.int32(END_OF_TURN))))
        if turn == 1:
            title_prompt = rng.integers(0, VOCAB, 80, dtype=np.int32)
            main.append((title_prompt, np.append(rng.integers(0, VOCAB, 7, dtype=np.int32), np.int32(END_OF_TURN))))
        prompt = np.concatenate([prompt, sample, rng.integers(0, VOCAB, TOOL_RESULT_TOKENS, dtype=np.int32)])
    for seq, (prompt_ids, sample) in enumerate(main, start=1):
        rows.append({"session_id": session_id, "seq": seq, "prompt": prompt_ids, "sample": sample})
    return rows


def list_array(arrays: list[np.ndarray], kind: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays), type=kind))


def build_store(path: Path, sessions: int, turns: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    con = duckdb.connect(str(path))
    store.ensure_schema(con)
    for first in range(0, sessions, SESSIONS_PER_CHUNK):
        rows = []
        for index in range(first, min(first + SESSIONS_PER_CHUNK, sessions)):
            rows += session_rows(rng, f"bench-{index:06d}", turns, rewritten=index % 10 == 0)
        samples = [r["sample"] for r in rows]
        chunk = pa.table(
            {
                "exchange_id": [str(uuid.uuid4()) for _ in rows],
                "session_id": [r["session_id"] for r in rows],
                "seq": pa.array([r["seq"] for r in rows], pa.int32()),
                "api": ["openai_chat"] * len(rows),
                "action": ["generate"] * len(rows),
                "status": ["ok"] * len(rows),
                "replay": [False] * len(rows),
                "model_engine": ["synthetic"] * len(rows),
                "finish_reason": ["stop"] * len(rows),
                "prompt_token_ids": list_array([r["prompt"] for r in rows], pa.int32()),
                "completion_token_ids": list_array(samples, pa.int32()),
                "completion_logprobs": list_array([-rng.random(len(s)) for s in samples], pa.float64()),
            }
        )
        store.add_segment(con, chunk)
    con.close()
    store.Store(path).close()  # the exchanges view over the segments
    con = duckdb.connect(str(path))
    # the Store counted the sessions from the exchanges when it opened the store; tasks and rewards added here
    con.execute("UPDATE sessions SET task_id = 'task-' || (hash(session_id) % 500), status = 'completed', reward = (hash(session_id) % 7) / 6.0")
    con.close()


def store_bytes(db: Path) -> int:
    """The DuckDB file and anything beside it (schema 2's Parquet segments, snapshot exports)."""
    return db.stat().st_size + sum(f.stat().st_size for f in store.segments_dir(db).glob("*") if f.is_file())


def measure(db: Path, builder: str, tokenizer: str | None, out_dir: Path, lenient: bool = False) -> dict:
    assembler = Assembler(db, builder, lenient=lenient, tokenizer=tokenizer)
    sink = ParquetSink(out_dir / f"{assembler.stats.builder}.parquet")
    started, cpu_started = time.perf_counter(), time.process_time()
    for batch in assembler.batches():
        sink.write(batch)
    sink.close()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    stats = assembler.stats
    result = {"builder": stats.builder, "wall_s": round(seconds, 1), "cpu_s": round(cpu, 1), "parquet_mb": round(sink.path.stat().st_size / 2**20, 1)}
    for clock, elapsed in (("wall", seconds), ("cpu", cpu)):
        result[f"sessions_per_{clock}_s"] = round(stats.sessions / elapsed, 1)
        result[f"exchange_tokens_per_{clock}_s"] = round(stats.exchange_tokens / elapsed)
        result[f"sequence_tokens_per_{clock}_s"] = round(stats.sequence_tokens / elapsed)
    sink.path.unlink()
    return {**result, "stats": stats.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--db", type=Path, help="reuse or create this store (default: a temporary file)")
    parser.add_argument("--tokenizer", help="tokenizer directory for break diagnosis")
    parser.add_argument("--builders", default="prefix_merging,prefix_merging_lenient,per_request")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="assemble-bench-"))
    db = args.db or work / "bench.duckdb"
    if not db.exists():
        started = time.perf_counter()
        build_store(db, args.sessions, args.turns)
        print(f"built synthetic store {db} in {time.perf_counter() - started:.1f}s", flush=True)
    size = store.query_dicts(db, "SELECT count(DISTINCT session_id) AS sessions, count(*) AS exchanges, sum(len(prompt_token_ids) + len(completion_token_ids)) AS tokens FROM exchanges")[0]
    print(f"SYNTHETIC store: {size['sessions']} sessions, {size['exchanges']} exchanges, {size['tokens']:,} exchange tokens, {store_bytes(db) / 2**30:.2f} GiB", flush=True)
    for name in args.builders.split(","):
        lenient = name == "prefix_merging_lenient"
        result = measure(db, "prefix_merging" if lenient else name, args.tokenizer, work, lenient=lenient)
        print(json.dumps(result), flush=True)
    shutil.rmtree(work)  # a --db store is kept: it is not in `work`


if __name__ == "__main__":
    main()
