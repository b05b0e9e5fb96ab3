"""A head without a shared file system: node snapshots pulled into the head's mirror (store.snapshots.pull_snapshot).

The node side is a real Store on disk; the head reads it only through `read_range` (what the node actor's
`read_file` runs), from a mirror folder of its own. The Ray transport itself is covered by
tests/integration/test_ray_pull.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from polar_mitm import store as store_module
from polar_mitm.store import Store, UnionStore, now, pull_snapshot, read_range, snapshot_dir


def _fill(store: Store, first: int, count: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        for i in range(first, first + count):
            ids = list(range(i, i + 300))
            row = {"exchange_id": f"x{i}", "session_id": f"s{i // 4}", "seq": i % 4, "status": "ok", "api": "openai_chat", "action": "generate",
                   "prompt_token_ids": ids, "completion_token_ids": ids[:20], "completion_logprobs": [-0.5] * 20, "started_at": now(), "ended_at": now()}
            loop.run_until_complete(store.commit_exchange(row))
    finally:
        loop.close()


def _wait_for_segments(store: Store, count: int) -> None:
    deadline = time.monotonic() + 60
    while store.query(f"SELECT count(*) FROM {store_module.SEGMENTS_TABLE}")[1][0][0] < count:
        assert time.monotonic() < deadline, "the compactor wrote no segment"
        time.sleep(0.1)


def _union_rows(snapshot) -> list[tuple]:
    union = UnionStore([snapshot])
    try:
        return union.query("SELECT exchange_id, len(prompt_token_ids), node FROM exchanges ORDER BY exchange_id")[1]
    finally:
        union.close()


def test_pulled_snapshot_reads_like_the_node_and_pulls_each_segment_once(tmp_path: Path) -> None:
    node_db = tmp_path / "node" / "store.n1.duckdb"
    node_db.parent.mkdir()
    mirror = tmp_path / "head" / "nodes" / "n1"
    calls: list[tuple[str, int, int]] = []

    async def read(path: str, offset: int, length: int) -> bytes:
        calls.append((path, offset, length))
        return read_range(node_db, path, offset, length)

    store = Store(node_db, segment_rows=16)
    try:
        _fill(store, 0, 20)  # one segment of 16 rows, 4 in the journal
        _wait_for_segments(store, 1)
        taken = store.snapshot("n1")
        assert len(taken.exchanges) == 2 and set(taken.sizes) == {*taken.exchanges, taken.sessions, taken.marks}

        pulled = asyncio.run(pull_snapshot(taken, mirror, read, "pull"))
        assert all(Path(p).parent == mirror for p in [*pulled.exchanges, pulled.sessions, pulled.marks])
        assert pulled.pulled_bytes == sum(taken.sizes.values())
        expected = [(f"x{i}", 300, "n1") for i in range(20)]
        assert _union_rows(pulled) == sorted(expected) == _union_rows(taken)

        # more rows: the segment already mirrored is not copied again, only the new tail, sessions and marks
        _fill(store, 20, 3)
        again = store.snapshot("n1")
        calls.clear()
        second = asyncio.run(pull_snapshot(again, mirror, read, "pull"))
        segment = taken.exchanges[0]
        assert segment not in {path for path, _, _ in calls}
        assert second.pulled_bytes == again.sizes[again.exchanges[-1]] + again.sizes[again.sessions] + again.sizes[again.marks]
        assert len(_union_rows(second)) == 23

        # "auto" on the node's own machine reads in place and copies nothing; "shared" never looks
        in_place = asyncio.run(pull_snapshot(again, tmp_path / "unused", read, "auto"))
        assert in_place.exchanges == again.exchanges and in_place.pulled_bytes == 0
        assert asyncio.run(pull_snapshot(again, tmp_path / "unused", read, "shared")) == again
    finally:
        store.close()


def _closed_store_snapshot(node_db: Path, rows: int):
    store = Store(node_db)
    try:
        _fill(store, 0, rows)
        return store.snapshot(node_db.stem.split(".")[-1])
    finally:
        store.close()


def test_auto_pulls_a_file_the_head_sees_with_another_size(tmp_path: Path) -> None:
    """A path that exists on the head but is not the node's file (another machine's disk, same layout) is pulled."""
    taken = _closed_store_snapshot(tmp_path / "store.n2.duckdb", 3)
    real = {path: Path(path).read_bytes() for path in taken.sizes}
    for path in taken.sizes:  # the head's own file at the same path differs
        Path(path).write_bytes(b"not the node's file")

    async def read(path: str, offset: int, length: int) -> bytes:
        return real[path][offset:offset + length]

    pulled = asyncio.run(pull_snapshot(taken, tmp_path / "mirror", read, "auto"))
    assert pulled.pulled_bytes == sum(taken.sizes.values())
    assert [row[0] for row in _union_rows(pulled)] == ["x0", "x1", "x2"]


def test_a_node_serves_only_its_segment_and_snapshot_files(tmp_path: Path) -> None:
    node_db = tmp_path / "store.n1.duckdb"
    taken = _closed_store_snapshot(node_db, 1)
    assert read_range(node_db, taken.sessions, 0, 4) == b"PAR1"
    (tmp_path / "secret.parquet").write_bytes(b"PAR1")
    for path in (str(node_db), str(tmp_path / "secret.parquet"), str(snapshot_dir(node_db) / ".." / "secret.parquet"), "/etc/passwd"):
        with pytest.raises(ValueError, match="is not a segment or snapshot file"):
            read_range(node_db, path, 0, 4)
