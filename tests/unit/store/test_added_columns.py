"""Stores written before a column was added, or before segments moved into the store file (schema 2: Parquet files
beside it), still open: the column reads as NULL, by a writer, a read-only reader, a bare DuckDB client and a head's
union of node snapshots. A real DuckDB store."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from polar_mitm import store
from polar_mitm.errors import ConfigError
from polar_mitm.store import Store
from tests.support.store_v2 import downgrade_to_schema_2

SELECT = "SELECT exchange_id, bridge_key, prompt_token_ids FROM exchanges ORDER BY seq"
OLD = [[f"e{seq}", None, [1, 2, seq]] for seq in range(3)]
# a later process (this one has seen the files): a writer opens the store (migrating it, adding columns), then a
# read-only reader and a head's union of the node's snapshot read it
READERS = """
import json
from pathlib import Path
from polar_mitm.store import Store
from polar_mitm.store.reading import ClosedStore
from polar_mitm.store.union import UnionStore
db = Path({db!r})
reopened = Store(db)
try:
    answers = [reopened.query({select!r})[1]]
    snapshot = reopened.snapshot("n0", db.parent / "snapshots")
finally:
    reopened.close()
with ClosedStore(db) as closed:
    answers.append(closed.query({select!r})[1])
with UnionStore([snapshot]) as union:
    answers.append(union.query({select!r})[1])
print(json.dumps([[list(row) for row in rows] for rows in answers]))
"""


def closed_store(db: Path) -> None:
    writer = Store(db)

    async def commit() -> None:
        for seq in range(3):
            await writer.commit_exchange({"exchange_id": f"e{seq}", "session_id": "s", "seq": seq, "status": "ok", "bridge_key": f"k{seq}", "prompt_token_ids": [1, 2, seq]})

    asyncio.run(commit())
    assert writer.query(SELECT)[1] == [(f"e{seq}", f"k{seq}", [1, 2, seq]) for seq in range(3)]
    writer.close()  # every journal becomes a segment


def read_by_every_reader(db: Path) -> list:
    done = subprocess.run([sys.executable, "-c", READERS.format(db=str(db), select=SELECT)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_segment_rows_without_a_later_column_read_it_as_null(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    closed_store(db)
    con = duckdb.connect(str(db))  # as a version before `bridge_key` made the table
    for (table,) in con.execute(f"SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '{store.SEGMENT_PREFIX}')").fetchall():
        con.execute(f"ALTER TABLE {table} DROP COLUMN bridge_key")
    con.close()
    assert read_by_every_reader(db) == [OLD, OLD, OLD]
    # a later segment has the column
    writer = Store(db)
    asyncio.run(writer.commit_exchange({"exchange_id": "e3", "session_id": "s", "seq": 3, "status": "ok", "bridge_key": "k3", "prompt_token_ids": [1, 2, 3]}))
    writer.close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert [list(row) for row in con.execute(SELECT).fetchall()] == [*OLD, ["e3", "k3", [1, 2, 3]]]
    finally:
        con.close()


def test_a_schema_2_store_is_migrated_into_its_file_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "v2.duckdb"
    closed_store(db)
    files = downgrade_to_schema_2(db, drop_columns=("bridge_key",))
    assert files and not duckdb.connect(str(db), read_only=True).execute(f"SELECT * FROM duckdb_tables() WHERE starts_with(table_name, '{store.SEGMENT_PREFIX}')").fetchall()
    # before any writer opened it, read-only readers in the store's folder read it as schema 2 did
    assert store.query(db, SELECT)[1] == OLD
    assert read_by_every_reader(db) == [OLD, OLD, OLD]
    # migrated: a bare client anywhere reads it without the Parquet files (they stay, as the segments' exports)
    monkeypatch.chdir("/")
    for file in files:
        file.rename(file.with_suffix(".moved"))
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert [list(row) for row in con.execute(SELECT).fetchall()] == OLD
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [(str(store.SCHEMA_VERSION),)]
    finally:
        con.close()


def test_a_schema_2_store_missing_a_segment_file_says_which_at_open(tmp_path: Path) -> None:
    db = tmp_path / "v2.duckdb"
    closed_store(db)
    [file] = downgrade_to_schema_2(db)
    file.unlink()
    with pytest.raises(ConfigError, match=f"segment 000001 .* its file {file} is missing"):
        Store(db)
