"""Merged segments (polar_mitm/store/compactor.py, segments.merge_segments): as segments age, `merge_fanin` tables of
one level become one table, so the `exchanges` view names a bounded number of tables however long the store is
written; every row stays in the view exactly once, with its segment (snapshot exports are still per segment), across
a reopen, a merge a crash cut short and a merge that fails."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from polar_mitm import store
from polar_mitm.store import Store, compactor
from polar_mitm.store.compactor import merge_level
from tests.support.rows import commit_in_order, exchange_row


def _settled(target: Store, segments: int) -> None:
    """Wait until `segments` segments are listed and no merge is queued or running."""
    deadline, calm = time.monotonic() + 30, 0
    while time.monotonic() < deadline:
        listed = target.con.cursor().execute(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}").fetchall()[0][0]
        calm = calm + 1 if listed >= segments and not target._merging and target._compactions.empty() else 0
        if calm == 3:  # three looks in a row: not the moment between one merge's listing and the next one's queueing
            return
        time.sleep(0.05)
    raise AssertionError(f"{segments} segments and no merge pending, within 30 s")


def _unmerged_store(db: Path, rows: int) -> None:
    """A closed store of `rows` rows in segments of 2, none merged (as a version before merges wrote it)."""
    target = Store(db, segment_rows=2, merge_fanin=0)  # 0: never merge
    try:
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(1, rows + 1)])
        _settled(target, rows // 2)
        assert len(_tables(target.con.cursor(), store.SEGMENT_PREFIX)) == rows // 2
    finally:
        target.close()


def _tables(con: duckdb.DuckDBPyConnection, prefix: str) -> list[str]:
    return [name for (name,) in con.execute(f"SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '{prefix}') ORDER BY 1").fetchall()]


def test_the_level_of_a_table_is_how_many_merges_its_segments_went_through() -> None:
    assert [merge_level(n, 4) for n in (1, 4, 16, 64)] == [0, 1, 2, 3]
    assert [merge_level(n, 2) for n in (1, 2, 4, 8)] == [0, 1, 2, 3]


def test_aged_segments_are_merged_and_every_row_reads_back_once(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    rows = [exchange_row(f"s{seq % 3}", seq, prompt_len=50) for seq in range(1, 37)]
    target = Store(db, segment_rows=2, merge_fanin=3, merge_after=0)
    try:
        commit_in_order(target, rows)
        _settled(target, 18)
        con = target.con.cursor()
        # 18 segments of 2 rows: two level-2 tables of 9 segments each; nothing left in a table of its own
        merged = _tables(con, store.MERGED_PREFIX)
        assert _tables(con, store.SEGMENT_PREFIX) == [] and len(merged) == 2
        sizes = con.execute(f"SELECT stored_in, count(*) FROM {store.SEGMENTS_TABLE} GROUP BY 1 ORDER BY 1").fetchall()
        assert [(name, 9) for name in merged] == sizes
        # each segment's rows are where the list says, with their segment's number
        for table in merged:
            assert con.execute(f"SELECT count(DISTINCT segment), min(rows), max(rows) FROM (SELECT segment, count(*) AS rows FROM {table} GROUP BY 1)").fetchall() == [(9, 2, 2)]
        _, read = target.query("SELECT exchange_id, seq, prompt_token_ids, completion_logprobs FROM exchanges ORDER BY seq")
        assert [(r[0], r[1], r[2], r[3]) for r in read] == [(r["exchange_id"], r["seq"], r["prompt_token_ids"], r["completion_logprobs"]) for r in rows]
        # a snapshot still hands out one Parquet file per segment, each holding that segment's rows
        snapshot = target.snapshot("node", tmp_path / "snap")
        segment_files = [path for path in snapshot.exchanges if Path(path).parent == store.segments_dir(db)]
        assert len(segment_files) == 18
        exported = [pq.read_table(path).column("exchange_id").to_pylist() for path in segment_files]
        assert [len(ids) for ids in exported] == [2] * 18 and sorted(sum(exported, [])) == sorted(r["exchange_id"] for r in rows)
        by_segment = dict(con.execute(f"SELECT segment, list(exchange_id ORDER BY exchange_id) FROM (SELECT * FROM {merged[0]} UNION ALL SELECT * FROM {merged[1]}) GROUP BY 1").fetchall())
        assert [sorted(ids) for ids in exported] == [by_segment[number] for number in sorted(by_segment)]
    finally:
        target.close()
    # closed, reopened by polar-mitm and by a bare DuckDB client: the same rows, once each
    assert [tuple(row) for row in store.query(db, "SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1]] == [(36, 36)]
    bare = duckdb.connect(str(db), read_only=True)
    try:
        assert bare.execute("SELECT count(*), sum(len(prompt_token_ids)) FROM exchanges").fetchall() == [(36, 36 * 50)]
    finally:
        bare.close()


def test_a_store_written_before_merges_has_its_segments_merged_when_opened(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    _unmerged_store(db, 16)
    target = Store(db, segment_rows=2, merge_fanin=4, merge_after=0)
    try:
        _settled(target, 8)
        con = target.con.cursor()
        assert _tables(con, store.SEGMENT_PREFIX) == [] and len(_tables(con, store.MERGED_PREFIX)) == 2
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(16, 16)]
    finally:
        target.close()


def test_a_merge_a_crash_cut_short_is_dropped_and_its_segments_read_once(tmp_path: Path) -> None:
    """A merged table written but never listed (the writer died between the two) is dropped at the next open, and the
    merges after it are numbered past it."""
    db = tmp_path / "s.duckdb"
    _unmerged_store(db, 8)
    con = store.connect(db)
    try:
        store.merge_segments(con, "exchange_merged_000007", [1, 2, 3], {})  # what a crash before the listing leaves
    finally:
        con.close()
    target = Store(db, segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        _settled(target, 4)
        con = target.con.cursor()
        assert "exchange_merged_000007" not in _tables(con, store.MERGED_PREFIX)
        assert all(int(name[len(store.MERGED_PREFIX):]) > 7 for name in _tables(con, store.MERGED_PREFIX))
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(8, 8)]
    finally:
        target.close()


def test_a_failed_merge_leaves_its_tables_in_the_view_and_the_next_one_goes_on(tmp_path: Path) -> None:
    """A real DuckDB failure: the name the next merge takes is already a table (made through the writer), so its
    CREATE TABLE fails; the tables it would have merged stay, in the view, the trouble is said, and after the next
    segment a merge under the next name succeeds."""
    db = tmp_path / "s.duckdb"
    said: list[str] = []
    target = Store(db, segment_rows=2, merge_fanin=2, merge_after=0, report=said.append)
    try:
        blocked = f"{store.MERGED_PREFIX}{target._next_merged:06d}"
        target.execute_write(f"CREATE TABLE {blocked} (x INTEGER)")
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(1, 5)])
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.02)
        assert said and "merging 2 segment tables" in said[0] and blocked in said[0]
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(4, 4)]
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(5, 9)])
        _settled(target, 4)
        con = target.con.cursor()
        assert _tables(con, store.SEGMENT_PREFIX) == [] and con.execute(f"SELECT count(DISTINCT stored_in) FROM {store.SEGMENTS_TABLE}").fetchall() == [(1,)]
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(8, 8)]
    finally:
        target.close()


def test_the_newest_segments_keep_their_own_tables(tmp_path: Path) -> None:
    """`merge_after`: the newest segments are never merged, so a store of fewer than `merge_after + merge_fanin`
    segments copies no row at all."""
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=2, merge_fanin=2, merge_after=3)
    try:
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(1, 9)])
        _settled(target, 4)
        assert _tables(target.con.cursor(), store.MERGED_PREFIX) == []  # 4 segments: 1 older than the newest 3
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(9, 17)])
        _settled(target, 8)
        con = target.con.cursor()
        own = {int(name[len(store.SEGMENT_PREFIX):]) for name in _tables(con, store.SEGMENT_PREFIX)}
        merged = {number for (number,) in con.execute(f"SELECT segment FROM {store.SEGMENTS_TABLE} WHERE stored_in IS NOT NULL").fetchall()}
        assert own == {5, 6, 7, 8} and merged == {1, 2, 3, 4}  # 5 of 8 older than the newest 3: two pairs merged, then the pairs
        assert len(_tables(con, store.MERGED_PREFIX)) == 1
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(16, 16)]
    finally:
        target.close()


def test_a_merged_table_made_before_a_column_existed_reads_it_as_null_and_merges_on(tmp_path: Path) -> None:
    """The contract grows (a column added in a later version): a merged table made before lacks it. The view reads
    it as NULL there, the table merges into the next level with it NULL, and its segments still export."""
    db = tmp_path / "s.duckdb"
    target = Store(db, segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(1, 5)])
        _settled(target, 2)
        (older,) = _tables(target.con.cursor(), store.MERGED_PREFIX)
    finally:
        target.close()
    con = store.connect(db)
    try:
        con.execute(f"ALTER TABLE {older} DROP COLUMN harness")  # as if made before `harness` was a column
    finally:
        con.close()
    target = Store(db, segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        assert target.query("SELECT seq, harness FROM exchanges ORDER BY seq")[1] == [(seq, None) for seq in range(1, 5)]
        commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(5, 9)])
        _settled(target, 4)
        (merged,) = _tables(target.con.cursor(), store.MERGED_PREFIX)
        assert merged != older
        assert target.query("SELECT seq, harness FROM exchanges ORDER BY seq")[1] == [(seq, None if seq < 5 else "qwen") for seq in range(1, 9)]
        snapshot = target.snapshot("node", tmp_path / "snap")
        exported = [pq.read_table(path) for path in snapshot.exchanges if Path(path).parent == store.segments_dir(db)]
        assert sorted(seq for table in exported for seq in table.column("seq").to_pylist()) == list(range(1, 9))
    finally:
        target.close()


def test_commits_go_on_while_a_merge_holds_the_compactor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge takes the compactor seconds (16 segments of harness-sized rows: ~5 s). Sealed journals, whose records
    wait in files, queue behind it instead of holding every commit at the backlog's 5 s wait; once it is done, the
    segments and the merge are all in, each row once."""
    release = threading.Event()
    merge = compactor.merge_segments

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - merge_segments' own
        assert release.wait(timeout=60)
        return merge(*args, **kwargs)

    monkeypatch.setattr(compactor, "merge_segments", held)
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=2, merge_after=0)
    waits: list[float] = []

    async def commit_all(rows: list) -> None:
        for row in rows:
            started = time.monotonic()
            await target.commit_exchange(row)
            waits.append(time.monotonic() - started)

    try:
        asyncio.run(commit_all([exchange_row("s", seq, prompt_len=20) for seq in range(1, 5)]))
        deadline = time.monotonic() + 30
        while not target._merging and time.monotonic() < deadline:
            time.sleep(0.02)
        assert target._merging  # the first two segments' merge, held
        asyncio.run(commit_all([exchange_row("s", seq, prompt_len=20) for seq in range(5, 21)]))
        assert len(target._compacting) >= 4 and max(waits) < 2, (len(target._compacting), sorted(waits)[-3:])
        release.set()
        _settled(target, 10)
        assert target.query("SELECT count(*), count(DISTINCT exchange_id) FROM exchanges")[1] == [(20, 20)]
        assert _tables(target.con.cursor(), store.SEGMENT_PREFIX) == []  # 10 segments: 8 and 2 merged
    finally:
        release.set()
        target.close()


def test_a_merge_copies_at_most_merge_rows_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB holds a merged table's rows in memory until they are checkpointed, so a level whose next merge would
    copy more than MERGE_ROWS rows is not merged on (a second level of 16 x 16 harness-sized segments: ~19 GB)."""
    monkeypatch.setattr(compactor, "MERGE_ROWS", 4)
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        rows = [exchange_row("s", seq, prompt_len=20) for seq in range(1, 17)]
        commit_in_order(target, rows)
        _settled(target, 8)
        held = sorted(len(t.segments) for t in target._merged.values())
        assert held == [2, 2, 2, 2], held  # eight segments in four merged tables of 4 rows; none of 8
        assert target.query("SELECT count(*) FROM exchanges")[1] == [(16,)]
    finally:
        target.close()
    monkeypatch.setattr(compactor, "MERGE_ROWS", 8)
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=2, merge_after=0)
    try:
        _settled(target, 8)
        deadline = time.monotonic() + 30
        while sorted(len(t.segments) for t in target._merged.values()) != [4, 4] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(len(t.segments) for t in target._merged.values()) == [4, 4]  # allowed more, the next level merges at open
        assert target.query("SELECT count(*) FROM exchanges")[1] == [(16,)]
    finally:
        target.close()


@pytest.mark.parametrize("fanin", [0, 3])
def test_without_merges_a_growing_view_is_warned_of_once_per_so_many_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fanin: int) -> None:
    """Unmerged, every re-pointing and read of the view binds each of its tables: each time the view comes to name
    another VIEW_TABLES_WARNING of them the log says so, with what a re-pointing took and the option that bounds it."""
    monkeypatch.setattr(compactor, "VIEW_TABLES_WARNING", 3)
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=fanin, merge_after=100)  # merges due only past 100
    try:
        with caplog.at_level("WARNING", logger="polar_mitm.store"):
            commit_in_order(target, [exchange_row("s", seq, prompt_len=20) for seq in range(1, 15)])
            _settled(target, 7)
    finally:
        target.close()
    warned = [r.getMessage() for r in caplog.records if "names" in r.getMessage() and "--store-merge-fanin" in r.getMessage()]
    if fanin:
        assert warned == []  # merges on: the view stays bounded once segments age
    else:
        assert [w.split(" names ")[1].split()[0] for w in warned] == ["3", "6"], warned
        assert all("re-pointing it at each segment took" in w for w in warned)
