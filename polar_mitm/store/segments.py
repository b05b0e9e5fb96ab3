"""Segments: the immutable Parquet files that hold committed exchanges, and the `exchanges` view over them.

Layout. `exchanges` is a view over two kinds of storage, with the contract's column types either way:

- journal tables (`exchange_journal_NNNNNN`, see records): where each exchange is committed before its reply,
  as six columns: the four live SQL filters on most, then the other fields in two JSON records. No list columns
  there: DuckDB writes a list column's whole uncheckpointed data into the WAL again on every commit (measured
  on 1.3 to 2.0: the Nth single-row commit of a 14k-id array logs N x 56 KB), which made each commit slower
  than the last until a checkpoint; a JSON record is logged once.
- segments (`<db>.segments/NNNNNN-<random>.parquet`, listed in `exchange_segments`): immutable Parquet files
  with INTEGER[] / DOUBLE[] columns. When a journal reaches `segment_rows` rows (or its records a size in MB) the
  writer starts a new one, and a compactor thread copies the full journal into a segment (fsynced, then renamed),
  after which the writer drops the journal and re-points the view in one transaction. A crash at any point leaves
  either the journal or the segment registered, never both and never neither; leftover journals are compacted when
  the store reopens.

Where the view finds its segments. The view names each segment relative to the folder that holds the database
file (`hello.duckdb.segments/000001-….parquet`), so the store (the file and its segments folder) can be moved or
copied as a whole and still opens. DuckDB resolves a relative path against the reading process's working
directory first and then each folder of its `file_search_path` setting (a view cannot name its own database's
folder: table-function arguments must be constants), so every connection the project opens sets that setting to
the store's folder (`connect`); another tool opening the file sets it too, or runs in the store's folder. The
random part of each segment's name keeps a reader whose working directory holds another store's segments
folder of the same name from reading that one's files: a name is only ever one file's.

This module holds the steps (write a segment, register it, re-point the view, migrate schema 1); the writer
(polar_mitm.store.writer) decides when they run and on which thread.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.errors import ConfigError
from polar_mitm.store.records import JOURNAL_SELECT, journal_source, journal_table
from polar_mitm.store.schema import (
    EXCHANGE_COLUMNS,
    EXCHANGES_DOC,
    MARK_COLUMNS,
    MARKS_TABLE,
    SESSION_COLUMNS,
    base_type,
    now,
    quote,
)

log = logging.getLogger("polar_mitm.store")

SEGMENTS_TABLE = "exchange_segments"


def segments_dir(db_path: str | os.PathLike[str]) -> Path:
    return Path(str(db_path) + ".segments")


def store_folder(db_path: str | os.PathLike[str]) -> Path:
    """The absolute folder that holds the database file: what the view's segment paths are relative to."""
    return Path(os.path.abspath(db_path)).parent


def fetch(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(columns, rows) of one statement, on a cursor of its own (a connection is shared between threads)."""
    cursor = con.cursor()
    try:
        result = cursor.execute(sql, params or [])
        columns = [d[0] for d in result.description] if result.description else []
        return columns, result.fetchall()
    finally:
        cursor.close()


def fetch_arrow(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> pa.Table:
    """One statement's result as an Arrow table, on a cursor of its own."""
    cursor = con.cursor()
    try:
        return cursor.sql(sql, params=params or []).to_arrow_table()
    finally:
        cursor.close()


def connect(db_path: str | os.PathLike[str], read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a store's DuckDB file so that its `exchanges` view finds the segments, whatever the working directory.

    Sets DuckDB's `file_search_path` to the store's folder for the whole database instance (SET GLOBAL, not a
    connect-time config: DuckDB refuses a second connection to a file with a config that differs from the first).
    """
    folder = store_folder(db_path)
    if "," in str(folder):
        # file_search_path is a comma-separated list, with no quoting
        raise ConfigError(f"--db {db_path}: a store's folder cannot contain a comma (DuckDB's file_search_path splits on commas): {folder}")
    con = duckdb.connect(str(db_path), read_only=read_only)
    con.execute("SET GLOBAL file_search_path = ?", [str(folder)])
    return con


def contract_select(present: Collection[str] | None = None) -> str:
    """Every exchange column with its contract type; those not in `present` (when given) as typed NULLs."""
    return ", ".join(
        f"CAST({name if present is None or name in present else 'NULL'} AS {base_type(kind)}) AS {name}" for name, kind in EXCHANGE_COLUMNS.items()
    )


SEGMENT_SELECT = contract_select()


# the columns of each segment file seen (a segment is immutable and its name unique): the view is re-pointed on the
# writer's thread at every compaction, which must not read every footer again
_SEGMENT_COLUMNS: dict[str, frozenset[str]] = {}
_ALL_COLUMNS = frozenset(EXCHANGE_COLUMNS)


def segments_select(con: duckdb.DuckDBPyConnection, paths: list[str]) -> str:
    """The select list over these segment files: a column none of them has (all written before it was added) reads
    as a typed NULL; read_parquet's union_by_name fills it where only some lack it."""
    present: set[str] = set()
    for path in paths:
        columns = _SEGMENT_COLUMNS.get(path)
        if columns is None:
            found = frozenset(row[0] for row in con.execute(f"DESCRIBE SELECT * FROM read_parquet({quote(path)})").fetchall())
            columns = _SEGMENT_COLUMNS[path] = _ALL_COLUMNS if found >= _ALL_COLUMNS else found
        present |= columns
    return SEGMENT_SELECT if present >= _ALL_COLUMNS else contract_select(present)


def segment_file(number: int) -> str:
    """A new segment's file name: its number, then a random part that no other segment file has (see the top)."""
    return f"{number:06d}-{secrets.token_hex(8)}.parquet"


# segment files a writer made (v2's NNNNNN.parquet too), and their temporary names
_SEGMENT_NAME = re.compile(r"\d{6}(-[0-9a-f]{16})?\.parquet(\.tmp)?")


def view_path(db_path: str | os.PathLike[str], file: str) -> str:
    """How the view names a segment file: relative to the store's folder (`<db name>.segments/<file>`)."""
    return f"{segments_dir(Path(db_path).name)}/{file}"


def register_segment(con: duckdb.DuckDBPyConnection, number: int, file: str, rows: int) -> None:
    con.execute(f"INSERT INTO {SEGMENTS_TABLE} VALUES (?, ?, ?, ?)", [number, file, rows, now()])


def listed_segments(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The segment files of the store, in segment order."""
    return [file for (file,) in con.execute(f"SELECT file FROM {SEGMENTS_TABLE} ORDER BY segment").fetchall()]


def remove_unlisted_segments(con: duckdb.DuckDBPyConnection, directory: Path) -> list[str]:
    """Delete segment files no segment lists (a compaction a crash cut short); only the writer may call this."""
    listed = set(listed_segments(con))
    removed = []
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if _SEGMENT_NAME.fullmatch(path.name) and path.name not in listed:
                path.unlink()
                removed.append(path.name)
    return removed


def exchanges_view_sql(con: duckdb.DuckDBPyConnection, segment_paths: list[str], journals: list[int]) -> str:
    """The view over these segments (as view_path names them) and journals."""
    parts = []
    if segment_paths:
        files = ", ".join(quote(path) for path in segment_paths)
        parts.append(f"SELECT {segments_select(con, segment_paths)} FROM read_parquet([{files}], union_by_name = true)")
    parts += [f"SELECT {JOURNAL_SELECT} FROM {journal_source(number)}" for number in journals]
    return "CREATE OR REPLACE VIEW exchanges AS " + with_marks(" UNION ALL ".join(parts), MARKS_TABLE)


def with_marks(rows: str, marks: str) -> str:
    """The exchanges `rows` selects, each with its mark's status and error where `marks` (a table or a query with
    MARK_COLUMNS) has one: a reply committed ok that never reached its client reads `client_disconnected`. A left
    join on a table of the few undelivered replies: filters on the other columns still reach the segments."""
    return (
        "SELECT e.* REPLACE (coalesce(m.status, e.status) AS status, CASE WHEN m.exchange_id IS NULL THEN e.error ELSE m.error END AS error) "
        f"FROM ({rows}) e LEFT JOIN {marks} m ON m.exchange_id = e.exchange_id"
    )


def create_table(con: duckdb.DuckDBPyConnection, table: str, columns: dict[str, str]) -> None:
    con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{n} {t}' for n, t in columns.items())})")
    # later versions add columns; never rename
    existing = {r[0] for r in con.execute(f"SELECT column_name FROM information_schema.columns WHERE table_name = '{table}'").fetchall()}
    for name, kind in columns.items():
        if name not in existing:
            con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind.replace(' PRIMARY KEY', '').replace(' NOT NULL', '')}")


def tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()}


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """The tables beside the exchanges (sessions, marks, meta, the segment list); Store makes journals and the view."""
    create_table(con, "sessions", SESSION_COLUMNS)
    create_table(con, MARKS_TABLE, MARK_COLUMNS)
    con.execute(f"CREATE TABLE IF NOT EXISTS {SEGMENTS_TABLE} (segment INTEGER PRIMARY KEY, file VARCHAR NOT NULL, rows BIGINT, created_at TIMESTAMPTZ)")
    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)")


def write_view(con: duckdb.DuckDBPyConnection, db_path: str | os.PathLike[str], segment_files: list[str], journals: list[int]) -> None:
    con.execute(exchanges_view_sql(con, [view_path(db_path, file) for file in segment_files], journals))
    con.execute(f"COMMENT ON VIEW exchanges IS {quote(EXCHANGES_DOC)}")


def write_segment(
    con: duckdb.DuckDBPyConnection, number: int, directory: Path, journal_bytes: int | None = None, slice_bytes: int = 0,
) -> tuple[str | None, int]:
    """Copy journal `number` (no longer written to) into a new Parquet segment; returns its file (None when the
    journal was empty) and the rows copied. `journal_bytes`: its records' size, when the writer counted it.

    `slice_bytes` (0: all at once): how many bytes of records are parsed at once. DuckDB parses a whole vector (up to
    2048 rows, so a whole journal) in one go and held ~5x its bytes meanwhile (measured: +300 MB for 256 rows of
    14k-token exchanges, +50 MB in 8 MB slices, which cost the compactor ~1.1-1.3x the CPU)."""
    table = journal_table(number)
    rows, size = con.execute(f"SELECT count(*), {'coalesce(sum(octet_length(head) + octet_length(body)), 0)' if journal_bytes is None else journal_bytes} FROM {table}").fetchall()[0]
    if not rows:
        return None, 0
    file = segment_file(number)
    per_slice = max(1, rows * slice_bytes // max(size, 1)) if slice_bytes else rows
    if per_slice >= rows:
        write_parquet(con, f"SELECT {JOURNAL_SELECT} FROM {journal_source(number)}", directory / file)
        return file, rows
    # slices of rows (a journal's rowids are 0..rows-1: it is only ever appended to), one row group each
    bounds = list(range(0, rows, per_slice))
    where = [f"rowid >= {start}" + (f" AND rowid < {start + per_slice}" if start + per_slice < rows else "") for start in bounds]
    select = " UNION ALL ".join(f"SELECT {JOURNAL_SELECT} FROM {journal_source(number, condition)}" for condition in where)
    write_parquet(con, select, directory / file, row_group_rows=per_slice)
    return file, rows


def migrate_v1(con: duckdb.DuckDBPyConnection, directory: Path) -> str | None:
    """Schema 1 kept `exchanges` as a table: it becomes the next segment (its file returned; None if it was empty)."""
    is_table = con.execute("SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = 'exchanges'").fetchall()[0][0]
    if not is_table:
        return None
    number = next_segment(con)
    rows = con.execute("SELECT count(*) FROM exchanges").fetchall()[0][0]
    file = segment_file(number) if rows else None
    if file is not None:
        columns = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'exchanges'").fetchall()}
        write_parquet(con, f"SELECT {contract_select(columns)} FROM exchanges", directory / file)
    with transaction(con):
        if file is not None:
            register_segment(con, number, file, rows)
        con.execute("DROP TABLE exchanges")
    return file


def write_parquet(con: duckdb.DuckDBPyConnection, select: str, path: Path, row_group_rows: int | None = None) -> None:
    """Write a segment durably: to a temporary name, fsynced, then renamed (a segment file is whole or absent).
    A failure (a full disk) leaves neither: the temporary file is removed, so it holds no space."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    row_groups = f", ROW_GROUP_SIZE {row_group_rows}" if row_group_rows else ""
    try:
        # lz4: about half zstd's CPU here (token ids are random-looking integers), in files ~1.5x the size
        con.execute(f"COPY ({select}) TO {quote(str(temporary))} (FORMAT parquet, COMPRESSION lz4_raw{row_groups})")
        _fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_soon(con: duckdb.DuckDBPyConnection, attempts: int = 2000) -> bool:
    """CHECKPOINT in a gap between the writer's transactions (DuckDB refuses one while another write is open)."""
    for _ in range(attempts):
        try:
            con.execute("CHECKPOINT")
            return True
        except duckdb.TransactionException:
            time.sleep(0.001)
    log.info("polar-mitm: no gap for a checkpoint; DuckDB checkpoints by itself past 1 GB of WAL")
    return False


def add_segment(con: duckdb.DuckDBPyConnection, db_path: str | os.PathLike[str], rows: pa.Table) -> None:
    """Bulk-load exchange rows (an Arrow table, any subset of the columns) as a segment of a store no Store has open."""
    number = next_segment(con)
    file = segment_file(number)
    con.register("polar_bulk_rows", rows)
    try:
        write_parquet(con, f"SELECT {contract_select(rows.column_names)} FROM polar_bulk_rows", segments_dir(db_path) / file)
    finally:
        con.unregister("polar_bulk_rows")
    register_segment(con, number, file, rows.num_rows)


def next_segment(con: duckdb.DuckDBPyConnection) -> int:
    return con.execute(f"SELECT coalesce(max(segment), 0) + 1 FROM {SEGMENTS_TABLE}").fetchall()[0][0]


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """BEGIN ... COMMIT around the block; rolled back (and the error raised again) if the block or COMMIT fails."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except duckdb.TransactionException:
            pass  # nothing left open to roll back
        raise
