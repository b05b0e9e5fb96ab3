"""The commit log (`<db>.commits`): where a committed exchange is durable before its row is in the database file.

A commit used to be an INSERT of one row into the journal table with DuckDB's WAL fsync: at 64 sessions rows arrive
one per group commit, and each INSERT cost ~1.2 ms of CPU alone and 4-5 ms in a busy gateway (DuckDB's Python
client takes the GIL back several times per statement; bench/README.md, "What the store costs"). So a group commit
appends its rows' journal records here and fsyncs (the write and the fsync hold no GIL), and the reply goes. The
records wait in the file, not in memory, until a segment's worth has gathered: then the log is sealed (renamed
`<db>.commits.NNNNNN`, after the journal it closes) and the compactor reads the records back and writes them as that
journal's segment, so each byte goes into DuckDB once (bench/README.md, "Sealed segments"). A read of the store
first moves whatever waits into the journals, so it sees every acknowledged row. A crash leaves the records in their
logs: the next open puts back each one whose exchange is not in the store, so none is lost and none is stored twice.

Each record is framed: its length and CRC-32 (8 bytes), then the record pickled (a tuple of strings, bytes and
ints that this process wrote itself). A torn tail (a crash mid-append, a write cut short by a full disk) fails its
length or CRC, and it and whatever follows are dropped: none of it was acknowledged. Appends go at the end of the
last good record (pwrite, not O_APPEND), so a failed append's bytes are written over by the next one.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import pickle
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import duckdb

from polar_mitm.store.records import (
    JournalRecord,
    in_slices,
    insert_journal_records,
    journal_record,
    journal_table,
    record_bytes,
)
from polar_mitm.store.segments import fsync_path
from polar_mitm.store.session_counts import SessionCounters
from polar_mitm.store.trouble import WriteTrouble

log = logging.getLogger("polar_mitm.store")

# When committed records leave the commit log. Every DuckDB statement costs the writer several times its CPU beside the
# busy event loop (its client takes the GIL back again and again: a flush of 7 sessions' counters 1.7 ms alone, 7.5 ms
# beside one busy thread), and an INSERT into a journal was 2.4 of the writer's 3.7 ms per exchange at 64 sessions
# with moves of 16 rows (bench/README.md, "The commit log"). So records wait until a segment's worth has gathered and
# become a segment table at once (a seal), or until a read, which moves them into the journal first. The session
# counters are flushed with each move or seal, and after a quarter-second without commits.
FLUSH_WHEN_QUIET_S = 0.25
MOVE_AGAIN_S = 0.5  # after a move failed (a full disk), how often a quiet writer tries again

_FRAME = struct.Struct("!II")  # payload length, CRC-32 of the payload


def commit_log_path(db: Path) -> Path:
    return db.with_name(db.name + ".commits")


def sealed_log_path(db: Path, number: int) -> Path:
    """Where the records of journal `number`, sealed, wait for its segment."""
    return db.with_name(f"{db.name}.commits.{number:06d}")


def commit_logs(db: Path) -> list[Path]:
    """A store's commit logs that exist: the sealed ones in journal order, then the one being appended to."""
    sealed = sorted(db.parent.glob(f"{glob.escape(db.name)}.commits.[0-9][0-9][0-9][0-9][0-9][0-9]"))
    return [*sealed, *[path for path in [commit_log_path(db)] if path.exists()]]


def _framed(file: BinaryIO) -> Iterator[JournalRecord]:
    """The framed records read from `file`, one at a time, up to the first that fails its length or CRC (a torn
    tail)."""
    while len(frame := file.read(_FRAME.size)) == _FRAME.size:
        length, crc = _FRAME.unpack(frame)
        payload = file.read(length)
        if len(payload) != length or zlib.crc32(payload) != crc:
            return
        yield pickle.loads(payload)


def _records(data: bytes) -> list[JournalRecord]:
    """The framed records in `data` (_framed)."""
    return list(_framed(io.BytesIO(data)))


def record_slices(path: Path, slice_bytes: int) -> Iterator[list[JournalRecord]]:
    """The framed records of the log at `path`, read as they are taken, in lists of at most `slice_bytes` of records
    (record_bytes; 0: one list of all), up to the first that fails its length or CRC; nothing when there is no log.
    The compactor so holds one slice of a sealed log, not the log's bytes and all its records at once (up to 32 MB
    each: 39 MB of records read back were alive in a gateway at 1,000 sessions). The log is opened now: a sealed log
    is never written again, so a read that moves its records into their journal meanwhile (and unlinks it) changes
    nothing this reads."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed by _slices when it ends (or by the collector, if dropped)
    except FileNotFoundError:
        return iter(())
    return _slices(file, slice_bytes)


def _slices(file: BinaryIO, slice_bytes: int) -> Iterator[list[JournalRecord]]:
    with file:
        yield from in_slices(_framed(file), slice_bytes)


class CommitLog:
    """The append-only log of one store's writer thread (not thread-safe). The file exists only while it holds
    records (created by the first append after it was emptied or removed)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._start = 0  # where the records not yet in the database file begin
        self._end = 0  # where the last good record ends: the next append's offset

    def read(self) -> list[JournalRecord]:
        """The records a crash left (the torn tail, if any, dropped); [] when there is no log."""
        try:
            return _records(self.path.read_bytes())
        except FileNotFoundError:
            return []

    def pending(self) -> list[JournalRecord]:
        """The records appended since the log was last emptied (or marked moved), read back from the file: they wait
        there, not in memory."""
        if self._fd is None or self._end == self._start:
            return []
        return _records(os.pread(self._fd, self._end - self._start, self._start))

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
            self._start = self._end = 0
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

    def seal(self, to: Path) -> None:
        """Rename the log's file to `to` (its records wait there for their segment: LoggedCommits._seal) and begin
        a new, empty one at the next append; the rename is made durable (its folder fsynced) before it returns."""
        self.close()
        os.rename(self.path, to)
        fsync_path(to.parent)
        self._start = self._end = 0

    def empty(self) -> None:
        """Every record is in the database file (committed there): start over. Not fsynced: if a crash brings the
        records back, the next open finds their exchanges in the store and skips them. If the file cannot be cut,
        its records are only marked as moved (pending() leaves them out)."""
        if self._fd is not None and self._end:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                self._start = self._end
                return
            self._start = self._end = 0

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
    """The writer's side of the commit log (a mixin of Store, whose attributes these are): commit, seal, move,
    recover.

    Where an acknowledged record is, at any moment: in the log being appended to (bound for the current journal,
    `_pending_rows` of them); in journal N's sealed log (N in `_sealed`: bound for its segment, which the compactor
    writes from the records themselves); or in the database file (a journal, or a segment). Waiting records are read
    back from their logs when they go, not held in memory. A read first moves what waits into the journals (the view
    names them), so it sees every acknowledged row."""

    path: Path
    con: duckdb.DuckDBPyConnection
    commits: int
    trouble: WriteTrouble
    _log: CommitLog
    _pending_rows: int  # committed (in the log being appended to), not yet in the database file
    _pending_bytes: int
    _sealed: set[int]  # journals whose records are sealed, in neither the journal nor its segment yet
    _move_failed: BaseException | None  # the last move's error: commits wait for a move that succeeds
    _journals: list[int]
    _journal_rows: int
    _journal_bytes: int
    journal_bytes_max: int
    segment_rows: int
    _journal_full: Callable[[duckdb.DuckDBPyConnection], None]  # hands a full journal to the compactor
    _rotate: Callable[[duckdb.DuckDBPyConnection], int | None]
    slice_bytes: int  # records parsed into DuckDB at once (Store's compact_slice_mb)
    _queue_compaction: Callable[..., None]
    _queue_uncompacted: Callable[[], None]
    _counters: SessionCounters
    _trouble: Callable[..., None]
    _committed: Callable[[list[Any]], None]  # acknowledges queued writes

    def _quiet_after(self) -> float | None:
        """How long the queue may stay empty before the writer flushes the session counters (or tries a failed
        move again)."""
        if self._move_failed is not None:
            return MOVE_AGAIN_S
        return FLUSH_WHEN_QUIET_S if self._counters.pending else None

    def _quiet(self, con: duckdb.DuckDBPyConnection) -> None:
        """Nothing to commit for a while: the counters into `sessions`; the records stay in the log (a move now would
        put rows into the journal, and the next segment would be parsed from there: an INSERT more per row)."""
        if self._move_failed is not None:
            self._move(con)
        self._counters.flush(con, self._trouble)

    def _settle(self, con: duckdb.DuckDBPyConnection) -> None:
        """Every committed exchange into the database file, and into the session counters."""
        self._move(con)
        self._counters.flush(con, self._trouble)

    def _last_records(self, con: duckdb.DuckDBPyConnection) -> None:
        """The writer's last step (the compactor has stopped): records none of whose journal is in the file yet are
        sealed, so the close writes their segment from them in slices as the compactor does, instead of moving them
        into the journal and writing it from there (140 Qwen Code rows of 14k prompt ids: RSS rose 145 MB at close
        against 328, bench/open_close.py); anything else settles as before."""
        if self._pending_rows and not self._journal_rows and not self._sealed:
            self._seal(con)
        else:
            self._settle(con)

    def _commit_rows(self, appends: duckdb.DuckDBPyConnection, batch: list[QueuedRow]) -> None:
        """A group commit of exchange rows: their records appended to the commit log, one fsync, then acknowledged;
        they become a segment once a segment's worth has gathered. While a move fails (a full disk), commits are
        refused: a reply is never sent for a row the database file cannot take."""
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
        self._pending_rows += len(records)
        self._pending_bytes += sum(map(record_bytes, records))
        del records  # they wait in the log, not in memory
        self._committed(taken)
        rows, size = self._journal_rows + self._pending_rows, self._journal_bytes + self._pending_bytes
        if rows >= self.segment_rows or (self.journal_bytes_max and size >= self.journal_bytes_max):
            if self._journal_rows:  # a read put rows into the journal: these fill it, and it is compacted from there
                self._settle(appends)
            else:
                self._seal(appends)

    def _seal(self, con: duckdb.DuckDBPyConnection) -> None:
        """A segment's worth of records, none of them in the database file yet: the current journal (empty) is
        closed as full, the log holding the records renamed to that journal's sealed log, and the records handed to
        the compactor, which reads them back and writes the segment from them (each byte into DuckDB once, not into a
        journal and then its segment). A failure on the way leaves them for a move into a journal, as before seals."""
        try:
            full = self._rotate(con)
        except Exception as error:  # noqa: BLE001 - they go into the current journal instead
            self._trouble("starting a new journal", error)
            self._settle(con)
            return
        if full is None:
            return
        try:
            self._log.seal(sealed_log_path(self.path, full))
        except OSError as error:  # the records stay in the log, bound for the new journal; the empty one is dropped
            self._trouble("sealing the commit log", error)
        else:
            self._sealed.add(full)
            self._pending_rows, self._pending_bytes = 0, 0
        self._queue_compaction(full)
        self._queue_uncompacted()
        self._counters.flush(con, self._trouble)

    def _move(self, con: duckdb.DuckDBPyConnection) -> bool:
        """Every record not yet in the database file into a journal, one INSERT per journal: sealed ones into
        their own (whose segment the compactor may be writing from them meanwhile: it replaces that journal, rows and
        all), the rest into the current one (a full journal then goes to the compactor), then their logs emptied.
        False: they stay in their logs (said once per episode), tried again before the next commit."""
        try:
            for number in sorted(self._sealed):
                sealed = sealed_log_path(self.path, number)
                insert_journal_records(con, chain.from_iterable(record_slices(sealed, self.slice_bytes)), journal_table(number), self.slice_bytes)
                self._sealed.discard(number)
                sealed.unlink(missing_ok=True)  # its records are in the file now
            if self._pending_rows:
                records = self._log.pending()
                written = insert_journal_records(con, records, journal_table(self._journals[-1]), self.slice_bytes)
                self._journal_rows += len(records)
                self._journal_bytes += written
                self._pending_rows, self._pending_bytes = 0, 0
                self._journal_full(con)
                self._log.empty()
        except Exception as error:  # noqa: BLE001 - they stay in their logs; retried
            self._move_failed = error.with_traceback(None)  # its frames would hold the cursor (writer._trouble)
            self._trouble("moving committed exchanges into the database file", error)
            return False
        self._move_failed = None
        return True

    def _recover(self) -> int:
        """At open: the commit logs' records whose exchanges are not in the store (a crash came between their commit
        and their move or segment, or a move failed at close) go into the current journal; then the logs go.
        Returns how many were put back (the caller recounts `sessions` then)."""
        logs = commit_logs(self.path)
        records = [record for path in logs for record in CommitLog(path).read()]
        missing: list[JournalRecord] = []
        if records:
            ids = [record[0] for record in records]
            # IN a subquery, not list_contains(?, exchange_id): over the view's union of every segment table DuckDB 2.0
            # held memory growing with the tables and the ids asked, and a store of 164 segments could not open after
            # a crash with 20 ids in its log (Out of Memory at 512 MB; the full soak, 2026-12-07)
            present = {exchange_id for (exchange_id,) in self.con.execute("SELECT exchange_id FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[]))", [ids]).fetchall()}
            missing = [record for record in records if record[0] not in present]  # each record is in one log only
            self._journal_bytes += insert_journal_records(self.con, missing, journal_table(self._journals[-1]), self.slice_bytes)
            self._journal_rows += len(missing)
            log.info(f"polar-mitm: {len(missing)} committed exchanges of {self.path} put back from its commit log ({len(records) - len(missing)} were in it already)")
        for path in logs:
            path.unlink(missing_ok=True)
        return len(missing)

    def _remove_logs(self) -> None:
        """At a close that left every record in the database file."""
        self._log.remove()
        for path in commit_logs(self.path):
            path.unlink(missing_ok=True)
