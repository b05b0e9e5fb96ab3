"""The commit log (polar_mitm/store/commit_log.py): a commit is durable in it before its reply, its records reach the
database file later (moved, many in one INSERT), a torn tail is dropped, and a crash in between loses and
duplicates nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from polar_mitm import store
from polar_mitm.store import Store, commit_log
from polar_mitm.store.commit_log import MOVE_ROWS, CommitLog, commit_log_path
from tests.support.rows import exchange_row


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


def test_a_commit_is_in_the_log_before_the_file_and_every_read_sees_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_log, "MOVE_WHEN_QUIET_S", 600.0)  # no quiet-time move while the test looks
    db = tmp_path / "s.duckdb"
    target = Store(db)
    try:
        rows = [exchange_row("s", seq) for seq in (1, 2, 3)]

        async def commit_all() -> None:
            for row in rows:
                await target.commit_exchange(row)

        asyncio.run(commit_all())
        journal = store.journal_table(target._journals[-1])
        # acknowledged: in the log; not yet in the journal (fewer than a move's worth, no quiet moment)
        assert [record[0] for record in CommitLog(commit_log_path(db)).read()] == [row["exchange_id"] for row in rows]
        assert target.con.cursor().execute(f"SELECT count(*) FROM {journal}").fetchall() == [(0,)]
        # a read moves them first, and the log is emptied once they are committed in the file
        assert sorted(r[0] for r in target.query("SELECT exchange_id FROM exchanges")[1]) == sorted(row["exchange_id"] for row in rows)
        assert commit_log_path(db).stat().st_size == 0
    finally:
        target.close()
    assert not commit_log_path(db).exists()  # a closed store: one file, nothing beside it


def test_records_a_crash_left_in_both_the_log_and_the_file_are_stored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after a move committed and before the log was emptied: the next open finds the records in the file
    and puts back only those that are not."""
    monkeypatch.setattr(commit_log, "MOVE_WHEN_QUIET_S", 600.0)  # the log holds what the test says it does
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


def test_rows_the_file_never_got_come_back_at_the_next_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log of a writer that died before moving its last commits: the next open (here any read through
    polar_mitm.store.query) puts them into the file, counted in `sessions`."""
    monkeypatch.setattr(commit_log, "MOVE_WHEN_QUIET_S", 600.0)  # the log holds what the test says it does
    db = tmp_path / "s.duckdb"
    rows = [exchange_row(f"s{seq % 2}", seq // 2 + 1) for seq in range(MOVE_ROWS // 2)]
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
