"""Opening the gateway's store at start: wait for a reader's lock to go, refuse a store another gateway holds, and
say which gateway that is (its control file names its pid; its confdir's gateway file, its URL)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import duckdb

from polar_mitm import routing
from polar_mitm.store import Store
from polar_mitm.store.by_path import live_endpoint, live_holder

# A reader that found no live gateway (`polar-mitm sql`, store.query, a notebook) opens the file read-only for the
# length of its query, which DuckDB's file lock refuses a writer meanwhile; a gateway starting just then (a restart
# after a crash leaves a stale control file) waits for it. Another live gateway on the store is refused at once.
READER_LOCK_WAIT_S = 15.0


def open_when_readers_leave(db: Path, memory_mb: int, journal_mb: int, compact_slice_mb: int, merge_fanin: int, report: Callable[[str], None]) -> Store:
    """The gateway's store, with its bounds and merges (gateway/options.py: store_memory_mb, ..., store_merge_fanin)."""
    deadline = time.monotonic() + READER_LOCK_WAIT_S
    while True:
        try:
            return Store(db, memory_mb=memory_mb, journal_mb=journal_mb, compact_slice_mb=compact_slice_mb, report=report, merge_fanin=merge_fanin)
        except duckdb.IOException as error:
            if "lock" not in str(error).lower() or live_endpoint(db) is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def why_not_opened(db: Path, confdir: str, error: BaseException) -> str:
    """The cause in one line: the gateway that holds the store (instead of DuckDB's lock message), else the error."""
    if isinstance(error, duckdb.IOException) and "lock" in str(error).lower() and (holder := live_holder(db)) is not None:
        pid = holder.get("pid")
        # its proxy URL is in the gateway file of its confdir: ours, when it was started the same way
        urls = [url for url, entry in routing.live_gateways(confdir).items() if entry.get("pid") == pid]
        who = f"the gateway at {urls[0]} (pid {pid})" if urls else f"the gateway with SQL endpoint {holder.get('sql_url')} (pid {pid})"
        return f"{who} holds this store; stop it or use another --db"
    return " ".join(str(error).split()) or type(error).__name__
