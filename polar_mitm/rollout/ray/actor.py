"""One GatewayNode per Ray node: the Ray actor the head (nodes.py) dispatches sessions to.

The actor is placed with a hard node affinity on a Ray node that carries the `polar_node` resource and takes
all of it, so there is exactly one per such node. It owns what a GatewayNode owns on that machine: the gateway
(with one or several engines, engines/pool.py), the DuckDB store on the node's own disk, the sandboxes and
the per-stage slots. Everything that crosses the actor boundary is JSON-able (pydantic `model_dump`).

A session id runs at most once per node: `run_session` for a session this actor already runs or ran answers
with that run. When the actor comes up on a store whose `sessions` table has sessions in a non-final state
(its previous incarnation died with them), they are marked `failed` ("the node restarted mid-session"); their
committed exchanges stay in the store, readable by the head through the node's Parquet snapshot (in place, or
pulled through `read_file` where the head does not share this node's disk).

The head reaches the node's gateway only through the actor (`control`): the gateway listens on the node's
loopback, which another machine cannot reach.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

from polar_mitm.errors import RequestRejected
from polar_mitm.rollout.backend import ControlCall
from polar_mitm.rollout.models import FINAL_STATUSES, SessionResult, TaskRequest
from polar_mitm.rollout.node import GatewayNode, NodeConfig
from polar_mitm.rollout.session_run import SessionWork
from polar_mitm.store.snapshots import read_range, snapshot_dir

UNFINISHED = f"task_id IS NOT NULL AND status NOT IN ({', '.join(repr(s) for s in sorted(FINAL_STATUSES))})"
RECOVER_SESSIONS = f"UPDATE sessions SET status = 'failed', error = coalesce(error || '; ', '') || 'the node restarted mid-session; its committed exchanges are kept' WHERE {UNFINISHED}"


class NodeActor:
    """Wrapped with `ray.remote` by the head; async methods run on the actor's event loop."""

    def __init__(self, name: str, config: dict[str, Any]):
        self.name = name
        self.config = NodeConfig.model_validate(config)
        self.node = GatewayNode(self.config)
        self.runs: dict[str, asyncio.Task] = {}
        self.latest: dict[str, SessionResult] = {}
        self.recovered = 0
        self.started = False

    async def start(self) -> dict[str, Any]:
        if not self.started:
            await self.node.start()
            _, rows = await asyncio.to_thread(self.node.store.query, f"SELECT count(*) FROM sessions WHERE {UNFINISHED}")
            self.recovered = int(rows[0][0])
            if self.recovered:
                await asyncio.to_thread(self.node.store.execute_write, RECOVER_SESSIONS)
            self.started = True
        return self.info()

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "name": self.name, "ray_node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(), "pid": os.getpid(),
            "gateway": self.node.gateway_url, "db": str(Path(self.config.gateway.db).resolve()), "upstream": self.config.gateway.upstream,
            "limits": self.config.limits.model_dump(), "recovered_sessions": self.recovered, "config": self.config.model_dump(mode="json"),
        }

    async def check(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """None if this node can run the request, else the rejection ({loc, message})."""
        try:
            await self.node.check(TaskRequest.model_validate(request))
        except RequestRejected as error:
            return {"loc": list(error.loc), "message": str(error)}
        return None

    async def run_session(self, work: dict[str, Any]) -> dict[str, Any]:
        session = SessionWork.model_validate(work)
        run = self.runs.get(session.session_id)
        if run is None:
            run = asyncio.create_task(self.node.run_session(session, lambda snapshot: self.latest.__setitem__(snapshot.session_id, snapshot)))
            self.runs[session.session_id] = run
        # a cancelled call (the head went away) leaves the session running; `cancel` is how the head stops one
        result = await asyncio.shield(run)
        self.latest[session.session_id] = result
        return result.model_dump(mode="json")

    async def result(self, session_id: str) -> dict[str, Any] | None:
        """The session's final result (waiting for it if it still runs); None if this actor never ran it."""
        run = self.runs.get(session_id)
        if run is None:
            return None
        return (await asyncio.shield(run)).model_dump(mode="json")

    def cancel(self, session_id: str) -> bool:
        run = self.runs.get(session_id)
        if run is None or run.done():
            return False
        run.cancel()
        return True

    def load(self) -> dict[str, Any]:
        """What the head shows and dispatches by: the sessions here and their latest snapshots, the engines."""
        active = {sid: self.latest[sid].model_dump(mode="json") if sid in self.latest else None for sid, run in self.runs.items() if not run.done()}
        return {
            "name": self.name, "active": active, "finished": sum(run.done() for run in self.runs.values()), "engines": self.engines(),
            "engine_reachable": self.node.engine_reachable,
        }

    def engines(self) -> list[dict[str, Any]]:
        """The gateway's engines (in or out of service, with several) and whether each answered the node's probe."""
        engine = self._engine()
        listed = engine.status() if hasattr(engine, "status") else [{"url": self.config.gateway.upstream, "in_service": True}]
        reach = {probe.url: probe for probe in self.node.engines}
        for entry in listed:
            probe = reach.get(entry["url"])
            entry.update(reachable=probe.reachable if probe else None, **({"error": probe.error} if probe and probe.error else {}))
        return listed

    def take_out_engine(self, url: str) -> list[dict[str, Any]]:
        self._router().take_out(url)
        return self.engines()

    def put_back_engine(self, url: str) -> list[dict[str, Any]]:
        self._router().put_back(url)
        return self.engines()

    def _engine(self) -> Any:
        master = self.node.gateway.master
        return master.addons.get("polaraddon").engine if master is not None else None

    def _router(self) -> Any:
        engine = self._engine()
        if not hasattr(engine, "take_out"):
            raise ValueError(f"node {self.name} has one engine ({self.config.gateway.upstream}); start it with several --upstream to route")
        return engine

    async def control(self, call: dict[str, Any]) -> dict[str, Any]:
        """A control call (pause/resume/status) on this node's gateway: its GatewayReply."""
        return (await self.node.control(ControlCall.model_validate(call))).model_dump()

    async def snapshot(self) -> dict[str, Any]:
        db = Path(self.config.gateway.db).resolve()
        return (await asyncio.to_thread(self.node.store.snapshot, self.name, snapshot_dir(db))).model_dump()

    async def read_file(self, path: str, offset: int, length: int) -> bytes:
        """A byte range of one of this store's segment or snapshot files, for a head that cannot read this disk."""
        return await asyncio.to_thread(read_range, Path(self.config.gateway.db).resolve(), path, offset, length)

    async def stop(self) -> None:
        for run in self.runs.values():
            run.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        await self.node.stop()
