"""Tasks -> sessions: the head side of the rollout server (what a node runs of a session: session_run.py).

A task fans out into `num_samples` sessions, each dispatched to a node through one call,
`Node.run_session(work, report)`; the node runs it through its stages and returns the final SessionResult.
Once every session has ended, the node exports the task's trajectories (`Node.export_task`) and the TaskResult
goes to the task's callback URL, after every session's own result.

The server's terminal gets one line per task accepted and one per task finished (logger `polar_mitm.rollout`);
callbacks.py adds one per delivery that failed.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from polar_mitm.errors import RequestRejected, TaskConflict
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.models import Delivery, SessionResult, TaskRequest, TaskResult
from polar_mitm.rollout.session_run import Report, SessionWork, queued_result, uncancel
from polar_mitm.store import now

log = logging.getLogger("polar_mitm.rollout")


class Node(Protocol):
    """The narrow interface between the scheduler and a machine. A distributed engine can implement it by
    forwarding these calls to a remote worker; cancelling `run_session` must cancel the session there."""

    async def check(self, request: TaskRequest) -> None:
        """Raise RequestRejected if this node cannot run the request (harness not installed, no Docker, ...)."""

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        """Run one session to a final status; `report` gets a snapshot at every stage change."""

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        """Assemble the task's sessions (rewards and group advantages final) into Parquet: (path, stats)."""

    async def count_exchanges(self, session_id: str) -> int:
        """A session's exchanges committed so far (0 while unknown)."""


@dataclass
class Task:
    task_id: str
    request: TaskRequest
    created_at: datetime
    sessions: dict[str, SessionResult] = field(default_factory=dict)
    runs: dict[str, asyncio.Task] = field(default_factory=dict)
    cancelled: bool = False
    finished_at: datetime | None = None
    trajectories: str | None = None
    trajectory_stats: dict[str, Any] | None = None
    deliveries: list[Delivery] = field(default_factory=list)
    finisher: asyncio.Task | None = None
    early_stopped: bool = False

    def result(self) -> TaskResult:
        sessions = sorted(self.sessions.values(), key=lambda s: s.sample_index)
        status = "running" if self.finished_at is None else ("cancelled" if self.cancelled else "completed")
        return TaskResult(
            task_id=self.task_id, status=status, created_at=self.created_at, finished_at=self.finished_at,
            counts=dict(Counter(s.status for s in sessions)), sessions=sessions, trajectories=self.trajectories,
            trajectory_stats=self.trajectory_stats, deliveries=list(self.deliveries), metadata=self.request.metadata,
            early_stopped=self.early_stopped,
        )


def finished_line(task: Task) -> str:
    """The terminal's line for a finished task: its sessions by status, the reward mean, an export error."""
    sessions = list(task.sessions.values())
    counts = ", ".join(f"{status} {n}" for status, n in sorted(Counter(s.status for s in sessions).items()))
    rewards = [s.reward for s in sessions if s.reward is not None]
    reward = f"reward mean {statistics.fmean(rewards):.3g} over {len(rewards)}" if rewards else "no reward"
    export = (task.trajectory_stats or {}).get("error")
    how = "cancelled" if task.cancelled else "finished"
    return f"polar-mitm rollout: task {task.task_id} {how}: {len(sessions)} session(s), {counts}; {reward}" + (f"; export failed: {export}" if export else "")


class Scheduler:
    """Every task of this server, its sessions on `node`, and their callbacks. Subclasses make it durable
    through `_accepted`, `_session`, `_session_ended` and `_finished` (durable.py)."""

    def __init__(self, node: Node, callbacks: CallbackSender | None = None):
        self.node = node
        self.callbacks = callbacks or CallbackSender()
        self.tasks: dict[str, Task] = {}
        self.session_tasks: dict[str, str] = {}

    async def submit(self, request: TaskRequest) -> Task:
        """Accept a task and start its sessions; returns at once. Same id + same request: the existing task."""
        if request.task_id is not None and request.task_id in self.tasks:
            existing = self.tasks[request.task_id]
            if existing.request == request:
                return existing
            raise TaskConflict(f"task {request.task_id!r} exists with a different request; choose another task_id")
        await self.node.check(request)
        if request.task_id is not None and request.task_id in self.tasks:  # the same task, submitted twice at once
            return await self.submit(request)
        task_id = request.task_id or f"task-{uuid.uuid4().hex[:12]}"
        task = Task(task_id=task_id, request=request, created_at=now())
        suffix = uuid.uuid4().hex[:6]  # session ids stay unique in a store reused across server runs
        works = [SessionWork(session_id=f"{task_id}-{index}-{suffix}", task_id=task_id, sample_index=index, request=request) for index in range(request.num_samples)]
        for work in works:
            task.sessions[work.session_id] = queued_result(work)
        self._accepted(task)  # persisted before it is known (StateUnavailable: not accepted); no await since it was made
        self.tasks[task_id] = task
        self.session_tasks.update(dict.fromkeys(task.sessions, task_id))
        log.info(f"polar-mitm rollout: task {task_id} accepted: {request.num_samples} session(s) of {request.agent.harness} in {request.runtime.backend} sandboxes")
        for work in works:
            task.runs[work.session_id] = asyncio.create_task(self._run_session(task, work), name=f"session {work.session_id}")
        return task

    def _accepted(self, task: Task) -> None:
        """A new task, its sessions queued, none of them started yet; raising refuses it (nothing of it is kept)."""

    def _finished(self, task: Task) -> None:
        """A task whose sessions all ended and whose export is done, just before its TaskResult is delivered."""

    async def _session(self, work: SessionWork, report: Report) -> SessionResult:
        """One session to its final result: the node runs it."""
        return await self.node.run_session(work, report)

    def _session_ended(self, task: Task, result: SessionResult) -> None:
        """A session's final result, before its delivery."""

    async def _run_session(self, task: Task, work: SessionWork) -> None:
        def report(snapshot: SessionResult) -> None:
            task.sessions[work.session_id] = snapshot

        try:
            result = await self._session(work, report)
        except BaseException as failure:  # noqa: BLE001 - a node that breaks its contract still yields a final result
            if isinstance(failure, asyncio.CancelledError):
                uncancel()
            result = task.sessions[work.session_id].model_copy(update={"status": "cancelled" if isinstance(failure, asyncio.CancelledError) else "failed", "error": f"node: {type(failure).__name__}: {failure}"})
        task.sessions[work.session_id] = result
        self._session_ended(task, result)
        self._early_stop(task)
        if task.request.callback_url:
            delivery = Delivery(delivery_id=f"{work.session_id}:session_result", kind="session_result", url=task.request.callback_url)
            task.deliveries.append(delivery)
            await self.callbacks.deliver(delivery, result.model_dump(mode="json"))
        if all(s.done for s in task.sessions.values()) and task.finisher is None:
            task.finisher = asyncio.create_task(self._finish(task), name=f"finish {task.task_id}")

    def _early_stop(self, task: Task) -> None:
        """Once `early_stop_min_usable_sessions` are usable, cancel the stragglers (they end `cancelled`)."""
        wanted = task.request.early_stop_min_usable_sessions
        if wanted is None or sum(s.usable for s in task.sessions.values()) < wanted:
            return
        task.early_stopped = True
        for session_id, run in task.runs.items():
            if not task.sessions[session_id].done and not run.done():
                run.cancel()

    async def _finish(self, task: Task) -> None:
        """Export the task (unless it finished before a restart: then only its delivery may be owed) and deliver
        its TaskResult, after every session's own delivery has ended (delivered or given up)."""
        await asyncio.gather(*task.runs.values(), return_exceptions=True)
        if task.finished_at is None:
            builder = task.request.builder
            try:
                task.trajectories, task.trajectory_stats = await self.node.export_task(task.task_id, list(task.sessions), builder.name, builder.options)
            except Exception as failure:  # noqa: BLE001 - the sessions' results stand; the export error is reported
                task.trajectory_stats = {"error": f"{type(failure).__name__}: {failure}"}
            task.finished_at = now()
            self._finished(task)
            log.info(finished_line(task))
        if task.request.callback_url:
            delivery = Delivery(delivery_id=f"{task.task_id}:task_result", kind="task_result", url=task.request.callback_url)
            task.deliveries.append(delivery)
            await self.callbacks.deliver(delivery, task.result().model_dump(mode="json"))

    def task(self, task_id: str) -> Task:
        return self.tasks[task_id]

    def session(self, session_id: str) -> SessionResult:
        return self.tasks[self.session_tasks[session_id]].sessions[session_id]

    async def count_exchanges_now(self, sessions: Iterable[SessionResult]) -> None:
        """Bring `n_exchanges` of sessions still under way up to date (a session counts its exchanges once, when its
        harness ends); answers about running sessions call this first."""
        for result in sessions:
            if not result.done and result.status != "queued":
                result.n_exchanges = await self.node.count_exchanges(result.session_id)

    def cancel_session(self, session_id: str) -> SessionResult:
        task = self.tasks[self.session_tasks[session_id]]
        run = task.runs[session_id]
        if not task.sessions[session_id].done:
            run.cancel()
        return task.sessions[session_id]

    def cancel_task(self, task_id: str) -> Task:
        task = self.tasks[task_id]
        if task.finished_at is None:
            task.cancelled = True
            for session_id, run in task.runs.items():
                if not task.sessions[session_id].done:
                    run.cancel()
        return task

    async def wait(self, task_id: str) -> Task:
        task = self.tasks[task_id]
        while task.finisher is None:
            await asyncio.gather(*task.runs.values(), return_exceptions=True)
            await asyncio.sleep(0)
        await task.finisher
        return task

    async def close(self) -> None:
        for task in self.tasks.values():
            for session_id, run in task.runs.items():
                if not task.sessions[session_id].done:
                    run.cancel()
        pending = [run for task in self.tasks.values() for run in task.runs.values()] + [t.finisher for t in self.tasks.values() if t.finisher]
        await asyncio.gather(*pending, return_exceptions=True)
        # a task whose last run just ended started its finisher (export through the node's store) meanwhile: it must
        # end before the node stops, or its export waits for the stopped store writer forever
        await asyncio.gather(*[t.finisher for t in self.tasks.values() if t.finisher], return_exceptions=True)
        await self.callbacks.close()


__all__ = ["Node", "RequestRejected", "Scheduler", "Task", "TaskConflict"]
