"""The store's compactor thread: full journals become segment tables (polar_mitm.store.segments), off the writer's
thread, each segment listed by the writer in one transaction. A sealed journal's segment is written from its records
(polar_mitm.store.commit_log), which never went into the journal table. A journal whose compaction failed (a full disk)
stays a journal, in the view, and is queued again after the writer's next new journal; the compactor itself never
dies of a failure."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.store.cache import SegmentCache
from polar_mitm.store.commit_log import CommitLog, sealed_log_path
from polar_mitm.store.records import journal_table
from polar_mitm.store.segments import (
    SEGMENT_COLUMNS,
    checkpoint_soon,
    register_segment,
    segment_file,
    transaction,
    write_records_segment,
    write_segment,
    write_view,
)
from polar_mitm.store.trouble import WriteTrouble, invalidates

log = logging.getLogger("polar_mitm.store")

# journals waiting for the compactor (one being compacted, one queued) before the writer waits for it: a compactor
# that falls behind (it yields to the proxy) would otherwise hold every full journal in memory
COMPACTION_BACKLOG = 2


class Compaction:
    """The compactor's part of Store (a mixin: the attributes below are Store's)."""

    con: duckdb.DuckDBPyConnection
    slice_bytes: int
    _journals: list[int]
    _compacting: set[int]  # journals queued for the compactor or being compacted
    _compacted: threading.Event  # set each time the compactor has written a segment or given up on one
    _handed: int  # steps the compactor has handed the writer and waits for (under _handing)
    _handing: threading.Lock
    _compactions: queue.Queue[tuple[int, int | None, bool] | None]
    _sealed: set[int]
    _call_writer: Callable[[Any], None]
    path: Path
    _segments: dict[int, tuple[str, ...]]
    _trouble: Callable[..., None]
    compaction_trouble: WriteTrouble
    _cache: SegmentCache
    _pending: Callable[..., Any]  # the writer's queued-step type
    segment_rows: int
    journal_bytes_max: int
    _journal_rows: int
    _journal_bytes: int
    _compactor: threading.Thread
    _rotate: Callable[[duckdb.DuckDBPyConnection], int | None]

    def _journal_full(self, con: duckdb.DuckDBPyConnection) -> None:
        """A journal holding `segment_rows` rows (or `journal_mb`) goes to the compactor, and a new one is begun."""
        if not (self._journal_rows >= self.segment_rows or (self.journal_bytes_max and self._journal_bytes >= self.journal_bytes_max)):
            return
        try:
            full_bytes = self._journal_bytes
            full = self._rotate(con)
        except Exception as error:  # noqa: BLE001 - keep journaling into the current table; retried after the next batch
            self._trouble("starting a new journal", error)
            return
        if full is not None:
            self._queue_compaction(full, full_bytes)
        self._queue_uncompacted()

    def _keep_up(self) -> None:
        """Between batches (never inside a move: the compactor's install step would wait for it)."""
        if len(self._compacting) > COMPACTION_BACKLOG and self._compactor.is_alive():
            # backpressure: commits wait (a few ms) rather than full journals piling up in memory
            self._compacted.clear()
            if not self._handed:  # else a step of the compactor's is queued: the loop runs it next
                self._compacted.wait(timeout=5)

    def _queue_compaction(self, number: int, journal_bytes: int | None = None) -> None:
        """Journal `number` to the compactor, saying whether its records are sealed (not in the journal table)."""
        self._compacting.add(number)
        self._compactions.put((number, journal_bytes, number in self._sealed))

    def _queue_uncompacted(self) -> None:
        """Queue again each full journal whose compaction failed (a full disk): they stay journals until then."""
        for number in self._journals[:-1]:
            if number not in self._compacting:
                self._queue_compaction(number)

    def _install_segment(self, con: duckdb.DuckDBPyConnection, number: int, rows: int) -> None:
        """Swap journal `number` for its segment table (written by write_segment; 0 rows: the journal was empty, no
        table) in one transaction: the view names the segment as the journal leaves it, never both or neither."""
        if number not in self._journals[:-1]:
            raise RuntimeError(f"{journal_table(number)} is no longer a full journal (the store was reopened)")
        segments = {**self._segments, **({number: SEGMENT_COLUMNS} if rows else {})}
        journals = [j for j in self._journals if j != number]
        with transaction(con):
            if rows:
                register_segment(con, number, segment_file(number), rows)
            write_view(con, segments, journals)
            con.execute(f"DROP TABLE {journal_table(number)}")
        self._segments, self._journals = segments, journals
        if number in self._sealed:
            self._sealed.discard(number)
            sealed_log_path(self.path, number).unlink(missing_ok=True)  # its records are the segment now

    def _compact(self, con: duckdb.DuckDBPyConnection, number: int) -> None:
        """Journal (or its sealed records) to segment, in the calling thread (start-up, close: nothing else writes)."""
        self._install_segment(con, number, self._write_segment(con, number, number in self._sealed)[0])

    def _write_segment(self, con: duckdb.DuckDBPyConnection, number: int, sealed: bool, journal_bytes: int | None = None, slice_bytes: int = 0) -> tuple[int, int]:
        """Journal `number`'s segment table, unlisted: from its sealed log's records while that log is there (a read
        may have moved them into the journal meanwhile, and removed it), else from the journal."""
        records = CommitLog(sealed_log_path(self.path, number)).read() if sealed else []
        if records:
            return write_records_segment(con, number, records, slice_bytes)
        return write_segment(con, number, journal_bytes, slice_bytes)

    def _compact_loop(self) -> None:
        # compaction yields to the proxy: DuckDB runs it on this thread alone (threads=1, set at open), niced
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            job = self._compactions.get()
            if job is None:
                return
            try:
                self._compact_one(*job)
            finally:
                self._compacting.discard(job[0])
                self._compacted.set()

    def _compact_one(self, number: int, journal_bytes: int | None, sealed: bool) -> None:
        """One journal to its segment (from its sealed log's records, if it is still there: a read may have moved
        them into the journal meanwhile); on failure (a full disk) it stays a journal, in the view (sealed records:
        moved into it by the writer's next move), and is queued again after the writer's next new journal. Never
        raises: the compactor outlives any failure."""
        if number not in self._journals[:-1]:
            return  # compacted already (queued twice around a reopen)
        started = time.perf_counter()
        try:
            con = self.con.cursor()  # the current connection's: the writer may have reopened the file
            # its own transaction, beside the writer's commits (another table); unlisted, so outside the view
            rows, slices = self._write_segment(con, number, sealed, journal_bytes, self.slice_bytes)
            written = time.perf_counter()
            self._to_writer(lambda writer, number=number, rows=rows: self._install_segment(writer, number, rows))
        except Exception as error:  # noqa: BLE001 - the journal stays (and stays in the view); compacted again later
            # a segment table written without its listing stays outside the view: the next try replaces it, and
            # the next open drops it
            self._trouble(f"compacting {journal_table(number)}, whose rows stay in the journal", error, compaction=True)
            self._compacted.set()  # a writer waiting on the backlog goes on
            return
        installed = time.perf_counter()
        self.compaction_trouble.writes_again()
        try:
            checkpointed = checkpoint_soon(con)
        except Exception as error:  # noqa: BLE001 - e.g. a full disk: the WAL keeps the rows; the writer reopens if DuckDB gave up
            # commits go on unless DuckDB gave up on the file (then the commits' own episode says so)
            self._trouble("checkpointing", error, compaction=not invalidates(error))
            return
        checkpointed_at = time.perf_counter()
        held: list[int | None] = []
        if checkpointed:  # the blocks it wrote stay in DuckDB's cache until cut (polar_mitm.store.cache)
            try:
                self._to_writer(lambda writer: held.append(self._cache.cut(writer)))
            except Exception as error:  # noqa: BLE001 - the cache stays as it was; commits go on
                self._trouble("cutting DuckDB's cache after a checkpoint", error, compaction=True)
        cut = f", DuckDB holds {held[0]} MB after a cut in {1000 * (time.perf_counter() - checkpointed_at):.0f} ms" if held and held[0] is not None else ""
        log.info(
            f"polar-mitm: segment {number:06d}: {rows} exchanges written in {slices} slices in {1000 * (written - started):.0f} ms, installed in "
            f"{1000 * (installed - written):.0f} ms, {'checkpoint' if checkpointed else 'no checkpoint'} in {1000 * (checkpointed_at - installed):.0f} ms{cut}"
        )

    def _to_writer(self, step: Callable[[duckdb.DuckDBPyConnection], None]) -> None:
        """Run `step` on the writer thread and wait for it. Counted before it is queued, so a writer about to wait
        for the compactor's backlog runs it instead: the writer used to clear the wake-up the compactor had just
        given and then wait out its 5 s timeout while the compactor waited for it (commits stalled 5.1 s, about
        once per 1,000 exchanges under load, bench: compaction log's "installed in 5101 ms")."""
        with self._handing:
            self._handed += 1
        self._compacted.set()
        try:
            self._call_writer(self._pending(step=step))
        finally:
            with self._handing:
                self._handed -= 1
