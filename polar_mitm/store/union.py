"""Several stores as one: `exchanges` and `sessions` over every node's snapshot files, each row with its `node`.

A head reads `read_parquet([...every node's files...])`: in this process (`UnionStore`, a `StoreReader` the
assembler and the exporter take like any store) or as a catalog file of views (`write_catalog`) that
`polar-mitm sql --db` opens like any store. Chosen over DuckDB ATTACH (a live node's file is locked by its
writer) and over pulling rows through each node's SQL endpoint (JSON rows, no cross-node joins or aggregates);
bench/ray_bench.py measures the snapshot and the union query.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.store.schema import EXCHANGE_COLUMNS, quote
from polar_mitm.store.segments import fetch, fetch_arrow, segments_select, with_marks
from polar_mitm.store.snapshots import NodeSnapshot


def union_views(con: duckdb.DuckDBPyConnection, snapshots: list[NodeSnapshot]) -> list[str]:
    """`exchanges` and `sessions` over every node's files, each row with its `node` (`con` reads their footers)."""
    exchange_parts, session_parts, marks = [], [], []
    for snap in snapshots:
        name = quote(snap.node)
        if snap.exchanges:
            files = ", ".join(quote(f) for f in snap.exchanges)
            exchange_parts.append(f"SELECT {segments_select(con, snap.exchanges)}, {name} AS node FROM read_parquet([{files}], union_by_name = true)")
        session_parts.append(f"SELECT *, {name} AS node FROM read_parquet({quote(snap.sessions)})")
        marks += [quote(snap.marks)] if snap.marks else []
    typed_nulls = ", ".join(f"NULL::{kind.split()[0]} AS {name}" for name, kind in EXCHANGE_COLUMNS.items())
    empty_exchanges = f"SELECT {typed_nulls}, NULL::VARCHAR AS node WHERE false"
    exchanges = " UNION ALL ".join(exchange_parts) or empty_exchanges
    if marks:  # a reply a node marked undelivered reads as marked here too (exchange ids are unique across nodes)
        exchanges = with_marks(exchanges, f"(SELECT * FROM read_parquet([{', '.join(marks)}]))")
    return [
        "CREATE OR REPLACE VIEW exchanges AS " + exchanges,
        # a session dispatched again after its node died before starting it has a row on both nodes: the later counts
        "CREATE OR REPLACE VIEW sessions AS "
        + (f"SELECT * FROM ({' UNION ALL BY NAME '.join(session_parts)}) QUALIFY row_number() OVER (PARTITION BY session_id ORDER BY last_seen_at DESC NULLS LAST) = 1" if session_parts else "SELECT NULL::VARCHAR AS session_id WHERE false"),
    ]


class UnionStore:
    """Read-only, in this process, over all nodes' files: a `StoreReader` (query / arrow). Close it when done."""

    def __init__(self, snapshots: list[NodeSnapshot]):
        self.snapshots = snapshots
        self._con = duckdb.connect()
        for statement in union_views(self._con, snapshots):
            self._con.execute(statement)

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        return fetch(self._con, sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        return fetch_arrow(self._con, sql, params)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> UnionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_catalog(path: Path, snapshots: list[NodeSnapshot]) -> Path:
    """A DuckDB file of views over every node's files, for `polar-mitm sql --db PATH` (and store.query) to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    con = duckdb.connect(str(temporary))
    try:
        for statement in union_views(con, snapshots):
            con.execute(statement)
    finally:
        con.close()
    os.replace(temporary, path)  # readers see the old catalog or the new one, never half of one
    return path
