"""The rollout server's durable state: its own DuckDB file of tasks, session states and callback deliveries.

One design for both schedulers: the Ray head's (`rollout serve --ray`: ray/head.py, ray/nodes.py; file `--head-db`)
and this machine's (`rollout serve`, `rollout run`: server.LocalBackend; file `--state`, default
`<db>.rollout.duckdb` beside the node's store). Written at every step that must survive the server: a task when
it is accepted (before the 202), a session when it is started or dispatched (before the node is called) and when
it ends, a delivery before each POST and after it.

A restarted server reads it back (`DurableScheduler.recover`): every accepted task is reported again; a session
that had ended keeps its result; one that was never started is started now; one that was started is never run
again: on Ray it is re-attached to its node (failed if the node no longer knows it); on one machine its sandbox
died with the server, so it ends `failed` ("the rollout server stopped while this session ran"). A task whose
sessions all ended is assembled and delivered as before. A delivery that was not acknowledged is sent again with
its delivery id; one that was is never sent again.

One process owns the file (DuckDB locks it); it is small (no exchanges), so writes are synchronous on the event
loop. The file is created at the first read or write, not when the DurableStore is made: a server that cannot
start leaves none behind. A write that fails (a full disk) raises StateUnavailable: the API answers a new task
with 503 rather than accept what it could not persist; the first failure and the recovery are one line each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.models import Delivery, SessionResult, TaskRequest
from polar_mitm.rollout.scheduler import Node, Scheduler, Task
from polar_mitm.rollout.session_run import Report, SessionWork, queued_result
from polar_mitm.store import now

log = logging.getLogger("polar_mitm.rollout")

Record = Callable[[SessionResult], Awaitable[None]]

# the table names are the Ray head's since the start: a head store written before this module still opens
SCHEMA = [
    "CREATE TABLE IF NOT EXISTS head_tasks (task_id VARCHAR PRIMARY KEY, request JSON NOT NULL, session_ids JSON NOT NULL, "
    "created_at TIMESTAMPTZ NOT NULL, finished_at TIMESTAMPTZ, trajectories VARCHAR, trajectory_stats JSON, early_stopped BOOLEAN DEFAULT false)",
    "CREATE TABLE IF NOT EXISTS head_sessions (session_id VARCHAR PRIMARY KEY, task_id VARCHAR NOT NULL, sample_index INTEGER NOT NULL, node VARCHAR, status VARCHAR NOT NULL, "
    "result JSON, dispatched_at TIMESTAMPTZ, updated_at TIMESTAMPTZ NOT NULL)",
    "CREATE TABLE IF NOT EXISTS head_deliveries (delivery_id VARCHAR PRIMARY KEY, kind VARCHAR NOT NULL, url VARCHAR NOT NULL, status VARCHAR NOT NULL, "
    "attempts INTEGER NOT NULL, delivered_at TIMESTAMPTZ, last_error VARCHAR, updated_at TIMESTAMPTZ NOT NULL)",
]

DIED_WITH_SERVER = "the rollout server stopped while this session ran; its sandbox went with it (not run again)"
LOCAL_NODE = "local"  # the `node` of sessions started by a single-machine server


class StateUnavailable(RuntimeError):
    """The server's state file could not be read or written (a full disk, a failed write)."""


def sandbox_owner(state: Path) -> str:
    """The tag a single-machine server puts on its sandboxes (process env, container label): the same for every
    run of the server on this state file, so a restart finds what a killed one left."""
    return hashlib.sha256(str(Path(state).resolve()).encode()).hexdigest()[:16]


@dataclass
class StoredTask:
    task_id: str
    request: TaskRequest
    session_ids: list[str]
    created_at: datetime
    finished_at: datetime | None
    trajectories: str | None
    trajectory_stats: dict[str, Any] | None
    early_stopped: bool
    sessions: dict[str, tuple[str | None, str, SessionResult | None]]  # session id -> (node, status, final result)


class DurableStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self.failing: str | None = None  # the error of the last write, while writes fail

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The file's connection, opened (and the file made) on first use; call with `lock` held."""
        if self._con is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect(str(self.path))
            for statement in SCHEMA:
                con.execute(statement)
            self._con = con
        return self._con

    def _statements(self, statements: list[tuple[str, list[Any]]]) -> None:
        """Run `statements` in one transaction; StateUnavailable (logged once per outage) if they cannot commit."""
        with self.lock:
            try:
                con = self.con
                con.execute("BEGIN TRANSACTION")
                for sql, params in statements:
                    con.execute(sql, params)
                con.execute("COMMIT")
            except (duckdb.Error, OSError) as error:
                self._failed(error)
                raise StateUnavailable(f"cannot write the rollout server's state {self.path}: {error}") from error
        if self.failing is not None:
            self.failing = None
            log.warning(f"polar-mitm rollout: the server's state {self.path} is writable again")

    def _failed(self, error: BaseException) -> None:
        if self._con is not None:
            try:
                self._con.execute("ROLLBACK")
            except duckdb.Error:  # no transaction left open, or the connection is gone: open a fresh one next time
                self._con.close()
                self._con = None
        if self.failing is None:
            log.warning(f"polar-mitm rollout: cannot write the server's state {self.path} ({type(error).__name__}: {error}); new tasks are refused (503) until it can")
        self.failing = str(error)

    def _write(self, sql: str, params: list[Any]) -> None:
        self._statements([(sql, params)])

    def _read(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.con.execute(sql, params or []).fetchall()

    # -- tasks
    def add_task(self, task_id: str, request: TaskRequest, session_ids: list[str], created_at: datetime) -> None:
        """The task and its sessions (`session_ids` in sample order), in one transaction."""
        statements: list[tuple[str, list[Any]]] = [(
            "INSERT INTO head_tasks (task_id, request, session_ids, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [task_id, request.model_dump_json(), json.dumps(session_ids), created_at],
        )]
        statements += [(
            "INSERT INTO head_sessions (session_id, task_id, sample_index, status, updated_at) VALUES (?, ?, ?, 'queued', ?) ON CONFLICT DO NOTHING",
            [session_id, task_id, index, now()],
        ) for index, session_id in enumerate(session_ids)]
        self._statements(statements)

    def task_finished(self, task_id: str, finished_at: datetime, trajectories: str | None, stats: dict[str, Any] | None, early_stopped: bool) -> None:
        self._write(
            "UPDATE head_tasks SET finished_at = ?, trajectories = ?, trajectory_stats = ?, early_stopped = ? WHERE task_id = ?",
            [finished_at, trajectories, json.dumps(stats, default=str), early_stopped, task_id],
        )

    # -- sessions
    def dispatched(self, session_id: str, node: str) -> None:
        self._write("UPDATE head_sessions SET node = ?, status = 'dispatched', dispatched_at = ?, updated_at = ? WHERE session_id = ?", [node, now(), now(), session_id])

    def requeued(self, session_id: str) -> None:
        """Its node died before the session started there: back in the queue, for another node."""
        self._write("UPDATE head_sessions SET node = NULL, status = 'queued', dispatched_at = NULL, updated_at = ? WHERE session_id = ?", [now(), session_id])

    def session_ended(self, result: SessionResult) -> None:
        self._write("UPDATE head_sessions SET status = ?, result = ?, updated_at = ? WHERE session_id = ?", [result.status, result.model_dump_json(), now(), result.session_id])

    def session_state(self, session_id: str) -> tuple[str | None, str, SessionResult | None] | None:
        rows = self._read("SELECT node, status, result FROM head_sessions WHERE session_id = ?", [session_id])
        if not rows:
            return None
        node, status, result = rows[0]
        return node, status, SessionResult.model_validate_json(result) if result else None

    # -- deliveries
    def delivery(self, delivery_id: str) -> Delivery | None:
        rows = self._read("SELECT delivery_id, kind, url, status, attempts, delivered_at, last_error FROM head_deliveries WHERE delivery_id = ?", [delivery_id])
        if not rows:
            return None
        keys = ("delivery_id", "kind", "url", "status", "attempts", "delivered_at", "last_error")
        return Delivery.model_validate(dict(zip(keys, rows[0], strict=True)))

    def save_delivery(self, delivery: Delivery) -> None:
        self._write(
            "INSERT INTO head_deliveries VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (delivery_id) DO UPDATE SET status = excluded.status, "
            "attempts = excluded.attempts, delivered_at = excluded.delivered_at, last_error = excluded.last_error, updated_at = excluded.updated_at",
            [delivery.delivery_id, delivery.kind, delivery.url, delivery.status, delivery.attempts, delivery.delivered_at, delivery.last_error, now()],
        )

    # -- recovery
    def tasks(self) -> list[StoredTask]:
        sessions: dict[str, dict[str, tuple[str | None, str, SessionResult | None]]] = {}
        for session_id, task_id, node, status, result in self._read("SELECT session_id, task_id, node, status, result FROM head_sessions"):
            sessions.setdefault(task_id, {})[session_id] = (node, status, SessionResult.model_validate_json(result) if result else None)
        stored = []
        for row in self._read("SELECT task_id, request, session_ids, created_at, finished_at, trajectories, trajectory_stats, early_stopped FROM head_tasks ORDER BY created_at"):
            task_id, request, session_ids, created_at, finished_at, trajectories, stats, early_stopped = row
            stored.append(StoredTask(
                task_id=task_id, request=TaskRequest.model_validate_json(request), session_ids=json.loads(session_ids), created_at=created_at,
                finished_at=finished_at, trajectories=trajectories, trajectory_stats=json.loads(stats) if stats else None,
                early_stopped=bool(early_stopped), sessions=sessions.get(task_id, {}),
            ))
        return stored

    def close(self) -> None:
        with self.lock:
            if self._con is not None:
                self._con.close()
                self._con = None


class DurableCallbackSender(CallbackSender):
    """Deliveries recorded in the store: one acknowledged is never sent again (also across restarts). A delivery
    whose record cannot be written is still sent (the outage is logged by the store)."""

    def __init__(self, store: DurableStore, **options: Any):
        super().__init__(**options)
        self.store = store

    async def deliver(self, delivery: Delivery, payload: dict[str, Any]) -> Delivery:
        stored = self.store.delivery(delivery.delivery_id)
        if stored is not None and stored.status == "delivered":
            delivery.status, delivery.attempts, delivery.delivered_at, delivery.last_error = stored.status, stored.attempts, stored.delivered_at, None
            return delivery
        if stored is not None:
            delivery.attempts = stored.attempts
        self._save(delivery)
        await super().deliver(delivery, payload)
        self._save(delivery)
        return delivery

    def _save(self, delivery: Delivery) -> None:
        try:
            self.store.save_delivery(delivery)
        except StateUnavailable:
            pass  # the store logged the outage; the receiver dedups a resend by its delivery id


class DurableScheduler(Scheduler):
    """The Scheduler with every task, session state and delivery in a DurableStore. The node records its own
    session states (RayNodes does); `LocalDurableScheduler` records them for a node that does not."""

    def __init__(self, node: Node, store: DurableStore, callbacks: CallbackSender | None = None):
        super().__init__(node, callbacks or DurableCallbackSender(store))
        self.store = store

    def _accepted(self, task: Task) -> None:
        self.store.add_task(task.task_id, task.request, list(task.sessions), task.created_at)

    def _finished(self, task: Task) -> None:
        assert task.finished_at is not None
        try:
            self.store.task_finished(task.task_id, task.finished_at, task.trajectories, task.trajectory_stats, task.early_stopped)
        except StateUnavailable:
            pass  # a restart exports it again

    def recover(self) -> int:
        """Every task the store holds, back in memory; each unfinished session run through `_session` (which
        knows what the store says of it; a task that had finished: only its deliveries, where owed). Returns how
        many tasks came back."""
        recovered = 0
        for stored in self.store.tasks():
            if stored.task_id in self.tasks:
                continue
            task = Task(task_id=stored.task_id, request=stored.request, created_at=stored.created_at, finished_at=stored.finished_at,
                        trajectories=stored.trajectories, trajectory_stats=stored.trajectory_stats, early_stopped=stored.early_stopped)
            self.tasks[task.task_id] = task
            for index, session_id in enumerate(stored.session_ids):
                work = SessionWork(session_id=session_id, task_id=task.task_id, sample_index=index, request=stored.request)
                _, _, final = stored.sessions.get(session_id, (None, "queued", None))
                task.sessions[session_id] = final or queued_result(work)
                self.session_tasks[session_id] = task.task_id
                task.runs[session_id] = asyncio.create_task(self._run_session(task, work), name=f"session {session_id}")
            recovered += 1
        return recovered


class LocalDurableScheduler(DurableScheduler):
    """A single machine's server: its node (GatewayNode) keeps no session state of its own, so this records each
    session's start (its first stage after queued, reported before its sandbox is made) and end. A session a
    previous run of the server had started died with it: failed, never run again (the server reaps what is left of
    its sandboxes before `recover`). One still queued (waiting for a stage slot) is started by the restart."""

    def __init__(self, node: Node, store: DurableStore, callbacks: CallbackSender | None = None, record: Record | None = None):
        super().__init__(node, store, callbacks)
        self.record = record  # the node's `sessions` row writer (GatewayNode.record): a died session's row says so

    async def _session(self, work: SessionWork, report: Report) -> SessionResult:
        state = self.store.session_state(work.session_id)
        if state is not None and state[2] is not None:
            return state[2]  # it ended before the restart
        if state is not None and state[1] == "dispatched":
            died = queued_result(work).model_copy(update={"status": "failed", "error": DIED_WITH_SERVER})
            if self.record is not None:
                try:
                    await self.record(died)
                except Exception as error:  # noqa: BLE001 - the row is a mirror; the result stands
                    log.warning(f"polar-mitm rollout: could not mark session {work.session_id} failed in the store: {error}")
            return died
        started = False

        def recorded(snapshot: SessionResult) -> None:
            nonlocal started
            if not started and snapshot.status != "queued":  # its sandbox is made next: a restart must not run it again
                self.store.dispatched(work.session_id, LOCAL_NODE)  # StateUnavailable: it fails before its sandbox exists
                started = True
            report(snapshot)

        return await self.node.run_session(work, recorded)

    def _session_ended(self, task: Task, result: SessionResult) -> None:
        try:
            self.store.session_ended(result)
        except StateUnavailable:
            pass  # kept in memory; a restart fails the session (its start is recorded, its end is not)
