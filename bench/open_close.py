"""A store's close, and its open after a crash: how far RSS rises above where it was, this tree against another.

    python -m bench.open_close [--baseline DIR] [--pairs 2] [--close-rows 140] [--crash-rows 480]

Rows are Qwen Code exchanges with 14k prompt ids (bench/compaction.py's, ~200 KB of records each; a journal becomes
a segment at 32 MB, ~160 of them). Each measurement is a process of its own that imports `polar_mitm` from the tree:
- close: `--close-rows` committed (fewer than a segment's worth, so they wait in the commit log), then `close()`,
  which makes them a segment; the peak (VmHWM, reset before the close) against RSS just before it.
- open after a crash: a writer commits `--crash-rows` with its compactor held back (its `_compact_one` replaced by
  a no-op, in that writer only: a compactor behind its backlog, so the sealed logs wait) and dies by `os._exit`;
  then another process opens the store, and its peak is read as above, with the open's wall time.
Trees alternate; every run is printed, then medians. Results: bench/README.md.
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

ROOT = Path(__file__).resolve().parent.parent


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _peak_from_here() -> float:
    """RSS now, with the peak (VmHWM) reset to it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _commit(store: object, rows: list[dict]) -> None:
    async def commit_all() -> None:
        for first in range(0, len(rows), 16):
            await asyncio.gather(*(store.commit_exchange(row) for row in rows[first : first + 16]))  # type: ignore[attr-defined]

    asyncio.run(commit_all())


def one(phase: str, folder: Path, rows: int) -> dict[str, float]:
    """One measurement (or the crashing writer) in this process, with the `polar_mitm` on sys.path."""
    from bench.compaction import exchange_rows
    from polar_mitm.store import Store, compactor

    db = folder / "s.duckdb"
    if phase == "close":
        store = Store(db)
        _commit(store, exchange_rows(rows, prompt_ids=14_000))
        time.sleep(1)  # the writer and compactor quiet
        before = _peak_from_here()
        started = time.perf_counter()
        store.close()
        return {"rise_mb": _status_mb("VmHWM") - before, "seconds": time.perf_counter() - started}
    if phase == "crash":
        compactor.Compaction._compact_one = lambda self, *job: None  # type: ignore[method-assign]
        store = Store(db)
        _commit(store, exchange_rows(rows, prompt_ids=14_000))
        os._exit(0)
    before = _peak_from_here()
    started = time.perf_counter()
    store = Store(db)
    took = time.perf_counter() - started
    rise = _status_mb("VmHWM") - before
    count = store.query("SELECT count(*) FROM exchanges")[1][0][0]
    store.close()
    assert count == rows, f"{count} rows read back of {rows}"
    return {"rise_mb": rise, "seconds": took}


def measure(source: Path, phase: str, folder: Path, rows: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "bench.open_close", "--one", str(source), phase, str(folder), str(rows)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} in {source} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) if phase != "crash" else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another polar_mitm source tree, run in turn with this one")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--close-rows", type=int, default=140)
    parser.add_argument("--crash-rows", type=int, default=480)
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # tree, phase, folder, rows: one run in this process
    args = parser.parse_args()
    if args.one is not None:
        tree, phase, folder, rows = args.one
        import bench.common  # noqa: F401 - this tree's bench (it imports no polar_mitm), whatever tree is measured
        import bench.compaction  # noqa: F401

        sys.path.insert(0, tree)  # before polar_mitm is first imported
        print(json.dumps(one(phase, Path(folder), int(rows))))
        return
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    results: dict[str, dict[str, list[dict[str, float]]]] = {name: {"close": [], "open": []} for name in trees}
    for _ in range(args.pairs):
        for name, source in trees.items():
            for phase, rows in (("close", args.close_rows), ("open", args.crash_rows)):
                folder = Path(tempfile.mkdtemp(prefix="polar-open-close-"))
                try:
                    if phase == "open":
                        measure(source, "crash", folder, rows)
                    results[name][phase].append(measure(source, phase, folder, rows))
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
            print(f"  {name}: {results[name]['close'][-1]} at close, {results[name]['open'][-1]} at open", flush=True)
    print(f"\n{args.close_rows} rows at close, {args.crash_rows} at an open after a crash; {args.pairs} runs each, medians ({os.cpu_count()} cores):")
    print("| tree | close: peak RSS rise (MB) | close (s) | open after a crash: peak RSS rise (MB) | open (s) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        close, opened = runs["close"], runs["open"]
        print(f"| {name} | {statistics.median(r['rise_mb'] for r in close):.0f} | {statistics.median(r['seconds'] for r in close):.2f} | "
              f"{statistics.median(r['rise_mb'] for r in opened):.0f} | {statistics.median(r['seconds'] for r in opened):.2f} |")


if __name__ == "__main__":
    main()
