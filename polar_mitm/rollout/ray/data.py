"""The head's reads of every node's store: snapshots (in place or pulled), the cluster catalog, task export, SQL.

Trajectories are assembled by the head over every node's store (a UnionStore of each node's Parquet snapshot:
its segments plus a fresh journal tail, polar_mitm.store.union), so GRPO group advantages span nodes. A live node
snapshots itself through its actor; a dead node's file is read by the head where it can see it. Where the head
does not share a node's disk (`node_data` pull, or auto on another machine), the files are pulled through the
node actor into `<output>/nodes/<node>/`. `<output>/cluster.duckdb` is a catalog of views over every node's
files, refreshed after each task and by `GET /sql`: `polar-mitm sql --db <output>/cluster.duckdb "SELECT node,
count(*) FROM exchanges GROUP BY node"`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from polar_mitm.rollout.node import export_sessions
from polar_mitm.rollout.ray.config import ClusterConfig
from polar_mitm.rollout.ray.nodes import NodeHandle, RayNodes
from polar_mitm.store.reading import snapshot_closed_store
from polar_mitm.store.snapshots import NodeSnapshot, ReadRange, pull_snapshot, snapshot_dir
from polar_mitm.store.sql_endpoint import check_read_only
from polar_mitm.store.union import UnionStore, write_catalog

log = logging.getLogger("polar_mitm.rollout.ray")


class ClusterData:
    """Every node's store, read by the head."""

    def __init__(self, config: ClusterConfig, nodes: RayNodes):
        assert config.output_dir is not None, "a resolved ClusterConfig"
        self.config = config
        self.output_dir: Path = config.output_dir
        self.nodes = nodes

    @property
    def catalog(self) -> Path:
        return self.output_dir / "cluster.duckdb"

    async def snapshots(self) -> list[NodeSnapshot]:
        """Every node's store as Parquet: live nodes snapshot themselves; a dead node's file is read by the head."""

        async def one(node: NodeHandle) -> NodeSnapshot | None:
            if node.alive:
                try:
                    taken = NodeSnapshot.model_validate(await node.actor.snapshot.remote())
                    node.last_snapshot = await pull_snapshot(taken, self.output_dir / "nodes" / node.name, _reader(node), self.config.node_data)
                    return node.last_snapshot
                except self.nodes.actor_errors as error:
                    self.nodes.mark_lost(node, error)
            try:
                node.last_snapshot = await asyncio.to_thread(snapshot_closed_store, node.db, node.name, snapshot_dir(node.db))
            except Exception as failure:  # noqa: BLE001 - not on this machine's disk, or still locked: its last snapshot
                log.warning(f"polar ray: cannot read node {node.name}'s store {node.db}: {failure!r}")
            return node.last_snapshot

        return [s for s in await asyncio.gather(*(one(n) for n in list(self.nodes.nodes.values()))) if s is not None]

    async def refresh_catalog(self) -> list[NodeSnapshot]:
        """Fresh snapshots of every node, and the catalog over them."""
        snapshots = await self.snapshots()
        await asyncio.to_thread(write_catalog, self.catalog, snapshots)
        return snapshots

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        """The task's Parquet, assembled over every node's store (`<output>/<task>.parquet`): (path, stats)."""
        snapshots = await self.refresh_catalog()

        def export() -> tuple[str, dict[str, Any]]:
            with UnionStore(snapshots) as union:
                path, stats = export_sessions(union, task_id, session_ids, builder, options, self.output_dir / f"{task_id}.parquet")
            return str(path), {**stats, "nodes": sorted(s.node for s in snapshots)}

        return await asyncio.to_thread(export)

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only query over every node's store (fresh snapshots)."""
        check_read_only(sql)
        snapshots = await self.refresh_catalog()
        with UnionStore(snapshots) as union:
            return await asyncio.to_thread(union.query, sql)


def _reader(node: NodeHandle) -> ReadRange:
    async def read(path: str, offset: int, length: int) -> bytes:
        return await node.actor.read_file.remote(path, offset, length)

    return read
