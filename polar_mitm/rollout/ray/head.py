"""The rollout head on Ray: `RolloutCluster` over the durable scheduler (rollout/durable.py), the backend of
`rollout serve --ray` and the Python entry point for a trainer's driver.

    polar-mitm rollout serve --ray [ADDRESS] --upstream URL [--upstream URL ...] --db /shared/polar.duckdb

or, inside a trainer's own Ray job (ray.init already called):

    async with RolloutCluster(ClusterConfig(node=NodeConfig(gateway=GatewayConfig(upstream=..., db=...)))) as cluster:
        result = await cluster.run(TaskRequest(...))

Durability: rollout/durable.py, the same store as the single-machine server's. A restarted head (same head_db)
gets back every task it had accepted (`DurableScheduler.recover`); callbacks that were acknowledged are never sent
again (`DurableCallbackSender`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_mitm.rollout.backend import ControlCall, Fleet, GatewayReply, SqlSource
from polar_mitm.rollout.durable import DurableScheduler, DurableStore
from polar_mitm.rollout.models import SessionResult, TaskRequest, TaskResult
from polar_mitm.rollout.ray.config import ClusterConfig
from polar_mitm.rollout.ray.data import ClusterData
from polar_mitm.rollout.ray.nodes import RayNodes
from polar_mitm.rollout.session_run import Report, SessionWork


class ClusterNode:
    """The whole cluster as the scheduler's one Node: sessions dispatched by RayNodes, task export by ClusterData."""

    def __init__(self, nodes: RayNodes, data: ClusterData):
        self.nodes = nodes
        self.data = data

    async def check(self, request: TaskRequest) -> None:
        await self.nodes.check(request)

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        return await self.nodes.run_session(work, report)

    async def count_exchanges(self, session_id: str) -> int:
        return await self.nodes.count_exchanges(session_id)

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        return await self.data.export_task(task_id, session_ids, builder, options)


class RolloutCluster:
    """The Python entry point: the rollout head in this process, for a trainer's driver inside its own Ray job.
    Also the Backend (backend.py) of `rollout serve --ray`: the API's /nodes, /sql and /control/* are its methods.

        gateway = GatewayConfig(upstream="http://127.0.0.1:30000/v1", db="/shared/polar.duckdb")
        async with RolloutCluster(ClusterConfig(node=NodeConfig(gateway=gateway))) as cluster:
            result = await cluster.run(TaskRequest(...))  # or submit(...), then wait(task_id)
            batch = polar_mitm.client.load_batch(result.trajectories)

    It joins the Ray cluster this process is connected to (the job's own, when ray.init was called; else
    `config.address`) and puts one node actor on every Ray node with the `polar_node` resource. All methods run
    on the event loop that started it. `close()` (or leaving the `async with`) cancels unfinished sessions and
    stops the node actors, unless `config.keep_nodes`; a Ray connection the trainer made stays open. A cluster
    that cannot start raises BackendStartError (no Ray cluster, no `polar_node` node) and leaves no head store.
    """

    def __init__(self, config: ClusterConfig):
        self.config = config.resolved()
        assert self.config.head_db is not None
        self.head = DurableStore(self.config.head_db)  # its file is made at the first write: after the nodes are up
        self.nodes = RayNodes(self.config, self.head)
        self.data = ClusterData(self.config, self.nodes)
        self.scheduler = DurableScheduler(ClusterNode(self.nodes, self.data), self.head)  # RayNodes records the session states
        self.recovered = 0
        self.started = False
        self.closed = False

    @classmethod
    async def start(cls, config: ClusterConfig) -> RolloutCluster:
        """A started cluster: node actors up; the tasks a previous head with this head_db had accepted, recovered."""
        cluster = cls(config)
        await cluster.open()
        return cluster

    async def open(self) -> None:
        """Start it (once): join Ray, the node actors up, the head store's tasks recovered."""
        if self.started:
            return
        try:
            await self.nodes.start()
        except BaseException:
            await self.nodes.stop()  # what it started: the node actors, the Ray connection it made
            raise
        self.recovered = self.scheduler.recover()
        self.started = True

    async def __aenter__(self) -> RolloutCluster:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def submit(self, request: TaskRequest | dict[str, Any]) -> TaskResult:
        """Accept a task and dispatch its sessions; returns at once: status running, every session (and its id) queued.
        Same task_id + same request: that task again; a different request under a used task_id: TaskConflict.
        A request no node can run: RequestRejected (`loc` names the field)."""
        return (await self.scheduler.submit(TaskRequest.model_validate(request))).result()

    async def wait(self, task_id: str) -> TaskResult:
        """The task once every session has ended and its trajectories are assembled (`trajectories`: a Parquet path)."""
        return (await self.scheduler.wait(task_id)).result()

    async def run(self, request: TaskRequest | dict[str, Any]) -> TaskResult:
        """submit, then wait."""
        return await self.wait((await self.submit(request)).task_id)

    def task(self, task_id: str) -> TaskResult:
        """The task as it stands now (KeyError: no such task)."""
        return self.scheduler.task(task_id).result()

    def cancel(self, task_id: str) -> TaskResult:
        """Cancel the task's unfinished sessions; wait() then returns it with status cancelled."""
        return self.scheduler.cancel_task(task_id).result()

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only query over every node's store: (columns, rows)."""
        return await self.data.query(sql)

    @property
    def catalog(self) -> Path:
        """`<output>/cluster.duckdb`: views over every node's store as of the last query or task (`polar-mitm sql`)."""
        return self.data.catalog

    def status(self) -> dict[str, Any]:
        """Every node (alive, draining, sessions by stage, engines) and the head queue, as `GET /nodes` shows them."""
        return self.nodes.status()

    def drain(self, node: str, draining: bool = True) -> dict[str, Any]:
        """Send nothing new to `node` (what it runs finishes there); draining=False takes it back. KeyError: no node."""
        return self.nodes.drain(node, draining).status()

    async def set_engine_service(self, node: str, url: str, in_service: bool) -> list[dict[str, Any]]:
        """Take one of `node`'s engines out of service or put it back: the node's engines. KeyError: no such node;
        ValueError: the node's refusal (an unknown URL, a node with one engine)."""
        actor = self.nodes.nodes[node].actor
        try:
            return await (actor.put_back_engine if in_service else actor.take_out_engine).remote(url)
        except Exception as error:  # noqa: BLE001 - the actor's exception, as the node's one-line answer
            raise ValueError(str(error).strip().splitlines()[-1]) from None

    async def control(self, call: ControlCall) -> dict[str, GatewayReply]:
        """A gateway control call (pause/resume/status) on every alive node at once: node name -> its gateway's
        reply, once every one has answered (a pause(drain): once no node has an engine call in flight)."""
        return await self.nodes.control(call)

    def health(self) -> dict[str, Any]:
        return self.nodes.health()

    @property
    def fleet(self) -> Fleet:
        return self

    @property
    def sql(self) -> SqlSource:
        return self

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.config.keep_nodes:
            await self.scheduler.callbacks.close()  # the sessions go on in the nodes; a later head re-attaches to them
        else:
            await self.scheduler.close()
        await self.nodes.stop()
        self.head.close()
