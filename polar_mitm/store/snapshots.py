"""A store as Parquet files at one instant (a *snapshot*), and how another machine reads or copies them.

Most of a store's exchanges are immutable segments, each exported once as a Parquet file
(`<db>.segments/NNNNNN-….parquet`, written the first time a snapshot needs it); only the newest (< `segment_rows`)
rows sit in journal tables. The DuckDB file itself no other process can open while its writer holds it. So a
snapshot is: the list of its segment files (nothing copied once exported) plus two small Parquet files written on
demand, the journal tail and the `sessions` table, taken in one DuckDB transaction so every row is in exactly one
file. Only this module (inside the store) reads the segment table and the journals
for that; outside the store a snapshot is taken through `Store.snapshot` or `ClosedStore.snapshot`
(polar_mitm.store.reading) and read through `UnionStore` / `write_catalog` (polar_mitm.store.union).

A reader on another machine gets the files through the store's owner: `read_range` (what the owner serves, only
its segment and snapshot files) and `pull_snapshot` (the reader's side: copies what it cannot read in place into
a mirror folder, in chunks; segments are immutable and uniquely named, so each is pulled once).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import duckdb
from pydantic import BaseModel

from polar_mitm.store.records import JOURNAL_STORED_SELECT, journal_numbers, journal_source
from polar_mitm.store.schema import MARKS_TABLE, quote, with_whole_texts
from polar_mitm.store.segments import export_segments, segments_dir


class NodeSnapshot(BaseModel):
    """One node's store as Parquet files (absolute paths on the node's disk)."""

    node: str
    exchanges: list[str]  # segments (immutable) and the journal tail written for this snapshot
    sessions: str
    marks: str | None = None  # the exchanges' later statuses (schema.MARKS_TABLE); None from a store without them
    seconds: float = 0.0
    sizes: dict[str, int] = {}  # bytes of every file above, as the node sees them
    pulled_bytes: int = 0  # copied to the head for this snapshot (0: read in place, or every file already there)


NodeData = Literal["auto", "shared", "pull"]
PULL_CHUNK = 16 * 2**20  # bytes per call to the node: well under Ray's object size limits, few round trips

# how the head reads a range of a node's file: (path on the node, offset, length) -> bytes
ReadRange = Callable[[str, int, int], Awaitable[bytes]]


def snapshot_dir(db_path: str | os.PathLike[str]) -> Path:
    """Where a store's snapshot files go by default: `<db>.snapshots/` beside it."""
    return Path(str(db_path) + ".snapshots")


def snapshot_store(con: duckdb.DuckDBPyConnection, db_path: Path, node: str, out_dir: Path) -> NodeSnapshot:
    """The store open on `con` (its writer's connection, or a read-only one to a file nobody writes) as Parquet,
    consistent at one instant; cheap: the journal tail and `sessions` are written, and each segment's Parquet
    export once (the first snapshot of a big store writes them all). Store-internal: outside
    the store, take a snapshot through `Store.snapshot` / `ClosedStore.snapshot`."""
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.time_ns()}"
    tail = out_dir / f"tail-{stamp}.parquet"
    sessions = out_dir / f"sessions-{stamp}.parquet"
    marks: Path | None = out_dir / f"marks-{stamp}.parquet"
    cursor = con.cursor()
    try:
        cursor.execute("BEGIN TRANSACTION")  # the segment list and the journals as of one instant
        segments = export_segments(cursor, segments_dir(db_path))
        journals = journal_numbers(cursor)
        files = list(segments)
        if journals:
            select = with_whole_texts(" UNION ALL ".join(f"SELECT {JOURNAL_STORED_SELECT} FROM {journal_source(n)}" for n in journals))
            cursor.execute(f"COPY ({select}) TO {quote(str(tail))} (FORMAT parquet, COMPRESSION lz4_raw)")
            files.append(str(tail))
        cursor.execute(f"COPY (SELECT * FROM sessions) TO {quote(str(sessions))} (FORMAT parquet)")
        if cursor.execute("SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = ?", [MARKS_TABLE]).fetchall()[0][0]:
            cursor.execute(f"COPY (SELECT * FROM {MARKS_TABLE}) TO {quote(str(marks))} (FORMAT parquet)")
        else:
            marks = None  # a store written before marks existed
        cursor.execute("COMMIT")
    finally:
        cursor.close()
    remove_older(out_dir, keep={tail.name, sessions.name, *([marks.name] if marks else [])})
    sizes = {path: os.path.getsize(path) for path in [*files, str(sessions), *([str(marks)] if marks else [])]}
    return NodeSnapshot(node=node, exchanges=files, sessions=str(sessions), marks=str(marks) if marks else None, seconds=round(time.perf_counter() - started, 4), sizes=sizes)


def readable_file(db_path: Path, path: str) -> Path:
    """`path` if it is one of the store's segment or snapshot files (all a head may read of a node); else ValueError."""
    resolved = Path(path).resolve()
    if resolved.suffix != ".parquet" or resolved.parent not in (segments_dir(db_path).resolve(), snapshot_dir(db_path).resolve()):
        raise ValueError(f"{path} is not a segment or snapshot file of {db_path}")
    return resolved


def read_range(db_path: Path, path: str, offset: int, length: int) -> bytes:
    """`length` bytes at `offset` of one of the store's segment or snapshot files (the owner's side of a pull)."""
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
    marks = await local(snapshot.marks) if snapshot.marks else None
    remove_older(mirror, keep={Path(p).name for p in [*exchanges, sessions, *([marks] if marks else [])]})
    return snapshot.model_copy(update={"exchanges": exchanges, "sessions": sessions, "marks": marks, "sizes": {}, "pulled_bytes": pulled})


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def remove_older(out_dir: Path, keep: set[str], grace: float = 600.0) -> None:
    """Old snapshot files go once a newer one exists and they are `grace` seconds old (a reader may still use them)."""
    cutoff = time.time() - grace
    for path in out_dir.glob("*.parquet"):
        if path.name not in keep and path.stat().st_mtime < cutoff:
            path.unlink(missing_ok=True)
