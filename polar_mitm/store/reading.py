"""The store's read interface, and the readers that are not the writer.

Everything above the store reads it through `StoreReader` (read-only SQL over `exchanges`, `sessions` and the
views: rows, or an Arrow table for token lists), never through a DuckDB connection or the file's layout. Who
satisfies it:

    Store        the live writer, in its own process (polar_mitm.store.writer)
    ClosedStore  a file no process writes any more (a dead node's), opened read-only in this process
    StorePath    a store named by its path, from any process: the file directly when nobody holds it, else the
                 SQL endpoint of the gateway that does (polar_mitm.store.by_path.query)
    UnionStore   every node's snapshot as one store (polar_mitm.store.union)

`SnapshotSource` adds `snapshot`: the store as Parquet files at one instant (polar_mitm.store.snapshots), which
the live Store and a ClosedStore can take (the union is made of snapshots; a StorePath may be another process's).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import duckdb
import pyarrow as pa

from polar_mitm.store.by_path import query as query_path
from polar_mitm.store.by_path import recover
from polar_mitm.store.schema import ExchangeRow
from polar_mitm.store.segments import connect, fetch, fetch_arrow
from polar_mitm.store.session_reads import Sessions
from polar_mitm.store.snapshots import NodeSnapshot, snapshot_dir, snapshot_store

# (column names, rows): rows are tuples in this process, lists when they came through a gateway as JSON
Rows = tuple[list[str], Sequence[Sequence[Any]]]


@runtime_checkable
class StoreReader(Protocol):
    """Read-only SQL over one store (or a union of stores) with the store's tables and views.

    Contract: `sql` is one read-only statement with `?` placeholders for `params`; both methods return the
    statement's whole result, as the store was when it ran (a concurrent writer's later rows are not in it);
    safe to call from several threads."""

    def query(self, sql: str, params: list[Any] | None = None) -> Rows:
        """(column names, rows)."""
        ...

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        """The result as an Arrow table: list columns (token ids, logprobs) as Arrow buffers, no Python object each."""
        ...


@runtime_checkable
class SnapshotSource(StoreReader, Protocol):
    """A store that can hand itself out as Parquet files at one instant (what a head reads of a node)."""

    def snapshot(self, node: str, out_dir: Path | None = None) -> NodeSnapshot:
        """Its exchanges and sessions as files (segments in place, the journal tail and `sessions` written into
        `out_dir`, default `<db>.snapshots/`), every row in exactly one of them; `node` names it in a union."""
        ...


@runtime_checkable
class ExchangeStore(SnapshotSource, Protocol):
    """The store as its gateway writes it: `Store` in the gateway's process, or `StoreProcess`
    (polar_mitm.gateway.store_process) in a process of its own. Commits return once the row is durable."""

    path: Path

    def query(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> Rows:
        """As StoreReader's; `session`: `exchanges` in `sql` is that session's rows alone, read from only the tables
        that hold them (polar_mitm.store.session_reads: a long store's thousands of segment tables are not bound)."""
        ...

    def arrow(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> pa.Table:
        """As `query`, as an Arrow table."""
        ...

    def next_seq(self, session_id: str) -> int:
        """The next exchange's seq in the session (issued in memory: the event loop never waits for it)."""
        ...

    def issued_seqs(self, session_id: str) -> int:
        """How many exchanges of the session were begun (each gets its row: committed, or still in flight)."""
        ...

    async def commit_exchange(self, row: ExchangeRow) -> None:
        """Commit one exchange row; returns once it is durable, raises if it was refused."""
        ...

    async def commit_mark(self, exchange_id: str, status: str, error: str) -> None:
        """Commit a later status for a committed exchange (a reply that could not be delivered)."""
        ...

    def execute_write(self, sql: str, params: list[Any] | None = None) -> None:
        """One write statement, serialised with the exchange commits."""
        ...

    def serve_sql(self, port: int = 0) -> str:
        """Answer read-only SQL from other processes on a loopback port; returns its URL."""
        ...

    def close(self) -> None:
        """Stop writing; every journal becomes a segment."""
        ...


class ClosedStore:
    """A store file that no process writes (its node died, its gateway stopped), open read-only in this process.

    DuckDB lets a read-only connection open a file only while no writer holds it (IOException otherwise); the
    journal is read as it was last committed. Close it when done (or use it as a context manager)."""

    def __init__(self, db_path: str | os.PathLike[str]):
        self.path = Path(db_path)
        recover(self.path)
        self._con = connect(self.path, read_only=True)

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        return fetch(self._con, sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        return fetch_arrow(self._con, sql, params)

    def snapshot(self, node: str, out_dir: Path | None = None) -> NodeSnapshot:
        return snapshot_store(self._con, self.path, node, out_dir or snapshot_dir(self.path))

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> ClosedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def snapshot_closed_store(db_path: Path, node: str, out_dir: Path) -> NodeSnapshot:
    """A store no process writes any more (its node died): opened read-only, its journal read as it was committed."""
    with ClosedStore(db_path) as closed:
        return closed.snapshot(node, out_dir)


class StorePath:
    """A store by its path, from any process, opened per call: directly (read-only) while no process holds the
    file, else through the SQL endpoint of the gateway that holds it (`polar_mitm.store.query`).

    Through a gateway rows come as JSON, so `arrow` builds its table from them (slower, same values)."""

    def __init__(self, db_path: str | os.PathLike[str]):
        self.path = Path(db_path)

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        return query_path(self.path, sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        try:
            recover(self.path)
            con = connect(self.path, read_only=True)
        except (duckdb.IOException, duckdb.ConnectionException):  # a writer (a gateway) holds the file, or it is not there yet
            columns, rows = self.query(sql, params)
            return pa.table({name: [row[index] for row in rows] for index, name in enumerate(columns)})
        try:
            return fetch_arrow(con, sql, params)
        finally:
            con.close()
