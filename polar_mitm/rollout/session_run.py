"""One session through its stages, on the node that holds its sandbox: the node side of the rollout server.

The head side (scheduler.py) hands a node a `SessionWork` and gets back the final SessionResult; it imports this
module, never the reverse. Stages, each stamped in `timings`:

    queued -> preparing -> running -> post_run -> building -> evaluating -> completed | failed | timed_out | cancelled

post_run is always reached (timeout, crash, cancel): once every model call the harness had in flight has its row
(the gateway cancels a call whose client went away and records it; post_run waits up to SETTLE_SECONDS), the
exchanges are counted and kept, and (unless cancelled) assembled. Evaluation runs only after a harness that exited
0. The sandbox is always destroyed. Per-stage limits (StageLimits) bound how many sessions prepare / run / build /
evaluate at once; a prepared session keeps its prepare slot until a run slot is free, so preparation runs at most
`prepare` sessions ahead of the running ones. Prepare slots go to sessions in the order they were made (sample
order, tasks in submission order), not the order they got round to asking (`OrderedSlots`). `timeout_seconds`
bounds the time a session spends preparing and running; waiting for a slot does not count.

A session that ends failed or timed_out while its model calls failed says so first in its `error`: the most
common failure among its exchange rows (e.g. "56 of 56 model calls failed with engine_unreachable: ..."), since
that, not the budget running out, is what a user has to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from polar_mitm import harnesses, redact
from polar_mitm.rollout.evaluation import EvaluationContext, evaluate
from polar_mitm.rollout.models import SessionResult, StageTiming, TaskRequest, TrajectorySummary, UploadStep
from polar_mitm.rollout.runtimes import Sandbox, tail
from polar_mitm.store import now


class StageLimits(BaseModel):
    """How many sessions of this node may be in each stage at once."""

    prepare: int = Field(2, ge=1)
    run: int = Field(2, ge=1)
    build: int = Field(1, ge=1)
    evaluate: int = Field(2, ge=1)


class OrderedSlots:
    """`limit` slots handed out in the order places were taken, not the order their holders asked.

    A session takes its place (`place()`, synchronous) when it is made, in sample order; before it asks it writes
    its queued row, a thread hop that finishes in any order. A plain Semaphore served whoever came back first:
    with one prepare slot, sample 3 prepared before sample 0 (CI, 2026-12-02). Nobody passes the first place in
    line, asking or not, so a place that will never ask must be `withdraw`n."""

    def __init__(self, limit: int):
        self.free = limit
        self._places = itertools.count()
        self._line: dict[int, asyncio.Future[None] | None] = {}  # place -> its waiter (None: not asked yet), in place order

    def place(self) -> int:
        place = next(self._places)
        self._line[place] = None
        return place

    async def acquire(self, place: int) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line[place] = waiter
        self._hand_out()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was ours already
            else:
                self.withdraw(place)
            raise

    def release(self) -> None:
        self.free += 1
        self._hand_out()

    def withdraw(self, place: int) -> None:
        """The place gives up its turn (it will not ask, or asks no more); idempotent."""
        self._line.pop(place, None)
        self._hand_out()

    @contextlib.asynccontextmanager
    async def held(self, place: int) -> AsyncIterator[None]:
        await self.acquire(place)
        try:
            yield
        finally:
            self.release()

    def _hand_out(self) -> None:
        while self.free and self._line:
            place, waiter = next(iter(self._line.items()))
            if waiter is None:
                return  # the first in line has not asked yet
            del self._line[place]
            self.free -= 1
            waiter.set_result(None)


class Stages:
    def __init__(self, limits: StageLimits):
        self.limits = limits
        self.prepare = OrderedSlots(limits.prepare)
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

# how long post_run waits for the model calls a harness had in flight when it ended (timeout, crash, cancel) to
# get their rows: the gateway notices the closed connection within a quarter second, cancels and commits
SETTLE_SECONDS = 15.0

# exchange row status -> (rows with it, the error of one of them)
ExchangeOutcomes = dict[str, tuple[int, str | None]]

# row statuses that are no cause of a session's failure: answered, cut by pause(abort) and issued again, or the
# harness hanging up (what its own end, e.g. the session's timeout killing it, does to its last call)
NOT_A_CAUSE = frozenset({"ok", "aborted", "client_disconnected"})


def queued_result(work: SessionWork) -> SessionResult:
    """The SessionResult of a session nothing has happened to yet (status queued): the one way it is made."""
    request = work.request
    return SessionResult(
        session_id=work.session_id, task_id=work.task_id, sample_index=work.sample_index, status="queued",
        harness=request.agent.harness, model=request.agent.model, metadata=request.metadata,
    )


def exchange_cause(outcomes: ExchangeOutcomes) -> str | None:
    """The most common failure among a session's exchange rows, in words; None if none failed."""
    failed = {status: counted for status, counted in outcomes.items() if status not in NOT_A_CAUSE}
    if not failed:
        return None
    status, (count, example) = max(failed.items(), key=lambda item: (item[1][0], item[0]))
    total = sum(n for n, _ in outcomes.values())
    said = f": {example[:300]}…" if example and len(example) > 300 else f": {example}" if example else ""
    return f"{count} of {total} model call(s) failed with {status}{said}"


class Workbench(Protocol):
    """What SessionRun needs from the node it runs on."""

    output_dir: Path

    async def create_sandbox(self, work: SessionWork) -> Sandbox: ...

    async def settle_exchanges(self, session_id: str, timeout: float) -> int:
        """Wait (up to `timeout` seconds) until every model call the session began has its row; how many still
        have none."""
        ...

    async def exchange_outcomes(self, session_id: str) -> ExchangeOutcomes:
        """The session's exchange rows so far, by status."""
        ...

    async def build(self, session_id: str, builder: str, options: dict[str, Any]) -> TrajectorySummary: ...

    async def record(self, result: SessionResult) -> None: ...


class SessionRun:
    """One session through its stages, on the node that holds its sandbox."""

    def __init__(self, work: SessionWork, bench: Workbench, stages: Stages, report: Report):
        self.work = work
        self.bench = bench
        self.stages = stages
        self.report = report
        self.result = queued_result(work)
        self.result.timings["queued"] = StageTiming(started_at=now())
        self.place = stages.prepare.place()  # now, synchronously: sessions are made in sample order
        self.sandbox: Sandbox | None = None
        self.teardown_error: str | None = None
        self.outcomes: ExchangeOutcomes = {}
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
            uncancel()
            status, error = "cancelled", "cancelled"
        finally:
            self.stages.prepare.withdraw(self.place)  # a session that never asked (cancelled, failed) lets the next pass
        try:
            await self._enter("post_run")
            # the harness is gone; a model call it had in flight ends (cancelled, recorded) before anything is counted
            unsettled = await self.bench.settle_exchanges(self.work.session_id, SETTLE_SECONDS)
            if unsettled:
                self.teardown_error = f"{unsettled} model call(s) still in flight {SETTLE_SECONDS:g}s after the harness ended are not counted"
            self.outcomes = await self.bench.exchange_outcomes(self.work.session_id)
            self.result.n_exchanges = sum(n for n, _ in self.outcomes.values())
            self.result.harness_output = redact.scrub_output(_read_tail(self.output), redact.env_secrets(self.work.request.agent.env))
            if status != "cancelled":
                if status is not None or self.work.request.evaluator is None:
                    await self._destroy()  # nothing more happens in it
                status, error = await self._build(status, error)
                if status is None and self.work.request.evaluator is not None:
                    status, error = await self._evaluate()
        except asyncio.CancelledError:
            uncancel()
            status, error = "cancelled", "cancelled"
        except Exception as failure:  # noqa: BLE001 - a session fails alone; the server goes on
            status, error = "failed", f"{self.result.status}: {type(failure).__name__}: {failure}"
        if await settle(self._destroy()):
            status, error = "cancelled", "cancelled"
        return await self._finish(status or "completed", error)

    async def _prepare_and_run(self) -> tuple[str | None, str | None]:
        request = self.work.request
        harness = harnesses.get(request.agent.harness)
        budget = request.timeout_seconds
        try:
            async with self.stages.prepare.held(self.place):
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
        self.result.evaluation.output = redact.scrub_output(self.result.evaluation.output, redact.env_secrets(self.work.request.agent.env))
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
        # what its model calls ran into comes first: it is the cause a timeout or a failed harness only shows
        cause = exchange_cause(self.outcomes) if status in ("failed", "timed_out") else None
        self.result.status = status  # type: ignore[assignment]
        self.result.error = "; ".join(e for e in (cause, error, self.teardown_error) if e) or None
        self.result.timings[status] = StageTiming(started_at=stamp, ended_at=stamp, seconds=0.0)
        self.report(self.result.model_copy(deep=True))
        await settle(self.bench.record(self.result))
        return self.result


async def settle[T](work: Awaitable[T]) -> bool:
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
            uncancel()
            cancelled = True


def uncancel() -> None:
    """The cancel was handled here: later awaits (teardown, store writes) must not see it again."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _read_tail(path: Path) -> str:
    try:
        return tail(path.read_bytes()[-8000:].decode("utf-8", "replace"))
    except OSError:
        return ""
