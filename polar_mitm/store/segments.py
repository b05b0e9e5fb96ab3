"""Segments: the compacted exchanges, DuckDB tables inside the store's own file, and the `exchanges` view.

Layout. `exchanges` is a view over two kinds of storage, with the contract's column types either way:

- journal tables (`exchange_journal_NNNNNN`, see records): where each exchange is committed before its reply,
  as eleven columns: the four live SQL filters on most, the other fields in two JSON records, and the five texts
  (records.TEXT_FIELDS) as they are. No list columns there: DuckDB writes a list column's whole uncheckpointed
  data into the WAL again on every commit (measured on 1.3 to 2.0: the Nth single-row commit of a 14k-id array
  logs N x 56 KB), which made each commit slower than the last until a checkpoint; a JSON record is logged once.
- segments (`exchange_segment_NNNNNN`, listed in `exchange_segments`): immutable tables with the contract's
  INTEGER[] / DOUBLE[] columns (the engine reply's echo of the prompt ids, and a token-in engine request's, kept
  as `[]`: the view puts them back, schema.SPLICED_TEXTS). When a journal reaches `segment_rows` rows (or its
  records a size in MB) the writer starts a new one, and a compactor thread copies the full journal into a new
  segment table in one transaction of its own, after which the writer lists the segment, drops the journal and
  re-points the view in one transaction. The view names only listed segments, so a crash at any point leaves each
  row visible exactly once (in its journal, or in its listed segment); an unlisted segment table is dropped when
  the store reopens.

One table per segment, not one table for all: DuckDB rewrites a table's last, partly filled row group (up to
122,880 rows) at every checkpoint, so a checkpoint after each compaction into one shared table took longer the
bigger the store (86 -> 630 ms over the first 11 segments, measured); a new table's checkpoint writes only itself.

But every query of the view binds each table it names, column by column (~0.5 ms a segment table of 46 columns):
over 1,000 segments a query took 0.5-0.6 s and an open 3.6 s, and the writer re-pointed the view (once a segment, at
its install: a spare journal waits in the view) in 0.3 s; over 3,000, 2.3 s, 13 s and 1 s. So segments can be merged
as they age (`merge_segments`, decided by the compactor; off by default: writer.MERGE_FANIN): `fanin` tables of one
level (a segment's own table level 0) become one `exchange_merged_NNNNNN` table of the next, written once, with a
`segment` column that keeps each row's segment; the list says where each segment's rows are (`stored_in`), and a
segment's Parquet export is still its own rows. The view names a bounded number of tables; a row merged is copied
once a level.

Why tables, not Parquet files beside the database (schema 2): a view cannot name its own database's folder
(table-function arguments must be constants), so a view over Parquet segments named them relative to the working
directory or DuckDB's `file_search_path`, and any DuckDB client that opened the file without setting it first
failed with "No files found". Everything is inside the `.duckdb` file now: `duckdb.connect(STORE)` from any folder,
by any tool, reads every exchange, and a copied or moved file still does. A store written as schema 2 is migrated
when a writer opens it (each Parquet segment loaded into its table; the files stay as their exports).

Parquet is still what other machines read (snapshots, the Ray union): a segment's Parquet export
(`<db>.segments/NNNNNN-<random>.parquet`, the name listed with the segment) is written the first time a snapshot
needs it, and never again (segments are immutable and each name is only ever one file's).

Here: the steps (compact, list a segment, re-point the view, export, migrate); the writer decides when and where.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import pyarrow as pa

from polar_mitm.errors import ConfigError
from polar_mitm.store.records import (
    JOURNAL_SEGMENT_SELECT,
    JOURNAL_STORED_SELECT,
    RECORD_BYTES_SQL,
    JournalRecord,
    journal_source,
    journal_table,
    records_source,
    records_table,
    transaction,
)
from polar_mitm.store.schema import (
    EXCHANGE_COLUMNS,
    EXCHANGES_DOC,
    MARK_COLUMNS,
    MARKS_TABLE,
    SESSION_COLUMNS,
    SPLICED_TEXTS,
    base_type,
    now,
    quote,
    with_whole_texts,
)

log = logging.getLogger("polar_mitm.store")

SEGMENTS_TABLE = "exchange_segments"  # one row per segment: its number, its Parquet export's name, rows
SEGMENT_PREFIX = "exchange_segment_"  # a segment's table: exchange_segment_NNNNNN (SEGMENT_COLUMNS)
MERGED_PREFIX = "exchange_merged_"  # segments merged into one table: exchange_merged_NNNNNN (segment, SEGMENT_COLUMNS)


def segment_table(number: int) -> str:
    return f"{SEGMENT_PREFIX}{number:06d}"


def segments_dir(db_path: str | os.PathLike[str]) -> Path:
    return Path(str(db_path) + ".segments")


def store_folder(db_path: str | os.PathLike[str]) -> Path:
    """The absolute folder that holds the database file: what a schema-2 view's segment paths are relative to."""
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
    """Open a store's DuckDB file. A store of this schema needs nothing more (any client opens it bare); one of
    schema 2 that no writer has opened since (read-only here) names its Parquet segments relative to its folder, so
    DuckDB's `file_search_path` is set to that folder for the whole database instance (SET GLOBAL, not a
    connect-time config: DuckDB refuses a second connection to a file with a config that differs from the first)."""
    folder = store_folder(db_path)
    con = duckdb.connect(str(db_path), read_only=read_only)
    with suppress(duckdb.InvalidInputException):  # which Jupyter without ipywidgets raises for any change of it
        con.execute("SET enable_progress_bar = false")  # else a statement past 2 s draws one on stdout: in `polar-mitm sql`'s rows
    if "," not in str(folder):  # file_search_path is a comma-separated list, with no quoting
        con.execute("SET GLOBAL file_search_path = ?", [str(folder)])
    return con


def contract_select(present: Collection[str] | None = None) -> str:
    """Every exchange column with its contract type; those not in `present` (when given) as typed NULLs."""
    return ", ".join(
        f"CAST({name if present is None or name in present else 'NULL'} AS {base_type(kind)}) AS {name}" for name, kind in EXCHANGE_COLUMNS.items()
    )


SEGMENT_SELECT = contract_select()


def stored_select(present: Collection[str]) -> str:
    """A segment table's rows as one of today's stores them: the contract's columns, then the places of the spliced
    texts (schema.SPLICED_TEXTS; NULL in a segment made before them: its texts are whole)."""
    places = ", ".join(f"{at if at in present else 'NULL'}::INTEGER AS {at}" for at in SPLICED_TEXTS.values())
    return f"{contract_select(present)}, {places}"


ALL_COLUMNS = tuple(EXCHANGE_COLUMNS)  # the contract's columns, in order: a segment's Parquet export has them
# a segment table's columns, in order, as create_segment makes them (a segment made before 2026-12-05 lacks the last)
SEGMENT_COLUMNS = (*ALL_COLUMNS, *SPLICED_TEXTS.values())
_ALL_COLUMNS = frozenset(ALL_COLUMNS)
# the columns of each Parquet file seen (a segment's export is immutable and its name unique): a head's union views
# and a schema-2 migration read each footer once
_SEGMENT_COLUMNS: dict[str, frozenset[str]] = {}


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
_SEGMENT_NAME = re.compile(r"\d{6}(-[0-9a-f]{16})?\.parquet(\.[0-9-]+)?(\.tmp)?")


def register_segment(con: duckdb.DuckDBPyConnection, number: int, file: str, rows: int) -> None:
    con.execute(f"INSERT INTO {SEGMENTS_TABLE} (segment, file, rows, created_at, sessions) VALUES (?, ?, ?, ?, (SELECT list(DISTINCT session_id) FROM {segment_table(number)}))", [number, file, rows, now()])


def listed_segments(con: duckdb.DuckDBPyConnection) -> list[tuple[int, str]]:
    """The store's segments, (number, the name of its Parquet export), in segment order."""
    return [(number, file) for number, file in con.execute(f"SELECT segment, file FROM {SEGMENTS_TABLE} ORDER BY segment").fetchall()]


class MergedTable(NamedTuple):
    segments: tuple[int, ...]  # the segments it holds, in order
    columns: tuple[str, ...]  # its columns besides `segment` (SEGMENT_COLUMNS when made by this version)


def merged_segments(con: duckdb.DuckDBPyConnection) -> dict[str, MergedTable]:
    """Each merged table in use; none in a store made before merges (read only: no writer has added the column)."""
    if not _lists_merges(con):
        return {}
    found = con.execute(f"SELECT stored_in, list(segment ORDER BY segment) FROM {SEGMENTS_TABLE} WHERE stored_in IS NOT NULL GROUP BY 1").fetchall()
    columns = _table_columns(con, MERGED_PREFIX)
    return {table: MergedTable(tuple(members), tuple(c for c in columns.get(table, ()) if c != "segment")) for table, members in found}


def _table_columns(con: duckdb.DuckDBPyConnection, prefix: str) -> dict[str, list[str]]:
    """The columns, in order, of each table whose name starts with `prefix`."""
    found = "SELECT table_name, list(column_name ORDER BY column_index) FROM duckdb_columns() WHERE schema_name = 'main' AND starts_with(table_name, ?) GROUP BY 1"
    return dict(con.execute(found, [prefix]).fetchall())


def remove_unlisted_segments(con: duckdb.DuckDBPyConnection, directory: Path) -> list[str]:
    """Drop segment and merged tables and delete Parquet files no listed segment owns (a compaction or merge a crash
    cut short: the rows are still in their journal or in the tables merged); only the writer may call this. Returns
    what it removed."""
    listed = listed_segments(con)
    merged = merged_segments(con)
    in_merged = {number for table in merged.values() for number in table.segments}
    names = {segment_table(number) for number, _ in listed if number not in in_merged} | set(merged)
    pattern = f"({SEGMENT_PREFIX}|{MERGED_PREFIX})\\d+"
    removed = sorted(name for name in tables(con) if re.fullmatch(pattern, name) and name not in names)
    for name in removed:
        con.execute(f"DROP TABLE {name}")
    files = {file for _, file in listed}
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if _SEGMENT_NAME.fullmatch(path.name) and path.name not in files:
                path.unlink()
                removed.append(path.name)
    return removed


def segment_columns(con: duckdb.DuckDBPyConnection) -> dict[int, tuple[str, ...]]:
    """Each listed segment's table columns, in order, for those in a table of their own (not merged); () for a
    segment without a table (schema 2's, not migrated). A segment is immutable: the writer asks once, at open."""
    columns = _table_columns(con, SEGMENT_PREFIX)
    own = con.execute(f"SELECT segment FROM {SEGMENTS_TABLE} {'WHERE stored_in IS NULL' if _lists_merges(con) else ''} ORDER BY segment").fetchall()
    return {number: tuple(columns.get(segment_table(number), ())) for (number,) in own}


def _lists_merges(con: duckdb.DuckDBPyConnection) -> bool:
    found = "SELECT count(*) FROM duckdb_columns() WHERE schema_name = 'main' AND table_name = ? AND column_name = 'stored_in'"
    return bool(con.execute(found, [SEGMENTS_TABLE]).fetchall()[0][0])


def exchanges_view_sql(segments: dict[int, tuple[str, ...]], journals: list[int], merged: dict[str, MergedTable] | None = None) -> str:
    """The view over these segments' tables (number -> its columns), merged tables and journals; a column a table
    was made without reads as NULL. A table made with every column (in the contract's order and types, as
    create_segment and merge_segments make them) is read as `*` (a merged one without its `segment`): the view's
    text, parsed at every query, stays short."""
    parts = sorted(
        [(number, f"SELECT {'*' if columns == SEGMENT_COLUMNS else stored_select(set(columns))} FROM {segment_table(number)}") for number, columns in segments.items()]
        + [
            (min(held.segments), f"SELECT {'* EXCLUDE (segment)' if held.columns == SEGMENT_COLUMNS else stored_select(set(held.columns))} FROM {table}")
            for table, held in (merged or {}).items()
        ]
    )
    parts = [select for _, select in parts] + [f"SELECT {JOURNAL_STORED_SELECT} FROM {journal_source(number)}" for number in journals]
    return "CREATE OR REPLACE VIEW exchanges AS " + with_marks(with_whole_texts(" UNION ALL ".join(parts)), MARKS_TABLE)


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
    """The tables beside the exchanges (sessions, marks, meta, the segment list); Store makes journals, segments and
    the view."""
    create_table(con, "sessions", SESSION_COLUMNS)
    create_table(con, MARKS_TABLE, MARK_COLUMNS)
    # stored_in: the merged table holding its rows (NULL: its own); sessions: those in it (NULL: listed before)
    create_table(con, SEGMENTS_TABLE, {"segment": "INTEGER PRIMARY KEY", "file": "VARCHAR NOT NULL", "rows": "BIGINT", "created_at": "TIMESTAMPTZ", "stored_in": "VARCHAR", "sessions": "VARCHAR[]"})
    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)")


def write_view(con: duckdb.DuckDBPyConnection, segments: dict[int, tuple[str, ...]], journals: list[int], merged: dict[str, MergedTable] | None = None) -> None:
    con.execute(exchanges_view_sql(segments, journals, merged))
    con.execute(f"COMMENT ON VIEW exchanges IS {quote(EXCHANGES_DOC)}")


def create_segment(con: duckdb.DuckDBPyConnection, number: int, select: str) -> None:
    """Segment `number`'s table (replaced if a failed earlier try left one) with the contract's base types (no
    constraint may fail a compaction), filled by `select` (named contract columns); in the caller's transaction."""
    table = segment_table(number)
    con.execute(f"DROP TABLE IF EXISTS {table}")
    columns = {**{name: base_type(kind) for name, kind in EXCHANGE_COLUMNS.items()}, **dict.fromkeys(SPLICED_TEXTS.values(), "INTEGER")}
    con.execute(f"CREATE TABLE {table} ({', '.join(f'{name} {kind}' for name, kind in columns.items())})")
    con.execute(f"INSERT INTO {table} BY NAME {select}")


def write_segment(con: duckdb.DuckDBPyConnection, number: int, journal_bytes: int | None = None, slice_bytes: int = 0) -> tuple[int, int]:
    """Copy journal `number` (no longer written to) into segment table `number`, in one transaction on `con`;
    returns (rows copied, slices: INSERTs it took); no rows: the journal was empty (no table). The segment stays
    out of the view until the writer lists it. `journal_bytes`: its records' size, when the writer counted it.

    `slice_bytes` (0: all at once): how many bytes of records are parsed at once. DuckDB parses a whole vector (up to
    2048 rows, so a whole journal) in one go and held ~5x its bytes meanwhile (measured: +300 MB for 256 rows of
    14k-token exchanges, +50 MB in 8 MB slices, which cost the compactor ~1.1-1.3x the CPU)."""
    table = journal_table(number)
    rows, size = con.execute(f"SELECT count(*), {f'coalesce(sum({RECORD_BYTES_SQL}), 0)' if journal_bytes is None else journal_bytes} FROM {table}").fetchall()[0]
    if not rows:
        return 0, 0
    per_slice = max(1, rows * slice_bytes // max(size, 1)) if slice_bytes else rows
    # slices of rows (a journal's rowids are 0..rows-1: it is only ever appended to), one INSERT each
    where = [f"rowid >= {start} AND rowid < {start + per_slice}" if per_slice < rows else "" for start in range(0, rows, per_slice)]
    with transaction(con):
        create_segment(con, number, f"SELECT {JOURNAL_SEGMENT_SELECT} FROM {journal_source(number, where[0])}")
        for condition in where[1:]:
            con.execute(f"INSERT INTO {segment_table(number)} BY NAME SELECT {JOURNAL_SEGMENT_SELECT} FROM {journal_source(number, condition)}")
    return rows, len(where)


def merge_segments(con: duckdb.DuckDBPyConnection, table: str, segments: Sequence[int], merged: Mapping[str, Collection[str]]) -> int:
    """Write `table`: the rows of these segments' own tables (each made with every column, SEGMENT_COLUMNS) and of
    these merged tables (name -> its columns besides `segment`; a column one lacks, NULL), each row with its
    segment's number, in one transaction (unlisted: the writer lists it, and drops what it replaces). Returns its
    rows. One CREATE TABLE ... AS, so the table is written once: appending to a table costs a rewrite of its last row
    group at each checkpoint (see the top)."""
    columns = ", ".join(SEGMENT_COLUMNS)
    parts = [f"SELECT {number}::INTEGER AS segment, {columns} FROM {segment_table(number)}" for number in segments]
    parts += [f"SELECT segment, {columns if tuple(present) == SEGMENT_COLUMNS else stored_select(set(present))} FROM {name}" for name, present in merged.items()]
    with transaction(con):
        con.execute(f"CREATE TABLE {table} AS {' UNION ALL '.join(parts)}")
        return int(con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0])


def write_records_segment(con: duckdb.DuckDBPyConnection, number: int, slices: Iterable[Sequence[JournalRecord]]) -> tuple[int, int]:
    """write_segment for records that never went into a journal table (the commit log's, sealed: see
    polar_mitm.store.commit_log): the same segment, parsed from an Arrow table of each slice of records in turn (one
    INSERT each) instead of from journal rows. Returns (rows, slices); (0, 0) and no table for no records."""
    rows = count = 0
    with transaction(con):
        for some in slices:
            con.register("polar_sealed_records", records_table(some))
            try:
                select = f"SELECT {JOURNAL_SEGMENT_SELECT} FROM {records_source('polar_sealed_records')}"
                if not count:
                    create_segment(con, number, select)
                else:
                    con.execute(f"INSERT INTO {segment_table(number)} BY NAME {select}")
            finally:
                con.unregister("polar_sealed_records")
            rows, count = rows + len(some), count + 1
    return rows, count


def migrate_v1(con: duckdb.DuckDBPyConnection) -> int:
    """Schema 1 kept `exchanges` as a table: its rows become the next segment (returns how many)."""
    is_table = con.execute("SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = 'exchanges'").fetchall()[0][0]
    if not is_table:
        return 0
    number = next_segment(con)
    columns = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'exchanges'").fetchall()}
    with transaction(con):
        rows = con.execute("SELECT count(*) FROM exchanges").fetchall()[0][0]
        if rows:
            create_segment(con, number, f"SELECT {contract_select(columns)} FROM exchanges")
            register_segment(con, number, segment_file(number), rows)
        con.execute("DROP TABLE exchanges")
    return int(rows)


def migrate_parquet_segments(con: duckdb.DuckDBPyConnection, directory: Path) -> list[int]:
    """Schema 2 kept segments as Parquet files in `directory`: each listed one without its table yet is loaded into
    one, a transaction each (an interrupted migration goes on at the next open). The files stay: they are the
    segments' Parquet exports. Returns the segments loaded."""
    present = tables(con)
    merged = {number for table in merged_segments(con).values() for number in table.segments}
    migrated = []
    for number, file in listed_segments(con):
        if segment_table(number) in present or number in merged:
            continue
        path = str((directory / file).resolve())
        if not os.path.exists(path):
            raise ConfigError(
                f"the store's segment {number:06d} is listed in {SEGMENTS_TABLE} but its file {path} is missing: put it back "
                "(the store of schema 2 keeps its segments beside it, in <db>.segments/) and start again"
            )
        with transaction(con):
            create_segment(con, number, f"SELECT {segments_select(con, [path])} FROM read_parquet({quote(path)})")
        migrated.append(number)
    return migrated


def export_segments(con: duckdb.DuckDBPyConnection, directory: Path) -> list[str]:
    """Every listed segment as a Parquet file in `directory` (absolute paths, in segment order), writing those not
    written yet: what a snapshot hands another machine. Works on a read-only connection; a schema-2 store that no
    writer migrated yet has every file already."""
    files, paths = dict(listed_segments(con)), []
    sources = {number: (set(columns), segment_table(number)) for number, columns in segment_columns(con).items()}
    for table, held in merged_segments(con).items():
        sources.update({number: (set(held.columns), f"{table} WHERE segment = {number}") for number in held.segments})
    for number, (columns, source) in sorted(sources.items()):
        path = (directory / files[number]).resolve()
        if not path.exists() and columns:
            write_parquet(con, with_whole_texts(f"SELECT {stored_select(columns)} FROM {source}"), path)
        paths.append(str(path))
    return paths


def write_parquet(con: duckdb.DuckDBPyConnection, select: str, path: Path) -> None:
    """Write a segment's Parquet export durably: to a temporary name of this thread's, fsynced, then renamed (a
    segment file is whole or absent, also while two snapshots export it at once). A failure (a full disk) leaves
    neither: the temporary file is removed, so it holds no space."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_native_id()}.tmp")
    try:
        # lz4: about half zstd's CPU here (token ids are random-looking integers), in files ~1.5x the size
        con.execute(f"COPY ({select}) TO {quote(str(temporary))} (FORMAT parquet, COMPRESSION lz4_raw)")
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (what a rename or unlink in it changed)."""
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


def add_segment(con: duckdb.DuckDBPyConnection, rows: pa.Table) -> None:
    """Bulk-load exchange rows (an Arrow table, any subset of the columns) as a segment of a store no Store has open."""
    number = next_segment(con)
    con.register("polar_bulk_rows", rows)
    try:
        with transaction(con):
            create_segment(con, number, f"SELECT {contract_select(rows.column_names)} FROM polar_bulk_rows")
            register_segment(con, number, segment_file(number), rows.num_rows)
    finally:
        con.unregister("polar_bulk_rows")


def next_segment(con: duckdb.DuckDBPyConnection) -> int:
    return con.execute(f"SELECT coalesce(max(segment), 0) + 1 FROM {SEGMENTS_TABLE}").fetchall()[0][0]
