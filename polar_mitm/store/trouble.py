"""How the store tells its user that it cannot write (a full disk, a failed write) and that it writes again: one
line each per episode, however many commits were refused in between (a gateway under load refuses hundreds a second)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import duckdb


class WriteTrouble:
    """An episode of failed writes: said when the first write fails and when a commit succeeds again.

    `compaction=True`: the compactor's episode, of its own. A journal that cannot become a segment stays a journal
    (in the view) while commits go on, so it says that, and only a compaction that succeeds ends it: sharing the
    commits' episode said "model calls are answered 500" while they were not, and each retry after a successful
    commit said it all again (8 lines in one test run on a slow machine)."""

    def __init__(self, path: Path, report: Callable[[str], None], compaction: bool = False):
        self.path, self.report, self.compaction = path, report, compaction
        self.since: float | None = None  # None: writes succeed
        self.refused = 0  # commits refused in this episode

    def failed(self, doing: str, error: BaseException, refused: int = 0) -> None:
        self.refused += refused
        if self.since is not None:
            return
        self.since = time.monotonic()
        if self.compaction:
            self.report(
                f"the store {self.path} cannot compact ({doing}: {one_line(error)}); commits go on into the journal, and "
                "compaction is tried again after each new journal"
            )
        else:
            self.report(
                f"the store {self.path} cannot write ({doing}: {one_line(error)}); model calls are answered 500 store_error, "
                "unrecorded, until it can (what was committed before stays)"
            )

    def writes_again(self) -> None:
        if self.since is None:
            return
        if self.compaction:
            self.report(f"the store {self.path} compacts again, after {time.monotonic() - self.since:.0f}s")
        else:
            self.report(f"the store {self.path} writes again, after {time.monotonic() - self.since:.0f}s ({self.refused} exchanges refused meanwhile)")
        self.since, self.refused = None, 0


def invalidates(error: BaseException) -> bool:
    """DuckDB refuses every later write on this database instance (a checkpoint failed: it must be opened again)."""
    return isinstance(error, duckdb.FatalException) or "database has been invalidated" in str(error)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__
