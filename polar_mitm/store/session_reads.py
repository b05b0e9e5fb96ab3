"""Reads of one session that bind only the tables holding it.

Every query of the `exchanges` view binds each table the view names, column by column (~0.5 ms a segment table of
46 columns: bench/segments_bench.py), so without merges (off by default: writer.MERGE_FANIN) a read of one session
in a store of 1,000 segments took ~0.5 s, of 3,000 ~2.3 s, however few rows it had. A rollout node reads each
session several times (its exchange count, polled while a call is in flight; its outcomes; its counts for the
trainer), and tokens mode reads a lineage back after a restart: a node's own reads grew with its history.

So each segment's listing names the sessions with rows in it (`exchange_segments.sessions`, written with the
listing), and a read of one session runs with `exchanges` bound, for that statement only, to the rows of that
session in the journals, in the segments whose listing names it (or names none: listed before the column was), and
in the merged tables holding one of those. The layout comes from the catalog in the read's own transaction, so
the tables it names are the ones the view named at that instant: each row exactly once, as through the view.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.store.records import journal_numbers
from polar_mitm.store.schema import quote
from polar_mitm.store.segments import (
    SEGMENT_COLUMNS,
    SEGMENTS_TABLE,
    MergedTable,
    exchanges_view_sql,
    segment_table,
    tables,
    transaction,
)

log = logging.getLogger("polar_mitm.store")

Sessions = str | Sequence[str]  # one session's id, or several
VIEW_PREFIX = "CREATE OR REPLACE VIEW exchanges AS "
_WITH = re.compile(r"\s*WITH\s+(?!RECURSIVE\b)", re.IGNORECASE)


def session_rows_sql(con: duckdb.DuckDBPyConnection, sessions: Sessions, known: Mapping[int | str, tuple[str, ...]]) -> str:
    """In the caller's transaction (its snapshot decides which tables exist): a SELECT of the `exchanges` view's
    rows of these sessions (one id, or several) over only the tables that may hold them. `known`: the columns of the
    segment tables (by number) and merged tables (by name) the store opened with; a table not there was made by this
    version, with every column."""
    wanted = [sessions] if isinstance(sessions, str) else list(sessions)
    found = con.execute(f"SELECT segment, stored_in FROM {SEGMENTS_TABLE} WHERE sessions IS NULL OR list_has_any(sessions, ?::VARCHAR[])", [wanted]).fetchall()
    segments = {number: known.get(number, SEGMENT_COLUMNS) for number, stored_in in found if stored_in is None}
    merged: dict[str, MergedTable] = {}
    for number, stored_in in found:
        if stored_in is not None:
            held = merged.get(stored_in, MergedTable((), known.get(stored_in, SEGMENT_COLUMNS)))
            merged[stored_in] = held._replace(segments=(*held.segments, number))
    view = exchanges_view_sql(segments, journal_numbers(con), merged)
    return f"SELECT * FROM ({view.removeprefix(VIEW_PREFIX)}) WHERE session_id IN ({', '.join(map(quote, wanted)) or 'NULL'})"


def list_sessions(con: duckdb.DuckDBPyConnection, db: Path) -> int:
    """Name the sessions of each listed segment whose listing does not name them yet (listed before the column was:
    a store of an earlier version, at its first open by a writer), reading only their tables' `session_id` columns;
    returns how many segments were named. One small statement a table (~1 ms; one statement over hundreds of tables
    took ~5 ms a table to plan, measured at 3,000 segments)."""
    unnamed = con.execute(f"SELECT segment, stored_in FROM {SEGMENTS_TABLE} WHERE sessions IS NULL ORDER BY segment").fetchall()
    if not unnamed:
        return 0
    present = tables(con)
    found = [(n, con.execute(f"SELECT list(DISTINCT session_id) FROM {segment_table(n)}").fetchall()[0][0]) for n, where in unnamed if where is None and segment_table(n) in present]
    for table in sorted({where for _, where in unnamed if where is not None and where in present}):
        found += con.execute(f"SELECT segment, list(DISTINCT session_id) FROM {table} GROUP BY segment").fetchall()
    with transaction(con):
        con.execute(
            f"UPDATE {SEGMENTS_TABLE} SET sessions = found.sessions FROM (SELECT unnest(?::INTEGER[]) AS segment, unnest(?::VARCHAR[][]) AS sessions) found "
            f"WHERE {SEGMENTS_TABLE}.segment = found.segment AND {SEGMENTS_TABLE}.sessions IS NULL",
            [[n for n, _ in found], [sessions or [] for _, sessions in found]],
        )
    if found:
        log.info(f"polar-mitm: the sessions of {len(found)} segments of {db} listed (segments listed before sessions were)")
    return len(found)


def with_session_rows(sql: str, rows: str) -> str:
    """`sql` with `exchanges` bound to `rows` (a CTE shadows the view of that name), inlined so the statement's own
    filters still reach the tables."""
    binding = f"exchanges AS NOT MATERIALIZED ({rows})"
    if (opening := _WITH.match(sql)) is not None:
        return f"WITH {binding}, {sql[opening.end():]}"
    return f"WITH {binding} {sql}"


@contextmanager
def _session_statement(con: duckdb.DuckDBPyConnection, sessions: Sessions, sql: str, known: Mapping[int | str, tuple[str, ...]]) -> Iterator[tuple[duckdb.DuckDBPyConnection, str]]:
    """A cursor of its own in a transaction of its own, and `sql` with `exchanges` bound to these sessions' rows."""
    cursor = con.cursor()
    try:
        cursor.execute("BEGIN TRANSACTION")
        yield cursor, with_session_rows(sql, session_rows_sql(cursor, sessions, known))
    finally:
        try:
            cursor.execute("ROLLBACK")  # it only read
        except duckdb.Error:
            pass  # no transaction left (DuckDB ended it with a failed statement)
        cursor.close()


def fetch_session(con: duckdb.DuckDBPyConnection, sessions: Sessions, sql: str, params: list[Any] | None, known: Mapping[int | str, tuple[str, ...]]) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(columns, rows) of one read-only statement whose `exchanges` is these sessions' rows."""
    with _session_statement(con, sessions, sql, known) as (cursor, statement):
        result = cursor.execute(statement, params or [])
        return [d[0] for d in result.description] if result.description else [], result.fetchall()


def fetch_session_arrow(con: duckdb.DuckDBPyConnection, sessions: Sessions, sql: str, params: list[Any] | None, known: Mapping[int | str, tuple[str, ...]]) -> pa.Table:
    """fetch_session's result as an Arrow table."""
    with _session_statement(con, sessions, sql, known) as (cursor, statement):
        return cursor.sql(statement, params=params or []).to_arrow_table()
