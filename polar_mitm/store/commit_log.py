"""The commit log (`<db>.commits`): where a committed exchange is durable before its row is in the database file.

A commit used to be an INSERT of one row into the journal table with DuckDB's WAL fsync: at 64 sessions rows arrive
one per group commit, and each INSERT cost ~1.2 ms of CPU alone and 4-5 ms in a busy gateway (DuckDB's Python
client takes the GIL back several times per statement; bench/README.md, "What the store costs"), while 64 rows in
one Arrow INSERT cost ~0.5 ms a row. So a group commit appends its rows' journal records here and fsyncs (the
write and the fsync hold no GIL), the reply goes, and the writer moves the records into the journal table later,
many in one INSERT, then empties the log. A crash between the two leaves them here: the next open puts back each
record whose exchange is not in the store, so none is lost and none is stored twice.

Each record is framed: its length and CRC-32 (8 bytes), then the record pickled (a tuple of strings, bytes and
ints that this process wrote itself). A torn tail (a crash mid-append, a write cut short by a full disk) fails its
length or CRC, and it and whatever follows are dropped: none of it was acknowledged. Appends go at the end of the
last good record (pwrite, not O_APPEND), so a failed append's bytes are written over by the next one.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import duckdb

from polar_mitm.store.records import JournalRecord, insert_journal_records, journal_record, journal_table, record_bytes
from polar_mitm.store.session_counts import SessionCounters
from polar_mitm.store.trouble import WriteTrouble

log = logging.getLogger("polar_mitm.store")

# committed records wait in the commit log until this many rows, or MB, or a quarter-second without commits, or a read,
# and then go into the journal in one INSERT, the session counters with them. Every DuckDB statement costs the writer
# several times its CPU beside the busy event loop (its client takes the GIL back again and again: a flush of 7
# sessions' counters 1.7 ms alone, 7.5 ms beside one busy thread): moving after 0.1 s of quiet did so 94 times in 640
# exchanges at 64 sessions (bench/scale.py), and the counters' flushes, every 0.25 s, cost 16.7 ms each there
MOVE_ROWS = 16
MOVE_MB = 8
MOVE_WHEN_QUIET_S = 0.25
MOVE_AGAIN_S = 0.5  # after a move failed (a full disk), how often a quiet writer tries again

_FRAME = struct.Struct("!II")  # payload length, CRC-32 of the payload


def commit_log_path(db: Path) -> Path:
    return db.with_name(db.name + ".commits")


class CommitLog:
    """The append-only log of one store's writer thread (not thread-safe). The file exists only while it holds
    records (created by the first append after it was emptied or removed)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._end = 0  # where the last good record ends: the next append's offset

    def read(self) -> list[JournalRecord]:
        """The records a crash left (the torn tail, if any, dropped); [] when there is no log."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        records: list[JournalRecord] = []
        at = 0
        while at + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, at)
            payload = data[at + _FRAME.size : at + _FRAME.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                break
            records.append(pickle.loads(payload))
            at += _FRAME.size + length
        return records

    def append(self, records: Sequence[JournalRecord]) -> None:
        """Write `records` after the last good one and fsync; raises OSError if they are not all durable (then none
        of them counts: the next append writes over them)."""
        frames = []
        for record in records:
            payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
            frames += [_FRAME.pack(len(payload), zlib.crc32(payload)), payload]
        data = b"".join(frames)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._end = 0
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(self._fd, memoryview(data)[written:], self._end + written)
            os.fsync(self._fd)
        except OSError:
            try:  # give the space back; if this fails too, the torn bytes are written over or dropped at a read
                os.ftruncate(self._fd, self._end)
            except OSError:
                pass
            raise
        self._end += len(data)

    def empty(self) -> None:
        """Every record is in the database file (committed there): start over. Not fsynced: if a crash brings the
        records back, the next open finds their exchanges in the store and skips them."""
        if self._fd is not None and self._end:
            os.ftruncate(self._fd, 0)
            self._end = 0

    def remove(self) -> None:
        """The store closed with every record in the database file: no log beside it."""
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class QueuedRow(Protocol):
    """A queued exchange row of the writer's (writer._Pending): `done` is called with None once it is durable."""

    row: Any
    done: Callable[[BaseException | None], None] | None


class LoggedCommits:
    """The writer's side of the commit log (a mixin of Store, whose attributes these are): commit, move, recover."""

    path: Path
    con: duckdb.DuckDBPyConnection
    commits: int
    trouble: WriteTrouble
    _log: CommitLog
    _moving: list[JournalRecord]  # committed (in the log), not yet in the journal table
    _move_failed: BaseException | None  # the last move's error: commits wait for a move that succeeds
    _journals: list[int]
    _journal_rows: int
    _journal_bytes: int
    segment_rows: int
    _journal_full: Callable[[duckdb.DuckDBPyConnection], None]  # hands a full journal to the compactor
    _counters: SessionCounters
    _trouble: Callable[..., None]
    _committed: Callable[[list[Any]], None]  # acknowledges queued writes

    def _quiet_after(self) -> float | None:
        """How long the queue may stay empty before the writer moves the commit log's records and flushes counters."""
        if self._moving:
            return MOVE_AGAIN_S if self._move_failed else MOVE_WHEN_QUIET_S
        return MOVE_WHEN_QUIET_S if self._counters.pending else None

    def _settle(self, con: duckdb.DuckDBPyConnection) -> None:
        """Every committed exchange into the database file, and into the session counters."""
        self._move(con)
        self._counters.flush(con, self._trouble)

    def _commit_rows(self, appends: duckdb.DuckDBPyConnection, batch: list[QueuedRow]) -> None:
        """A group commit of exchange rows: their records appended to the commit log, one fsync, then acknowledged;
        moved into the journal later (MOVE_ROWS). While a move fails (a full disk), commits are refused: the log
        holds at most one move's worth, and a reply is never sent for a row the database file cannot take."""
        records: list[JournalRecord] = []
        taken: list[QueuedRow] = []
        for item in batch:
            try:
                records.append(journal_record(item.row))
            except Exception as error:  # noqa: BLE001 - one bad row fails alone
                self._trouble("committing an exchange", error, refused=1)
                if item.done:
                    item.done(error)
                continue
            taken.append(item)
        if not taken:
            return
        error: BaseException | None = None
        if self._move_failed is not None and not self._move(appends):
            error = self._move_failed
        else:
            try:
                self._log.append(records)
            except OSError as failed:
                error = failed
                self._trouble("committing an exchange", failed)
        if error is not None:
            self.trouble.refused += len(taken)
            for item in taken:
                if item.done:
                    item.done(error)
            return
        self.commits += 1
        self._moving += records
        self._committed(taken)
        # never more than one journal's worth at a time (tests' tiny journals: one move, many journals at once)
        if len(self._moving) >= min(MOVE_ROWS, self.segment_rows) or sum(map(record_bytes, self._moving)) >= MOVE_MB << 20:
            self._settle(appends)

    def _move(self, con: duckdb.DuckDBPyConnection) -> bool:
        """The commit log's records into the current journal in one INSERT (a full journal then goes to the
        compactor, as after a group commit), then the log emptied. False: they stay in the log and in memory (said
        once per episode), tried again before the next commit."""
        if self._moving:
            try:
                written = insert_journal_records(con, self._moving, journal_table(self._journals[-1]))
            except Exception as error:  # noqa: BLE001 - they stay in the log; retried
                self._move_failed = error.with_traceback(None)  # its frames would hold the cursor (writer._trouble)
                self._trouble("moving committed exchanges into the database file", error)
                return False
            self._journal_rows += len(self._moving)
            self._journal_bytes += written
            self._moving = []
            self._journal_full(con)
            try:
                self._log.empty()
            except OSError:
                pass  # the records are in the database file: an open that finds them in the log skips them
        self._move_failed = None
        return True

    def _recover(self, records: list[JournalRecord]) -> int:
        """At open: the commit log's records whose exchanges are not in the store (a crash came between their commit
        and their move, or a move failed at close) go into the current journal; then the log goes. Returns how many
        were put back (the caller recounts `sessions` then)."""
        missing: list[JournalRecord] = []
        if records:
            ids = [record[0] for record in records]
            present = {exchange_id for (exchange_id,) in self.con.execute("SELECT exchange_id FROM exchanges WHERE list_contains(?, exchange_id)", [ids]).fetchall()}
            missing = [record for record in records if record[0] not in present]
            self._journal_bytes += insert_journal_records(self.con, missing, journal_table(self._journals[-1]))
            self._journal_rows += len(missing)
            log.info(f"polar-mitm: {len(missing)} committed exchanges of {self.path} put back from its commit log ({len(records) - len(missing)} were in it already)")
        self._log.remove()
        return len(missing)
