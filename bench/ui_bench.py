"""How fast the dashboard (`polar-mitm ui`, polar_mitm/ui/) answers on a 10,000-exchange store.

    .venv/bin/python bench/ui_bench.py [--sessions 500] [--turns 20] [--out bench/ui_results.md]

The store is written by the real writer (polar_mitm.store.Store.commit_exchange) with rows shaped like the
gateway's (tests/support/ui_stores.py, from tests/support/rows.py's exchange_row): 500 agent-loop sessions of 20
turns whose prompt grows turn by turn (prefix merging makes one sequence of each), chat messages and tools in the
engine request, policy versions, one exchange in 20 an engine error, the rollout server's sessions rows (task,
status, reward, stage timings), tasks of 10 sessions.

Each page is fetched through the app in this process (httpx's ASGI transport: the page's own work, no socket),
a few times: the first (cold: DuckDB file opened, tokenizer loaded) and the median of the rest are reported, in
two states: the closed file (`polar-mitm ui` on a finished run) and the same file held by a live writer with its
SQL endpoint (a gateway writing: the reads go through that endpoint as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.store import Store  # noqa: E402
from polar_mitm.ui import PathSource, standalone_app  # noqa: E402
from tests.support.ui_stores import CONTEXT_TOKENS, SAMPLED_TOKENS, SYSTEM_TOKENS, write_store  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def time_pages(app: object, paths: list[str], repeat: int) -> dict[str, tuple[float, float, float, int]]:
    """path -> (first wall s, median wall s, median CPU s of this process, HTML bytes). CPU time is what a shared,
    busy machine does not inflate (DuckDB's threads count in it, so it can exceed the wall time)."""
    results = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:  # type: ignore[arg-type]
        for path in paths:
            walls, cpus = [], []
            size = 0
            for _ in range(repeat):
                began, cpu = time.perf_counter(), cpu_seconds()
                reply = await client.get(path)
                walls.append(time.perf_counter() - began)
                cpus.append(cpu_seconds() - cpu)
                assert reply.status_code == 200, f"{path}: {reply.status_code} {reply.text[:300]}"
                size = len(reply.content)
            results[path] = (walls[0], statistics.median(walls[1:]), statistics.median(cpus[1:]), size)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--db", type=Path, default=Path("/tmp/ui-bench/store.duckdb"))
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="reuse the store at --db if it is there")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args()
    if not (args.keep and args.db.exists()):
        shutil.rmtree(args.db.parent, ignore_errors=True)
        began = time.perf_counter()
        asyncio.run(write_store(args.db, args.sessions, args.turns))
        print(f"built {args.sessions * args.turns} exchanges in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    session = f"s{args.sessions // 2:04d}"
    paths = ["/ui/", f"/ui/session?id={session}", f"/ui/sequence?id={session}:prefix_merging:1"]
    source = PathSource(args.db)
    closed = asyncio.run(time_pages(standalone_app(source), paths, args.repeat))
    source.close()  # this process opens the file for writing next
    live_store = Store(args.db)  # a live writer holding the file, answering SQL as a gateway does
    live_store.serve_sql()
    try:
        live = asyncio.run(time_pages(standalone_app(PathSource(args.db)), paths, args.repeat))
    finally:
        live_store.close()
    lines = [
        f"Dashboard pages on a {args.sessions * args.turns:,}-exchange store ({args.sessions} sessions x {args.turns} turns, prompts growing to "
        f"{SYSTEM_TOKENS + (args.turns - 1) * (CONTEXT_TOKENS + SAMPLED_TOKENS):,} tokens), {datetime.now(UTC):%Y-%m-%d}, this machine:",
        "",
        "| page | closed file: first / median wall, median CPU | written by a live gateway (its SQL endpoint): first / median wall, median CPU | HTML |",
        "|---|---|---|---|",
    ]
    for path in paths:
        c, lv = closed[path], live[path]
        lines.append(f"| `{path}` | {c[0] * 1000:.0f} / {c[1] * 1000:.0f} ms, {c[2] * 1000:.0f} ms | {lv[0] * 1000:.0f} / {lv[1] * 1000:.0f} ms, {lv[2] * 1000:.0f} ms | {c[3] / 1024:.0f} KB |")
    lines += ["", f"load average while measuring: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
