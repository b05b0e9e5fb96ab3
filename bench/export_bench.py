"""Task export as the store grows: the time to export one 16-session task from a node's store of 100 and of 10,000
sessions, the old way (one assembly per session, each scoring the whole store) beside the new (one pass over the
task's sessions), in one run, on the same store files. Writes bench/export_results.md.

    .venv/bin/python -m bench.export_bench [--sizes 100,10000] [--task-sessions 16] [--turns 12] [--rounds 3]
                                           [--baseline-rev 9a8deeb]

The old way is the real old code: polar_mitm as of `--baseline-rev` (the commit before one-pass export), taken
with `git archive` into a temporary folder; each way runs in a process of its own that imports its tree, opens the
store with that tree's `Store` (the live writer, as a node has it) and calls its `rollout.node.export_sessions`,
then times one session's build-stage assembly (`assemble(session=...)`, what a node runs after each session).
Rounds alternate old and new; the table gives the median.

The store is SYNTHETIC (not recorded data), its sessions shaped as bench/assemble_bench.py's: agent loops of
`--turns` calls (a 400-token system prompt, 40 sampled tokens and a 60-token tool result a turn, a title call,
an SDK retry at turn 10; every 10th session rewritten mid-way), named as the rollout server names them, in tasks
of 16 with rewards. Its layout is a running node's: the other sessions ran 512 at a time, their rows in commit
order cut into 256-row segments as the writer cuts them (written with store.add_segment, to build 10,000
sessions in seconds), so every segment holds rows of hundreds of sessions; the exported task's sessions are then
committed row by row through `Store.commit_exchange` (the gateway's commit path) and recorded with the node's
own `sessions` upsert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT

CONCURRENT = 512  # sessions running at once on the node whose store is synthesized
SEGMENT_ROWS = 256  # the writer's default segment size (Store(segment_rows=256))
BUILDER = "prefix_merging"
BASELINE_REV = "9a8deeb"  # main before one-pass export (issue 25)


def build_store(db: Path, sessions: int, task_sessions: int, turns: int) -> list[str]:
    """A node's store of `sessions` sessions, the last `task_sessions` of them the task to export (their ids)."""
    import numpy as np
    import pyarrow as pa

    from bench.assemble_bench import list_array, session_rows
    from polar_mitm import store
    from polar_mitm.rollout.node import RECORD_SESSION

    rng = np.random.default_rng(0)
    others = sessions - task_sessions
    tasks = [f"task-{int(rng.integers(2**48)):012x}" for _ in range(-(-others // task_sessions))]
    # the rollout server's session ids ({task}-{index}-{suffix}); waves of concurrent sessions, their rows in commit
    # order (turn by turn) and cut into segments as the writer cuts them: each segment holds hundreds of sessions
    ids = [f"{tasks[i // task_sessions]}-{i % task_sessions}-{int(rng.integers(2**24)):06x}" for i in range(others)]
    con = store.connect(db)
    store.ensure_schema(con)
    for first in range(0, others, CONCURRENT):
        rows = sorted((row for index in range(first, min(first + CONCURRENT, others)) for row in session_rows(rng, ids[index], turns, index % 10 == 0)), key=lambda r: r["seq"])
        for cut in range(0, len(rows), SEGMENT_ROWS):
            segment = rows[cut:cut + SEGMENT_ROWS]
            samples = [r["sample"] for r in segment]
            store.add_segment(con, pa.table({
                "exchange_id": [f"{r['session_id']}-{r['seq']}" for r in segment], "session_id": [r["session_id"] for r in segment],
                "seq": pa.array([r["seq"] for r in segment], pa.int32()), "api": ["openai_chat"] * len(segment), "action": ["generate"] * len(segment),
                "status": ["ok"] * len(segment), "replay": [False] * len(segment), "model_engine": ["synthetic"] * len(segment), "finish_reason": ["stop"] * len(segment),
                "prompt_token_ids": list_array([r["prompt"] for r in segment], pa.int32()), "completion_token_ids": list_array(samples, pa.int32()),
                "completion_logprobs": list_array([-rng.random(len(x)) for x in samples], pa.float64()),
            }))
    con.close()
    live = store.Store(db)  # counts the bulk-loaded sessions into `sessions` as it opens
    try:
        live.execute_write("UPDATE sessions SET task_id = regexp_extract(session_id, '^(task-[0-9a-f]+)'), status = 'completed', reward = (hash(session_id) % 7) / 6.0")
        task = f"task-{int(rng.integers(2**48)):012x}"
        task_ids = [f"{task}-{k}-{int(rng.integers(2**24)):06x}" for k in range(task_sessions)]
        rows = sorted((row for k, session_id in enumerate(task_ids) for row in session_rows(rng, session_id, turns, rewritten=k == 0)), key=lambda r: r["seq"])
        loop = asyncio.new_event_loop()
        try:
            for row in rows:  # through the gateway's commit path, the task's sessions turn by turn
                loop.run_until_complete(live.commit_exchange({
                    "exchange_id": f"{row['session_id']}-{row['seq']}", "session_id": row["session_id"], "seq": row["seq"], "api": "openai_chat",
                    "action": "generate", "status": "ok", "model_engine": "synthetic", "finish_reason": "stop", "prompt_token_ids": row["prompt"].tolist(),
                    "completion_token_ids": row["sample"].tolist(), "completion_logprobs": (-rng.random(len(row["sample"]))).tolist(),
                    "started_at": store.now(), "ended_at": store.now(),
                }))
        finally:
            loop.close()
        for k, session_id in enumerate(task_ids):
            live.execute_write(RECORD_SESSION, [session_id, store.now(), store.now(), "qwen", task, "completed", k / task_sessions, "{}", "{}", None])
    finally:
        live.close()
    return task_ids


def export(db: str, task: list[str], out: str) -> dict[str, Any]:
    """In a process of its own (its tree first on sys.path): the node's export of the task, and one build stage."""
    import polar_mitm
    from polar_mitm.assembler import assemble
    from polar_mitm.rollout.node import export_sessions
    from polar_mitm.store import Store

    live = Store(db)
    try:
        task_id = live.query("SELECT task_id FROM sessions WHERE session_id = ?", [task[0]])[1][0][0]
        started, cpu = time.perf_counter(), time.process_time()
        _, stats = export_sessions(live, task_id, task, BUILDER, {}, Path(out))
        export_s, export_cpu = time.perf_counter() - started, time.process_time() - cpu
        started = time.perf_counter()
        assemble(None, BUILDER, task[-1], store=live)
        build_s = time.perf_counter() - started
        # the floor under any query of the `exchanges` view: it reads every segment
        started = time.perf_counter()
        live.query("SELECT count(*) FROM exchanges WHERE session_id = ?", ["none"])
        view_s = time.perf_counter() - started
        segments = live.query("SELECT count(*) FROM exchange_segments")[1][0][0]
    finally:
        live.close()
    return {"tree": str(Path(polar_mitm.__file__).parent.parent), "export_s": export_s, "export_cpu_s": export_cpu, "build_s": build_s, "view_s": view_s, "segments": segments, "sequences": stats["sequences"], "group": stats["group"]}


def run_way(source: Path, db: Path, task: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.export_bench", "export", str(db), "--source", str(source), "--out", str(out), "--task", ",".join(task)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["tree"]).resolve() == source.resolve(), result["tree"]  # the tree asked for, not another on the path
    return result


def same_rows(old: Path, new: Path) -> bool:
    """Both ways wrote the same sequences with the same rewards and advantages (row order aside)."""
    import pyarrow.parquet as pq

    columns = ["sequence_id", "session_id", "group_id", "reward", "advantage", "trainable", "input_ids", "loss_mask"]
    old_rows, new_rows = (sorted(pq.read_table(p, columns=columns).to_pylist(), key=lambda r: r["sequence_id"]) for p in (old, new))
    return old_rows == new_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,10000", help="sessions in the store, comma-separated")
    parser.add_argument("--task-sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-rev", default=BASELINE_REV, help="the commit whose polar_mitm is the old way")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "export_results.md")
    args = parser.parse_args()

    from polar_mitm.store import query

    work = Path(tempfile.mkdtemp(prefix="export-bench-"))
    try:
        base = work / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline_rev, "polar_mitm"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        rows = []
        for size in (int(s) for s in args.sizes.split(",")):
            db = work / f"store-{size}.duckdb"
            started = time.perf_counter()
            task = build_store(db, size, args.task_sessions, args.turns)
            exchanges = int(query(db, "SELECT count(*) FROM exchanges")[1][0][0])
            print(f"store of {size} sessions ({exchanges} exchanges, {store_mb(db):.0f} MB) built in {time.perf_counter() - started:.0f} s", flush=True)
            results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for round_ in range(args.rounds):
                for way in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
                    result = run_way(base if way == "old" else ROOT, db, task, work / f"{way}-{size}.parquet")
                    results[way].append(result)
                    print(f"  {way}: export {result['export_s']:.2f} s ({result['export_cpu_s']:.2f} s CPU), one session's build {result['build_s']:.3f} s", flush=True)
            old, new = results["old"][-1], results["new"][-1]
            equal = same_rows(work / f"old-{size}.parquet", work / f"new-{size}.parquet") and old["group"] == new["group"] and old["sequences"] == new["sequences"]
            rows.append((size, exchanges, new["segments"], store_mb(db), {way: {key: statistics.median(r[key] for r in runs) for key in ("export_s", "export_cpu_s", "build_s", "view_s")} for way, runs in results.items()}, equal, new["sequences"]))
            for path in work.glob(f"store-{size}.duckdb*"):
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(args, rows)


def store_mb(db: Path) -> float:
    return sum(f.stat().st_size for f in [db, *Path(str(db) + ".segments").glob("*")] if f.is_file()) / 2**20


def write_report(args: argparse.Namespace, rows: list) -> None:
    load = os.getloadavg()[0]
    lines = [
        "# Task export as the store grows (bench/export_bench.py)",
        "",
        f"`python -m bench.export_bench --sizes {args.sizes} --task-sessions {args.task_sessions} --turns {args.turns} --rounds {args.rounds}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, this machine ({os.cpu_count()} cores shared with other work, load average {load:.1f} at the end). "
        f"SYNTHETIC store (see the bench's docstring); old = polar_mitm at {args.baseline_rev} (one assembly per session, each scoring the whole store), "
        "new = this tree (one pass over the task's sessions). Each way in a process of its own, on the live `Store` as a node holds it; "
        f"median of {args.rounds} alternating rounds. Export: `rollout.node.export_sessions` for the {args.task_sessions}-session task, Parquet written; "
        "build: one session's `assemble(session=...)`, what a node runs after each session.",
        "",
        "| store sessions | exchanges | segments | store MB | export old (s) | export new (s) | old / new | export CPU old / new (s) | one session's build old / new (s) | one query on `exchanges` (s) | same rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, exchanges, segments, mb, medians, equal, sequences in rows:
        old, new = medians["old"], medians["new"]
        lines.append(
            f"| {size:,} | {exchanges:,} | {segments} | {mb:.0f} | {old['export_s']:.2f} | {new['export_s']:.2f} | {old['export_s'] / new['export_s']:.1f}x | "
            f"{old['export_cpu_s']:.2f} / {new['export_cpu_s']:.2f} | {old['build_s']:.3f} / {new['build_s']:.3f} | {new['view_s']:.3f} | {'yes' if equal else 'NO'} ({sequences} sequences) |"
        )
    first, last = rows[0][4], rows[-1][4]
    lines += [
        "",
        f"From {rows[0][0]:,} to {rows[-1][0]:,} sessions in the store, the old export's CPU time grew {last['old']['export_cpu_s'] / first['old']['export_cpu_s']:.1f}x "
        f"and the new one's {last['new']['export_cpu_s'] / first['new']['export_cpu_s']:.1f}x (wall: {last['old']['export_s'] / first['old']['export_s']:.1f}x and "
        f"{last['new']['export_s'] / first['new']['export_s']:.1f}x). The new way reads the task's sessions only, in two queries on `exchanges` (what each session "
        "holds, then its token lists); what is left of its growth is the floor under any query of that view, which reads every segment "
        "(\"one query on `exchanges`\": a query that matches no row). \"same rows\": both ways wrote the same sequences, rewards and advantages, and the same group stats.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        side = argparse.ArgumentParser(description="one way of the export bench, in its own process")
        side.add_argument("side")
        side.add_argument("db")
        side.add_argument("--source", type=Path, required=True)
        side.add_argument("--out", required=True)
        side.add_argument("--task", required=True)
        options = side.parse_args()
        sys.path.insert(0, str(options.source))  # before polar_mitm is first imported: that tree is measured
        print(json.dumps(export(options.db, options.task.split(","), options.out)))
    else:
        main()
