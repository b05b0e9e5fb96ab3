"""Every node's store as one: Parquet on each node's disk, read by the head in place or pulled to its disk.

Each gateway node keeps its own DuckDB store (one writer per file, on its own disk). Most of its exchanges are
already immutable Parquet segments (`<db>.segments/NNNNNN.parquet`); only the newest (< `segment_rows`) rows sit
in a journal table inside the DuckDB file, which no other process can open while the node writes it. So a node
*snapshot* is: the list of its segment files (nothing copied) plus two small Parquet files written on demand,
the journal tail and the `sessions` table, taken in one DuckDB transaction so every row is in exactly one file.

The head then reads `read_parquet([...every node's files...])`: an in-memory DuckDB (`UnionStore`, which the
assembler takes as `store=`) or a catalog file of views (`write_catalog`) that `polar-mitm sql --db` opens like
any store. Where the head sees a node's file at the same path with the same size (one machine, or a shared file
system such as NFS or Lustre under every node's `--db`), it reads it in place; otherwise `pull_snapshot` copies
it into the head's mirror (`<output_dir>/nodes/<node>/`) through the node, in chunks. Segments are immutable and
uniquely named, so each is pulled once; a snapshot after that costs the journal tail and `sessions` files.
Chosen over DuckDB ATTACH (a live node's file is locked by its writer) and over pulling rows through each
node's SQL endpoint (JSON rows, no cross-node joins or aggregates); bench/ray_bench.py measures the snapshot and
the union query.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import duckdb
from pydantic import BaseModel

from polar_mitm import store as store_module
from polar_mitm.store.segments import fetch, fetch_arrow


class NodeSnapshot(BaseModel):
    """One node's store as Parquet files (absolute paths on the node's disk)."""

    node: str
    exchanges: list[str]  # segments (immutable) and the journal tail written for this snapshot
    sessions: str
    seconds: float = 0.0
    sizes: dict[str, int] = {}  # bytes of every file above, as the node sees them
    pulled_bytes: int = 0  # copied to the head for this snapshot (0: read in place, or every file already there)


NodeData = Literal["auto", "shared", "pull"]
PULL_CHUNK = 16 * 2**20  # bytes per call to the node: well under Ray's object size limits, few round trips

# how the head reads a range of a node's file: (path on the node, offset, length) -> bytes
ReadRange = Callable[[str, int, int], Awaitable[bytes]]


def snapshot_dir(db_path: Path) -> Path:
    return Path(str(db_path) + ".snapshots")


def snapshot_store(con: duckdb.DuckDBPyConnection, db_path: Path, node: str, out_dir: Path) -> NodeSnapshot:
    """The store open on `con` (a live Store's connection, or a read-only one to a dead node's file) as Parquet,
    consistent at one instant; cheap: only the journal tail and `sessions` are written."""
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.time_ns()}"
    tail = out_dir / f"tail-{stamp}.parquet"
    sessions = out_dir / f"sessions-{stamp}.parquet"
    cursor = con.cursor()
    try:
        cursor.execute("BEGIN TRANSACTION")  # the segment list and the journals as of one instant
        segments = [str(store_module.segments_dir(db_path).resolve() / file) for (file,) in cursor.execute(f"SELECT file FROM {store_module.SEGMENTS_TABLE} ORDER BY segment").fetchall()]
        journals = sorted(
            int(name[len(store_module.JOURNAL_PREFIX):])
            for (name,) in cursor.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND starts_with(table_name, ?)", [store_module.JOURNAL_PREFIX]).fetchall()
            if name[len(store_module.JOURNAL_PREFIX):].isdigit()
        )
        files = list(segments)
        if journals:
            select = " UNION ALL ".join(f"SELECT {store_module.JOURNAL_SELECT} FROM {store_module.journal_source(n)}" for n in journals)
            cursor.execute(f"COPY ({select}) TO {_quote(str(tail))} (FORMAT parquet, COMPRESSION lz4_raw)")
            files.append(str(tail))
        cursor.execute(f"COPY (SELECT * FROM sessions) TO {_quote(str(sessions))} (FORMAT parquet)")
        cursor.execute("COMMIT")
    finally:
        cursor.close()
    _remove_older(out_dir, keep={tail.name, sessions.name})
    sizes = {path: os.path.getsize(path) for path in [*files, str(sessions)]}
    return NodeSnapshot(node=node, exchanges=files, sessions=str(sessions), seconds=round(time.perf_counter() - started, 4), sizes=sizes)


def readable_file(db_path: Path, path: str) -> Path:
    """`path` if it is one of the store's segment or snapshot files (all a head may read of a node); else ValueError."""
    resolved = Path(path).resolve()
    if resolved.suffix != ".parquet" or resolved.parent not in (store_module.segments_dir(db_path).resolve(), snapshot_dir(db_path).resolve()):
        raise ValueError(f"{path} is not a segment or snapshot file of {db_path}")
    return resolved


def read_range(db_path: Path, path: str, offset: int, length: int) -> bytes:
    with readable_file(db_path, path).open("rb") as handle:
        handle.seek(offset)
        return handle.read(length)


async def pull_snapshot(snapshot: NodeSnapshot, mirror: Path, read: ReadRange, mode: NodeData = "auto") -> NodeSnapshot:
    """The snapshot with every file the head cannot read in place replaced by its copy under `mirror`.

    "shared": every path is used as the node gave it; "pull": every file is copied; "auto": a file the head sees
    at the same path with the same size is read in place (same machine or shared file system), others are copied.
    A copy is written to a temporary name and renamed, so a reader never sees half a file; a segment already in
    the mirror with its size is not copied again."""
    if mode == "shared":
        return snapshot
    mirror.mkdir(parents=True, exist_ok=True)
    pulled = 0

    async def local(path: str) -> str:
        nonlocal pulled
        size = snapshot.sizes[path]
        if mode == "auto" and _has_size(Path(path), size):
            return path
        copy = mirror / Path(path).name
        if _has_size(copy, size):
            return str(copy)
        partial = copy.with_name(copy.name + ".part")
        with partial.open("wb") as handle:
            for offset in range(0, size, PULL_CHUNK) or [0]:
                chunk = await read(path, offset, min(PULL_CHUNK, size - offset))
                await asyncio.to_thread(handle.write, chunk)
        if partial.stat().st_size != size:
            partial.unlink()
            raise OSError(f"pulled {path} from node {snapshot.node} short: {size} bytes expected")
        os.replace(partial, copy)
        pulled += size
        return str(copy)

    exchanges = [await local(path) for path in snapshot.exchanges]
    sessions = await local(snapshot.sessions)
    keep = {Path(p).name for p in [*exchanges, sessions]}
    _remove_older(mirror, keep=keep)
    return snapshot.model_copy(update={"exchanges": exchanges, "sessions": sessions, "sizes": {}, "pulled_bytes": pulled})


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def snapshot_closed_store(db_path: Path, node: str, out_dir: Path) -> NodeSnapshot:
    """A store no process writes any more (its node died): opened read-only, its journal read as it was committed."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return snapshot_store(con, db_path, node, out_dir)
    finally:
        con.close()


def _remove_older(out_dir: Path, keep: set[str], grace: float = 600.0) -> None:
    """Old snapshot files go once a newer one exists and they are `grace` seconds old (a reader may still use them)."""
    cutoff = time.time() - grace
    for path in out_dir.glob("*.parquet"):
        if path.name not in keep and path.stat().st_mtime < cutoff:
            path.unlink(missing_ok=True)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def union_views(snapshots: list[NodeSnapshot]) -> list[str]:
    """`exchanges` and `sessions` over every node's files, each row with its `node`."""
    exchange_parts, session_parts = [], []
    for snap in snapshots:
        name = _quote(snap.node)
        if snap.exchanges:
            files = ", ".join(_quote(f) for f in snap.exchanges)
            exchange_parts.append(f"SELECT {store_module.SEGMENT_SELECT}, {name} AS node FROM read_parquet([{files}], union_by_name = true)")
        session_parts.append(f"SELECT *, {name} AS node FROM read_parquet({_quote(snap.sessions)})")
    typed_nulls = ", ".join(f"NULL::{kind.split()[0]} AS {name}" for name, kind in store_module.EXCHANGE_COLUMNS.items())
    empty_exchanges = f"SELECT {typed_nulls}, NULL::VARCHAR AS node WHERE false"
    return [
        "CREATE OR REPLACE VIEW exchanges AS " + (" UNION ALL ".join(exchange_parts) or empty_exchanges),
        # a session dispatched again after its node died before starting it has a row on both nodes: the later counts
        "CREATE OR REPLACE VIEW sessions AS "
        + (f"SELECT * FROM ({' UNION ALL BY NAME '.join(session_parts)}) QUALIFY row_number() OVER (PARTITION BY session_id ORDER BY last_seen_at DESC NULLS LAST) = 1" if session_parts else "SELECT NULL::VARCHAR AS session_id WHERE false"),
    ]


class UnionStore:
    """Read-only, in this process: the `query` / `arrow` surface the assembler's Reader uses, over all nodes' files."""

    def __init__(self, snapshots: list[NodeSnapshot]):
        self.snapshots = snapshots
        self.con = duckdb.connect()
        for statement in union_views(snapshots):
            self.con.execute(statement)

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        return fetch(self.con, sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> Any:
        return fetch_arrow(self.con, sql, params)

    def close(self) -> None:
        self.con.close()


def write_catalog(path: Path, snapshots: list[NodeSnapshot]) -> Path:
    """A DuckDB file of views over every node's files, for `polar-mitm sql --db PATH` (and store.query) to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    con = duckdb.connect(str(temporary))
    try:
        for statement in union_views(snapshots):
            con.execute(statement)
    finally:
        con.close()
    os.replace(temporary, path)  # readers see the old catalog or the new one, never half of one
    return path
