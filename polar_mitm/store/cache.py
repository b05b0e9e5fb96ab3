"""DuckDB's cache of segment blocks, cut back after each checkpoint.

DuckDB keeps every block a checkpoint wrote in its buffer pool until its memory limit forces it out, so with
segments as tables the gateway grew by every segment it wrote (bench/memory_bench.py at 64 sessions: DuckDB's
BASE_TABLE memory 8 -> 310 MB within 60 s, still rising towards the 512 MB limit). The one way DuckDB offers to drop
them is a lower memory limit: blocks that are on disk are dropped, not written anywhere. A lower limit would also
fail any other allocation that needs more meanwhile, so the cut runs only where nothing else can allocate: on the
writer thread (no commit beside it), after the compactor's checkpoint (the compactor waits for it), and while no
read runs (reads wait the few milliseconds it takes; a cut that would wait for a read is skipped, the next
checkpoint's cut takes its place).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb

# what the cut leaves of the segments' blocks, beyond DuckDB's other memory (the journal being written, ...)
KEEP_MB = 32


class SegmentCache:
    """The reads' gate and the cut; `limit_mb`: the store's DuckDB memory limit, restored after each cut (0: DuckDB's
    default, which RESET restores exactly; its spelling, e.g. "18.8 GiB", would not)."""

    def __init__(self, limit_mb: int, keep_mb: int = KEEP_MB):
        self.restore = f"SET memory_limit = '{limit_mb}MB'" if limit_mb else "RESET memory_limit"
        self.keep_mb = keep_mb
        self._gate = threading.Condition()
        self._readers = 0
        self._cutting = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around any read on the writer's database instance (any thread)."""
        with self._gate:
            while self._cutting:
                self._gate.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._gate:
                self._readers -= 1

    def cut(self, con: duckdb.DuckDBPyConnection) -> int | None:
        """Drop cached segment blocks past `keep_mb` (writer thread, after a checkpoint); returns the MB DuckDB then
        holds, None when skipped (a read running) or when DuckDB could not free that much (pinned memory)."""
        with self._gate:
            if self._readers:
                return None
            self._cutting = True
        try:
            other = con.execute("SELECT coalesce(sum(memory_usage_bytes) FILTER (WHERE tag <> 'BASE_TABLE'), 0) FROM duckdb_memory()").fetchall()[0][0]
            try:
                con.execute(f"SET memory_limit = '{(other >> 20) + self.keep_mb}MB'")
            except duckdb.OutOfMemoryException:
                return None
            finally:
                con.execute(self.restore)
            return int(con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchall()[0][0]) >> 20
        finally:
            with self._gate:
                self._cutting = False
                self._gate.notify_all()
