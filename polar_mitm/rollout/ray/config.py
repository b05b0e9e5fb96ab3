"""The cluster's configuration and names: what the head, its node actors and a trainer's driver agree on; and
the check that there is a Ray cluster at the address before Ray is asked to join it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import BaseModel, Field

from polar_mitm.errors import BackendStartError
from polar_mitm.rollout.node import NodeConfig
from polar_mitm.store.snapshots import NodeData

NODE_RESOURCE = "polar_node"  # a Ray node gets a gateway node when it carries this resource
NODE_LABEL = "polar-node"  # its name, if it carries this label (else node-<ray node id>)
NAMESPACE = "polar-mitm"  # the node actors' Ray namespace
START_NODE = f"ray start --head --resources '{{\"{NODE_RESOURCE}\": 1}}' --labels {NODE_LABEL}=NAME"  # how to make one


class ClusterConfig(BaseModel):
    address: str | None = Field(None, description="Ray address ('auto', 'ray://...', host:port); None: the job's own cluster, else a local one.")
    node: NodeConfig = Field(description="Every node's config; its gateway.db names the directory and stem of each node's store.")
    head_db: Path | None = Field(None, description="The head's own DuckDB (tasks, sessions, deliveries); default <db stem>.head.duckdb.")
    output_dir: Path | None = Field(None, description="The head's task Parquet files and cluster.duckdb; default <db stem>.head/.")
    poll_interval: float = Field(0.5, gt=0, description="Seconds between the head's polls of every node (stage snapshots, liveness).")
    keep_nodes: bool = Field(False, description="Leave the node actors running when the head closes (a new head re-attaches to them).")
    node_data: NodeData = Field("auto", description="How the head reads the nodes' stores: 'shared' in place (one machine or a shared file system), 'pull' copied through the node actors into <output_dir>/nodes/, 'auto' in place where the head sees the same file, else pulled.")

    def resolved(self) -> ClusterConfig:
        db = self.node.gateway.db.expanduser().resolve()  # actors run in other working directories
        gateway = self.node.gateway.model_copy(update={"db": db, "confdir": str(Path(self.node.gateway.confdir).expanduser().resolve())})
        node = self.node.model_copy(update={"gateway": gateway, "output_dir": self.node.output_dir.resolve() if self.node.output_dir else None})
        return self.model_copy(update={
            "node": node,
            "head_db": (self.head_db or db.with_name(f"{db.stem}.head.duckdb")).expanduser().resolve(),
            "output_dir": (self.output_dir or db.with_name(f"{db.stem}.head")).expanduser().resolve(),
        })


def node_db(db: Path, name: str) -> Path:
    """Node `name`'s store: `<db stem>.<name><suffix>` beside `db`."""
    return db.with_name(f"{db.stem}.{name}{db.suffix}")


def actor_name(node: str) -> str:
    return f"polar-node-{node}"


def check_address(address: str | None) -> None:
    """Fail at once, in one line, where `ray.init` would wait minutes: an address (given, $RAY_ADDRESS, or the one
    'auto' finds) where nothing listens, or 'auto' with no cluster on this machine. None and ray:// are Ray's."""
    address = os.environ.get("RAY_ADDRESS") or address  # as ray.init reads it
    if address is None or address.startswith("ray://"):
        return
    if address == "auto":
        try:
            from ray._private import services  # Ray's own lookup: the last `ray start` here, or a running GCS
        except ImportError:
            return  # a Ray without it: ray.init looks for itself
        try:
            found = services.canonicalize_bootstrap_address(address)
        except Exception:  # noqa: BLE001 - "no cluster" in whatever words this Ray has for it
            found = None
        if found is None:
            raise BackendStartError(f"no Ray cluster found on this machine; start one ({START_NODE}) or pass its address to --ray")
        address = found
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise BackendStartError(f"{address!r} is not a Ray address (host:port, auto or ray://...)")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=3).close()
    except OSError as error:
        raise BackendStartError(f"no Ray cluster at {address} ({error.strerror or type(error).__name__}); start one ({START_NODE}) or pass its address to --ray") from None
