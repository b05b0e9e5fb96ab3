"""Pause, drain, abort and resume a gateway's engine calls around a weight update, and its policy version.

States (one per gateway):

    serving ──pause(drain)──▶ draining ──in-flight reaches 0──▶ paused ──resume(version)──▶ serving
       │                         └──timeout: 504, back to serving──┘                        ▲
       └──pause(abort): in-flight engine calls cancelled──▶ paused ─────────────────────────┘

While not serving, a new engine call waits in `run` (the harness only sees a slower reply). An aborted call is
reported to its caller as `EngineCallAborted` (the gateway records that attempt as an untrainable row) and is
issued again, whole, after resume, under the new version and engine model. Every engine call is stamped with
the policy version in force when it was admitted.

The HTTP side (`handle`) is transport-free: it takes a method, path and JSON body and returns (status, JSON), so
the addon serves it and tests can call it directly. Pure asyncio, one event loop: no locks needed.

`GET /control/status` also says whether the engine answers (`engine_reachable`, and `engines`: one entry per
engine URL, from each client's `Reachability`): a harness retrying against a dead engine shows only as slow.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from polar_mitm.engines import Reachability
from polar_mitm.errors import ControlError

T = TypeVar("T")

State = Literal["serving", "draining", "paused"]


class PauseRequest(BaseModel):
    model_config = {"extra": "forbid"}
    mode: Literal["drain", "abort"] = Field("drain", description="drain: wait for in-flight engine calls to finish; abort: cancel them (re-issued after resume).")
    timeout_seconds: float = Field(300.0, gt=0, description="drain only: give up after this long, answer 504 and keep serving.")


class ResumeRequest(BaseModel):
    model_config = {"extra": "forbid"}
    policy_version: int | None = Field(None, ge=0, description="The version of the weights served from now on; never lower than the current one. Omitted: unchanged.")
    engine_model: str | None = Field(None, min_length=1, description="The engine model (e.g. a LoRA adapter name) to serve from now on; must be listed by the engine's /models.")


class EngineHealth(BaseModel):
    url: str
    reachable: bool | None = Field(description="Whether its last call got an answer (an HTTP error counts); null: not called yet.")
    since: float | None = Field(description="Unix time it last became reachable or unreachable.")
    last_error: str | None = Field(description="Why its last call found it unreachable.")
    failed_calls: int = Field(description="Calls that found it unreachable, in its current (or last) time down.")


class ControlStatus(BaseModel):
    state: State
    paused: bool
    in_flight: int = Field(description="Engine calls running now.")
    waiting: int = Field(description="Engine calls held back until resume.")
    policy_version: int
    engine_model: str | None = Field(description="The engine model set by resume; null: the gateway's configured one.")
    pause_mode: str | None
    paused_seconds: float | None = Field(description="How long the gateway has not been serving, if it is not.")
    aborted_total: int = Field(description="Engine calls aborted by pause(abort) since start.")
    engine_reachable: bool | None = Field(None, description="Whether the engine answers (several: any of them); null: not called yet, or none configured.")
    engines: list[EngineHealth] = Field(default_factory=list, description="Each engine URL's reachability.")


class EngineCallAborted(Exception):
    """An engine call cancelled by pause(abort). Internal to the gateway: the caller records it and retries."""

    def __init__(self, policy_version: int):
        super().__init__(f"engine call aborted by pause(mode=abort) under policy version {policy_version}")
        self.policy_version = policy_version


class PolicyControl:
    def __init__(
        self, policy_version: int = 0, model_exists: Callable[[str], Awaitable[bool]] | None = None,
        engines: Callable[[], list[Reachability]] | None = None,
    ):
        self.state: State = "serving"
        self.policy_version = policy_version
        self.engine_model: str | None = None
        self.pause_mode: str | None = None
        self.paused_at: float | None = None
        self.aborted_total = 0
        self.waiting = 0
        # asks the engine whether it serves a model name (resume's engine_model); None: not checked
        self.model_exists = model_exists
        self.engines = engines  # each engine URL's reachability, for status; None: not reported
        self._calls: set[asyncio.Task[Any]] = set()
        self._aborted: set[asyncio.Task[Any]] = set()
        self._state_changed = asyncio.Event()

    # -- the gateway's side
    async def run(self, call: Callable[[int, str | None], Awaitable[T]]) -> tuple[int, T]:
        """Run one engine call once the gateway serves: `call(policy_version, engine_model)`.

        Returns (the version it ran under, its result). Raises EngineCallAborted when pause(abort) cancelled it;
        the caller records that attempt and calls `run` again, which waits for resume.
        """
        while self.state != "serving":
            self.waiting += 1
            try:
                await self._wait_for_change()
            finally:
                self.waiting -= 1
        version = self.policy_version
        task = asyncio.ensure_future(call(version, self.engine_model))
        self._calls.add(task)
        try:
            return version, await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task in self._aborted and not (current is not None and current.cancelling()):
                raise EngineCallAborted(version) from None
            task.cancel()  # our own caller was cancelled (its client went away): take the engine call with it
            raise
        finally:
            self._calls.discard(task)
            self._aborted.discard(task)
            self._notify()

    # -- the trainer's side
    async def pause(self, request: PauseRequest) -> ControlStatus:
        if self.state != "serving":
            raise ControlError(409, "already_paused", f"the gateway is already {self.state} (mode={self.pause_mode}); resume it first")
        self.state, self.pause_mode, self.paused_at = "draining", request.mode, time.monotonic()
        self._notify()
        if request.mode == "abort":
            for task in list(self._calls):
                self._aborted.add(task)
                task.cancel()
            self.aborted_total += len(self._aborted)
        deadline = time.monotonic() + request.timeout_seconds
        while self._calls:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._wait_for_change(), left)
            except TimeoutError:
                in_flight = len(self._calls)
                self._serve()
                raise ControlError(504, "drain_timeout", f"{in_flight} engine call(s) still in flight after {request.timeout_seconds:g}s; the gateway keeps serving") from None
        self.state = "paused"
        self._notify()
        return self.status()

    async def resume(self, request: ResumeRequest) -> ControlStatus:
        if self.state == "serving":
            raise ControlError(409, "not_paused", "the gateway is not paused; pause it before resuming")
        if self.state == "draining":
            raise ControlError(409, "still_draining", "the gateway is still draining; wait for its pause call to return")
        if request.policy_version is not None and request.policy_version < self.policy_version:
            raise ControlError(409, "version_backwards", f"policy_version {request.policy_version} is lower than the current {self.policy_version}")
        if request.engine_model is not None and self.model_exists is not None and not await self.model_exists(request.engine_model):
            raise ControlError(404, "unknown_engine_model", f"the engine does not serve {request.engine_model!r} (load the adapter into the engine first)")
        if request.policy_version is not None:
            self.policy_version = request.policy_version
        if request.engine_model is not None:
            self.engine_model = request.engine_model
        self._serve()
        return self.status()

    def status(self) -> ControlStatus:
        engines = [
            EngineHealth(url=r.url, reachable=r.reachable, since=r.since, last_error=r.last_error, failed_calls=r.failed_calls)
            for r in (self.engines() if self.engines is not None else [])
        ]
        known = [engine.reachable for engine in engines if engine.reachable is not None]
        return ControlStatus(
            state=self.state,
            paused=self.state != "serving",
            in_flight=len(self._calls),
            waiting=self.waiting,
            policy_version=self.policy_version,
            engine_model=self.engine_model,
            pause_mode=self.pause_mode,
            paused_seconds=None if self.paused_at is None else round(time.monotonic() - self.paused_at, 3),
            aborted_total=self.aborted_total,
            engine_reachable=any(known) if known else None,
            engines=engines,
        )

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """One control request: (HTTP status, JSON body). Errors are {"error": {"type", "message"}}."""
        try:
            if path == "/control/status":
                _expect(method, "GET", path)
                return 200, self.status().model_dump()
            if path == "/control/pause":
                _expect(method, "POST", path)
                return 200, (await self.pause(_parse(PauseRequest, body))).model_dump()
            if path == "/control/resume":
                _expect(method, "POST", path)
                return 200, (await self.resume(_parse(ResumeRequest, body))).model_dump()
            raise ControlError(404, "not_found", f"no control endpoint {path}; there are /control/pause, /control/resume, /control/status")
        except ControlError as error:
            return error.status, {"error": {"type": error.kind, "message": error.message}}

    # -- internals
    def _serve(self) -> None:
        self.state, self.pause_mode, self.paused_at = "serving", None, None
        self._notify()

    def _notify(self) -> None:
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    async def _wait_for_change(self) -> None:
        await self._state_changed.wait()


def _expect(method: str, wanted: str, path: str) -> None:
    if method != wanted:
        raise ControlError(405, "method_not_allowed", f"{path} takes {wanted}, not {method}")


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        data = json.loads(body or b"{}")
    except ValueError as error:
        raise ControlError(400, "invalid_json", f"the body is not JSON: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors())
        raise ControlError(422, "invalid_request", problems) from None
