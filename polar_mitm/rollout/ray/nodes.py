"""The head's view of its gateway nodes: one handle per node actor, membership, dispatch, failure, control.

Placement. Every alive Ray node with the `polar_node` resource gets one detached, named actor (actor.py),
pinned there by a hard node affinity and holding the whole resource; its store is `<db stem>.<node><suffix>`
beside `--db` (the node name is the node's `polar-node` label, else `node-<ray node id>`, so a node restarted
with the same label gets its store back). Nodes that join later are picked up by the monitor.

Dispatch. Sessions wait in one head queue ordered by `dispatch_priority` (higher first), then arrival. A node
takes at most `prepare + run` of its stage limits at once (admission: a session dispatched there starts
preparing at once or waits for a run slot there); the queue goes to the node with the lowest fill, so sessions
spread. Sessions given to one node at the same moment may start there in either order (Ray does not order an
async actor's calls). A draining node gets nothing new and finishes what it has.

Failure. The head records "dispatched to N" before calling N. If N's actor dies (the node's processes killed,
the machine lost), its sessions whose harness had started end `failed`, with the exchanges its store had
committed (counted from the store file when the head can read it); those N had not started (last seen queued or
preparing, no exchange in N's store) and those still in the head queue go to the other nodes. Nothing runs
twice: a session with anything recorded is never dispatched again. N's store stays on N's disk; when N comes
back under the same label its actor reopens the store, marks those sessions failed there too, and the head reads
it again.

Control. `control` sends a gateway control call to every alive node's actor at once (the actor calls its own
gateway on its loopback) and returns once every one has answered: a pause(drain) returns when no node's gateway
has an engine call in flight.

Start-up. `start` fails with one line (BackendStartError) when there is no Ray cluster at the address, when Ray
cannot be joined, or when no alive node carries `polar_node`; the connection it made is closed again.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.errors import BackendStartError, RequestRejected
from polar_mitm.rollout.backend import ControlCall, GatewayReply
from polar_mitm.rollout.durable import DurableStore
from polar_mitm.rollout.models import SessionResult, TaskRequest
from polar_mitm.rollout.ray.actor import NodeActor
from polar_mitm.rollout.ray.config import (
    NAMESPACE,
    NODE_LABEL,
    NODE_RESOURCE,
    START_NODE,
    ClusterConfig,
    actor_name,
    check_address,
    node_db,
)
from polar_mitm.rollout.session_run import Report, SessionWork, queued_result, uncancel
from polar_mitm.store.snapshots import NodeSnapshot

log = logging.getLogger("polar_mitm.rollout.ray")


@dataclass
class NodeHandle:
    name: str
    ray_node_id: str
    actor: Any  # the node actor's Ray handle (ray.actor.ActorHandle; Ray is imported only when used)
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
            "gateway": self.info.get("gateway"), "engines": self.last_load.get("engines", []), "engine_reachable": self.last_load.get("engine_reachable"),
        }


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray import exceptions

    return tuple(getattr(exceptions, name) for name in ("RayActorError", "ActorDiedError", "ActorUnavailableError") if hasattr(exceptions, name))


class RayNodes:
    """Implements scheduler.Node's sessions over the cluster's node actors (the task export is data.py's)."""

    def __init__(self, config: ClusterConfig, head: DurableStore):
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
            check_address(self.config.address)
            try:
                ray.init(address=self.config.address, namespace=NAMESPACE, logging_level=logging.WARNING, configure_logging=False)
            except Exception as error:  # noqa: BLE001 - any way Ray cannot be joined is one line
                raise BackendStartError(f"cannot join the Ray cluster at {self.config.address}: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}") from None
            self.ray_started_here = True
        failures = await self.discover()
        if not self.nodes:
            why = f"; the node actors did not start: {failures[0]!r}" if failures else f" (start one: {START_NODE})"
            raise BackendStartError(f"no alive Ray node carries the {NODE_RESOURCE!r} resource{why}")
        self.monitor = asyncio.create_task(self._monitor(), name="polar ray monitor")

    async def discover(self) -> list[BaseException]:
        """Attach to (or create) the actor of every alive Ray node with the polar_node resource; returns why each
        actor that did not start did not."""
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
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for failure in failures:
            log.warning(f"polar ray: a node actor did not start: {failure!r}")
        self._dispatch()
        return failures

    async def _attach(self, name: str, node_id: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        gateway = self.config.node.gateway.model_copy(update={"db": node_db(self.config.node.gateway.db, name)})
        wanted = self.config.node.model_copy(update={"gateway": gateway}).model_dump(mode="json")
        info = None
        try:  # a node actor a previous head left running: re-attached if it has this config, else replaced
            actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
            info = await asyncio.wait_for(actor.start.remote(), 180)
            if info.get("config") != wanted:
                log.warning(f"polar ray: node actor {actor_name(name)} runs another configuration ({info.get('db')}); replacing it")
                ray.kill(actor)
                info = None
        except ValueError:
            pass  # none
        except self.actor_errors:
            info = None  # one that is going away
        if info is None:
            await name_released(actor_name(name))
            actor = ray.remote(NodeActor).options(
                name=actor_name(name), namespace=NAMESPACE, lifetime="detached", num_cpus=0, resources={NODE_RESOURCE: 1}, max_concurrency=10_000,
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
        reach = {n.name: n.last_load.get("engine_reachable") for n in self.nodes.values() if n.alive}
        known = [r for r in reach.values() if r is not None]
        return {
            "ray": True, "nodes": {n.name: n.alive for n in self.nodes.values()}, "engine_reachable": all(known) if known else None,
            "engine_reachable_by_node": reach, "head_db": str(self.config.head_db), "limits": self.config.node.limits.model_dump(),
        }

    # -- control
    async def control(self, call: ControlCall) -> dict[str, GatewayReply]:
        """`call` on every alive node's gateway at once; node name -> its gateway's reply (503: the node was lost)."""
        alive = [n for n in self.nodes.values() if n.alive]

        async def one(node: NodeHandle) -> GatewayReply:
            try:
                return GatewayReply.model_validate(await node.actor.control.remote(call.model_dump()))
            except self.actor_errors as error:
                self.mark_lost(node, error)
                return GatewayReply(status=503, body={"error": {"type": "node_lost", "message": f"node {node.name} was lost: {type(error).__name__}"}})

        return dict(zip((n.name for n in alive), await asyncio.gather(*(one(n) for n in alive)), strict=True))

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
                uncancel()
                result = queued_result(work).model_copy(update={"status": "cancelled", "error": "cancelled before it was dispatched"})
                self.head.session_ended(result)
                return result
            self.head.dispatched(work.session_id, node.name)
            self.reports[work.session_id] = report
            ref = node.actor.run_session.remote(work.model_dump(mode="json"))
            result = await self._follow(node, work, ref)
            if result is not None:
                return result
            log.warning(f"polar ray: session {work.session_id} had not started on lost node {node.name}; dispatching it again")

    async def count_exchanges(self, session_id: str) -> int:
        """A running session's exchanges so far, read from the store of the node that runs it (0 while unknown)."""
        for node in self.nodes.values():
            if session_id in (node.last_load.get("active") or {}):
                counted = await asyncio.to_thread(count_in_store, node.db, session_id, 2.0)
                return counted or 0
        return 0

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

    # -- failure
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
                    uncancel()
                    if not cancel_sent:
                        node.actor.cancel.remote(work.session_id)
                        cancel_sent = True
        except self.actor_errors as error:
            self.mark_lost(node, error)
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

    async def _never_started(self, node: NodeHandle, session_id: str) -> bool:
        """The lost node had not started its harness (its last snapshot: queued or preparing) and its store holds no
        exchange of it: nothing of the session is recorded anywhere, so it may run on another node."""
        active = node.last_load.get("active") or {}
        snapshot = active.get(session_id)
        if session_id in active and snapshot is not None and snapshot["status"] not in ("queued", "preparing"):
            return False
        if session_id not in active and node.last_load:
            return False  # dispatched after the last poll: unknown, so not run twice
        return await asyncio.to_thread(count_in_store, node.db, session_id) == 0  # None: unreadable, so not known

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
            self.mark_lost(node, error)
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
        result = SessionResult.model_validate(last) if last else queued_result(work)
        db = node.db if node else node_db(self.config.node.gateway.db, str(name))
        kept = await asyncio.to_thread(count_in_store, db, work.session_id)
        n_exchanges = kept if kept is not None else result.n_exchanges
        reason = why or (f"its node {name} died mid-session ({type(error).__name__})" if error else f"its node {name} is gone")
        return result.model_copy(update={
            "status": "failed", "n_exchanges": n_exchanges,
            "error": f"{reason}; the {n_exchanges} exchange(s) it committed stay in {db} and in the cluster's SQL",
        })

    def mark_lost(self, node: NodeHandle, error: BaseException) -> None:
        """The node is gone (its actor died): nothing more is dispatched to it."""
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
            loads = await asyncio.gather(*(asyncio.wait_for(wait_ref(n.actor.load.remote()), 30) for n in alive), return_exceptions=True)
            for node, load in zip(alive, loads, strict=True):
                if isinstance(load, self.actor_errors):
                    self.mark_lost(node, load)
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

    async def stop(self) -> None:
        """Stop the monitor and (unless `keep_nodes`) the node actors; close the Ray connection this head made."""
        import ray

        if self.monitor is not None:
            self.monitor.cancel()
            await asyncio.gather(self.monitor, return_exceptions=True)
        if not self.config.keep_nodes:
            for node in self.nodes.values():
                if node.alive:
                    try:
                        await asyncio.wait_for(wait_ref(node.actor.stop.remote()), 60)
                    except Exception as failure:  # noqa: BLE001 - killed below either way
                        log.warning(f"polar ray: node {node.name} did not stop cleanly: {failure!r}")
                    ray.kill(node.actor)
            await asyncio.gather(*(name_released(actor_name(name)) for name in self.nodes))
        if self.ray_started_here:
            ray.shutdown()
            self.ray_started_here = False


async def name_released(name: str, timeout: float = 60.0) -> None:
    """Wait until no actor holds `name` (a killed actor keeps its name until Ray has reaped it)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        await asyncio.sleep(0.2)


async def wait_ref(ref: Any) -> Any:
    """An ObjectRef as a coroutine (what asyncio.wait_for and gather take)."""
    return await ref


def count_in_store(db: Path, session_id: str, patience: float = 30.0) -> int | None:
    """What a node's store holds of a session, read from its file or through its gateway's SQL endpoint (None: not
    readable from here). A node process that is still exiting holds the file (or answers nothing on its SQL
    port) for a moment: retried."""
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
