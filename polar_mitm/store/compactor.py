"""The store's compactor thread: full journals become segment tables (polar_mitm.store.segments), off the writer's
thread, each segment listed by the writer in one transaction. A sealed journal's segment is written from its records
(polar_mitm.store.commit_log), which never went into the journal table. A journal whose compaction failed (a full disk)
stays a journal, in the view, and is queued again after the writer's next new journal; the compactor itself never
dies of a failure. With `merge_fanin` set (off by default) it also merges aged segments, `merge_fanin` tables of one
level into one, so the view names a bounded number of tables however long the store is written (merge_segments)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.store.cache import SegmentCache
from polar_mitm.store.commit_log import record_slices, sealed_log_path
from polar_mitm.store.records import JOURNAL_COLUMNS, journal_table
from polar_mitm.store.segments import (
    MERGED_PREFIX,
    SEGMENT_COLUMNS,
    SEGMENTS_TABLE,
    MergedTable,
    checkpoint_soon,
    merge_segments,
    register_segment,
    segment_file,
    segment_table,
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
# sealed journals (their records wait in files, not in memory) may queue further behind a merge: one of 16 segments
# of 256 harness-sized rows takes the compactor ~5 s
SEALED_BACKLOG = 16
# the most rows one merge copies: DuckDB holds a table's newest row group (up to 122,880 rows) in memory until it is
# committed and checkpointed, outside its memory limit, so a merge's memory grows with its rows (16 segments of 256
# chat-mode rows of 172 KB: +1.2 GB, docs/store.md). Beyond it a level is not merged on: 16 of those merged tables
# would be 65,536 rows at once. Tables of smaller segments still merge up to this many rows.
MERGE_ROWS = 4096
# with merges off, a warning each time the view comes to name this many more tables: every re-pointing and every read
# of the view binds them all (at 1,000 tables 0.3-0.5 s each, at 3,000 ~1 s: bench/segments_bench.py)
VIEW_TABLES_WARNING = 1000


@dataclass(frozen=True)
class Merge:
    """A compactor job: these segments (in their own tables) and merged tables, all of one level, into `table`."""

    table: str
    segments: tuple[int, ...]  # in tables of their own
    merged: dict[str, tuple[str, ...]]  # merged tables -> their columns besides `segment`


def create_journal(con: duckdb.DuckDBPyConnection, number: int) -> None:
    con.execute(f"CREATE TABLE {journal_table(number)} ({', '.join(f'{n} {t}' for n, t in JOURNAL_COLUMNS.items())})")


def merge_level(segments: int, fanin: int) -> int:
    """The level of a table holding this many segments: a segment's own table is level 0, and a merge of `fanin`
    tables of level L is level L + 1 (holding fanin ** (L + 1) segments)."""
    level, size = 0, 1
    while size < segments:
        level, size = level + 1, size * fanin
    return level


class Compaction:
    """The compactor's part of Store (a mixin: the attributes below are Store's)."""

    con: duckdb.DuckDBPyConnection
    slice_bytes: int
    _journals: list[int]
    _compacting: set[int]  # journals queued for the compactor or being compacted
    _compacted: threading.Event  # set each time the compactor has written a segment or given up on one
    _handed: int  # steps the compactor has handed the writer and waits for (under _handing)
    _handing: threading.Lock
    _compactions: queue.Queue[tuple[int, int | None, bool] | Merge | None]
    _sealed: set[int]
    _call_writer: Callable[[Any], None]
    path: Path
    _segments: dict[int, tuple[str, ...]]  # segments in tables of their own -> their columns
    _merged: dict[str, MergedTable]
    merge_fanin: int
    merge_after: int
    _merging: bool  # a merge is queued or running (one at a time)
    _next_merged: int
    _trouble: Callable[..., None]
    compaction_trouble: WriteTrouble
    _cache: SegmentCache
    _pending: Callable[..., Any]  # the writer's queued-step type
    segment_rows: int
    journal_bytes_max: int
    _journal_rows: int
    _journal_bytes: int
    _compactor: threading.Thread
    _next_number: int  # the next journal's
    _spare: int | None  # an empty journal already in the view: the next one, started without re-pointing the view
    _keep_spare: bool  # False while closing

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
        # a merge holds the compactor for seconds: sealed journals then queue behind it (up to SEALED_BACKLOG)
        # rather than stall commits; otherwise every queued journal counts, as before merges
        waiting = len(self._compacting - self._sealed) if self._merging else len(self._compacting)
        if (waiting > COMPACTION_BACKLOG or len(self._compacting) > SEALED_BACKLOG) and self._compactor.is_alive():
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
        table) in one transaction: the view names the segment as the journal leaves it, never both or neither. The
        view is re-pointed here anyway, so a spare journal is made here too, when none is waiting."""
        if number not in self._journals[:-1]:
            raise RuntimeError(f"{journal_table(number)} is no longer a full journal (the store was reopened)")
        segments = {**self._segments, **({number: SEGMENT_COLUMNS} if rows else {})}
        journals = [j for j in self._journals if j != number]
        spare = self._next_number if self._spare is None and self._keep_spare else None
        with transaction(con):
            if rows:
                register_segment(con, number, segment_file(number), rows)
            if spare is not None:
                create_journal(con, spare)
            started = time.perf_counter()
            write_view(con, segments, self._view_journals(journals, spare), self._merged)
            repointed = time.perf_counter() - started
            con.execute(f"DROP TABLE {journal_table(number)}")
        tables = len(segments) + len(self._merged)
        if not self.merge_fanin and rows and tables % VIEW_TABLES_WARNING == 0:
            log.warning(
                f"polar-mitm: the exchanges view of {self.path} names {tables} tables (a segment each); re-pointing it at each "
                f"segment took {1000 * repointed:.0f} ms this time, and every read of it binds them all: --store-merge-fanin 16 "
                "merges aged segments (docs/store.md)"
            )
        self._segments, self._journals = segments, journals
        if spare is not None:
            self._spare, self._next_number = spare, spare + 1
        if number in self._sealed:
            self._sealed.discard(number)
            sealed_log_path(self.path, number).unlink(missing_ok=True)  # its records are the segment now
        self._queue_merge()

    def _rotate(self, con: duckdb.DuckDBPyConnection) -> int | None:
        """Start a new journal; returns the full one, for the compactor. Writer thread (or before it starts).

        The spare journal becomes it, with no change to the view. Re-pointing the view binds every table it names
        (0.27 s at 1,000 unmerged segments, 0.95 s at 3,000: bench/segments_bench.py), and commits wait behind it,
        so it is done once a segment, at its install, not also here; only without a spare (at open, or with the
        compactor a journal behind) is one made here, with the next spare, in one re-pointing."""
        if self._spare is not None:
            number, spare = self._spare, None
        else:
            number, spare = self._next_number, (self._next_number + 1 if self._keep_spare else None)
            with transaction(con):
                for table in (number, spare):
                    if table is not None:
                        create_journal(con, table)
                write_view(con, self._segments, self._view_journals([*self._journals, number], spare), self._merged)
            self._next_number = (spare or number) + 1
        full, self._journals, self._spare, self._journal_rows, self._journal_bytes = self._journals, [*self._journals, number], spare, 0, 0
        return full[-1] if full else None

    def _view_journals(self, journals: list[int], spare: int | None = None) -> list[int]:
        """The journals the view names: these, and the spare one (`spare`, or the one waiting)."""
        spare = self._spare if spare is None else spare
        return [*journals, spare] if spare is not None else journals

    def _set_merges(self, fanin: int, after: int) -> None:
        if fanin == 1 or fanin < 0 or after < 0:
            raise ValueError(f"merge_fanin {fanin}, merge_after {after}: a merge takes at least 2 tables (0: no merges), after 0 or more segments")
        self.merge_fanin, self.merge_after, self._merging = fanin, after, False

    def _queue_merge(self) -> None:
        """Queue the next merge, if one is due and none is queued (writer thread, or before the threads start): the
        oldest `merge_fanin` tables of the lowest level that has that many, beyond the newest `merge_after` segments
        (which keep their own tables: a store of fewer segments never pays for a merge). Only segments with every
        column (as create_segment makes them) are merged; an older one keeps its own table."""
        if not self.merge_fanin or self._merging:
            return
        levels: dict[int, list[tuple[int, int | str]]] = {}
        for number, columns in sorted(self._segments.items())[: max(0, len(self._segments) - self.merge_after)]:
            if columns == SEGMENT_COLUMNS:
                levels.setdefault(0, []).append((number, number))
        for table, held in self._merged.items():
            levels.setdefault(merge_level(len(held.segments), self.merge_fanin), []).append((min(held.segments), table))
        for level in sorted(levels):
            oldest = sorted(levels[level])[: self.merge_fanin]
            if len(oldest) == self.merge_fanin and self._rows_of(oldest) <= MERGE_ROWS:
                table = f"{MERGED_PREFIX}{self._next_merged:06d}"
                self._next_merged += 1
                self._merging = True
                merged = {m: self._merged[m].columns for _, m in oldest if isinstance(m, str)}
                self._compactions.put(Merge(table, tuple(m for _, m in oldest if isinstance(m, int)), merged))
                return

    def _rows_of(self, tables: list[tuple[int, int | str]]) -> int:
        """The rows these segment tables (by number) and merged tables (by name) hold, as the segment list says."""
        numbers = [t for _, t in tables if isinstance(t, int)] + [n for _, t in tables if isinstance(t, str) for n in self._merged[t].segments]
        cursor = self.con.cursor()
        try:
            return int(cursor.execute(f"SELECT coalesce(sum(rows), 0) FROM {SEGMENTS_TABLE} WHERE list_contains(?, segment)", [numbers]).fetchall()[0][0])
        finally:
            cursor.close()

    def _install_merge(self, con: duckdb.DuckDBPyConnection, merge: Merge) -> None:
        """List the merged table as where its segments are, re-point the view and drop the tables merged, in one
        transaction (writer thread): every row is in the view exactly once, before and after."""
        if any(n not in self._segments for n in merge.segments) or any(t not in self._merged for t in merge.merged):
            raise RuntimeError(f"{merge.table}: its tables changed meanwhile (the store was reopened)")
        members = tuple(sorted([*merge.segments, *(n for t in merge.merged for n in self._merged[t].segments)]))
        segments = {n: c for n, c in self._segments.items() if n not in merge.segments}
        merged = {**{t: held for t, held in self._merged.items() if t not in merge.merged}, merge.table: MergedTable(members, SEGMENT_COLUMNS)}
        with transaction(con):
            con.execute(f"UPDATE {SEGMENTS_TABLE} SET stored_in = ? WHERE list_contains(?, segment)", [merge.table, list(members)])
            write_view(con, segments, self._view_journals(self._journals), merged)
            for table in [*map(segment_table, merge.segments), *merge.merged]:
                con.execute(f"DROP TABLE {table}")
        self._segments, self._merged, self._merging = segments, merged, False
        self._queue_merge()

    def _compact(self, con: duckdb.DuckDBPyConnection, number: int, when: str) -> None:
        """Journal (or its sealed records) to segment, in the calling thread (start-up, close: nothing else writes).
        In slices, as the compactor does: a journal at open or close is as big as any other (up to `journal_mb`)."""
        started = time.perf_counter()
        rows, slices = self._write_segment(con, number, number in self._sealed, slice_bytes=self.slice_bytes)
        self._install_segment(con, number, rows)
        if rows:
            # DuckDB holds a segment's rows until a checkpoint writes them: with several journals to compact (a
            # crash behind the compactor's backlog), without one each it held them all. Not needed for the rows
            # (they are committed), so a checkpoint that fails (a full disk) leaves the open or close going on.
            try:
                con.execute("CHECKPOINT")
                self._cache.cut(con)
            except duckdb.Error as error:
                if invalidates(error):
                    raise
                log.warning(f"polar-mitm: no checkpoint after segment {number:06d} {when} ({error}); its rows are committed")
            log.info(f"polar-mitm: segment {number:06d}: {rows} exchanges written in {slices} slices in {1000 * (time.perf_counter() - started):.0f} ms, {when}")

    def _write_segment(self, con: duckdb.DuckDBPyConnection, number: int, sealed: bool, journal_bytes: int | None = None, slice_bytes: int = 0) -> tuple[int, int]:
        """Journal `number`'s segment table, unlisted: from its sealed log's records while that log is there (a read
        may have moved them into the journal meanwhile, and removed it), else from the journal."""
        if sealed:
            rows, slices = write_records_segment(con, number, record_slices(sealed_log_path(self.path, number), slice_bytes))
            if rows:
                return rows, slices
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
            if isinstance(job, Merge):
                self._merge_one(job)
                continue
            try:
                self._compact_one(*job)
            finally:
                self._compacting.discard(job[0])
                self._compacted.set()

    def _merge_one(self, merge: Merge) -> None:
        """One merge: its table written (unlisted, so outside the view until the writer lists it), then listed, then a
        checkpoint. On failure the tables merged stay as they were, in the view; the table half made is dropped at
        the next open, and the merge is tried again after the next segment. Never raises."""
        started = time.perf_counter()
        try:
            con = self.con.cursor()
            rows = merge_segments(con, merge.table, merge.segments, merge.merged)
            written = time.perf_counter()
            self._to_writer(lambda writer: self._install_merge(writer, merge))
        except Exception as error:  # noqa: BLE001 - the tables merged stay, in the view
            self._merging = False
            self._trouble(f"merging {len(merge.segments) + len(merge.merged)} segment tables into {merge.table}, which stay as they were", error, compaction=True)
            return
        installed = time.perf_counter()
        log.info(f"polar-mitm: {merge.table}: {rows} exchanges of {len(merge.segments) + len(merge.merged)} tables merged in {1000 * (written - started):.0f} ms, installed in "
                 f"{1000 * (installed - written):.0f} ms{self._checkpoint(con)}")

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
        log.info(
            f"polar-mitm: segment {number:06d}: {rows} exchanges written in {slices} slices in {1000 * (written - started):.0f} ms, installed in "
            f"{1000 * (installed - written):.0f} ms{self._checkpoint(con)}"
        )

    def _checkpoint(self, con: duckdb.DuckDBPyConnection) -> str:
        """A checkpoint after a segment or merge is listed, then DuckDB's cache cut; what it did, for the log line."""
        self.compaction_trouble.writes_again()
        started = time.perf_counter()
        try:
            checkpointed = checkpoint_soon(con)
        except Exception as error:  # noqa: BLE001 - e.g. a full disk: the WAL keeps the rows; the writer reopens if DuckDB gave up
            # commits go on unless DuckDB gave up on the file (then the commits' own episode says so)
            self._trouble("checkpointing", error, compaction=not invalidates(error))
            return ", checkpoint failed"
        checkpointed_at = time.perf_counter()
        held: list[int | None] = []
        if checkpointed:  # the blocks it wrote stay in DuckDB's cache until cut (polar_mitm.store.cache)
            try:
                self._to_writer(lambda writer: held.append(self._cache.cut(writer)))
            except Exception as error:  # noqa: BLE001 - the cache stays as it was; commits go on
                self._trouble("cutting DuckDB's cache after a checkpoint", error, compaction=True)
        cut = f", DuckDB holds {held[0]} MB after a cut in {1000 * (time.perf_counter() - checkpointed_at):.0f} ms" if held and held[0] is not None else ""
        return f", {'checkpoint' if checkpointed else 'no checkpoint'} in {1000 * (checkpointed_at - started):.0f} ms{cut}"

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
