"""The spare journal (polar_mitm/store/compactor.py, Compaction._rotate): the writer re-points the `exchanges` view
once a segment, at its install, and not also when it starts a new journal (each re-pointing binds every table the
view names, so its cost grows with the store's history); an empty journal made at the install waits in the view.
Every row stays in the view exactly once; a closed store holds one empty journal, as before. (A store killed with
its spare: tests/unit/test_store.py's SIGKILL tests, whose journals rotate every 6 rows.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from polar_mitm import store
from polar_mitm.store import Store, compactor
from tests.support.rows import commit_in_order, exchange_row


def _journal_tables(target: Store) -> list[str]:
    found = target.con.cursor().execute("SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, 'exchange_journal_') ORDER BY 1")
    return [name for (name,) in found.fetchall()]


def _listed(target: Store) -> int:
    return int(target.con.cursor().execute(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}").fetchall()[0][0])


def _wait_for_segments(target: Store, segments: int) -> None:
    deadline = time.monotonic() + 30
    while _listed(target) < segments or not target._compactions.empty() or target._compacting:
        assert time.monotonic() < deadline, f"{segments} segments within 30 s"
        time.sleep(0.02)


def test_a_new_journal_re_points_nothing_and_each_segment_re_points_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    views: list[list[int]] = []  # the journals each re-pointing named
    real_write_view = compactor.write_view

    def write_view(con, segments, journals, merged=None):  # noqa: ANN001, ANN202 - the real one, counted
        views.append(list(journals))
        real_write_view(con, segments, journals, merged)

    monkeypatch.setattr(compactor, "write_view", write_view)
    target = Store(tmp_path / "s.duckdb", segment_rows=4, merge_fanin=0)
    try:
        assert len(views) == 1 and len(views[0]) == 2  # the open: its first journal and the spare, at once
        assert _journal_tables(target) == [store.journal_table(n) for n in views[0]]
        rows = [exchange_row(f"s{seq % 2}", seq, prompt_len=20) for seq in range(1, 25)]
        for first in range(0, len(rows), 4):  # a journal at a time, each compacted before the next fills
            commit_in_order(target, rows[first : first + 4])
            _wait_for_segments(target, first // 4 + 1)
        # six journals filled: six installs, each making the next spare; the six rotations took spares
        assert len(views) == 1 + 6, views
        assert all(len(named) == 2 for named in views[1:])  # the open journal and the spare beside it
        assert len(_journal_tables(target)) == 2
        stored = target.query("SELECT exchange_id FROM exchanges ORDER BY seq")[1]
        assert [r[0] for r in stored] == [row["exchange_id"] for row in rows]  # each once
    finally:
        target.close()
    # the close took the spare as its (empty) open journal, without re-pointing, and re-pointed once as the last
    # open journal, empty, was dropped
    assert len(views) == 1 + 6 + 1 and views[-1] == [8]
    reopened = Store(tmp_path / "s.duckdb")
    try:
        assert reopened.query("SELECT count(*) FROM exchanges")[1][0][0] == 24
        assert _listed(reopened) == 6  # no segment of no rows was listed for an empty journal
    finally:
        reopened.close()


def test_a_journal_filling_before_the_last_is_compacted_makes_its_own_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compactor behind: a rotation finding no spare makes the journal and the next spare itself, in one
    re-pointing; no row is lost or doubled once the compactor catches up."""
    views: list[list[int]] = []
    real_write_view, real_write_segment = compactor.write_view, compactor.Compaction._write_segment
    held = threading.Event()

    def write_view(con, segments, journals, merged=None):  # noqa: ANN001, ANN202 - the real one, counted
        views.append(list(journals))
        real_write_view(con, segments, journals, merged)

    def write_segment(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - the real one, once let go
        assert held.wait(timeout=30)
        return real_write_segment(self, *args, **kwargs)

    monkeypatch.setattr(compactor, "write_view", write_view)
    monkeypatch.setattr(compactor.Compaction, "_write_segment", write_segment)
    target = Store(tmp_path / "s.duckdb", segment_rows=2, merge_fanin=0)
    try:
        first_journal, spare = views[0]
        rows = [exchange_row("s", seq, prompt_len=20) for seq in range(1, 6)]
        commit_in_order(target, rows[:4])  # two journals filled while the first waits to be compacted
        deadline = time.monotonic() + 10
        while len(target._journals) < 3 and time.monotonic() < deadline:  # the writer seals after the reply
            time.sleep(0.01)
        # the first rotation took the spare (no re-pointing), the second found none and made its own with the next
        assert views[1:] == [[first_journal, spare, spare + 1, spare + 2]], views
        held.set()
        commit_in_order(target, rows[4:])
        _wait_for_segments(target, 2)
        assert len(_journal_tables(target)) == 2  # the open journal and its spare
        assert [r[0] for r in target.query("SELECT exchange_id FROM exchanges ORDER BY seq")[1]] == [row["exchange_id"] for row in rows]
    finally:
        held.set()
        target.close()
