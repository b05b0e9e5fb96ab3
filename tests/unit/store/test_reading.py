"""The store's read interface: the live Store, a closed file, a store by its path and a union of snapshots are
all `StoreReader`s (a type checker says so) and answer the same SQL with the same rows and Arrow tables."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.store import ClosedStore, SnapshotSource, Store, StorePath, StoreReader, UnionStore, now

REPO = Path(__file__).resolve().parents[3]
EXCHANGES = "SELECT exchange_id, session_id, seq, prompt_token_ids, completion_logprobs FROM exchanges WHERE seq >= ? ORDER BY exchange_id"
SESSIONS = "SELECT session_id, n_exchanges FROM sessions ORDER BY session_id"


def _fill(store: Store, count: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        for i in range(count):
            ids = list(range(i, i + 50))
            row = {"exchange_id": f"x{i:03d}", "session_id": f"s{i // 4}", "seq": i % 4 + 1, "status": "ok", "api": "openai_chat", "action": "generate",
                   "prompt_token_ids": ids, "completion_token_ids": ids[:5], "completion_logprobs": [-0.25] * 5, "started_at": now(), "ended_at": now()}
            loop.run_until_complete(store.commit_exchange(row))
    finally:
        loop.close()


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _answers(reader: StoreReader) -> tuple[list[tuple], list, list[tuple]]:
    """What a reader says to the two queries: rows as tuples (a gateway's come as JSON lists) and Arrow as Python."""
    _, rows = reader.query(EXCHANGES, [2])
    table = reader.arrow(EXCHANGES, [2])
    assert table.column_names == ["exchange_id", "session_id", "seq", "prompt_token_ids", "completion_logprobs"]
    return [tuple(r) for r in rows], table.to_pylist(), [tuple(r) for r in reader.query(SESSIONS)[1]]


def test_every_reader_answers_like_the_live_store(tmp_path: Path) -> None:
    db = tmp_path / "node" / "store.duckdb"
    live = Store(db, segment_rows=8)
    try:
        _fill(live, 20)  # two segments of 8 rows, 4 rows in the journal
        _wait(lambda: live.query("SELECT count(*) FROM exchange_segments")[1][0][0] == 2, "the compactor wrote no segments")
        _wait(lambda: live.query("SELECT sum(n_exchanges) FROM sessions")[1][0][0] == 20, "the session counters were not flushed")
        expected = _answers(live)
        assert len(expected[0]) == 15 and expected[0][0][3] == list(range(1, 51)) and len(expected[2]) == 5
        snapshot = live.snapshot("n1")
        assert snapshot.exchanges[-1].startswith(str(db.resolve()) + ".snapshots/tail-")  # the journal's 4 rows
        with UnionStore([snapshot]) as union:
            assert _answers(union) == expected
            assert isinstance(union, StoreReader) and not isinstance(union, SnapshotSource)
        assert isinstance(live, SnapshotSource)
    finally:
        live.close()

    with ClosedStore(db) as closed:
        assert isinstance(closed, SnapshotSource)
        assert _answers(closed) == expected
        with UnionStore([closed.snapshot("n1")]) as union:
            assert _answers(union) == expected
    by_path = StorePath(db)
    assert isinstance(by_path, StoreReader) and not isinstance(by_path, SnapshotSource)
    assert _answers(by_path) == expected


HOLDER = """
import sys
from polar_mitm.store import Store
store = Store(sys.argv[1])
store.serve_sql()
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


def test_a_store_by_path_reads_through_the_gateway_that_holds_it(tmp_path: Path) -> None:
    """While another process writes the file, StorePath's rows and Arrow tables come from its SQL endpoint."""
    db = tmp_path / "store.duckdb"
    store = Store(db, segment_rows=8)
    try:
        _fill(store, 12)
    finally:
        store.close()
    expected = _answers(ClosedStore(db))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        with pytest.raises(Exception, match="lock"):
            ClosedStore(db)  # the file is held: only the endpoint can answer
        assert _answers(StorePath(db)) == expected
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


CHECK = """
from polar_mitm.assembler import Assembler
from polar_mitm.store import ClosedStore, SnapshotSource, Store, StorePath, StoreReader, UnionStore


def readers(live: Store, closed: ClosedStore, union: UnionStore, by_path: StorePath) -> None:
    every: list[StoreReader] = [live, closed, union, by_path]
    snapshots: list[SnapshotSource] = [live, closed]
    Assembler(store=union, session_ids=["s1"])
"""
BROKEN = """
from polar_mitm.store import SnapshotSource, UnionStore


def union(union: UnionStore) -> None:
    source: SnapshotSource = union
"""


def test_a_type_checker_accepts_each_reader_as_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")
    monkeypatch.setenv("MYPYPATH", str(REPO))

    def mypy(source: str) -> tuple[int, str]:
        (tmp_path / "check.py").write_text(source)
        # only check.py's own lines are reported (silent imports): the project's other typing debts do not count here
        out, err, status = api.run([str(tmp_path / "check.py"), "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"), "--python-executable", sys.executable])
        return status, out + err

    status, out = mypy(CHECK)
    assert status == 0, out
    status, out = mypy(BROKEN)
    assert status == 1 and 'expression has type "UnionStore", variable has type "SnapshotSource"' in out, out


def test_no_reader_draws_duckdbs_progress_bar(tmp_path: Path) -> None:
    """DuckDB draws a progress bar on stdout for any statement past 2 s: in `polar-mitm sql`'s output (a script's
    CSV), and in a gateway's log while it opens a long store. Every connection the store makes has it off, cursors
    too. In a process of its own, as a user's: DuckDB's own default is on there, off under pytest's capture."""
    db = tmp_path / "s.duckdb"
    Store(db).close()
    setting = "SELECT current_setting('enable_progress_bar')"
    code = (
        "import sys; from polar_mitm.store import Store; from polar_mitm.store.segments import connect\n"
        f"live = Store(sys.argv[1]); print(live.con.execute({setting!r}).fetchall(), live.con.cursor().execute({setting!r}).fetchall()); live.close()\n"
        f"print(connect(sys.argv[1], read_only=True).cursor().execute({setting!r}).fetchall())"
    )
    done = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[(False,)] [(False,)]", "[(False,)]"]
