"""The writer: one Store per DuckDB file, the file's single writer, committing each exchange before its reply.

DuckDB allows one writing process per file. The gateway owns the file while it runs: a single writer
thread does group commits into the commit log (polar_mitm.store.commit_log; the event loop never touches DuckDB),
a compactor thread turns each segment's worth of them into a segment table (see polar_mitm.store.segments), and
read-only SQL from other processes is answered by the
gateway itself over a loopback control endpoint named in `<db>.control.json` (polar_mitm.store.sql_endpoint).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.store import session_counts, sql_endpoint, views
from polar_mitm.store.cache import SegmentCache
from polar_mitm.store.commit_log import CommitLog, LoggedCommits, commit_log_path, sealed_log_path
from polar_mitm.store.compactor import Compaction, Merge
from polar_mitm.store.records import (
    add_text_columns,
    insert_journal_rows,
    journal_numbers,
    journal_table,
)
from polar_mitm.store.schema import (
    MARKS_TABLE,
    SCHEMA_VERSION,
    ExchangeRow,
    now,
    trajectory_statements,
)
from polar_mitm.store.segments import (
    MERGED_PREFIX,
    connect,
    ensure_schema,
    fetch,
    fetch_arrow,
    merged_segments,
    migrate_parquet_segments,
    migrate_v1,
    next_segment,
    remove_unlisted_segments,
    segment_columns,
    segments_dir,
    tables,
    transaction,
)
from polar_mitm.store.session_counts import READS_SESSIONS, RECOUNT_NEW_SESSIONS, RECOUNT_SESSIONS, SessionCounters
from polar_mitm.store.session_reads import Sessions, fetch_session, fetch_session_arrow, list_sessions
from polar_mitm.store.snapshots import NodeSnapshot, snapshot_dir, snapshot_store
from polar_mitm.store.trouble import WriteTrouble, invalidates, one_line

log = logging.getLogger("polar_mitm.store")
open_stores: set[Path] = set()  # the files a Store of this process holds (by_path.recover leaves their logs alone)

# the memory bounds (polar_mitm/gateway/options.py: store_memory_mb, store_journal_mb, store_compact_slice_mb, with
# these defaults): DuckDB's memory limit (0: DuckDB's own, 80% of RAM) is a backstop, well above what the other two
# leave in use: past it DuckDB fails the write, and a live gateway's SQL readers share it (256 MB with whole-journal
# compactions did, in bench/memory_bench.py); a journal becomes a segment at this many MB of records even before it
# has `segment_rows` rows (0: rows only); a compaction parses this many MB of records at once (0: the whole journal)
MEMORY_MB = 512
JOURNAL_MB = 32
COMPACT_SLICE_MB = 8
# segment tables merged as they age (Compaction._queue_merge), `merge_fanin` of one level into one, once
# `merge_after` newer segments exist. Off by default (0): with 16 the view names at most ~64 segments' tables and ~15
# merged ones a level (a query over 3,000 segments 53 ms instead of 2.3 s, bench/segments_bench.py), but a merge of 16
# segments of harness-sized rows raised a gateway's peak RSS by ~900 MB (bench/memory_bench.py: 1438 against 546 MB
# at 64 sessions), and a row is copied once a level (~1.4 ms of CPU for a chat-mode row, bench/compaction.py)
MERGE_FANIN = 0
MERGE_AFTER = 48
# after DuckDB invalidated the database (a write that failed mid-checkpoint: a full disk), how often the writer
# tries to open the file again; commits meanwhile are refused at once
REOPEN_EVERY_S = 0.5


@dataclass
class _Pending:
    """One queued write: an exchange row, a statement from execute_write, or a step of the store itself."""

    sql: str = ""
    params: list[Any] = field(default_factory=list)
    done: Any = None  # called with (error or None) from the writer thread
    row: ExchangeRow | None = None
    step: Callable[[duckdb.DuckDBPyConnection], None] | None = None  # runs alone, in its own transaction


class Store(Compaction, LoggedCommits):
    """The single writer of one DuckDB file; safe to use from an asyncio event loop."""

    def __init__(
        self, path: str | os.PathLike[str], batch_max: int = 64, segment_rows: int = 256, memory_mb: int = MEMORY_MB, journal_mb: int = JOURNAL_MB,
        compact_slice_mb: int = COMPACT_SLICE_MB, report: Callable[[str], None] | None = None, merge_fanin: int = MERGE_FANIN,
        merge_after: int = MERGE_AFTER,
    ):
        """`report`: where the store says, in one line each, that it cannot write and that it writes again
        (default: a warning on this module's log); one line per episode, not one per refused commit. `batch_max`:
        rows per group commit; each is held ~3 times meanwhile (rows, records, DuckDB's copy), and 256 rows of ~180 KB
        records peaked 1.35 GB at 512 sessions against 1.0-1.06 GB for 64, at the same CPU (bench/memory_bench.py)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.segments_dir, self.segment_rows = segments_dir(self.path), segment_rows
        self.memory_mb, self.journal_bytes_max, self.slice_bytes = memory_mb, journal_mb << 20, compact_slice_mb << 20
        self.trouble = WriteTrouble(self.path, report or (lambda message: log.warning(f"polar-mitm: {message}")))
        self.compaction_trouble = WriteTrouble(self.path, self.trouble.report, compaction=True)
        self.con = self._connect()
        self._cache = SegmentCache(memory_mb)  # cut after each checkpoint (polar_mitm.store.cache)
        self._sealed: set[int] = set()  # journals whose records are in their sealed logs (polar_mitm.store.commit_log)
        self._keep_spare = True  # an empty journal waits in the view for the next rotation (Compaction._rotate)
        ensure_schema(self.con)
        migrate_v1(self.con)
        for number in migrate_parquet_segments(self.con, self.segments_dir):
            log.info(f"polar-mitm: segment {number:06d} of {self.path} moved from its Parquet file into the store file (schema 2 to 3)")
        list_sessions(self.con, self.path)  # what reads of one session bind by, for segments listed before it was
        self._read_layout(self.con)
        self._set_merges(merge_fanin, merge_after)
        self._compactions: queue.Queue[tuple[int, int | None, bool] | Merge | None] = queue.Queue()
        # merged tables are numbered on, past any a crash left unlisted (dropped just below)
        self._next_merged = 1 + max((int(name[len(MERGED_PREFIX):]) for name in tables(self.con) if re.fullmatch(MERGED_PREFIX + r"\d+", name)), default=0)
        # what a crash cut short of a compaction goes (its rows are still in their journal); then journals left by
        # a crash (or a hard stop) become segments before anything new is written
        for name in remove_unlisted_segments(self.con, self.segments_dir):
            log.info(f"polar-mitm: removed {name}, which a crash left unlisted (its rows were in a journal)")
        leftovers = list(self._journals)
        for number in leftovers:
            if add_text_columns(self.con, journal_table(number)):
                log.info(f"polar-mitm: {journal_table(number)} of {self.path} given its texts as columns (the journal layout before 2026-12)")
        self._rotate(self.con)
        # a journal sealed before the crash has its records in its sealed log: its segment is written from there in
        # slices, as the compactor would have, instead of every log's records going into the current journal at once
        self._sealed.update(number for number in leftovers if sealed_log_path(self.path, number).exists())
        for number in leftovers:
            self._compact(self.con, number, "at open")
        self._log = CommitLog(commit_log_path(self.path))
        recovered = self._recover()  # counted into `sessions` by the recount below
        self._pending_rows, self._pending_bytes, self._move_failed = 0, 0, None
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        views.create_views(self.con, unless_current=True)  # after the tables and the exchanges view they select from
        if recovered or self.con.execute("SELECT value FROM meta WHERE key = 'closed_cleanly'").fetchall() != [("true",)]:
            self.con.execute(RECOUNT_NEW_SESSIONS)
            self.con.execute(RECOUNT_SESSIONS)
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'false')")
        self._seq = session_counts.IssuedSeqs(self.con.execute("SELECT session_id, max(seq) FROM exchanges GROUP BY session_id").fetchall())
        self._compacting: set[int] = set()  # journals queued for the compactor or being compacted
        self._compacted = threading.Event()  # set each time the compactor has written a segment or given up on one
        self._handed, self._handing = 0, threading.Lock()  # steps the compactor handed the writer (Compaction._to_writer)
        self._invalid: BaseException | None = None  # DuckDB invalidated the database: reopened before the next write
        self._next_reopen = 0.0
        self._counters = SessionCounters({session_id for (session_id,) in self.con.execute("SELECT session_id FROM sessions").fetchall()})
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._batch_max = batch_max
        self._queue_merge()  # what aged while the store was closed (or written by a version before merges)
        self._pending = _Pending
        self._writer = threading.Thread(target=self._write_loop, name="polar-store-writer", daemon=True)
        self._writer.start()
        self._compactor = threading.Thread(target=self._compact_loop, name="polar-store-compactor", daemon=True)
        self._compactor.start()
        self._control: ThreadingHTTPServer | None = None
        self.commits = 0
        open_stores.add(self.path.resolve())

    # -- sequencing: in memory, so the event loop never waits on DuckDB for it
    def next_seq(self, session_id: str) -> int:
        return self._seq.next(session_id)

    def issued_seqs(self, session_id: str) -> int:
        """How many exchanges of the session were begun (each gets its row: committed, or still in flight)."""
        return self._seq.get(session_id, 0)

    def seqs(self) -> dict[str, int]:  # each session's last issued seq: a store process hands them to its gateway
        return dict(self._seq)

    # -- writes
    async def commit_exchange(self, row: ExchangeRow) -> None:
        """Commit one exchange row; returns only once it is durable in DuckDB (the writer thread converts it).
        submit_exchange and submit_mark queue one and call `done` from the writer thread: durable (None) or refused."""
        await self.durable(lambda done: self.submit_exchange(row, done))

    async def commit_mark(self, exchange_id: str, status: str, error: str) -> None:
        """Commit a later status for a committed exchange (MARKS_TABLE: an undelivered reply); returns once durable."""
        await self.durable(lambda done: self.submit_mark(exchange_id, status, error, done))

    def submit_exchange(self, row: ExchangeRow, done: Callable[[BaseException | None], None]) -> None:
        self._queue.put(_Pending(row=row, done=done))

    def submit_mark(self, exchange_id: str, status: str, error: str, done: Callable[[BaseException | None], None]) -> None:
        self._queue.put(_Pending(f"INSERT OR REPLACE INTO {MARKS_TABLE} VALUES (?, ?, ?, ?)", [exchange_id, status, error, now()], done=done))

    @staticmethod
    async def durable(submit: Callable[[Callable[[BaseException | None], None]], None]) -> None:
        """Queue a write with `submit` (its `done` called from any thread); wait on the event loop until durable."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(None)
        submit(lambda error: loop.call_soon_threadsafe(settle, error))
        await future

    def execute_write(self, sql: str, params: list[Any] | None = None) -> None:
        """Run one write statement through the writer thread (serialised with exchange commits)."""
        self._call_writer(_Pending(sql, params or []))

    def _call_writer(self, item: _Pending) -> None:
        event = threading.Event()
        errors: list[BaseException] = []

        def done(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            event.set()

        item.done = done
        self._queue.put(item)
        event.wait()
        if errors:
            raise errors[0]

    def _connect(self) -> duckdb.DuckDBPyConnection:
        con = connect(self.path)
        # Checkpoints are the compactor's, right after it drops a journal (when there is least to write); the
        # automatic ones, which would stall a commit, only if the WAL grows past 1 GB. DuckDB's default would also
        # checkpoint instead of logging any commit over 100 KB, i.e. every exchange.
        con.execute(f"SET auto_checkpoint_skip_wal_threshold = {2**62}")
        con.execute("SET checkpoint_threshold = '1GB'")
        # every statement on the hot path is one small insert; parallel scans would only compete with the proxy
        con.execute("SET threads = 1")
        if self.memory_mb:
            con.execute(f"SET memory_limit = '{self.memory_mb}MB'")
        # DuckDB's allocator gives memory back after each task that peaked past 8 MB (default 128 MB), and purges in
        # background threads: a compaction's transient memory would otherwise stay resident (bench/memory_results.md)
        con.execute("SET allocator_flush_threshold = '8MB'")
        con.execute("SET allocator_background_threads = true")
        return con

    def _writer_cursors(self) -> tuple[duckdb.DuckDBPyConnection, duckdb.DuckDBPyConnection]:
        con = self.con.cursor()
        # exchange rows go in through a connection of their own, without DuckDB's optimizer: there is nothing to
        # optimize in an INSERT of values, and its passes cost ~0.15 ms of each commit (measured, DuckDB 2.0)
        appends = self.con.cursor()
        appends.execute("SET SESSION enable_optimizer = false")  # SESSION: a plain SET switches it off for every connection
        return con, appends

    def _write_loop(self) -> None:
        con, appends = self._writer_cursors()
        while True:
            try:
                # the session counters wait for a quiet moment (polar_mitm.store.commit_log): flushing right away
                # held the GIL just as the event loop was woken to send the reply
                first = self._queue.get(timeout=self._quiet_after())
            except queue.Empty:
                if self._invalid is not None:
                    if not self._reopen():
                        continue
                    con, appends = self._writer_cursors()
                self._quiet(appends)
                self._keep_up()
                continue
            if first is None:
                self._last_records(appends)
                return
            if self._invalid is not None:
                if not self._reopen():
                    self._refuse(first)
                    continue
                con, appends = self._writer_cursors()
            if first.step is not None:
                self._run_step(con, first)
                self._keep_up()
                continue
            batch, step = [first], None
            while len(batch) < self._batch_max:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                if item.step is not None:
                    step = item  # runs alone, right after this batch
                    break
                batch.append(item)
            self._commit_batch(con, appends, batch)
            if step is not None:
                self._run_step(con, step)
            self._journal_full(con)
            self._keep_up()

    def _refuse(self, item: _Pending) -> None:
        """Answer a queued write with the store's failure, without trying it (the file is being reopened)."""
        assert self._invalid is not None
        self._trouble("reopening the store", self._invalid, refused=int(item.row is not None))
        if item.done:
            item.done(OSError(f"the store cannot write until it is reopened: {one_line(self._invalid)}"))

    def _reopen(self) -> bool:
        """Open the file again after DuckDB invalidated it (writer thread): what was committed is read back from it
        (the WAL replayed), a new journal started and the full ones queued for compaction. False: not yet."""
        if time.monotonic() < self._next_reopen:
            return False
        self._next_reopen = time.monotonic() + REOPEN_EVERY_S
        try:
            self.con.close()
        except duckdb.Error:
            pass
        try:
            self.con = con = self._connect()
            self._read_layout(con)
            self._rotate(con)
        except Exception as error:  # noqa: BLE001 - still cannot write; tried again in REOPEN_EVERY_S
            self._invalid = error.with_traceback(None)
            return False
        self._invalid = None
        self._compacting.clear()  # the compactor skips what it was given before and is not a journal any more
        self._queue_uncompacted()
        return True

    def _read_layout(self, con: duckdb.DuckDBPyConnection) -> None:
        """Where the rows are, as the file says (at open, and when it is opened again): segments in tables of their
        own, merged tables, journals, and the next journal's number."""
        self._segments, self._merged = segment_columns(con), merged_segments(con)
        self._journals = journal_numbers(con)  # a spare one among them, empty, becomes a segment of no rows
        self._next_number, self._spare = max(next_segment(con), max(self._journals, default=0) + 1), None

    def _trouble(self, doing: str, error: BaseException, refused: int = 0, compaction: bool = False) -> None:
        """A write failed: said once per episode (polar_mitm.store.trouble), not once per refused commit."""
        if invalidates(error):
            # DuckDB refuses every write from now on: reopened before the next one. Kept without its traceback, whose
            # frames would hold cursors (and so the invalidated database) that the reopen must let go of
            self._invalid = error.with_traceback(None)
        (self.compaction_trouble if compaction else self.trouble).failed(doing, error, refused)

    def _run_step(self, con: duckdb.DuckDBPyConnection, item: _Pending) -> None:
        assert item.step is not None
        try:
            item.step(con)
        except Exception as error:  # noqa: BLE001 - reported to the waiting caller
            if invalidates(error):
                self._invalid = error.with_traceback(None)
            if item.done:
                item.done(error)
            return
        if item.done:
            item.done(None)

    def _commit_batch(self, con: duckdb.DuckDBPyConnection, appends: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        if all(item.row is not None for item in batch):
            self._commit_rows(appends, batch)
            return
        # statements see every exchange committed before them, and run with this batch's rows in one transaction
        if not self._move(appends):
            for item in batch:
                if item.done:
                    item.done(self._move_failed)
            return
        try:
            with transaction(con):
                self._apply(con, batch)
            self.commits += 1
        except Exception:
            # one bad row must not fail its neighbours: retry each alone (unless DuckDB refuses every write now)
            for item in batch:
                if self._invalid is not None:
                    self._refuse(item)
                    continue
                try:
                    with transaction(con):
                        self._apply(con, [item])
                except Exception as error:  # noqa: BLE001 - reported to the waiting caller
                    self._trouble("committing an exchange", error, refused=int(item.row is not None))
                    if item.done:
                        item.done(error)
                    continue
                self._committed([item])
            return
        self._committed(batch)

    def _committed(self, batch: list[_Pending]) -> None:
        rows = [item.row for item in batch if item.row is not None]
        if rows:
            self.trouble.writes_again()
        self._counters.add(rows)
        for item in batch:
            if item.done:
                item.done(None)

    def _apply(self, con: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        """The batch's writes in queue order, in the caller's transaction; each run of exchange rows goes in as one
        insert, straight into the journal (beside statements, not through the commit log)."""
        table = journal_table(self._journals[-1])
        rows: list[Mapping[str, Any]] = []
        written = 0
        for item in batch:
            if item.row is not None:
                rows.append(item.row)
                continue
            written += insert_journal_rows(con, rows, table)
            rows = []
            con.execute(item.sql, item.params)
        written += insert_journal_rows(con, rows, table)
        self._journal_rows += sum(item.row is not None for item in batch)
        self._journal_bytes += written

    def _counted(self, sql: str | None = None) -> None:
        """Before a read: every exchange committed so far is in the database file (the writer moves what waits in
        its commit log, if anything does, and this waits for it), and, before a read of `sessions` (`sql` names it
        or a view over it; None: any read), in its counters."""
        if threading.current_thread() is self._writer or not self._writer.is_alive():
            return
        if not self._pending_rows and not self._sealed and not (self._counters.pending and (sql is None or READS_SESSIONS.search(sql))):
            return
        settled = threading.Event()
        self._queue.put(_Pending(step=self._settle, done=lambda _error: settled.set()))
        settled.wait(timeout=30)  # a writer stopped meanwhile never answers: the read goes on with what is there

    # -- reads (any thread)
    def query(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """`session`: `exchanges` is that session's rows, read from only the tables holding them (session_reads)."""
        self._counted(sql)
        with self._cache.reading():
            return fetch(self.con, sql, params) if session is None else fetch_session(self.con, session, sql, params, self._known_columns())

    def arrow(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> pa.Table:
        """The result of read-only SQL as an Arrow table (list columns as Arrow buffers, no Python object per value)."""
        self._counted(sql)
        with self._cache.reading():
            return fetch_arrow(self.con, sql, params) if session is None else fetch_session_arrow(self.con, session, sql, params, self._known_columns())

    def _known_columns(self) -> dict[int | str, tuple[str, ...]]:
        return {**self._segments, **{table: held.columns for table, held in self._merged.items()}}

    def snapshot(self, node: str, out_dir: Path | None = None) -> NodeSnapshot:
        """The store as Parquet files at one instant (polar_mitm.store.snapshots), while the writer goes on: the
        journal tail and `sessions` are written into `out_dir` (default `<db>.snapshots/`), and each segment's export
        the first time; absolute paths."""
        db = self.path.resolve()
        self._counted()
        with self._cache.reading():
            return snapshot_store(self.con, db, node, out_dir or snapshot_dir(db))

    # -- the control endpoint for readers in other processes
    def load_trajectories(self, parquet: Path) -> None:
        """Load an assembler Parquet file into the `trajectories` table through the writer thread."""
        for sql in trajectory_statements(parquet):
            self.execute_write(sql)

    def serve_sql(self, port: int = 0, pid: int | None = None) -> str:
        """Answer read-only SQL from other processes on a loopback port (named in the control file, with `pid`:
        the gateway's, default this process's); returns its URL."""
        self._control = sql_endpoint.serve_sql(self.path, self.query, port, self.load_trajectories, pid)
        return sql_endpoint.sql_url(self._control)

    def close(self) -> None:
        """Stop writing; every journal becomes a segment, so a closed store holds its exchanges as typed columns."""
        if self._control is not None:
            sql_endpoint.stop_serving(self.path, self._control)
            self._control = None
        self._compactions.put(None)  # finishes the compactions queued so far (their last step needs the writer)
        self._compactor.join(timeout=600)
        self._queue.put(None)
        self._writer.join(timeout=60)
        try:
            full = list(self._journals)
            self._keep_spare = False  # a closed store holds one (empty) journal, not a spare beside it
            self._rotate(self.con)
            for number in full:
                self._compact(self.con, number, "at close")
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'true')")
            self.con.execute("CHECKPOINT")
        except Exception:  # noqa: BLE001 - the journals stay; the next open compacts them
            log.exception("polar-mitm: could not compact the journal at close")
        self.con.close()
        open_stores.discard(self.path.resolve())
        if self._pending_rows or self._sealed:  # a record that could not be moved stays in its log, for the next open
            self._log.close()
        else:
            self._remove_logs()
