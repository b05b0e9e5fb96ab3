"""The store's memory bounds: DuckDB's memory limit, journals rotated by their records' bytes, compaction in
slices (one INSERT each), and the gateway options that set them defaulting to the store's own values."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from polar_mitm import store
from polar_mitm.gateway.options import OPTIONS
from polar_mitm.store import Store, compactor, writer
from polar_mitm.store import records as store_records
from polar_mitm.store.cache import SegmentCache
from polar_mitm.store.segments import write_segment
from tests.support.rows import exchange_row


def test_the_gateway_options_default_to_the_stores_bounds() -> None:
    defaults = {option.name: option.default for option in OPTIONS}
    assert defaults["store_memory_mb"] == writer.MEMORY_MB
    assert defaults["store_journal_mb"] == writer.JOURNAL_MB
    assert defaults["store_compact_slice_mb"] == writer.COMPACT_SLICE_MB
    assert defaults["store_merge_fanin"] == writer.MERGE_FANIN == 0


def test_the_gateways_store_merges_as_its_option_says(tmp_path: Path) -> None:
    from polar_mitm.gateway.startup import open_when_readers_leave

    opened = open_when_readers_leave(tmp_path / "s.duckdb", 512, 32, 8, 16, lambda message: None)
    try:
        assert (opened.merge_fanin, opened.merge_after) == (16, writer.MERGE_AFTER)
    finally:
        opened.close()
    with pytest.raises(ValueError, match="at least 2"):
        Store(tmp_path / "t.duckdb", merge_fanin=1)


def test_duckdb_gets_the_memory_limit_and_zero_leaves_duckdbs_own(tmp_path: Path) -> None:
    bounded = Store(tmp_path / "a.duckdb", memory_mb=200)
    try:
        assert bounded.query("SELECT current_setting('memory_limit')")[1][0][0] in ("190.7 MiB", "200.0 MB", "200MB")
    finally:
        bounded.close()
    unbounded = Store(tmp_path / "b.duckdb", memory_mb=0)
    try:
        assert "GiB" in unbounded.query("SELECT current_setting('memory_limit')")[1][0][0]  # DuckDB's 80% of RAM
    finally:
        unbounded.close()


def _commit(target: Store, rows: list) -> None:
    async def commit_all() -> None:
        for start in range(0, len(rows), 6):
            await asyncio.gather(*(target.commit_exchange(row) for row in rows[start : start + 6]))

    asyncio.run(commit_all())


def test_a_journal_becomes_a_segment_by_its_bytes_compacted_in_slices_and_reads_back_the_same(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="polar_mitm.store")
    rows = [exchange_row("s", seq, prompt_len=4000) for seq in range(1, 61)]
    # 1 MB: ~35 of these rows, far below segment_rows (256); slices of 1 MB of records: ~35 rows each, so slicing is
    # forced smaller here, to ~6 rows of ~30 KB
    target = Store(tmp_path / "s.duckdb", journal_mb=1, compact_slice_mb=1)
    target.slice_bytes = 200_000
    try:
        _commit(target, rows)
        deadline = time.monotonic() + 30
        while not target.query(f"SELECT * FROM {store.SEGMENTS_TABLE}")[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        ((number, segment_rows),) = target.query(f"SELECT segment, rows FROM {store.SEGMENTS_TABLE}")[1]
        read = dict(target.query("SELECT exchange_id, prompt_token_ids FROM exchanges")[1])
    finally:
        target.close()
    assert 20 < segment_rows < 60  # rotated at 1 MB of records, not at 256 rows
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"polar-mitm: segment {number:06d}: ")]
    slices = int(said.split(" exchanges written in ")[1].split()[0])
    assert slices >= segment_rows // 10, said  # ~6 rows of ~30 KB a slice
    assert read == {row["exchange_id"]: list(row["prompt_token_ids"]) for row in rows}


def test_the_compaction_backlog_never_stalls_commits_on_a_lost_wake_up(tmp_path: Path) -> None:
    """With full journals queued faster than the compactor turns them into segments, the writer waits for the
    compactor, which waits for the writer to install what it wrote. Its wake-up could come just before the writer
    cleared it: then both waited until the writer's 5 s timeout, and every commit meanwhile (bench: 1 in ~1,000
    exchanges took 5.1 s). Tiny journals make that race frequent; no commit may wait anywhere near 5 s."""
    target = Store(tmp_path / "b.duckdb", segment_rows=2)
    waits: list[float] = []

    async def commit(row: dict) -> None:
        started = time.monotonic()
        await target.commit_exchange(row)
        waits.append(time.monotonic() - started)

    async def commit_all() -> None:
        rows = [exchange_row(f"s{i % 8}", i // 8 + 1, prompt_len=200) for i in range(400)]
        for start in range(0, len(rows), 8):
            await asyncio.gather(*(commit(row) for row in rows[start : start + 8]))

    try:
        asyncio.run(commit_all())
        assert target.query("SELECT count(*) FROM exchanges")[1] == [(400,)]
    finally:
        target.close()
    assert max(waits) < 3, sorted(waits)[-5:]


def _base_table_mb(target: Store) -> float:
    return target.query("SELECT coalesce(sum(memory_usage_bytes), 0) / 2^20 FROM duckdb_memory() WHERE tag = 'BASE_TABLE'")[1][0][0]


@pytest.mark.parametrize("cut", [True, False])
def test_the_blocks_each_checkpoint_wrote_leave_duckdbs_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool) -> None:
    """DuckDB kept every block a compaction's checkpoint wrote until its memory limit forced it out: the gateway grew
    by each segment (bench: 8 -> 310 MB of BASE_TABLE within a minute at 64 sessions). Each checkpoint is followed
    by a cut to what the cache may keep; without the cut (the second case) the same rows leave it growing."""
    if not cut:
        monkeypatch.setattr(SegmentCache, "cut", lambda self, con: None)
    target = Store(tmp_path / "c.duckdb", journal_mb=1)
    target._cache.keep_mb = 1
    rng = random.Random(7)
    try:

        async def commit_all() -> None:
            for start in range(0, 480, 8):
                await asyncio.gather(*(target.commit_exchange(exchange_row(f"s{i % 8}", i // 8 + 1, prompt_len=4000, rng=rng)) for i in range(start, start + 8)))

        asyncio.run(commit_all())
        deadline = time.monotonic() + 60
        while target.query(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}")[1][0][0] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the last segment's checkpoint and cut
        segments = target.query(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}")[1][0][0]
        held = _base_table_mb(target)
        assert target.query("SELECT count(*) FROM exchanges")[1] == [(480,)]
        limit = target.query("SELECT current_setting('memory_limit')")[1][0][0]
    finally:
        target.close()
    assert segments >= 10
    assert limit in ("488.2 MiB", "512.0 MB", "512MB")  # restored after each cut
    if cut:
        assert held <= 3, held
    else:
        assert held > 6, held  # what the cut is for: the same rows, the cache growing by each segment


def test_a_cut_waits_for_no_read_and_a_read_never_runs_under_the_lowered_limit(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "r.duckdb"))
    con.execute("SET memory_limit = '300MB'")
    cache = SegmentCache(300, keep_mb=1)
    try:
        with cache.reading():
            assert cache.cut(con) is None  # skipped, not waited for: the next checkpoint's cut takes its place
        assert cache.cut(con) is not None
        assert con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0] in ("286.1 MiB", "300.0 MB")
        default = SegmentCache(0, keep_mb=1)  # DuckDB's own limit (--store-memory-mb 0), restored as it was
        con.execute("RESET memory_limit")
        own = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        assert default.cut(con) is not None
        assert con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0] == own
        con.execute("SET memory_limit = '300MB'")
        seen: list[str] = []

        def read() -> None:
            with cache.reading():
                seen.append("read")

        cache._cutting = True  # a cut under way: a read waits for it
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.2)
        assert seen == []
        with cache._gate:
            cache._cutting = False
            cache._gate.notify_all()
        reader.join(5)
        assert seen == ["read"]
    finally:
        con.close()


def _said_at_close(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(rows, slices) of the one segment the close wrote, from its log line."""
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().endswith(", at close")]
    rows, rest = said.split(": ")[2].split(" exchanges written in ")
    return int(rows), int(rest.split()[0])


def test_the_close_writes_the_last_segment_from_the_commit_log_in_slices(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records only in the commit log at close are sealed and written as a segment from there, a slice at a time,
    as the compactor does: not first moved into the journal in one statement and then copied (a peak of ~10x their
    bytes, bench/README.md). Every row reads back, and no log is left."""
    caplog.set_level(logging.INFO, logger="polar_mitm.store")
    rows = [exchange_row("s", seq, prompt_len=4000) for seq in range(1, 31)]
    db = tmp_path / "s.duckdb"
    target = Store(db)  # a segment's worth is 256 rows or 32 MB: these ~1 MB stay in the commit log
    target.slice_bytes = 200_000  # ~6 rows of ~30 KB a slice
    from_journals: list[int] = []

    def from_journal(con: duckdb.DuckDBPyConnection, number: int, *args: int | None) -> tuple[int, int]:
        written = write_segment(con, number, *args)
        if written[0]:
            from_journals.append(number)
        return written

    monkeypatch.setattr(compactor, "write_segment", from_journal)
    _commit(target, rows)
    target.close()
    assert _said_at_close(caplog)[0] == len(rows) and _said_at_close(caplog)[1] >= 4
    assert from_journals == []  # written from the sealed log's records
    assert not list(tmp_path.glob("s.duckdb.commits*"))
    assert [tuple(r) for r in store.query(db, f"SELECT count(*), sum(rows) FROM {store.SEGMENTS_TABLE}")[1]] == [(1, len(rows))]
    read = dict(store.query(db, "SELECT exchange_id, prompt_token_ids FROM exchanges")[1])
    assert read == {row["exchange_id"]: list(row["prompt_token_ids"]) for row in rows}


def test_a_journal_with_rows_in_the_file_is_compacted_at_close_in_slices_of_all_its_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A read moves the commit log's records into the journal; the close then writes the segment from the journal,
    sliced by the bytes of its records, texts included (counted before by their head and body only, ~5 KB of a
    harness's ~200 KB row: one slice for any journal)."""
    caplog.set_level(logging.INFO, logger="polar_mitm.store")
    rows = [exchange_row("s", seq, prompt_len=4000) for seq in range(1, 31)]
    db = tmp_path / "s.duckdb"
    target = Store(db)
    target.slice_bytes = 200_000
    _commit(target, rows[:20])
    assert target.query("SELECT count(*) FROM exchanges")[1] == [(20,)]  # a read: the records into the journal
    _commit(target, rows[20:])
    target.close()
    assert _said_at_close(caplog)[0] == len(rows) and _said_at_close(caplog)[1] >= 4
    assert sorted(r[0] for r in store.query(db, "SELECT exchange_id FROM exchanges")[1]) == sorted(row["exchange_id"] for row in rows)


def test_records_moved_in_slices_go_in_all_or_none(tmp_path: Path) -> None:
    """insert_journal_records with `slice_bytes`: one statement per slice, in one transaction of its own, so a move
    that fails half-way leaves no row behind (its records stay in their log and are moved again: never twice)."""
    insert_journal_records, journal_record = store_records.insert_journal_records, store_records.journal_record
    target = Store(tmp_path / "s.duckdb")
    try:
        con = target.con.cursor()
        records = [journal_record(exchange_row("s", seq, prompt_len=4000)) for seq in range(1, 13)]
        table = store.journal_table(target._journals[-1])

        def failing_after_eight():
            yield from records[:8]
            raise OSError("the disk is full")

        with pytest.raises(OSError, match="disk is full"):
            insert_journal_records(con, failing_after_eight(), table, 60_000)  # ~2 records a slice: 4 went in
        assert con.execute(f"SELECT count(*) FROM {table}").fetchall() == [(0,)]
        written = insert_journal_records(con, records, table, 60_000)
        assert con.execute(f"SELECT count(*) FROM {table}").fetchall() == [(12,)]
        assert written == sum(map(store_records.record_bytes, records))
    finally:
        target.close()


def _crashed_writer(tmp_path: Path, script: str) -> list[str]:
    """Run a writer `script` (it dies by os._exit after its commits) in a process of its own; the exchange ids it
    printed as each commit returned."""
    path = tmp_path / "writer.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


BEHIND_WRITER = """
import asyncio, os, sys
from polar_mitm.store import Store, compactor
from tests.support.rows import exchange_row
compactor.Compaction._compact_one = lambda self, *job: None  # the compactor falls behind: every sealed log waits

async def main():
    target = Store({db!r}, segment_rows=6)
    for seq in range(1, 21):
        row = exchange_row("s", seq, prompt_len=3000)
        await target.commit_exchange(row)
        print(row["exchange_id"], flush=True)
    os._exit(0)  # a crash: nothing closed

asyncio.run(main())
"""


def test_sealed_logs_a_crash_left_become_their_own_segments_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store that died with its compactor behind (sealed logs waiting) opens by writing each sealed journal's
    segment from its log, in slices, a checkpoint after each, as the compactor would have: not all their records
    into the current journal at once (3 logs of 32 MB: RSS rose 230 MB at open against 743, bench/open_close.py). No
    committed row is lost or doubled."""
    caplog.set_level(logging.INFO, logger="polar_mitm.store")
    db = tmp_path / "crash.duckdb"
    committed = _crashed_writer(tmp_path, BEHIND_WRITER.format(db=str(db)))
    assert len(committed) == 20
    sealed = sorted(path.name for path in tmp_path.glob("crash.duckdb.commits.*"))
    assert len(sealed) == 3  # 18 rows in three sealed logs, 2 in the log being appended to
    reopened = Store(db)
    try:
        at_open = [r.getMessage() for r in caplog.records if r.getMessage().endswith(", at open")]
        ids = [r[0] for r in reopened.query("SELECT exchange_id FROM exchanges")[1]]
    finally:
        reopened.close()
    assert [said.split(": ")[2].split(" exchanges")[0] for said in at_open] == ["6", "6", "6"], at_open
    assert sorted(ids) == sorted(committed)
    assert not list(tmp_path.glob("crash.duckdb.commits*"))


MANY_SEGMENTS_WRITER = """
import asyncio, os
from polar_mitm.store import Store
from tests.support.rows import exchange_row

async def main():
    target = Store({db!r}, segment_rows=10, memory_mb=64)
    for seq in range(1, {count} + 1):
        row = exchange_row("s", seq, prompt_len=20)
        await target.commit_exchange(row)
        print(row["exchange_id"], flush=True)
    while target._compacting:  # every full journal a segment, the last rows in the commit log only
        await asyncio.sleep(0.01)
    os._exit(0)  # a crash: nothing closed

asyncio.run(main())
"""


def test_a_store_of_many_segments_opens_after_a_crash_with_rows_in_its_log(tmp_path: Path) -> None:
    """The open that puts a crash's logged rows back asks which of them the file holds already. Asked with
    list_contains over the view, DuckDB held memory growing with its segment tables and the ids: a gateway of the
    full soak (164 segments, 20+ ids in its log) could not restart (Out of Memory at its 512 MB) and its rows were
    unreadable. Here 80 segments, 9 ids in the log and a 64 MB limit."""
    db = tmp_path / "many.duckdb"
    committed = _crashed_writer(tmp_path, MANY_SEGMENTS_WRITER.format(db=str(db), count=809))
    assert len(committed) == 809
    assert store.commit_log_path(db).stat().st_size > 0
    reopened = Store(db, memory_mb=64)
    try:
        ids = [r[0] for r in reopened.query("SELECT exchange_id FROM exchanges")[1]]
        segments = reopened.query(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}")[1][0][0]
    finally:
        reopened.close()
    assert segments >= 80
    assert sorted(ids) == sorted(committed)


def test_a_checkpoint_that_fails_at_close_leaves_the_segment_and_the_close_going_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint after a segment written at an open or close only frees DuckDB's memory: the rows are
    committed. One that fails (here the cache cut after it, as a full disk would fail it) is said, not raised."""
    caplog.set_level(logging.INFO, logger="polar_mitm.store")
    db = tmp_path / "s.duckdb"
    target = Store(db)
    rows = [exchange_row("s", seq, prompt_len=200) for seq in range(1, 11)]
    _commit(target, rows)

    def full_disk(con: duckdb.DuckDBPyConnection) -> int | None:
        raise duckdb.IOException("No space left on device")

    target._cache.cut = full_disk  # type: ignore[method-assign]
    target.close()
    assert any("no checkpoint after segment" in r.getMessage() and "at close" in r.getMessage() for r in caplog.records)
    assert _said_at_close(caplog)[0] == len(rows)
    assert sorted(r[0] for r in store.query(db, "SELECT exchange_id FROM exchanges")[1]) == sorted(row["exchange_id"] for row in rows)
