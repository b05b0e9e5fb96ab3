"""A store is its `.duckdb` file: made with a relative `--db` in one working directory, read from any other by every
reader the README names (a bare DuckDB client included, with nothing set), and movable or copyable as a file.

The stores come from tests/support/user_stores.py (a real gateway / the README's main job, run with `--db NAME.duckdb`
in a directory of their own); the readers run with another working directory and name the store relative to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm import store
from polar_mitm.store import Store
from tests.support.rows import exchange_row
from tests.support.user_stores import UserStore, polar_mitm, user_env

# an outside tool: the plain `duckdb` package (no polar_mitm, nothing set), and pandas through it; argv: db
OUTSIDE = """
import sys, duckdb
con = duckdb.connect(sys.argv[1], read_only=True)
print(con.sql("SELECT count(*) FROM exchanges").fetchall()[0][0])
print(len(con.sql("SELECT exchange_id, prompt_token_ids FROM exchanges").df()))
"""


def outside_tool(db: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OUTSIDE, db], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=120)


def sql_count(db: str, cwd: Path) -> int:
    done = polar_mitm("sql", "--db", db, "--json", "SELECT count(*) AS n FROM exchanges", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[0])["n"]


def check_every_reader(target: UserStore, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reader, run in `cwd` with the store named relative to it, sees every exchange of the store."""
    expected = sum(target.sessions.values())
    relative = os.path.relpath(target.db, cwd)
    assert not (cwd / store.segments_dir(target.db.name)).exists()  # nothing here to find by accident
    # the sessions table is a table: its counters do not depend on where the segments are found
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        counted = store.query(relative, "SELECT sum(n_exchanges) FROM sessions")[1][0][0]
        listed = store.query_dicts(relative, "SELECT session_id, count(*) AS n FROM exchanges GROUP BY ALL")
    assert counted == expected and {r["session_id"]: r["n"] for r in listed} == target.sessions
    assert sql_count(relative, cwd) == expected  # the `polar-mitm sql` console script
    # the `duckdb` package as an outside tool would use it (nothing set), then pandas; here and in the store's folder
    for db, where in ((relative, cwd), (target.db.name, target.db.parent)):
        outside = outside_tool(db, where)
        assert outside.returncode == 0 and outside.stdout.split() == [str(expected), str(expected)], outside.stderr


@pytest.mark.engine
def test_a_gateway_store_made_with_a_relative_db_is_read_from_another_directory(run_store: UserStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `polar-mitm sql` from another directory while the gateway held the store (its loopback SQL endpoint)
    assert [line.split()[:3] for line in run_store.live_sql.splitlines()[2:4]] == [["plain-three-turns", "|", "3"], ["plain-two-turns", "|", "2"]]
    check_every_reader(run_store, tmp_path, monkeypatch)


@pytest.mark.engine
@pytest.mark.harness
def test_the_readme_store_is_read_and_assembled_from_another_directory(readme_store: UserStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_every_reader(readme_store, tmp_path, monkeypatch)
    relative = os.path.relpath(readme_store.db, tmp_path)
    # the assembler, through its CLI: reads the segments, writes the trajectories table again (same rows)
    done = polar_mitm("assemble", "--db", relative, "--builder", "prefix_merging", "--out", "train.parquet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = pq.read_table(tmp_path / "train.parquet")
    assert set(written.column("session_id").to_pylist()) == set(readme_store.sessions)
    stored = store.query(readme_store.db, "SELECT count(*) FROM trajectories WHERE builder = 'prefix_merging'")[1][0][0]
    assert stored == written.num_rows
    # on defaults (--render auto: tokens mode, the engine's model is on this machine) each multi-turn session is
    # one sequence; chat mode split each into two (the engine re-rendered the forced first reply differently)
    assert min(readme_store.sessions.values()) >= 2 and written.num_rows == len(readme_store.sessions), readme_store.sessions
    assert store.query_dicts(readme_store.db, "SELECT DISTINCT render_mode, count(*) FILTER (WHERE NOT bridged) AS first_turns FROM exchanges GROUP BY ALL") == [
        {"render_mode": "tokens", "first_turns": len(readme_store.sessions)}
    ]


@pytest.mark.engine
def test_a_copied_store_opens_and_stays_its_own(run_store: UserStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "copied" / "run.duckdb"
    copy.parent.mkdir()
    shutil.copy2(run_store.db, copy)  # the file alone: nothing of a store lives beside it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check_every_reader(UserStore(db=copy, sessions=run_store.sessions), elsewhere, monkeypatch)
    # the assembler on the copy, from a third directory
    done = polar_mitm("assemble", "--db", os.path.relpath(copy, elsewhere), "--builder", "per_request", "--out", "train.parquet", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert pq.read_table(elsewhere / "train.parquet").num_rows == sum(run_store.sessions.values())
    # written to, the copy moves on alone: the original keeps its rows
    writer = Store(copy)
    try:
        asyncio.run(writer.commit_exchange(exchange_row("copy-only", 1, prompt_len=20)))
    finally:
        writer.close()
    expected = sum(run_store.sessions.values())
    assert sql_count(str(copy), elsewhere) == expected + 1
    assert sql_count(run_store.db.name, run_store.db.parent) == expected
    # read from the original's folder, the copy is still the copy
    assert sql_count(os.path.relpath(copy, run_store.db.parent), run_store.db.parent) == expected + 1


@pytest.mark.engine
def test_a_store_in_a_read_only_folder_is_read_without_writing_to_it(run_store: UserStore, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    shutil.copy2(run_store.db, folder / "run.duckdb")
    before = {path: path.stat().st_mtime_ns for path in folder.rglob("*")}
    for path in [*before, folder]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        assert sql_count(str(folder / "run.duckdb"), tmp_path) == sum(run_store.sessions.values())
        assert store.query(folder / "run.duckdb", "SELECT count(*) FROM sessions")[1] == [[len(run_store.sessions)]]
    finally:
        for path in [folder, *before]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    # (as root the modes stop nothing: what is checked is that reading wrote nothing, not even a WAL)
    assert {path: path.stat().st_mtime_ns for path in folder.rglob("*")} == before
