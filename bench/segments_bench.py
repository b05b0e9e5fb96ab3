"""A store's history against the cost of reading it: stores of many segments, with their segments merged as they age
(`merge_fanin` 16: 16 tables of a level at a time, once 48 newer segments exist) and without (`merge_fanin` 0, the
default), side by side in one run.

    .venv/bin/python -m bench.segments_bench [--segments 100,1000,3000] [--rounds 2]
                                             [--output bench/segments_results.md]

Each store is SYNTHETIC: `--segments` segments of 4 small rows each (50 sessions), bulk-loaded with
`store.add_segment` as a node's writer would have cut them (what a long run leaves: a segment per 256 rows, so
3,000 segments are ~770,000 exchanges). Its copy for each variant is then opened by a `Store` with that fan-in in a
process of its own (the first open, which merges what aged: its time and CPU), and then again, where it is timed:
the open, three queries on the `exchanges` view (one matching nothing, one session, a count of all), and the
view's re-pointing (what the writer does at every segment's install: the CREATE VIEW, rolled back), and then, writing
on, what the writer spends re-pointing per segment (two segments of small rows committed: how many re-pointings, and
their time; twice a segment before the spare journal of 2026-12-07, once after). The row
size does not matter to those (DuckDB binds each table the view names, column by column), and reads of one session as
a node makes them (`Store.query(..., session=)`, which binds only the tables listed as holding it: `recent`, in the
newest 10 segments, and `s7`, in every 12th or so); what a merge costs for
harness-sized rows is bench/compaction.py's to measure (`--rows 16640`: 65 segments, one merge of the oldest 16).
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
from typing import TYPE_CHECKING

from bench.common import ROOT

if TYPE_CHECKING:
    from polar_mitm.store import Store

QUERIES = {
    "no match": "SELECT count(*) FROM exchanges WHERE session_id = 'nobody'",
    "one session": "SELECT count(*) FROM exchanges WHERE session_id = 's7'",
    "count": "SELECT count(*) FROM exchanges",
}
# a session in the newest 10 segments; one in every 12th or so (the synthetic cycle of 50 sessions)
SESSION_READS = {"session read: recent": "recent", "session read: s7": "s7"}


def build(db: Path, segments: int) -> None:
    import pyarrow as pa

    from polar_mitm import store

    con = store.connect(db)
    store.ensure_schema(con)
    for number in range(segments):
        ids = [f"x{number}-{i}" for i in range(4)]
        # 50 sessions cycling through every segment, but one row of each of the newest 10 segments is `recent`'s:
        # a session of a real run, which lives through a few consecutive segments
        sessions = [f"s{(number * 4 + i) % 50}" if i or number < segments - 10 else "recent" for i in range(4)]
        store.add_segment(con, pa.table({
            "exchange_id": ids, "session_id": sessions, "seq": pa.array([number * 4 + i for i in range(4)], pa.int32()),
            "api": ["openai_chat"] * 4, "action": ["generate"] * 4, "status": ["ok"] * 4,
        }))
    con.close()


def one(db: Path, fanin: int) -> dict[str, float]:
    """In a process of its own: open (merging what aged), close, open again and time the reads."""
    from polar_mitm.store import Store
    from polar_mitm.store.segments import exchanges_view_sql

    wall, cpu = time.perf_counter(), time.process_time()
    first = Store(db, merge_fanin=fanin)
    settle(first)
    first.close()
    result = {"first_open_s": time.perf_counter() - wall, "first_open_cpu_s": time.process_time() - cpu}
    started = time.perf_counter()
    target = Store(db, merge_fanin=fanin)
    result["open_s"] = time.perf_counter() - started
    settle(target)  # a merge queued as the first one closed runs now: the reads below are timed without it
    try:
        con = target.con.cursor()
        result["tables"] = len(target._segments) + len(target._merged) + len(target._journals)
        result["rows"] = target.query(QUERIES["count"])[1][0][0]
        for name, sql in QUERIES.items():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                target.query(sql)
                times.append(time.perf_counter() - started)
            result[name] = min(times)
        # a read of one session as a node makes it (Store.query(..., session=): only the tables holding it bound)
        for name, session in SESSION_READS.items():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                target.query("SELECT count(*) FROM exchanges", session=session)
                times.append(time.perf_counter() - started)
            result[name] = min(times)
        sql = exchanges_view_sql(target._segments, target._journals, target._merged)
        started = time.perf_counter()
        con.execute("BEGIN TRANSACTION")
        con.execute(sql)
        result["view_s"] = time.perf_counter() - started
        con.execute("ROLLBACK")
        result.update(writing_on(target))
    finally:
        target.close()
    return result


def settle(target: Store) -> None:
    """Until no merge is queued or running, three looks in a row (a merge's install queues the next one: between
    the two, neither shows)."""
    calm = 0
    while calm < 3:
        calm = calm + 1 if not target._merging and target._compactions.empty() else 0
        time.sleep(0.05)


def listed_segments(target: Store) -> int:
    return len(target._segments) + sum(len(held.segments) for held in target._merged.values())


def writing_on(target: Store) -> dict[str, float]:
    """What the writer spends re-pointing the view while a node writes on: two segments' worth of small rows
    committed (64 at a time), each compacted before the next is written, each re-pointing timed where it is made
    (the `write_view` the store's modules call, wrapped)."""
    from polar_mitm.store import compactor, writer

    timed: list[float] = []

    def timing(real):  # noqa: ANN001, ANN202
        def write_view(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            started = time.perf_counter()
            real(*args, **kwargs)
            timed.append(time.perf_counter() - started)
        return write_view

    for module in (compactor, writer):  # a tree before the spare journal re-pointed in both
        if hasattr(module, "write_view"):
            module.write_view = timing(module.write_view)
    listed = listed_segments(target)
    rows: list[dict[str, object]] = [{"exchange_id": f"w{i}", "session_id": f"w{i % 64}", "seq": 1 + i // 64, "api": "openai_chat", "action": "generate", "status": "ok"}
            for i in range(2 * target.segment_rows)]

    async def commit(some: list[dict[str, object]]) -> None:
        for first in range(0, len(some), 64):
            await asyncio.gather(*(target.commit_exchange(row) for row in some[first : first + 64]))

    # a segment at a time, each compacted before the next fills, as at a node's pace (a segment of a busy node's
    # rows takes seconds; its compaction a fraction of one)
    for segment in range(2):
        asyncio.run(commit(rows[segment * target.segment_rows : (segment + 1) * target.segment_rows]))
        deadline = time.monotonic() + 600
        while (listed_segments(target) < listed + segment + 1 or target._compacting) and time.monotonic() < deadline:
            time.sleep(0.02)
    return {"repoints_per_segment": len(timed) / 2, "repointing_s_per_segment": sum(timed) / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", default="100,1000,3000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "segments_results.md")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # DB FANIN: a single run, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(Path(args.one[0]), int(args.one[1]))))
        return
    folder = Path(tempfile.mkdtemp(prefix="polar-segments-"))
    variants = {"merged (merge_fanin 16, merge_after 48)": 16, "unmerged (merge_fanin 0)": 0}
    lines = []
    try:
        for count in (int(n) for n in args.segments.split(",")):
            source = folder / f"s{count}.duckdb"
            started = time.perf_counter()
            build(source, count)
            print(f"{count} segments built in {time.perf_counter() - started:.1f} s", flush=True)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fanin in variants.items():
                    db = folder / f"run-{count}-{fanin}.duckdb"
                    shutil.copy(source, db)
                    done = subprocess.run([sys.executable, "-m", "bench.segments_bench", "--one", str(db), str(fanin)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
                    if done.returncode != 0:
                        raise RuntimeError(f"{name} at {count} segments failed:\n{done.stderr[-3000:]}")
                    runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    for path in folder.glob(f"run-{count}-{fanin}.duckdb*"):
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                    print(f"  {count} {name}: {runs[name][-1]}", flush=True)
            for name, results in runs.items():
                def med(key: str) -> float:
                    return statistics.median(r[key] for r in results)  # noqa: B023 - used at once
                lines.append(
                    f"| {count:,} | {name} | {int(med('tables'))} | {med('first_open_s'):.1f} / {med('first_open_cpu_s'):.1f} | {med('open_s'):.2f} | "
                    + " | ".join(f"{1000 * med(q):.0f}" for q in [*QUERIES, *SESSION_READS]) + f" | {1000 * med('view_s'):.0f} | {med('repoints_per_segment'):g} / {1000 * med('repointing_s_per_segment'):.0f} | {int(med('rows')):,} |"
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    header = (
        f"Segments bench (`python -m bench.segments_bench`), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores; "
        f"medians of {args.rounds} round(s).\n\n"
        "| segments | store | tables in the view | first open, merging (s, wall / CPU) | open (s) | "
        + " | ".join(f"query: {q} (ms)" for q in QUERIES) + " | " + " | ".join(f"{q} (ms)" for q in SESSION_READS) + " | view re-pointed (ms) | writing on: re-pointings / ms per segment | rows |\n"
        + "|---" * (8 + len(QUERIES) + len(SESSION_READS)) + "|\n"
    )
    text = header + "\n".join(lines) + "\n"
    args.output.write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
