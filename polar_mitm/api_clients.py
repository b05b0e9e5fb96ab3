"""Clients of polar-mitm's two HTTP APIs, each sync and async: the rollout server (`RolloutClient`,
`AsyncRolloutClient`) and one gateway's `/control/*` (`GatewayControl`, `AsyncGatewayControl`).

httpx's pattern (`httpx._client.BaseClient` under `Client` and `AsyncClient`): everything that does not depend on how
bytes move lives once, in the bases: which call each method makes (`Call`), how an answer becomes a value or an
error, when a wait is over (`TaskWait`). The sync and async classes only send and sleep. Every method returns the
server's JSON as it is (dicts and lists shaped like the pydantic models in `polar_mitm.rollout.models` and
`polar_mitm.gateway.control`), so a trainer needs only httpx: nothing of the server is imported.

Errors: an answer >= 400 raises `ServerRefused` (a `ClientError`, and a `ControlError` as the gateway's and the
rollout server's refusals always were) with the HTTP status and the server's own message; a server that cannot be
reached, or does not answer in time, raises `ClientError`; `wait` past its timeout raises `ClientError`.

    async with AsyncRolloutClient("http://127.0.0.1:8070") as rollouts:
        accepted = await rollouts.submit(task)
        result = await rollouts.wait(accepted["task_id"], on_poll=lambda r: print(r["counts"]))
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal, Self
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from polar_mitm.errors import ClientError, ServerRefused

__all__ = ["AsyncGatewayControl", "AsyncRolloutClient", "Call", "GatewayControl", "RolloutClient", "TaskWait"]

JSON = dict[str, Any]
ControlAction = Literal["pause", "resume", "status"]
PollCallback = Callable[[JSON], None]
# what a refusal is called when the server's body names no error type
KIND_BY_STATUS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                  409: "conflict", 422: "invalid_request", 504: "timeout"}
# the gateway's own default drain bound (gateway/control.py PauseRequest): a pause call may take that long
DEFAULT_DRAIN_SECONDS = 300.0


@dataclass(frozen=True)
class Call:
    """One HTTP call, built before any I/O, so the sync and the async client make the very same one.
    `timeout` None: the client's own."""

    method: str
    path: str
    body: Any = None
    params: Mapping[str, str] | None = None
    timeout: float | None = None

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


def refusal(call: Call, response: httpx.Response) -> ServerRefused:
    """The error for an answer >= 400, in both servers' body shapes: the gateway's `{"error": {"type", "message"}}`
    (also what the rollout server relays from a node's gateway, naming the `node`) and the rollout server's
    `{"message", "detail"}`."""
    try:
        body = response.json()
    except ValueError:
        body = response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    kind = str(error["type"]) if isinstance(error, dict) and error.get("type") else KIND_BY_STATUS.get(response.status_code, "http_error")
    said = _server_words(body)
    if isinstance(body, dict) and body.get("node"):
        said = f"{said} (node {body['node']})"
    return ServerRefused(response.status_code, kind, f"{call.name}: HTTP {response.status_code}: {said}", said, body)


def _server_words(body: Any) -> str:
    """What the server said: `error.message` (a gateway), `message` (the rollout server), `detail` (FastAPI's own
    answers, e.g. an unknown route), else the body itself."""
    if isinstance(body, dict):
        error = body.get("error")
        for said in (error.get("message") if isinstance(error, dict) else error, body.get("message"), body.get("detail")):
            if isinstance(said, str) and said:
                return said
    return str(body)


class _APIBase:
    """URL, headers and timeout of one server; how a Call's answer becomes a value or an error."""

    server_kind: ClassVar[str]  # "rollout server" / "gateway", in error messages

    def __init__(self, url: str, timeout: float, headers: Mapping[str, str] | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        # a polar-mitm server is reached directly: a gateway is itself a proxy, and the environment's proxy settings
        # (HTTPS_PROXY pointing at a gateway, say) are for harnesses, not for its control calls
        self._client_options: dict[str, Any] = {"timeout": timeout, "trust_env": False, "headers": dict(headers or {})}

    def _request_options(self, call: Call) -> dict[str, Any]:
        options: dict[str, Any] = {"json": call.body, "params": call.params}
        if call.timeout is not None:
            options["timeout"] = call.timeout
        return options

    def _unreachable(self, call: Call, error: httpx.HTTPError) -> ClientError:
        if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
            return ClientError(f"no answer from the {self.server_kind} at {self.url} to {call.name} in time: {type(error).__name__}: {error}")
        return ClientError(f"cannot reach the {self.server_kind} at {self.url}: {type(error).__name__}: {error}")

    def _answer(self, call: Call, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise refusal(call, response)
        try:
            return response.json()
        except ValueError as error:
            raise ClientError(f"{call.name}: the {self.server_kind} at {self.url} answered HTTP {response.status_code} with no JSON: {response.text[:300]!r}") from error


class _SyncTransport(_APIBase):
    """Sends Calls on an httpx.Client (`http`), one at a time."""

    def __init__(self, url: str, timeout: float, headers: Mapping[str, str] | None = None):
        super().__init__(url, timeout, headers)
        self.http = httpx.Client(**self._client_options)

    def _send(self, call: Call) -> Any:
        try:
            response = self.http.request(call.method, self.url + call.path, **self._request_options(call))
        except httpx.HTTPError as error:
            raise self._unreachable(call, error) from error
        return self._answer(call, response)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()


class _AsyncTransport(_APIBase):
    """Sends Calls on an httpx.AsyncClient (`http`)."""

    def __init__(self, url: str, timeout: float, headers: Mapping[str, str] | None = None):
        super().__init__(url, timeout, headers)
        self.http = httpx.AsyncClient(**self._client_options)

    async def _send(self, call: Call) -> Any:
        try:
            response = await self.http.request(call.method, self.url + call.path, **self._request_options(call))
        except httpx.HTTPError as error:
            raise self._unreachable(call, error) from error
        return self._answer(call, response)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        await self.aclose()


# -- the gateway's /control/*


class _GatewayCalls:
    """The calls of a gateway's control API (served by the gateway itself, on its proxy port)."""

    server_kind: ClassVar[str] = "gateway"
    timeout: float

    def _status(self) -> Call:
        return Call("GET", "/control/status")

    def _pause(self, mode: str, timeout_seconds: float) -> Call:
        # a drain answers once nothing is in flight, or with 504 after timeout_seconds: wait for that answer
        return Call("POST", "/control/pause", {"mode": mode, "timeout_seconds": timeout_seconds}, timeout=timeout_seconds + self.timeout)

    def _resume(self, policy_version: int | None, engine_model: str | None) -> Call:
        body: JSON = {}
        if policy_version is not None:
            body["policy_version"] = policy_version
        if engine_model is not None:
            body["engine_model"] = engine_model
        return Call("POST", "/control/resume", body)


def _segment(value: str) -> str:
    """An id as one path segment (ids are URL-safe by TaskRequest's pattern; quoting keeps any other id one segment)."""
    return quote(value, safe="")


def _bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class GatewayControl(_GatewayCalls, _SyncTransport):
    """Pause, resume and inspect one gateway (its `/control/*` endpoints).

    `url` is the gateway's own address (the proxy URL, e.g. http://127.0.0.1:8080). Refusals raise `ServerRefused`
    (a `polar_mitm.errors.ControlError`) with the HTTP status: 409 pause twice / resume without pause / a version
    that goes backwards, 404 an engine model the engine does not serve, 504 a drain that timed out (the gateway
    then keeps serving), 401/403 a missing or wrong token.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        super().__init__(url, timeout, _bearer(token))

    def status(self) -> JSON:
        """The control status: state, paused, in_flight, waiting, policy_version, engine_model, pause_mode, etc."""
        return self._send(self._status())

    def pause(self, mode: Literal["drain", "abort"] = "drain", timeout_seconds: float = DEFAULT_DRAIN_SECONDS) -> JSON:
        """Stop new engine calls. drain: returns once nothing is in flight (504 after timeout_seconds, and the
        gateway keeps serving); abort: in-flight calls are cancelled now and issued again after resume."""
        return self._send(self._pause(mode, timeout_seconds))

    def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> JSON:
        """Serve again, stamping `policy_version` on every engine call from now on, optionally from another engine
        model (e.g. a LoRA adapter just loaded into the engine)."""
        return self._send(self._resume(policy_version, engine_model))


class AsyncGatewayControl(_GatewayCalls, _AsyncTransport):
    """`GatewayControl` on an event loop: the same calls, answers and errors, awaited."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        super().__init__(url, timeout, _bearer(token))

    async def status(self) -> JSON:
        return await self._send(self._status())

    async def pause(self, mode: Literal["drain", "abort"] = "drain", timeout_seconds: float = DEFAULT_DRAIN_SECONDS) -> JSON:
        return await self._send(self._pause(mode, timeout_seconds))

    async def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> JSON:
        return await self._send(self._resume(policy_version, engine_model))


# -- the rollout server


@dataclass
class TaskWait:
    """When polling a task is over, for both clients: `after(result)` is None once the task is no longer running,
    else the seconds to sleep before the next poll; past `timeout` (None: never) it raises ClientError. `on_poll`
    sees every TaskResult polled, the last one included (a progress display)."""

    task_id: str
    timeout: float | None
    poll_seconds: float
    on_poll: PollCallback | None = None
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = math.inf if self.timeout is None else time.monotonic() + self.timeout

    def after(self, result: JSON) -> float | None:
        if self.on_poll is not None:
            self.on_poll(result)
        if result["status"] != "running":
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            counts = ", ".join(f"{status} {n}" for status, n in sorted((result.get("counts") or {}).items()))
            raise ClientError(f"task {self.task_id} still running after {self.timeout:g}s ({counts or 'no sessions'})")
        return min(self.poll_seconds, left)  # the last poll lands on the deadline, not a poll_seconds past it


class _RolloutCalls:
    """The calls of the rollout server's API (polar_mitm/rollout/server.py; /nodes and /sql on a Ray head)."""

    server_kind: ClassVar[str] = "rollout server"
    timeout: float

    def _submit(self, task: Mapping[str, Any] | BaseModel) -> Call:
        body = task.model_dump(mode="json", exclude_unset=True) if isinstance(task, BaseModel) else dict(task)
        return Call("POST", "/tasks", body)

    def _task(self, task_id: str) -> Call:
        return Call("GET", f"/tasks/{_segment(task_id)}")

    def _tasks(self) -> Call:
        return Call("GET", "/tasks")

    def _sessions(self, task_id: str) -> Call:
        return Call("GET", f"/tasks/{_segment(task_id)}/sessions")

    def _session(self, session_id: str) -> Call:
        return Call("GET", f"/sessions/{_segment(session_id)}")

    def _cancel(self, task_id: str) -> Call:
        return Call("DELETE", f"/tasks/{_segment(task_id)}")

    def _cancel_session(self, session_id: str) -> Call:
        return Call("DELETE", f"/sessions/{_segment(session_id)}")

    def _health(self) -> Call:
        return Call("GET", "/health")

    def _nodes(self) -> Call:
        return Call("GET", "/nodes")

    def _sql(self, query: str) -> Call:
        return Call("GET", "/sql", params={"q": query})

    def _control(self, action: ControlAction, body: JSON) -> Call:
        if action == "status":
            return Call("GET", "/control/status")
        # pause answers once every node's gateway drained (or refused): give it the gateways' own bound
        timeout = float(body.get("timeout_seconds", DEFAULT_DRAIN_SECONDS)) + self.timeout if action == "pause" else None
        return Call("POST", f"/control/{action}", body, timeout=timeout)


class RolloutClient(_RolloutCalls, _SyncTransport):
    """Submit a group (a TaskRequest) to the rollout server, await its SessionResults, fetch its trajectories.

    Refusals raise `ServerRefused` (a ClientError) with the server's message: 422 a request that cannot run (the
    message names the field), 409 a task_id taken by another request, 404 an unknown task or session, 401 a
    missing or wrong `token` (a server started with --api-token).
    """

    def __init__(self, url: str, timeout: float = 30.0, token: str | None = None):
        super().__init__(url, timeout, _bearer(token))

    def submit(self, task: Mapping[str, Any] | BaseModel) -> JSON:
        """POST /tasks; returns {task_id, session_ids, status_url}. Put the policy version the group is submitted
        under in `metadata.policy_version`: it is kept with the task and its sessions."""
        return self._send(self._submit(task))

    def task(self, task_id: str) -> JSON:
        """The TaskResult so far: status, counts, sessions (SessionResults), trajectories (a Parquet path once done)."""
        return self._send(self._task(task_id))

    def tasks(self) -> list[JSON]:
        """Every task's TaskResult so far (GET /tasks)."""
        return self._send(self._tasks())

    def sessions(self, task_id: str) -> list[JSON]:
        """A task's SessionResults (GET /tasks/{id}/sessions)."""
        return self._send(self._sessions(task_id))

    def session(self, session_id: str) -> JSON:
        """One SessionResult (GET /sessions/{id})."""
        return self._send(self._session(session_id))

    def cancel(self, task_id: str) -> JSON:
        """Cancel the task's unfinished sessions (DELETE /tasks/{id}); returns its TaskResult as of now."""
        return self._send(self._cancel(task_id))

    def cancel_session(self, session_id: str) -> JSON:
        """Cancel one session (DELETE /sessions/{id}); returns its SessionResult as of now."""
        return self._send(self._cancel_session(session_id))

    def wait(self, task_id: str, timeout: float | None = 3600.0, poll_seconds: float = 1.0, on_poll: PollCallback | None = None) -> JSON:
        """Poll until the task is no longer running; returns its TaskResult (see TaskWait; timeout None: no limit)."""
        waiting = TaskWait(task_id, timeout, poll_seconds, on_poll)
        while True:
            result = self.task(task_id)
            pause = waiting.after(result)
            if pause is None:
                return result
            time.sleep(pause)

    def control(self, action: ControlAction, **body: Any) -> JSON:
        """The same control call on every gateway node this server owns: {"nodes": {gateway_url: status}}."""
        return self._send(self._control(action, body))

    def health(self) -> JSON:
        """GET /health: status, the node's health, task and session counts."""
        return self._send(self._health())

    def nodes(self) -> JSON:
        """GET /nodes (a Ray head): every node's state and the head's queue."""
        return self._send(self._nodes())

    def sql(self, query: str) -> JSON:
        """GET /sql (a Ray head): one read-only query over every node's store -> {columns, rows, catalog}."""
        return self._send(self._sql(query))


class AsyncRolloutClient(_RolloutCalls, _AsyncTransport):
    """`RolloutClient` on an event loop: the same calls, answers and errors, awaited."""

    def __init__(self, url: str, timeout: float = 30.0, token: str | None = None):
        super().__init__(url, timeout, _bearer(token))

    async def submit(self, task: Mapping[str, Any] | BaseModel) -> JSON:
        return await self._send(self._submit(task))

    async def task(self, task_id: str) -> JSON:
        return await self._send(self._task(task_id))

    async def tasks(self) -> list[JSON]:
        return await self._send(self._tasks())

    async def sessions(self, task_id: str) -> list[JSON]:
        return await self._send(self._sessions(task_id))

    async def session(self, session_id: str) -> JSON:
        return await self._send(self._session(session_id))

    async def cancel(self, task_id: str) -> JSON:
        return await self._send(self._cancel(task_id))

    async def cancel_session(self, session_id: str) -> JSON:
        return await self._send(self._cancel_session(session_id))

    async def wait(self, task_id: str, timeout: float | None = 3600.0, poll_seconds: float = 1.0, on_poll: PollCallback | None = None) -> JSON:
        waiting = TaskWait(task_id, timeout, poll_seconds, on_poll)
        while True:
            result = await self.task(task_id)
            pause = waiting.after(result)
            if pause is None:
                return result
            await asyncio.sleep(pause)

    async def control(self, action: ControlAction, **body: Any) -> JSON:
        return await self._send(self._control(action, body))

    async def health(self) -> JSON:
        return await self._send(self._health())

    async def nodes(self) -> JSON:
        return await self._send(self._nodes())

    async def sql(self, query: str) -> JSON:
        return await self._send(self._sql(query))
