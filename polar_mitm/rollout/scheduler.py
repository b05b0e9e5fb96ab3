"""Tasks -> sessions -> stages.

A task fans out into `num_samples` sessions, each dispatched to a node through one call,
`Node.run_session(work, report)`; the node runs it through its stages (SessionRun below) and returns the
SessionResult. Stages, each stamped in `timings`:

    queued -> preparing -> running -> post_run -> building -> evaluating -> completed | failed | timed_out | cancelled

post_run is always reached (timeout, crash, cancel): the exchanges recorded so far are counted and kept,
and (unless cancelled) assembled. Evaluation runs only after a harness that exited 0. The sandbox is always
destroyed. Per-stage limits (StageLimits) bound how many sessions prepare / run / build / evaluate at once;
a prepared session keeps its prepare slot until a run slot is free, so preparation runs at most
`prepare` sessions ahead of the running ones. `timeout_seconds` bounds the time a session spends preparing
and running; waiting for a slot does not count.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from polar_mitm import harnesses
from polar_mitm.errors import RequestRejected, TaskConflict
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.evaluation import EvaluationContext, evaluate
from polar_mitm.rollout.models import (
    Delivery,
    SessionResult,
    StageTiming,
    TaskRequest,
    TaskResult,
    TrajectorySummary,
    UploadStep,
)
from polar_mitm.rollout.runtimes import Sandbox, tail
from polar_mitm.store import now


class StageLimits(BaseModel):
    """How many sessions of this node may be in each stage at once."""

    prepare: int = Field(2, ge=1)
    run: int = Field(2, ge=1)
    build: int = Field(1, ge=1)
    evaluate: int = Field(2, ge=1)


class Stages:
    def __init__(self, limits: StageLimits):
        self.limits = limits
        self.prepare = asyncio.Semaphore(limits.prepare)
        self.run = asyncio.Semaphore(limits.run)
        self.build = asyncio.Semaphore(limits.build)
        self.evaluate = asyncio.Semaphore(limits.evaluate)


class SessionWork(BaseModel):
    """Everything a node needs to run one session."""

    session_id: str
    task_id: str
    sample_index: int
    request: TaskRequest


Report = Callable[[SessionResult], None]




class Node(Protocol):
    """The narrow interface between the scheduler and a machine. A distributed engine can implement it by
    forwarding these calls to a remote worker; cancelling `run_session` must cancel the session there."""

    async def check(self, request: TaskRequest) -> None:
        """Raise RequestRejected if this node cannot run the request (harness not installed, no Docker, ...)."""

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        """Run one session to a final status; `report` gets a snapshot at every stage change."""

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        """Assemble the task's sessions (rewards and group advantages final) into Parquet: (path, stats)."""


class Workbench(Protocol):
    """What SessionRun needs from the node it runs on."""

    output_dir: Path

    async def create_sandbox(self, work: SessionWork) -> Sandbox: ...

    async def count_exchanges(self, session_id: str) -> int: ...

    async def build(self, session_id: str, builder: str, options: dict[str, Any]) -> TrajectorySummary: ...

    async def record(self, result: SessionResult) -> None: ...


class SessionRun:
    """One session through its stages, on the node that holds its sandbox."""

    def __init__(self, work: SessionWork, bench: Workbench, stages: Stages, report: Report):
        self.work = work
        self.bench = bench
        self.stages = stages
        self.report = report
        request = work.request
        self.result = SessionResult(
            session_id=work.session_id, task_id=work.task_id, sample_index=work.sample_index, status="queued",
            harness=request.agent.harness, model=request.agent.model, metadata=request.metadata,
        )
        self.result.timings["queued"] = StageTiming(started_at=now())
        self.sandbox: Sandbox | None = None
        self.teardown_error: str | None = None
        self.output = bench.output_dir / work.task_id / f"{work.session_id}.harness.log"

    async def _enter(self, stage: str) -> None:
        stamp = now()
        self._close_stage(stamp)
        self.result.status = stage  # type: ignore[assignment]
        self.result.timings[stage] = StageTiming(started_at=stamp)
        self.report(self.result.model_copy(deep=True))
        await self.bench.record(self.result)

    def _close_stage(self, stamp: datetime) -> None:
        current = self.result.timings.get(self.result.status)
        if current is not None and current.ended_at is None:
            current.ended_at = stamp
            current.seconds = round((stamp - current.started_at).total_seconds(), 3)

    async def run(self) -> SessionResult:
        status: str | None = None
        error: str | None = None
        try:
            await self.bench.record(self.result)
            status, error = await self._prepare_and_run()
        except asyncio.CancelledError:
            _uncancel()
            status, error = "cancelled", "cancelled"
        try:
            await self._enter("post_run")
            self.result.n_exchanges = await self.bench.count_exchanges(self.work.session_id)
            self.result.harness_output = _read_tail(self.output)
            if status != "cancelled":
                if status is not None or self.work.request.evaluator is None:
                    await self._destroy()  # nothing more happens in it
                status, error = await self._build(status, error)
                if status is None and self.work.request.evaluator is not None:
                    status, error = await self._evaluate()
        except asyncio.CancelledError:
            _uncancel()
            status, error = "cancelled", "cancelled"
        except Exception as failure:  # noqa: BLE001 - a session fails alone; the server goes on
            status, error = "failed", f"{self.result.status}: {type(failure).__name__}: {failure}"
        if await _settle(self._destroy()):
            status, error = "cancelled", "cancelled"
        return await self._finish(status or "completed", error)

    async def _prepare_and_run(self) -> tuple[str | None, str | None]:
        request = self.work.request
        harness = harnesses.get(request.agent.harness)
        budget = request.timeout_seconds
        try:
            async with self.stages.prepare:
                await self._enter("preparing")
                started = time.monotonic()
                async with asyncio.timeout(budget):
                    self.sandbox = await self.bench.create_sandbox(self.work)
                    for step in request.runtime.prepare:
                        if isinstance(step, UploadStep):
                            await self.sandbox.upload(step.upload)
                            continue
                        try:
                            result = await self.sandbox.exec(step.exec, step.timeout_seconds)
                        except TimeoutError:  # the step's own limit (the budget's ends the `async with`)
                            return "failed", f"preparing: `{step.exec}` exceeded its {step.timeout_seconds:g}s"
                        if result.exit_code != 0:
                            return "failed", f"preparing: `{step.exec}` exited with {result.exit_code}: {tail(result.stdout + result.stderr, 1500)}"
                    argv, env = await self.sandbox.prepare_harness(harness, request.agent, request.instruction)
                budget -= time.monotonic() - started
                self._close_stage(now())  # waiting for a run slot shows as the gap before `running`
                await self.stages.run.acquire()  # keep the prepare slot until a run slot is ours
            try:
                await self._enter("running")
                code = await self.sandbox.run_harness(argv, env, budget, self.output)
            finally:
                self.stages.run.release()
        except TimeoutError:
            return "timed_out", f"{self.result.status}: the session's {request.timeout_seconds:g}s budget ran out"
        except harnesses.HarnessNotInstalled as failure:
            return "failed", str(failure)
        except Exception as failure:  # noqa: BLE001 - reported in the session's result
            return "failed", f"{self.result.status}: {type(failure).__name__}: {failure}"
        self.result.harness_exit_code = code
        if code != 0:
            return "failed", f"the harness exited with status {code}"
        return None, None

    async def _build(self, status: str | None, error: str | None) -> tuple[str | None, str | None]:
        async with self.stages.build:
            await self._enter("building")
            builder = self.work.request.builder
            try:
                self.result.trajectory = await self.bench.build(self.work.session_id, builder.name, builder.options)
            except Exception as failure:  # noqa: BLE001 - the exchanges stay in the store; only the summary is missing
                if status is None:
                    return "failed", f"building: {type(failure).__name__}: {failure}"
        return status, error

    async def _evaluate(self) -> tuple[str | None, str | None]:
        evaluator = self.work.request.evaluator
        assert evaluator is not None and self.sandbox is not None
        async with self.stages.evaluate:
            await self._enter("evaluating")
            context = EvaluationContext(
                session_id=self.work.session_id, task=self.work.request, harness_exit_code=self.result.harness_exit_code,
                n_exchanges=self.result.n_exchanges, sandbox=self.sandbox, loop=asyncio.get_running_loop(),
            )
            try:
                self.result.evaluation = await evaluate(evaluator, self.sandbox, context)
            except TimeoutError:
                return "failed", f"evaluating: the evaluator exceeded its {evaluator.timeout_seconds:g}s"
            except Exception as failure:  # noqa: BLE001 - reported in the session's result
                return "failed", f"evaluating: {type(failure).__name__}: {failure}"
        self.result.reward = self.result.evaluation.reward
        return None, None

    async def _destroy(self) -> None:
        if self.sandbox is None:
            return
        try:
            await self.sandbox.destroy()
        except Exception as failure:  # noqa: BLE001 - reported; the session's own outcome stands
            self.teardown_error = f"tearing down the sandbox: {type(failure).__name__}: {failure}"

    async def _finish(self, status: str, error: str | None) -> SessionResult:
        stamp = now()
        self._close_stage(stamp)
        self.result.status = status  # type: ignore[assignment]
        self.result.error = "; ".join(e for e in (error, self.teardown_error) if e) or None
        self.result.timings[status] = StageTiming(started_at=stamp, ended_at=stamp, seconds=0.0)
        self.report(self.result.model_copy(deep=True))
        await _settle(self.bench.record(self.result))
        return self.result


async def _settle(work: Any) -> bool:
    """Run `work` to its end even if this task is cancelled meanwhile (teardown, the final store write);
    True if a cancel came in."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            return cancelled
        except asyncio.CancelledError:
            if future.cancelled():
                return cancelled
            _uncancel()
            cancelled = True


def _uncancel() -> None:
    # the cancel was handled here: later awaits (teardown, store writes) must not see it again
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _read_tail(path: Path) -> str:
    try:
        return tail(path.read_bytes()[-8000:].decode("utf-8", "replace"))
    except OSError:
        return ""


# -- the task level: fan-out, cancellation, results, callbacks


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




class Scheduler:
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
        self.tasks[task_id] = task
        suffix = uuid.uuid4().hex[:6]  # session ids stay unique in a store reused across server runs
        for index in range(request.num_samples):
            session_id = f"{task_id}-{index}-{suffix}"
            work = SessionWork(session_id=session_id, task_id=task_id, sample_index=index, request=request)
            task.sessions[session_id] = SessionResult(
                session_id=session_id, task_id=task_id, sample_index=index, status="queued",
                harness=request.agent.harness, model=request.agent.model, metadata=request.metadata,
            )
            self.session_tasks[session_id] = task_id
            task.runs[session_id] = asyncio.create_task(self._run_session(task, work), name=f"session {session_id}")
        return task

    async def _run_session(self, task: Task, work: SessionWork) -> None:
        def report(snapshot: SessionResult) -> None:
            task.sessions[work.session_id] = snapshot

        try:
            result = await self.node.run_session(work, report)
        except BaseException as failure:  # noqa: BLE001 - a node that breaks its contract still yields a final result
            if isinstance(failure, asyncio.CancelledError):
                _uncancel()
            result = task.sessions[work.session_id].model_copy(update={"status": "cancelled" if isinstance(failure, asyncio.CancelledError) else "failed", "error": f"node: {type(failure).__name__}: {failure}"})
        task.sessions[work.session_id] = result
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
        # every session's own delivery ends (delivered or given up) before the TaskResult goes out
        await asyncio.gather(*task.runs.values(), return_exceptions=True)
        builder = task.request.builder
        try:
            task.trajectories, task.trajectory_stats = await self.node.export_task(task.task_id, list(task.sessions), builder.name, builder.options)
        except Exception as failure:  # noqa: BLE001 - the sessions' results stand; the export error is reported
            task.trajectory_stats = {"error": f"{type(failure).__name__}: {failure}"}
        task.finished_at = now()
        if task.request.callback_url:
            delivery = Delivery(delivery_id=f"{task.task_id}:task_result", kind="task_result", url=task.request.callback_url)
            payload = task.result().model_dump(mode="json")
            task.deliveries.append(delivery)
            await self.callbacks.deliver(delivery, payload)

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
        await self.callbacks.close()


__all__ = ["Node", "RequestRejected", "Scheduler", "SessionRun", "SessionWork", "StageLimits", "Stages", "Task", "TaskConflict"]
