"""The writer: one Store per DuckDB file, the file's single writer, committing each exchange before its reply.

DuckDB allows one writing process per file. The gateway owns the file while it runs: a single writer
thread does group commits (the event loop never touches DuckDB), a compactor thread turns full journals into
Parquet segments (see polar_mitm.store.segments), and read-only SQL from other processes is answered by the
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

from polar_mitm.store import sql_endpoint, views
from polar_mitm.store.records import (
    JOURNAL_COLUMNS,
    JOURNAL_PREFIX,
    insert_journal_rows,
    journal_table,
)
from polar_mitm.store.schema import (
    ARROW_TYPES,
    SCHEMA_VERSION,
    SESSION_COLUMNS,
    ExchangeRow,
    base_type,
    now,
    trajectory_statements,
)
from polar_mitm.store.segments import (
    checkpoint_soon,
    connect,
    ensure_schema,
    fetch,
    fetch_arrow,
    listed_segments,
    migrate_v1,
    next_segment,
    register_segment,
    remove_unlisted_segments,
    segments_dir,
    tables,
    transaction,
    write_segment,
    write_view,
)
from polar_mitm.store.snapshots import NodeSnapshot, snapshot_dir, snapshot_store

log = logging.getLogger("polar_mitm.store")

SESSION_ARROW_SCHEMA = pa.schema([(name, ARROW_TYPES[base_type(SESSION_COLUMNS[name])]) for name in ("session_id", "created_at", "last_seen_at", "n_exchanges", "harness")])

# an UPDATE plus an INSERT of the sessions not there yet: DuckDB's INSERT ... ON CONFLICT DO UPDATE cost ~3x more
_UPDATE_SESSIONS = (
    "UPDATE sessions SET last_seen_at = p.last_seen_at, n_exchanges = coalesce(sessions.n_exchanges, 0) + p.n_exchanges, "
    "harness = coalesce(sessions.harness, p.harness) FROM polar_pending_sessions p WHERE sessions.session_id = p.session_id"
)
_UPDATE_SESSION = "UPDATE sessions SET last_seen_at = ?, n_exchanges = coalesce(n_exchanges, 0) + ?, harness = coalesce(harness, ?) WHERE session_id = ?"
_INSERT_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, created_at, last_seen_at, n_exchanges, harness FROM polar_pending_sessions "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions)"
)


# after a crash: session counters the writer had not flushed yet, recounted from the exchanges themselves
_RECOUNT_NEW_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, min(started_at), max(coalesce(ended_at, started_at)), count(*), any_value(harness) FROM exchanges "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions) GROUP BY session_id"
)
_RECOUNT_SESSIONS = (
    "UPDATE sessions SET n_exchanges = e.n, last_seen_at = greatest(sessions.last_seen_at, e.last_seen_at), harness = coalesce(sessions.harness, e.harness) "
    "FROM (SELECT session_id, count(*) AS n, max(coalesce(ended_at, started_at)) AS last_seen_at, any_value(harness) AS harness "
    "FROM exchanges GROUP BY session_id) e WHERE sessions.session_id = e.session_id"
)


@dataclass
class _Pending:
    """One queued write: an exchange row, a statement from execute_write, or a step of the store itself."""

    sql: str = ""
    params: list[Any] = field(default_factory=list)
    done: Any = None  # called with (error or None) from the writer thread
    row: ExchangeRow | None = None
    step: Callable[[duckdb.DuckDBPyConnection], None] | None = None  # runs alone, in its own transaction


class Store:
    """The single writer of one DuckDB file; safe to use from an asyncio event loop."""

    def __init__(self, path: str | os.PathLike[str], batch_max: int = 256, segment_rows: int = 256):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.segments_dir = segments_dir(self.path)
        self.segment_rows = segment_rows
        self.con = connect(self.path)
        # Checkpoints are the compactor's, right after it drops a journal (when there is least to write); the
        # automatic ones, which would stall a commit, only if the WAL grows past 1 GB. DuckDB's default would also
        # checkpoint instead of logging any commit over 100 KB, i.e. every exchange.
        self.con.execute(f"SET auto_checkpoint_skip_wal_threshold = {2**62}")
        self.con.execute("SET checkpoint_threshold = '1GB'")
        # every statement on the hot path is one small insert; parallel scans would only compete with the proxy
        self.con.execute("SET threads = 1")
        ensure_schema(self.con)
        migrate_v1(self.con, self.segments_dir)
        self._segments = listed_segments(self.con)  # file names, in the segments folder
        self._journals = sorted(int(name[len(JOURNAL_PREFIX):]) for name in tables(self.con) if re.fullmatch(JOURNAL_PREFIX + r"\d+", name))
        self._next_number = max(next_segment(self.con), max(self._journals, default=0) + 1)
        # journals left by a crash (or a hard stop) become segments before anything new is written; the view is
        # written again either way, with paths relative to where the store is now
        leftovers = list(self._journals)
        self._rotate(self.con)
        for number in leftovers:
            self._compact(self.con, number)
        for name in remove_unlisted_segments(self.con, self.segments_dir):
            log.info(f"polar-mitm: removed {name}, a segment file a crash left unlisted (its rows were in a journal)")
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        views.create_views(self.con)  # after the tables and the exchanges view they select from
        if self.con.execute("SELECT value FROM meta WHERE key = 'closed_cleanly'").fetchall() != [("true",)]:
            self.con.execute(_RECOUNT_NEW_SESSIONS)
            self.con.execute(_RECOUNT_SESSIONS)
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'false')")
        self._seq: dict[str, int] = dict(self.con.execute("SELECT session_id, max(seq) FROM exchanges GROUP BY session_id").fetchall())
        self._journal_rows = 0
        self._known_sessions = {session_id for (session_id,) in self.con.execute("SELECT session_id FROM sessions").fetchall()}
        self._session_counts: dict[str, dict[str, Any]] = {}  # committed exchanges not yet counted into `sessions`
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._batch_max = batch_max
        self._compactions: queue.Queue[int | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="polar-store-writer", daemon=True)
        self._writer.start()
        self._compactor = threading.Thread(target=self._compact_loop, name="polar-store-compactor", daemon=True)
        self._compactor.start()
        self._control: ThreadingHTTPServer | None = None
        self.commits = 0

    # -- sequencing: in memory, so the event loop never waits on DuckDB for it
    def next_seq(self, session_id: str) -> int:
        seq = self._seq.get(session_id, 0) + 1
        self._seq[session_id] = seq
        return seq

    # -- writes
    async def commit_exchange(self, row: ExchangeRow) -> None:
        """Commit one exchange row; returns only once it is durable in DuckDB."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

            loop.call_soon_threadsafe(settle)

        # the row is converted in the writer thread, in bulk: the event loop only queues it
        self._queue.put(_Pending(row=row, done=done))
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

    def _write_loop(self) -> None:
        con = self.con.cursor()
        # exchange rows go in through a connection of their own, without DuckDB's optimizer: there is nothing to
        # optimize in an INSERT of values, and its passes cost ~0.15 ms of each commit (measured, DuckDB 2.0)
        appends = self.con.cursor()
        appends.execute("SET SESSION enable_optimizer = false")  # SESSION: a plain SET switches it off for every connection
        unflushed_batches = 0
        while True:
            try:
                # session counters wait for a quiet moment: flushing right away held the GIL just as the event loop
                # was woken to send the reply
                first = self._queue.get(timeout=0.005 if self._session_counts else None)
            except queue.Empty:
                self._flush_sessions(con)
                unflushed_batches = 0
                continue
            if first is None:
                self._flush_sessions(con)
                return
            if first.step is not None:
                self._run_step(con, first)
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
            unflushed_batches += 1
            # session counters follow the replies: after 5 ms without new rows, or every 8 batches under load
            if unflushed_batches >= 8:
                self._flush_sessions(con)
                unflushed_batches = 0
            if self._journal_rows >= self.segment_rows:
                try:
                    full = self._rotate(con)
                except Exception:  # noqa: BLE001 - keep journaling into the current table; retried after the next batch
                    log.exception("polar-mitm: could not start a new journal")
                    continue
                if full is not None:
                    self._compactions.put(full)

    def _run_step(self, con: duckdb.DuckDBPyConnection, item: _Pending) -> None:
        assert item.step is not None
        try:
            item.step(con)
        except Exception as error:  # noqa: BLE001 - reported to the waiting caller
            if item.done:
                item.done(error)
            return
        if item.done:
            item.done(None)

    def _commit_batch(self, con: duckdb.DuckDBPyConnection, appends: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        try:
            if all(item.row is not None for item in batch):
                # one INSERT is its own transaction: no BEGIN/COMMIT statements to pay for (~0.5 ms at one row)
                insert_journal_rows(appends, [item.row for item in batch], journal_table(self._journals[-1]))  # type: ignore[misc]
            else:
                with transaction(con):
                    self._apply(con, batch)
            self.commits += 1
        except Exception:
            # one bad row must not fail its neighbours: retry each alone
            for item in batch:
                try:
                    with transaction(con):
                        self._apply(con, [item])
                except Exception as error:  # noqa: BLE001 - reported to the waiting caller
                    if item.done:
                        item.done(error)
                    continue
                self._committed([item])
            return
        self._committed(batch)

    def _committed(self, batch: list[_Pending]) -> None:
        rows = [item.row for item in batch if item.row is not None]
        self._journal_rows += len(rows)
        _count_sessions(self._session_counts, rows)
        for item in batch:
            if item.done:
                item.done(None)

    def _apply(self, con: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        """The batch's writes in queue order; each run of exchange rows goes in as one insert."""
        table = journal_table(self._journals[-1])
        rows: list[Mapping[str, Any]] = []
        for item in batch:
            if item.row is not None:
                rows.append(item.row)
                continue
            insert_journal_rows(con, rows, table)
            rows = []
            con.execute(item.sql, item.params)
        insert_journal_rows(con, rows, table)

    def _flush_sessions(self, con: duckdb.DuckDBPyConnection) -> None:
        """Count committed exchanges into `sessions`, in a transaction of their own.

        Kept out of the exchange's commit, which the client waits for (each DuckDB statement costs ~0.5 ms). If the
        process dies in between, the next open recounts the sessions from the exchanges.
        """
        if not self._session_counts:
            return
        counts = self._session_counts
        try:
            if len(counts) == 1 and self._known_sessions.issuperset(counts):
                _update_sessions(con, counts, self._known_sessions)  # one UPDATE: its own transaction
            else:
                with transaction(con):
                    _update_sessions(con, counts, self._known_sessions)
        except Exception:  # noqa: BLE001 - kept, and retried with the next flush
            log.exception("polar-mitm: could not update session counters")
            return
        self._known_sessions.update(counts)
        self._session_counts = {}

    # -- journals and segments
    def _rotate(self, con: duckdb.DuckDBPyConnection) -> int | None:
        """Start a new journal; returns the full one, for the compactor. Writer thread (or before it starts)."""
        number = self._next_number
        journals = self._journals + [number]
        with transaction(con):
            con.execute(f"CREATE TABLE {journal_table(number)} ({', '.join(f'{n} {t}' for n, t in JOURNAL_COLUMNS.items())})")
            write_view(con, self.path, self._segments, journals)
        self._next_number += 1
        full, self._journals, self._journal_rows = self._journals, journals, 0
        return full[-1] if full else None

    def _install_segment(self, con: duckdb.DuckDBPyConnection, number: int, file: str | None, rows: int) -> None:
        """Swap journal `number` for its segment `file` (None: the journal was empty) in one transaction: the rows
        are never in both or in neither."""
        segments = self._segments + ([file] if file is not None else [])
        journals = [j for j in self._journals if j != number]
        with transaction(con):
            if file is not None:
                register_segment(con, number, file, rows)
            write_view(con, self.path, segments, journals)
            con.execute(f"DROP TABLE {journal_table(number)}")
        self._segments, self._journals = segments, journals

    def _compact(self, con: duckdb.DuckDBPyConnection, number: int) -> None:
        """Journal to segment, all in the calling thread (start-up and close, when nothing else writes)."""
        self._install_segment(con, number, *write_segment(con, number, self.segments_dir))

    def _compact_loop(self) -> None:
        # compaction yields to the proxy: DuckDB runs it on this thread alone (threads=1, set at open), niced
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        con = self.con.cursor()
        while True:
            number = self._compactions.get()
            if number is None:
                return
            started = time.perf_counter()
            try:
                file, rows = write_segment(con, number, self.segments_dir)
                written = time.perf_counter()
                self._call_writer(_Pending(step=lambda writer, number=number, file=file, rows=rows: self._install_segment(writer, number, file, rows)))
            except Exception:  # noqa: BLE001 - the journal stays (and stays in the view); compacted again at the next open
                log.exception(f"polar-mitm: could not compact {journal_table(number)}")
                continue
            installed = time.perf_counter()
            checkpointed = checkpoint_soon(con)
            log.info(
                f"polar-mitm: segment {number:06d}: {rows} exchanges written in {1000 * (written - started):.0f} ms, installed in "
                f"{1000 * (installed - written):.0f} ms, {'checkpoint' if checkpointed else 'no checkpoint'} in {1000 * (time.perf_counter() - installed):.0f} ms"
            )

    # -- reads (any thread)
    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        return fetch(self.con, sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        """The result of read-only SQL as an Arrow table (list columns as Arrow buffers, no Python object per value)."""
        return fetch_arrow(self.con, sql, params)

    def snapshot(self, node: str, out_dir: Path | None = None) -> NodeSnapshot:
        """The store as Parquet files at one instant (polar_mitm.store.snapshots), while the writer goes on: only
        the journal tail and `sessions` are written, into `out_dir` (default `<db>.snapshots/`); absolute paths."""
        db = self.path.resolve()
        return snapshot_store(self.con, db, node, out_dir or snapshot_dir(db))

    # -- the control endpoint for readers in other processes
    def load_trajectories(self, parquet: Path) -> None:
        """Load an assembler Parquet file into the `trajectories` table through the writer thread."""
        for sql in trajectory_statements(parquet):
            self.execute_write(sql)

    def serve_sql(self, port: int = 0) -> str:
        """Answer read-only SQL from other processes on a loopback port (named in the control file); returns its URL."""
        self._control = sql_endpoint.serve_sql(self.path, self.query, port, self.load_trajectories)
        return sql_endpoint.sql_url(self._control)

    def close(self) -> None:
        """Stop writing; every journal becomes a segment, so a closed store holds its exchanges in Parquet."""
        if self._control is not None:
            sql_endpoint.stop_serving(self.path, self._control)
            self._control = None
        self._compactions.put(None)  # finishes the compactions queued so far (their last step needs the writer)
        self._compactor.join(timeout=600)
        self._queue.put(None)
        self._writer.join(timeout=60)
        try:
            full = list(self._journals)
            self._rotate(self.con)
            for number in full:
                self._compact(self.con, number)
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'true')")
            self.con.execute("CHECKPOINT")
        except Exception:  # noqa: BLE001 - the journals stay; the next open compacts them
            log.exception("polar-mitm: could not compact the journal at close")
        self.con.close()



def _count_sessions(counts: dict[str, dict[str, Any]], rows: list[Mapping[str, Any]]) -> None:
    for row in rows:
        stamp = row.get("ended_at") or now()
        entry = counts.get(row["session_id"])
        if entry is None:
            counts[row["session_id"]] = {"created_at": row.get("started_at") or stamp, "last_seen_at": stamp, "n_exchanges": 1, "harness": row.get("harness")}
        else:
            entry["last_seen_at"] = stamp
            entry["n_exchanges"] += 1
            entry["harness"] = entry["harness"] or row.get("harness")


def _update_sessions(con: duckdb.DuckDBPyConnection, counts: dict[str, dict[str, Any]], known: set[str]) -> None:
    """Add counts to the sessions that exist (e.g. recorded by the rollout server), then insert the new ones."""
    new = not known.issuperset(counts)
    if len(counts) == 1:
        ((session_id, entry),) = counts.items()
        con.execute(_UPDATE_SESSION, [entry["last_seen_at"], entry["n_exchanges"], entry["harness"], session_id])
        if not new:
            return
    polar_pending_sessions = pa.table(  # noqa: F841 - read by DuckDB
        {"session_id": list(counts), **{key: [entry[key] for entry in counts.values()] for key in ("created_at", "last_seen_at", "n_exchanges", "harness")}},
        schema=SESSION_ARROW_SCHEMA,
    )
    if len(counts) > 1:
        con.execute(_UPDATE_SESSIONS)
    if new:
        con.execute(_INSERT_SESSIONS)

