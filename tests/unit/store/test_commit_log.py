"""The commit log (polar_mitm/store/commit_log.py): a commit is durable in it before its reply, its records reach the
database file later (a segment's worth sealed and written as a segment, or moved into a journal by a read), a torn
tail is dropped, and a crash in between loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from polar_mitm import store
from polar_mitm.store import Store, commit_log, compactor
from polar_mitm.store.commit_log import CommitLog, commit_log_path, commit_logs, record_slices, sealed_log_path
from tests.support.rows import commit_in_order, exchange_row


def _record(index: int) -> tuple:
    return (f"e{index}", "s", index, "ok", b"{}", b"{}", b"request " * 100, None, None, None, None)


def test_a_torn_tail_is_dropped_and_the_next_append_writes_over_it(tmp_path: Path) -> None:
    log = CommitLog(tmp_path / "s.duckdb.commits")
    log.append([_record(1), _record(2)])
    good = log.path.stat().st_size
    # what a crash mid-append leaves: part of a record after the last good one
    with log.path.open("r+b") as out:
        out.seek(good)
        out.write(b"\x00\x00\x01\x00garbage")
    assert CommitLog(log.path).read() == [_record(1), _record(2)]
    log.append([_record(3)])  # at the end of the last good record, over the torn bytes
    assert CommitLog(log.path).read() == [_record(1), _record(2), _record(3)]
    # a flipped byte inside a record: its CRC fails, it and what follows are dropped
    data = bytearray(log.path.read_bytes())
    data[good + 20] ^= 0xFF
    log.path.write_bytes(bytes(data))
    assert CommitLog(log.path).read() == [_record(1), _record(2)]
    log.empty()
    assert log.path.stat().st_size == 0 and CommitLog(log.path).read() == []
    log.remove()
    assert not log.path.exists()


def test_a_sealed_log_is_read_a_slice_at_a_time_as_it_is_taken(tmp_path: Path) -> None:
    """The compactor's reader: slices of at most `slice_bytes` of records (one record alone if it is larger), read
    from the file as they are taken, so a slice is all it holds; the torn tail dropped as read() drops it; the
    file is opened at the call, so a read that unlinks the sealed log meanwhile takes nothing from it."""
    log = CommitLog(tmp_path / "s.duckdb.commits.000001")
    records = [_record(index) for index in range(1, 8)]  # 800 bytes of texts each, record_bytes 804
    log.append(records)
    with log.path.open("ab") as out:
        out.write(b"\x00\x00\x01\x00torn")
    slices = record_slices(log.path, 2 * 804)
    first = next(slices)
    assert first == records[:2]
    log.path.unlink()  # a read moved them into their journal: this reader still has the sealed log open
    assert [first, *slices] == [records[:2], records[2:4], records[4:6], records[6:]]
    other = CommitLog(tmp_path / "s.duckdb.commits.000002")
    other.append(records[:3])
    assert list(record_slices(other.path, 0)) == [records[:3]]  # 0: all at once
    assert list(record_slices(other.path, 100)) == [[record] for record in records[:3]]  # never an empty slice
    assert list(record_slices(tmp_path / "none", 100)) == []


def test_a_commit_is_in_the_log_before_the_file_and_every_read_sees_it(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    target = Store(db)
    try:
        rows = [exchange_row("s", seq) for seq in (1, 2, 3)]

        async def commit_all() -> None:
            for row in rows:
                await target.commit_exchange(row)

        asyncio.run(commit_all())
        journal = store.journal_table(target._journals[-1])
        # acknowledged: in the log; not yet in the journal (fewer than a segment's worth, and no read yet)
        assert [record[0] for record in CommitLog(commit_log_path(db)).read()] == [row["exchange_id"] for row in rows]
        assert target.con.cursor().execute(f"SELECT count(*) FROM {journal}").fetchall() == [(0,)]
        # a read moves them first, and the log is emptied once they are committed in the file
        assert sorted(r[0] for r in target.query("SELECT exchange_id FROM exchanges")[1]) == sorted(row["exchange_id"] for row in rows)
        assert commit_log_path(db).stat().st_size == 0
    finally:
        target.close()
    assert not commit_log_path(db).exists()  # a closed store: one file, nothing beside it


def test_records_a_crash_left_in_both_the_log_and_the_file_are_stored_once(tmp_path: Path) -> None:
    """A crash after a move committed and before the log was emptied: the next open finds the records in the file
    and puts back only those that are not."""
    db = tmp_path / "s.duckdb"
    target = Store(db)
    rows = [exchange_row("s", seq) for seq in range(1, 6)]

    async def commit(some: list) -> None:
        for row in some:
            await target.commit_exchange(row)

    try:
        asyncio.run(commit(rows[:3]))
        both = commit_log_path(db).read_bytes()  # rows 1-3, about to be moved
        assert target.query("SELECT count(*) FROM exchanges")[1] == [(3,)]  # moved
        asyncio.run(commit(rows[3:]))
        only_in_log = commit_log_path(db).read_bytes()  # rows 4-5: in the log only
    finally:
        target.close()
    # the file holds rows 1-5 now; give it back a log of rows 1-5 as a crash could have left it, plus a torn tail
    commit_log_path(db).write_bytes(both + only_in_log + b"\x00\x00\x00\x09torn")
    reopened = Store(db)
    try:
        ids = [r[0] for r in reopened.query("SELECT exchange_id FROM exchanges")[1]]
        counts = reopened.query("SELECT n_exchanges FROM sessions WHERE session_id = 's'")[1]
    finally:
        reopened.close()
    assert sorted(ids) == sorted(row["exchange_id"] for row in rows)
    assert counts == [(5,)]
    assert not commit_log_path(db).exists()


def test_rows_the_file_never_got_come_back_at_the_next_open(tmp_path: Path) -> None:
    """The log of a writer that died before moving its last commits: the next open (here any read through
    polar_mitm.store.query) puts them into the file, counted in `sessions`."""
    db = tmp_path / "s.duckdb"
    rows = [exchange_row(f"s{seq % 2}", seq // 2 + 1) for seq in range(8)]
    target = Store(db)
    try:

        async def commit_all() -> None:
            for row in rows:
                await target.commit_exchange(row)

        asyncio.run(commit_all())
        left = commit_log_path(db).read_bytes()
    finally:
        target.close()
    # as if the process had died right after those commits: the file without them, the log with them
    fresh = tmp_path / "fresh.duckdb"
    Store(fresh).close()
    os.replace(fresh, db)
    commit_log_path(db).write_bytes(left)
    read = store.query(db, "SELECT exchange_id FROM exchanges")[1]
    assert sorted(r[0] for r in read) == sorted(row["exchange_id"] for row in rows)
    assert dict(store.query(db, "SELECT session_id, n_exchanges FROM sessions")[1]) == {"s0": len(rows) // 2, "s1": len(rows) // 2}
    assert not commit_log_path(db).exists()


@pytest.fixture
def held_compactor(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The compactor waits for the returned event before it writes a segment from sealed records."""
    release = threading.Event()
    write = compactor.write_records_segment

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - write_records_segment's own
        assert release.wait(timeout=60)
        return write(*args, **kwargs)

    monkeypatch.setattr(compactor, "write_records_segment", held)
    return release


def _journal_count(target: Store, number: int) -> int:
    return target.con.cursor().execute(f"SELECT count(*) FROM {store.journal_table(number)}").fetchall()[0][0]


def _wait(condition, what: str) -> None:  # noqa: ANN001
    for _ in range(600):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_segments_worth_becomes_a_segment_without_passing_through_a_journal(tmp_path: Path, held_compactor: threading.Event) -> None:
    """With no read meanwhile, `segment_rows` committed records are sealed (their log renamed after the journal
    they close) and the compactor writes the segment from them: the journal table never holds a row."""
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=4)
    try:
        number = target._journals[-1]
        rows = [exchange_row("s", seq) for seq in range(1, 5)]
        commit_in_order(target, rows)
        _wait(lambda: target._journals[-1] != number, "the seal (right after the acknowledgement, on the writer thread)")
        # sealed: the records in the journal's sealed log, the journal closed (a new one begun) and still empty
        assert [record[0] for record in CommitLog(sealed_log_path(db, number)).read()] == [row["exchange_id"] for row in rows]
        assert target._journals[-1] == number + 1 and _journal_count(target, number) == 0
        assert not commit_log_path(db).exists() or commit_log_path(db).stat().st_size == 0
        held_compactor.set()
        _wait(lambda: number in target._segments and number not in target._journals, "the segment")
        assert not sealed_log_path(db, number).exists()
        table = store.segment_table(number)
        assert sorted(r[0] for r in target.con.cursor().execute(f"SELECT exchange_id FROM {table}").fetchall()) == sorted(row["exchange_id"] for row in rows)
        read = target.query("SELECT exchange_id, prompt_token_ids FROM exchanges ORDER BY seq")[1]
        assert [r[0] for r in read] == [row["exchange_id"] for row in rows]
        assert [r[1] for r in read] == [list(row["prompt_token_ids"]) for row in rows]
    finally:
        held_compactor.set()
        target.close()
    assert commit_logs(db) == []


def test_a_read_while_a_segment_is_written_moves_its_records_into_their_journal(tmp_path: Path, held_compactor: threading.Event) -> None:
    """A read cannot wait for the compactor: sealed records go into their own journal, the read sees them, and the
    segment written from the same records then replaces that journal: every row once."""
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=4)
    try:
        number = target._journals[-1]
        rows = [exchange_row("s", seq) for seq in range(1, 7)]  # 4 sealed, 2 in the log being appended to
        commit_in_order(target, rows)
        _wait(lambda: sealed_log_path(db, number).exists(), "the seal")
        assert sorted(r[0] for r in target.query("SELECT exchange_id FROM exchanges")[1]) == sorted(row["exchange_id"] for row in rows)
        assert _journal_count(target, number) == 4 and _journal_count(target, number + 1) == 2
        assert not sealed_log_path(db, number).exists()  # in the file now
        held_compactor.set()
        _wait(lambda: number not in target._journals, "the segment to replace its journal")
        ids = [r[0] for r in target.query("SELECT exchange_id FROM exchanges")[1]]
        assert sorted(ids) == sorted(row["exchange_id"] for row in rows)
        assert target.query("SELECT count(*) FROM exchanges WHERE session_id = 's'")[1] == [(6,)]
    finally:
        held_compactor.set()
        target.close()
    assert [tuple(r) for r in store.query(db, "SELECT n_exchanges FROM sessions WHERE session_id = 's'")[1]] == [(6,)]


def test_sealed_records_a_crash_left_come_back_at_the_next_open(tmp_path: Path, held_compactor: threading.Event) -> None:
    """A writer that died with records sealed (its segment not written yet) and more in its log: the next open puts
    back both, once each, counted in `sessions`."""
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=4)
    number = target._journals[-1]
    rows = [exchange_row("s", seq) for seq in range(1, 7)]
    try:
        commit_in_order(target, rows)
        _wait(lambda: sealed_log_path(db, number).exists(), "the seal")
        sealed, tail = sealed_log_path(db, number).read_bytes(), commit_log_path(db).read_bytes()
    finally:
        held_compactor.set()
        target.close()
    fresh = tmp_path / "fresh.duckdb"
    Store(fresh).close()
    os.replace(fresh, db)
    sealed_log_path(db, number).write_bytes(sealed)
    commit_log_path(db).write_bytes(tail)
    read = store.query(db, "SELECT exchange_id FROM exchanges")[1]
    assert sorted(r[0] for r in read) == sorted(row["exchange_id"] for row in rows)
    assert [tuple(r) for r in store.query(db, "SELECT n_exchanges FROM sessions WHERE session_id = 's'")[1]] == [(6,)]
    assert commit_logs(db) == []


def test_waiting_records_are_read_back_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The records not yet in the database file are read back from the log when they go (not kept in memory); a
    log that cannot be cut after a move marks its records moved, so they never go twice."""
    log = CommitLog(tmp_path / "s.duckdb.commits")
    log.append([_record(1), _record(2)])
    assert log.pending() == [_record(1), _record(2)]
    log.empty()
    assert log.pending() == []
    log.append([_record(3)])

    def refused(fd: int, length: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(commit_log.os, "ftruncate", refused)  # a real OSError, raised where the cut is asked for
    log.empty()
    assert log.pending() == []
    log.append([_record(4)])
    assert log.pending() == [_record(4)]
    assert log.read() == [_record(3), _record(4)]  # a crash now: the next open finds 3 in the store and skips it
    monkeypatch.undo()
    log.remove()
