"""Reads of one session (polar_mitm/store/session_reads.py, `Store.query(..., session=)`): `exchanges` is that
session's rows, read from the journals and from only the segment and merged tables whose listing names the session,
so a node's own reads do not bind a long store's every table; the same rows as the view gives, exactly once, while
segments are written, merged and listed beside the read."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import duckdb

from polar_mitm import store
from polar_mitm.store import Store
from polar_mitm.store.session_reads import session_rows_sql, with_session_rows
from tests.support.rows import commit_in_order, exchange_row

IDS = "SELECT exchange_id FROM exchanges WHERE session_id = ? ORDER BY seq"


def _rows(sessions: int, turns: int) -> list[store.ExchangeRow]:
    """`turns` rows of each session, one turn of every session after another (as concurrent sessions commit)."""
    return [exchange_row(f"s{index}", seq, prompt_len=20) for seq in range(1, turns + 1) for index in range(sessions)]


def _settled(target: Store, segments: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = target.con.cursor().execute(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}").fetchall()[0][0]
        if listed >= segments and not target._compacting and not target._merging and target._compactions.empty():
            return
        time.sleep(0.05)
    raise AssertionError(f"{segments} segments listed within 30 s")


def _named(sql: str) -> set[str]:
    return set(re.findall(r"exchange_(?:segment|merged|journal)_\d+", sql))


def test_a_session_read_gives_the_views_rows_from_only_the_tables_holding_them(tmp_path: Path) -> None:
    target = Store(tmp_path / "s.duckdb", segment_rows=4, merge_fanin=0)
    try:
        # sessions s0..s3 for 8 turns (8 segments of 4 rows), then s9 alone (a segment of its own, and a journal)
        commit_in_order(target, [*_rows(4, 8), *(exchange_row("s9", seq, prompt_len=20) for seq in range(1, 7))])
        _settled(target, 9)
        for session in ("s0", "s3", "s9", "nobody"):
            expected = target.query(IDS, [session])[1]
            assert target.query(IDS, [session], session=session)[1] == expected
            # the statement needs no filter of its own: `exchanges` is the session's rows
            assert target.query("SELECT exchange_id FROM exchanges ORDER BY seq", session=session)[1] == expected
            assert target.arrow("SELECT exchange_id FROM exchanges ORDER BY seq", session=session).column("exchange_id").to_pylist() == [e for (e,) in expected]
        assert len(target.query(IDS, ["s9"])[1]) == 6
        several = "SELECT exchange_id FROM exchanges WHERE session_id IN ('s0', 's9') ORDER BY session_id, seq"
        assert target.query("SELECT exchange_id FROM exchanges ORDER BY session_id, seq", session=["s0", "s9"])[1] == target.query(several)[1]
        cursor = target.con.cursor()
        listed = dict(cursor.execute(f"SELECT segment, sessions FROM {store.SEGMENTS_TABLE}").fetchall())
        assert sorted(listed[1]) == ["s0", "s1", "s2", "s3"] and listed[9] == ["s9"]
        for session, holding in (("s9", {9}), ("s0", set(range(1, 9))), ("nobody", set())):
            named = _named(session_rows_sql(cursor, session, {}))
            assert {name for name in named if name.startswith(store.SEGMENT_PREFIX)} == {store.segment_table(n) for n in holding}
            assert any(name.startswith("exchange_journal_") for name in named)  # rows not yet in a segment are read too
        # a statement with its own WITH keeps it
        counted = target.query("WITH mine AS (SELECT * FROM exchanges) SELECT count(*) FROM mine", session="s0")[1]
        assert counted == [(8,)]
    finally:
        target.close()


def test_segments_listed_before_sessions_were_are_read_until_a_writer_lists_them(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=4, merge_fanin=2, merge_after=1)
    try:
        commit_in_order(target, _rows(4, 4))
        _settled(target, 4)
        assert target._merged, "the test needs a merged table"
    finally:
        target.close()
    con = duckdb.connect(str(db))
    con.execute(f"UPDATE {store.SEGMENTS_TABLE} SET sessions = NULL")  # as an earlier version listed them
    # a reader of such a store reads every segment whose listing names no session, merged or not
    con.execute("BEGIN TRANSACTION")
    named = _named(session_rows_sql(con, "nobody", {}))
    assert {n for n in named if not n.startswith("exchange_journal_")} == {*(store.segment_table(n) for n in (3, 4)), *_tables(con, "exchange_merged_")}
    assert len(con.execute(with_session_rows("SELECT * FROM exchanges", session_rows_sql(con, "s1", {}))).fetchall()) == 4
    con.execute("ROLLBACK")
    con.close()
    target = Store(db, segment_rows=4, merge_fanin=0)  # its first open lists them
    try:
        listed = target.query(f"SELECT segment, list_sort(sessions) FROM {store.SEGMENTS_TABLE} ORDER BY segment")[1]
        assert listed == [(n, ["s0", "s1", "s2", "s3"]) for n in (1, 2, 3, 4)]
        assert not {n for n in _named(session_rows_sql(target.con.cursor(), "nobody", {})) if not n.startswith("exchange_journal_")}
        assert [len(target.query(IDS, [s], session=s)[1]) for s in ("s0", "s1", "s2", "s3")] == [4, 4, 4, 4]
    finally:
        target.close()


def _tables(con: duckdb.DuckDBPyConnection, prefix: str) -> set[str]:
    return {name for (name,) in con.execute(f"SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '{prefix}')").fetchall()}


def test_merged_segments_are_read_through_their_merged_table(tmp_path: Path) -> None:
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        commit_in_order(target, [*_rows(2, 8), *(exchange_row("late", seq, prompt_len=20) for seq in range(1, 5))])
        _settled(target, 10)
        assert target._merged, "the test needs merged tables"
        for session in ("s0", "s1", "late"):
            assert target.query(IDS, [session], session=session)[1] == target.query(IDS, [session])[1]
        named = _named(session_rows_sql(target.con.cursor(), "late", {}))
        late_tables = {t for t, held in target._merged.items() if set(held.segments) & {9, 10}} | {store.segment_table(n) for n in (9, 10) if n in target._segments}
        assert {n for n in named if not n.startswith("exchange_journal_")} == late_tables
    finally:
        target.close()


def test_a_session_read_beside_compactions_and_merges_sees_each_row_once(tmp_path: Path) -> None:
    """Reads in a thread of their own while rows are committed, journals become segments and segments are merged:
    every read sees each of the session's committed rows exactly once (never a journal and its segment both, never a
    table the writer has just dropped)."""
    target = Store(tmp_path / "s.duckdb", segment_rows=3, merge_fanin=2, merge_after=1)
    seen: list[list[str]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append([e for (e,) in target.query("SELECT exchange_id FROM exchanges ORDER BY seq", session="s0")[1]])
            except BaseException as error:  # noqa: BLE001 - reported below
                failures.append(error)
                return

    reader = threading.Thread(target=read)
    reader.start()
    rows = _rows(3, 30)
    try:

        async def commit_all() -> None:
            for row in rows:
                await target.commit_exchange(row)
                await asyncio.sleep(0.002)

        asyncio.run(commit_all())
        _settled(target, 30)
    finally:
        stop.set()
        reader.join()
    try:
        assert not failures, failures
        order = [row["exchange_id"] for row in rows if row["session_id"] == "s0"]
        assert len(seen) > 20 and len(set(target._merged)) > 0
        for ids in seen:  # a prefix of the session's rows (those committed when it read), each once
            assert ids == order[: len(ids)]
        assert seen[-1] == order or target.query("SELECT exchange_id FROM exchanges ORDER BY seq", session="s0")[1] == [(e,) for e in order]
    finally:
        target.close()


def test_with_session_rows_binds_exchanges_for_the_statement_only() -> None:
    assert with_session_rows("SELECT 1", "R") == "WITH exchanges AS NOT MATERIALIZED (R) SELECT 1"
    assert with_session_rows("  with x AS (SELECT 2) SELECT * FROM x", "R") == "WITH exchanges AS NOT MATERIALIZED (R), x AS (SELECT 2) SELECT * FROM x"


def test_a_store_in_its_own_process_answers_a_session_read(tmp_path: Path) -> None:
    from polar_mitm.gateway.store_process import StoreProcess

    said: list[str] = []
    target = StoreProcess(tmp_path / "s.duckdb", 512, 32, 8, 0, said.append)
    try:

        async def commit_all() -> None:
            for row in _rows(2, 3):
                await target.commit_exchange(row)

        asyncio.run(commit_all())
        assert target.query("SELECT count(*) FROM exchanges", session="s1")[1] == [(3,)]
        assert target.arrow("SELECT seq FROM exchanges ORDER BY seq", session=["s0"]).column("seq").to_pylist() == [1, 2, 3]
    finally:
        target.close()
    assert not said
