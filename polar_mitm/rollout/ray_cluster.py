"""The rollout server scaled out on Ray: one GatewayNode actor per Ray node, the head dispatching sessions to them.

    polar-mitm rollout serve --ray [ADDRESS] --upstream URL [--upstream URL ...] --db /shared/polar.duckdb

or, inside a trainer's own Ray job (ray.init already called), RolloutCluster:

    async with RolloutCluster(ClusterConfig(node=NodeConfig(gateway=GatewayConfig(upstream=..., db=...)))) as cluster:
        result = await cluster.run(TaskRequest(...))

Placement. Every alive Ray node with the `polar_node` resource gets one detached, named actor (ray_node.py),
pinned there by a hard node affinity and holding the whole resource; its store is `<db stem>.<node><suffix>`
beside `--db` (the node name is the node's `polar-node` label, else `node-<ray node id>`, so a node restarted
with the same label gets its store back). Nodes that join later are picked up by the monitor.

Dispatch. Sessions wait in one head queue ordered by `dispatch_priority` (higher first), then arrival. A node
takes at most `prepare + run` of its stage limits at once (admission: a session dispatched there starts
preparing at once or waits for a run slot there); the queue goes to the node with the lowest fill, so sessions
spread. Sessions given to one node at the same moment may start there in either order (Ray does not order an
async actor's calls). `GET /nodes` shows each node's sessions by stage and the head queue. A draining node (`DELETE
/nodes/NAME`) gets nothing new and finishes what it has.

Failure. The head records "dispatched to N" before calling N. If N's actor dies (the node's processes killed,
the machine lost), its sessions whose harness had started end `failed`, with the exchanges its store had
committed (counted from the store file when the head can read it); those N had not started (last seen queued or
preparing, no exchange in N's store) and those still in the head queue go to the other nodes. Nothing runs
twice: a session with anything recorded is never dispatched again. N's store stays on N's disk; when N comes
back under the same label its actor reopens the store, marks those sessions failed there too, and the head reads
it again.

Data. Trajectories are assembled by the head over every node's store (cluster_store.py: each node's Parquet
segments plus a fresh journal tail, read through paths: one machine or a shared file system), so GRPO group
advantages span nodes. `<output>/cluster.duckdb` is a catalog of views over every node's files, refreshed
after each task and by `GET /sql`: `polar-mitm sql --db <output>/cluster.duckdb "SELECT node, count(*) FROM
exchanges GROUP BY node"`.

Durability: head_store.py.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Body, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from polar_mitm.errors import RequestRejected
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.cluster_store import (
    NodeData,
    NodeSnapshot,
    UnionStore,
    pull_snapshot,
    snapshot_closed_store,
    snapshot_dir,
    write_catalog,
)
from polar_mitm.rollout.head_store import HeadStore
from polar_mitm.rollout.models import Delivery, SessionResult, TaskRequest, TaskResult
from polar_mitm.rollout.node import NodeConfig, export_sessions
from polar_mitm.rollout.ray_node import NAMESPACE, NODE_RESOURCE, NodeActor
from polar_mitm.rollout.scheduler import Report, Scheduler, SessionWork, Task, _uncancel

log = logging.getLogger("polar_mitm.rollout.ray")

NODE_LABEL = "polar-node"


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
    return db.with_name(f"{db.stem}.{name}{db.suffix}")


@dataclass
class NodeHandle:
    name: str
    ray_node_id: str
    actor: Any
    info: dict[str, Any]
    capacity: int
    db: Path
    active: set[str] = field(default_factory=set)
    alive: bool = True
    draining: bool = False
    last_load: dict[str, Any] = field(default_factory=dict)
    last_snapshot: NodeSnapshot | None = None

    def status(self) -> dict[str, Any]:
        stages: dict[str, int] = {}
        for snapshot in (self.last_load.get("active") or {}).values():
            status = snapshot["status"] if snapshot else "queued"
            stages[status] = stages.get(status, 0) + 1
        return {
            "name": self.name, "ray_node_id": self.ray_node_id, "alive": self.alive, "draining": self.draining, "capacity": self.capacity,
            "dispatched": len(self.active), "stages": stages, "finished": self.last_load.get("finished", 0), "db": str(self.db),
            "gateway": self.info.get("gateway"), "engines": self.last_load.get("engines", []),
        }


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray import exceptions

    return tuple(getattr(exceptions, name) for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError") if hasattr(exceptions, name))


class RayNodes:
    """Implements scheduler.Node over the cluster's node actors."""

    def __init__(self, config: ClusterConfig, head: HeadStore):
        self.config = config
        self.head = head
        self.nodes: dict[str, NodeHandle] = {}
        self.queue: list[tuple[int, int, str, asyncio.Future]] = []
        self.order = itertools.count()
        self.reports: dict[str, Report] = {}
        self.monitor: asyncio.Task | None = None
        self.ray_started_here = False
        self.actor_errors = _actor_errors()

    # -- membership
    async def start(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.config.address, namespace=NAMESPACE, logging_level=logging.WARNING, configure_logging=False)
            self.ray_started_here = True
        await self.discover()
        if not self.nodes:
            raise RuntimeError(f"no alive Ray node carries the {NODE_RESOURCE!r} resource (ray start ... --resources '{{\"{NODE_RESOURCE}\": 1}}')")
        self.monitor = asyncio.create_task(self._monitor(), name="polar ray monitor")

    async def discover(self) -> None:
        """Attach to (or create) the actor of every alive Ray node with the polar_node resource."""
        import ray

        found = await asyncio.to_thread(ray.nodes)
        starting = []
        for entry in found:
            if not entry.get("Alive") or not entry.get("Resources", {}).get(NODE_RESOURCE):
                continue
            node_id = entry["NodeID"]
            name = (entry.get("Labels") or {}).get(NODE_LABEL) or f"node-{node_id[:12]}"
            known = self.nodes.get(name)
            if known is not None and known.alive and known.ray_node_id == node_id:
                continue
            starting.append(self._attach(name, node_id))
        if starting and not self.nodes:
            # the first node makes the confdir's CA and secret; on a shared disk the others must not race it
            first, *rest = starting
            outcomes = [*await asyncio.gather(first, return_exceptions=True), *await asyncio.gather(*rest, return_exceptions=True)]
        else:
            outcomes = await asyncio.gather(*starting, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.warning(f"polar ray: a node actor did not start: {outcome!r}")
        self._dispatch()

    async def _attach(self, name: str, node_id: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_name = f"polar-node-{name}"
        gateway = self.config.node.gateway.model_copy(update={"db": node_db(self.config.node.gateway.db, name)})
        wanted = self.config.node.model_copy(update={"gateway": gateway}).model_dump(mode="json")
        info = None
        try:  # a node actor a previous head left running: re-attached if it has this config, else replaced
            actor = ray.get_actor(actor_name, namespace=NAMESPACE)
            info = await asyncio.wait_for(actor.start.remote(), 180)
            if info.get("config") != wanted:
                log.warning(f"polar ray: node actor {actor_name} runs another configuration ({info.get('db')}); replacing it")
                ray.kill(actor)
                info = None
        except ValueError:
            pass  # none
        except self.actor_errors:
            info = None  # one that is going away
        if info is None:
            await _name_released(actor_name)
            actor = ray.remote(NodeActor).options(
                name=actor_name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, resources={NODE_RESOURCE: 1}, max_concurrency=10_000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(name, wanted)
            info = await asyncio.wait_for(actor.start.remote(), 180)
        limits = self.config.node.limits
        handle = NodeHandle(name=name, ray_node_id=info["ray_node_id"], actor=actor, info=info, capacity=limits.prepare + limits.run, db=Path(info["db"]))
        previous = self.nodes.get(name)
        if previous is not None:
            handle.draining = previous.draining
        self.nodes[name] = handle
        log.info(f"polar ray: node {name} up: gateway {info['gateway']}, store {info['db']}")

    def drain(self, name: str, draining: bool = True) -> NodeHandle:
        node = self.nodes[name]
        node.draining = draining
        self._dispatch()
        return node

    def status(self) -> dict[str, Any]:
        queued = sorted(self.queue)
        return {
            "nodes": [node.status() for node in self.nodes.values()],
            "queue": {"sessions": sum(not f.done() for *_, f in queued), "priorities": sorted({-p for p, *_ in queued}, reverse=True)},
        }

    def health(self) -> dict[str, Any]:
        return {"ray": True, "nodes": {n.name: n.alive for n in self.nodes.values()}, "head_db": str(self.config.head_db), "limits": self.config.node.limits.model_dump()}

    # -- the Node interface
    async def check(self, request: TaskRequest) -> None:
        usable = [n for n in self.nodes.values() if n.alive and not n.draining]
        if not usable:
            raise RequestRejected(("runtime",), "no gateway node is alive and accepting sessions")
        rejection = await usable[0].actor.check.remote(request.model_dump(mode="json"))
        if rejection is not None:
            raise RequestRejected(tuple(rejection["loc"]), rejection["message"])

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        state = self.head.session_state(work.session_id)
        if state is not None and state[2] is not None:
            return state[2]  # it ended before the head restarted
        if state is not None and state[0] is not None:
            return await self._reattach(work, state[0], report)
        while True:
            try:
                node = await self._admit(work)
            except asyncio.CancelledError:
                _uncancel()
                result = _placeholder(work).model_copy(update={"status": "cancelled", "error": "cancelled before it was dispatched"})
                self.head.session_ended(result)
                return result
            self.head.dispatched(work.session_id, node.name)
            self.reports[work.session_id] = report
            ref = node.actor.run_session.remote(work.model_dump(mode="json"))
            result = await self._follow(node, work, ref)
            if result is not None:
                return result
            log.warning(f"polar ray: session {work.session_id} had not started on lost node {node.name}; dispatching it again")

    async def _admit(self, work: SessionWork) -> NodeHandle:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self.queue, (-work.request.dispatch_priority, next(self.order), work.session_id, future))
        self._dispatch()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # a node was given at the same moment: give it back
                future.result().active.discard(work.session_id)
                self._dispatch()
            raise

    def _dispatch(self) -> None:
        while self.queue:
            open_nodes = [n for n in self.nodes.values() if n.alive and not n.draining and len(n.active) < n.capacity]
            if not open_nodes:
                return
            _, _, session_id, future = heapq.heappop(self.queue)
            if future.done():
                continue
            node = min(open_nodes, key=lambda n: (len(n.active) / n.capacity, len(n.active), n.name))
            node.active.add(session_id)
            future.set_result(node)

    async def _follow(self, node: NodeHandle, work: SessionWork, ref: Any, rerun: bool = True) -> SessionResult | None:
        """Wait for the node's result; a cancel here is sent to the node, whose result (cancelled) is still awaited.
        None: the node died before the session started there (and `rerun`): it may be dispatched again."""
        cancel_sent = False
        result: SessionResult | None = None
        try:
            while True:
                try:
                    result = SessionResult.model_validate(await ref)
                    break
                except asyncio.CancelledError:
                    _uncancel()
                    if not cancel_sent:
                        node.actor.cancel.remote(work.session_id)
                        cancel_sent = True
        except self.actor_errors as error:
            self._lost(node, error)
            if rerun and not cancel_sent and await self._never_started(node, work.session_id):
                self.head.requeued(work.session_id)
                return None
            result = await self._failed_on_lost_node(node, work, error)
        finally:
            node.active.discard(work.session_id)
            self.reports.pop(work.session_id, None)
            self._dispatch()
        result = result.model_copy(update={"node": node.name})
        self.head.session_ended(result)
        return result

    async def count_exchanges(self, session_id: str) -> int:
        """A running session's exchanges so far, read from the store of the node that runs it (0 while unknown)."""
        for node in self.nodes.values():
            if session_id in (node.last_load.get("active") or {}):
                counted = await asyncio.to_thread(_count_exchanges, node.db, session_id, 2.0)
                return counted or 0
        return 0

    async def _never_started(self, node: NodeHandle, session_id: str) -> bool:
        """The lost node had not started its harness (its last snapshot: queued or preparing) and its store holds no
        exchange of it: nothing of the session is recorded anywhere, so it may run on another node."""
        active = node.last_load.get("active") or {}
        snapshot = active.get(session_id)
        if session_id in active and snapshot is not None and snapshot["status"] not in ("queued", "preparing"):
            return False
        if session_id not in active and node.last_load:
            return False  # dispatched after the last poll: unknown, so not run twice
        return await asyncio.to_thread(_count_exchanges, node.db, session_id) == 0  # None: unreadable, so not known

    async def _reattach(self, work: SessionWork, name: str, report: Report) -> SessionResult:
        """A session the previous head dispatched: its node's result, never a second run."""
        node = self.nodes.get(name)
        if node is None or not node.alive:
            result = await self._failed_on_lost_node(node, work, None, name=name)
            self.head.session_ended(result)
            return result
        node.active.add(work.session_id)
        self.reports[work.session_id] = report
        try:
            found = await node.actor.result.remote(work.session_id)
        except self.actor_errors as error:
            found = None
            self._lost(node, error)
        if found is None:
            node.active.discard(work.session_id)
            self.reports.pop(work.session_id, None)
            result = await self._failed_on_lost_node(node, work, None, name=name, why="the node no longer has it (a restarted node); not run again")
            self.head.session_ended(result)
            return result
        result = await self._follow(node, work, node.actor.result.remote(work.session_id), rerun=False)
        assert result is not None
        return result

    async def _failed_on_lost_node(self, node: NodeHandle | None, work: SessionWork, error: BaseException | None, name: str | None = None, why: str | None = None) -> SessionResult:
        name = node.name if node else name
        last = (node.last_load.get("active") or {}).get(work.session_id) if node else None
        result = SessionResult.model_validate(last) if last else _placeholder(work)
        db = node.db if node else node_db(self.config.node.gateway.db, str(name))
        kept = await asyncio.to_thread(_count_exchanges, db, work.session_id)
        n_exchanges = kept if kept is not None else result.n_exchanges
        reason = why or (f"its node {name} died mid-session ({type(error).__name__})" if error else f"its node {name} is gone")
        return result.model_copy(update={
            "status": "failed", "n_exchanges": n_exchanges,
            "error": f"{reason}; the {n_exchanges} exchange(s) it committed stay in {db} and in the cluster's SQL",
        })

    def _lost(self, node: NodeHandle, error: BaseException) -> None:
        if node.alive:
            log.warning(f"polar ray: node {node.name} lost: {type(error).__name__}: {error}")
        node.alive = False
        self._dispatch()

    async def _monitor(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.config.poll_interval)
            rounds += 1
            alive = [n for n in self.nodes.values() if n.alive]
            loads = await asyncio.gather(*(asyncio.wait_for(_await(n.actor.load.remote()), 30) for n in alive), return_exceptions=True)
            for node, load in zip(alive, loads, strict=True):
                if isinstance(load, self.actor_errors):
                    self._lost(node, load)
                elif isinstance(load, dict):
                    node.last_load = load
                    for session_id, snapshot in load["active"].items():
                        report = self.reports.get(session_id)
                        if report is not None and snapshot is not None:
                            report(SessionResult.model_validate(snapshot))
            if rounds % 10 == 0:
                try:
                    await self.discover()
                except Exception as failure:  # noqa: BLE001 - membership is retried next round
                    log.warning(f"polar ray: node discovery failed: {failure!r}")

    # -- data
    async def snapshots(self) -> list[NodeSnapshot]:
        """Every node's store as Parquet: live nodes snapshot themselves; a dead node's file is read by the head."""
        nodes = list(self.nodes.values())

        async def one(node: NodeHandle) -> NodeSnapshot | None:
            if node.alive:
                try:
                    taken = NodeSnapshot.model_validate(await node.actor.snapshot.remote())
                    node.last_snapshot = await pull_snapshot(taken, self.config.output_dir / "nodes" / node.name, self._reader(node), self.config.node_data)
                    return node.last_snapshot
                except self.actor_errors as error:
                    self._lost(node, error)
            try:
                node.last_snapshot = await asyncio.to_thread(snapshot_closed_store, node.db, node.name, snapshot_dir(node.db))
            except Exception as failure:  # noqa: BLE001 - not on this machine's disk, or still locked: its last snapshot
                log.warning(f"polar ray: cannot read node {node.name}'s store {node.db}: {failure!r}")
            return node.last_snapshot

        return [s for s in await asyncio.gather(*(one(n) for n in nodes)) if s is not None]

    @staticmethod
    def _reader(node: NodeHandle) -> Any:
        async def read(path: str, offset: int, length: int) -> bytes:
            return await node.actor.read_file.remote(path, offset, length)

        return read

    async def refresh_catalog(self) -> tuple[Path, list[NodeSnapshot]]:
        snapshots = await self.snapshots()
        assert self.config.output_dir is not None
        return await asyncio.to_thread(write_catalog, self.config.output_dir / "cluster.duckdb", snapshots), snapshots

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        _, snapshots = await self.refresh_catalog()
        assert self.config.output_dir is not None

        def export() -> tuple[str, dict[str, Any]]:
            union = UnionStore(snapshots)
            try:
                path, stats = export_sessions(union, task_id, session_ids, builder, options, self.config.output_dir / f"{task_id}.parquet")
            finally:
                union.close()
            return str(path), {**stats, "nodes": sorted(s.node for s in snapshots)}

        return await asyncio.to_thread(export)

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only query over every node's store (fresh snapshots)."""
        from polar_mitm.store import check_read_only

        check_read_only(sql)
        _, snapshots = await self.refresh_catalog()
        union = UnionStore(snapshots)
        try:
            return await asyncio.to_thread(union.query, sql)
        finally:
            union.close()

    async def stop(self) -> None:
        import ray

        if self.monitor is not None:
            self.monitor.cancel()
            await asyncio.gather(self.monitor, return_exceptions=True)
        if not self.config.keep_nodes:
            for node in self.nodes.values():
                if node.alive:
                    try:
                        await asyncio.wait_for(_await(node.actor.stop.remote()), 60)
                    except Exception as failure:  # noqa: BLE001 - killed below either way
                        log.warning(f"polar ray: node {node.name} did not stop cleanly: {failure!r}")
                    ray.kill(node.actor)
            await asyncio.gather(*(_name_released(f"polar-node-{name}") for name in self.nodes))
        if self.ray_started_here:
            ray.shutdown()


async def _name_released(actor_name: str, timeout: float = 60.0) -> None:
    """Wait until no actor holds `actor_name` (a killed actor keeps its name until Ray has reaped it)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:
            return
        await asyncio.sleep(0.2)


async def _await(ref: Any) -> Any:
    return await ref


def _placeholder(work: SessionWork) -> SessionResult:
    request = work.request
    return SessionResult(
        session_id=work.session_id, task_id=work.task_id, sample_index=work.sample_index, status="queued",
        harness=request.agent.harness, model=request.agent.model, metadata=request.metadata,
    )


def _count_exchanges(db: Path, session_id: str, patience: float = 30.0) -> int | None:
    """What a dead node's store holds of a session, read from its file (None: not readable from here). A node
    process that is still exiting holds the file (or answers nothing on its SQL port) for a moment: retried."""
    from polar_mitm import store

    deadline = time.monotonic() + patience
    while True:
        try:
            _, rows = store.query(db, "SELECT count(*) FROM exchanges WHERE session_id = ?", [session_id], timeout=5)
            return int(rows[0][0])
        except Exception:  # noqa: BLE001 - another machine's disk, or the file still locked
            if time.monotonic() > deadline or not db.exists():
                return None
            time.sleep(1.0)


class DurableCallbackSender(CallbackSender):
    """Deliveries recorded in the head store: one acknowledged is never sent again (also across head restarts)."""

    def __init__(self, head: HeadStore, **options: Any):
        super().__init__(**options)
        self.head = head

    async def deliver(self, delivery: Delivery, payload: dict[str, Any]) -> Delivery:
        stored = self.head.delivery(delivery.delivery_id)
        if stored is not None and stored.status == "delivered":
            delivery.status, delivery.attempts, delivery.delivered_at, delivery.last_error = stored.status, stored.attempts, stored.delivered_at, None
            return delivery
        if stored is not None:
            delivery.attempts = stored.attempts
        self.head.save_delivery(delivery)
        await super().deliver(delivery, payload)
        self.head.save_delivery(delivery)
        return delivery


class RayScheduler(Scheduler):
    """The Scheduler over RayNodes, with every task, session state and delivery in the head store."""

    def __init__(self, nodes: RayNodes, head: HeadStore, callbacks: CallbackSender | None = None):
        super().__init__(nodes, callbacks or DurableCallbackSender(head))
        self.nodes = nodes
        self.head = head

    async def submit(self, request: TaskRequest) -> Task:
        task = await super().submit(request)
        # no await between the sessions' creation and here: recorded before any of them is dispatched
        self.head.add_task(task.task_id, task.request, list(task.sessions), task.created_at)
        return task

    async def _finish(self, task: Task) -> None:
        if task.finished_at is not None:  # finished before a restart: only its delivery may be owed
            if task.request.callback_url:
                delivery = Delivery(delivery_id=f"{task.task_id}:task_result", kind="task_result", url=task.request.callback_url)
                task.deliveries.append(delivery)
                await self.callbacks.deliver(delivery, task.result().model_dump(mode="json"))
            return
        await super()._finish(task)
        assert task.finished_at is not None
        self.head.task_finished(task.task_id, task.finished_at, task.trajectories, task.trajectory_stats, task.early_stopped)

    def recover(self) -> int:
        """Every task the head store holds, back in memory; unfinished sessions re-attached or dispatched.
        Returns how many tasks came back."""
        recovered = 0
        for stored in self.head.tasks():
            if stored.task_id in self.tasks:
                continue
            task = Task(task_id=stored.task_id, request=stored.request, created_at=stored.created_at, finished_at=stored.finished_at,
                        trajectories=stored.trajectories, trajectory_stats=stored.trajectory_stats, early_stopped=stored.early_stopped)
            self.tasks[task.task_id] = task
            for index, session_id in enumerate(stored.session_ids):
                work = SessionWork(session_id=session_id, task_id=task.task_id, sample_index=index, request=stored.request)
                _, _, final = stored.sessions.get(session_id, (None, "queued", None))
                task.sessions[session_id] = final or _placeholder(work)
                self.session_tasks[session_id] = task.task_id
                task.runs[session_id] = asyncio.create_task(self._run_session(task, work), name=f"session {session_id}")
            recovered += 1
        return recovered


class RolloutCluster:
    """The Python entry point: the rollout head in this process, for a trainer's driver inside its own Ray job.

        gateway = GatewayConfig(upstream="http://127.0.0.1:30000/v1", db="/shared/polar.duckdb")
        async with RolloutCluster(ClusterConfig(node=NodeConfig(gateway=gateway))) as cluster:
            result = await cluster.run(TaskRequest(...))  # or submit(...), then wait(task_id)
            batch = polar_mitm.client.load_batch(result.trajectories)

    It joins the Ray cluster this process is connected to (the job's own, when ray.init was called; else
    `config.address`) and puts one node actor on every Ray node with the `polar_node` resource. All methods run
    on the event loop that started it. `close()` (or leaving the `async with`) cancels unfinished sessions and
    stops the node actors, unless `config.keep_nodes`; a Ray connection the trainer made stays open.
    """

    def __init__(self, config: ClusterConfig):
        self.config = config.resolved()
        assert self.config.head_db is not None
        self.head = HeadStore(self.config.head_db)
        self.nodes = RayNodes(self.config, self.head)
        self.scheduler = RayScheduler(self.nodes, self.head)
        self.recovered = 0
        self.started = False

    @classmethod
    async def start(cls, config: ClusterConfig) -> RolloutCluster:
        """A started cluster: node actors up; the tasks a previous head with this head_db had accepted, recovered."""
        cluster = cls(config)
        await cluster._start()
        return cluster

    async def _start(self) -> None:
        await self.nodes.start()
        self.recovered = self.scheduler.recover()
        self.started = True

    async def __aenter__(self) -> RolloutCluster:
        if not self.started:
            await self._start()
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
        return await self.nodes.query(sql)

    def status(self) -> dict[str, Any]:
        """Every node (alive, draining, sessions by stage, engines) and the head queue, as `GET /nodes` shows them."""
        return self.nodes.status()

    def drain(self, node: str, draining: bool = True) -> dict[str, Any]:
        """Send nothing new to `node` (what it runs finishes there); draining=False takes it back. KeyError: no node."""
        return self.nodes.drain(node, draining).status()

    def health(self) -> dict[str, Any]:
        return self.nodes.health()

    async def close(self) -> None:
        if self.config.keep_nodes:
            await self.scheduler.callbacks.close()  # the sessions go on in the nodes; a later head re-attaches to them
        else:
            await self.scheduler.close()
        await self.nodes.stop()
        self.head.close()


def create_ray_app(config: ClusterConfig) -> Any:
    """The rollout server's API (server.py) with the cluster as its backend, plus:

        GET    /nodes                    every node: alive, draining, sessions by stage, engines; the head queue
        DELETE /nodes/{name}             drain: nothing new goes there; what runs there finishes
        POST   /nodes/{name}/engines/{take-out|put-back}
                                         {"url": ...}: one of the node's engines out of / back in service
        GET    /sql?q=SELECT...          one read-only query over every node's store
    """
    from polar_mitm.rollout.server import create_app

    @asynccontextmanager
    async def backend():
        cluster = await RolloutCluster.start(config)
        try:
            yield cluster, cluster.scheduler
        finally:
            await cluster.close()

    app = create_app(None, backend=backend)

    def cluster_of(request: Request) -> RolloutCluster:
        return request.app.state.node

    def unknown(name: str) -> JSONResponse:
        return JSONResponse(status_code=404, content={"message": f"no node {name!r}", "detail": f"no node {name!r}"})

    @app.get("/nodes")
    async def nodes(request: Request) -> Any:
        return cluster_of(request).nodes.status()

    @app.delete("/nodes/{name}", status_code=202)
    async def drain(name: str, request: Request) -> Any:
        cluster = cluster_of(request)
        if name not in cluster.nodes.nodes:
            return unknown(name)
        return cluster.nodes.drain(name).status()

    @app.post("/nodes/{name}/engines/{action}")
    async def engine(name: str, action: str, request: Request, url: str = Body(embed=True)) -> Any:
        cluster = cluster_of(request)
        if name not in cluster.nodes.nodes or action not in ("take-out", "put-back"):
            return unknown(name) if name not in cluster.nodes.nodes else JSONResponse(status_code=404, content={"message": f"no action {action!r} (take-out, put-back)"})
        actor = cluster.nodes.nodes[name].actor
        try:
            return await (actor.take_out_engine if action == "take-out" else actor.put_back_engine).remote(url)
        except Exception as error:  # noqa: BLE001 - the node's answer (unknown URL, a single engine)
            return JSONResponse(status_code=400, content={"message": str(error).splitlines()[-1]})

    @app.get("/sql")
    async def sql(q: str, request: Request) -> Any:
        try:
            columns, rows = await cluster_of(request).query(q)
        except Exception as error:  # noqa: BLE001 - the query's error, to the caller
            return JSONResponse(status_code=400, content={"message": f"{type(error).__name__}: {error}"})
        return {"columns": columns, "rows": jsonable_encoder([list(r) for r in rows]), "catalog": str(cluster_of(request).config.output_dir / "cluster.duckdb")}

    return app
