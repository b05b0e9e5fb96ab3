"""The rollout server's HTTP API (FastAPI; the OpenAPI schema is at /openapi.json, docs at /docs).

    POST   /tasks                 TaskRequest -> 202 TaskAccepted, at once (persisted first: 503 if it cannot be); the
                                  sessions run in the background
    GET    /tasks                 every task's TaskResult (live)
    GET    /tasks/{id}            TaskResult (live: status "running" until every session ended)
    GET    /tasks/{id}/sessions   its SessionResults
    GET    /sessions/{id}         one SessionResult
    DELETE /tasks/{id}            cancel the task's unfinished sessions -> 202 TaskResult
    DELETE /sessions/{id}         cancel one session -> 202 SessionResult
    GET    /health                the backend's health; `engine_reachable`, and status "degraded" when it is false
    POST   /control/pause|resume, GET /control/status
                                  the same call on every gateway this server owns, at once: {"nodes": {gateway:
                                  status}} once each has answered; a refusal is answered with its status code
    GET    /nodes                 (Ray) every node: alive, draining, sessions by stage, engines; the head queue
    DELETE /nodes/{name}          (Ray) drain: nothing new goes there; what runs there finishes
    POST   /nodes/{name}/engines/{take-out|put-back}
                                  (Ray) {"url": ...}: one of the node's engines out of / back in service
    GET    /sql?q=SELECT...       (Ray) one read-only query over every node's store

The API serves a `Backend` (backend.py): `LocalBackend` below, this machine's gateway node (`rollout serve`), or
`polar_mitm.rollout.ray.RolloutCluster` (`rollout serve --ray`). A backend without nodes or SQL answers those
routes with a 404 that says why. This module imports no Ray module.

A request that cannot run is a 422 whose `message` names the field (`agent.harness: ...`), in FastAPI's
`detail` shape too; the server goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import duckdb
from fastapi import Body, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import polar_mitm
from polar_mitm import api_auth
from polar_mitm.errors import BackendStartError, GatewayStartError, RequestRejected, TaskConflict
from polar_mitm.rollout.backend import Backend, ControlCall, Fleet, GatewayReply, SqlSource
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.durable import DurableStore, LocalDurableScheduler, StateUnavailable, sandbox_owner
from polar_mitm.rollout.models import SessionResult, TaskAccepted, TaskRequest, TaskResult
from polar_mitm.rollout.node import GatewayNode, NodeConfig, gateway_control
from polar_mitm.rollout.scheduler import Node, Scheduler

if TYPE_CHECKING:
    import uvicorn

# the rollout server's own lines (tasks, callbacks, nodes) go to this logger and its children (.ray)
PROGRESS_LOGGER = "polar_mitm.rollout"
log = logging.getLogger(PROGRESS_LOGGER)


class LocalNode(Node, Protocol):
    """A gateway node in this process: GatewayNode (or a test's stand-in for one)."""

    @property
    def gateway_url(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


class LocalBackend:
    """This machine's one gateway node and a scheduler over it (`polar-mitm rollout serve`). Implements Backend.

    With a `state` file (`rollout serve --state`, default `<db>.rollout.duckdb`; `rollout run` only with --state)
    tasks, session states and deliveries are durable (durable.py): `open` first kills what a killed server on the
    same state left of its sandboxes (processes by their owner marker, containers by their label), then recovers
    its tasks."""

    fleet: Fleet | None = None  # one node: nothing to list or drain
    sql: SqlSource | None = None  # its store is read directly (`polar-mitm sql --db`)

    def __init__(self, node: LocalNode | NodeConfig, callbacks: CallbackSender | None = None, state: Path | None = None):
        self.owner = sandbox_owner(state) if state is not None else None
        if isinstance(node, NodeConfig):
            node = GatewayNode(node.model_copy(update={"sandbox_owner": self.owner}))
        self.node: LocalNode = node
        self.store = DurableStore(state) if state is not None else None
        record = self.node.record if isinstance(self.node, GatewayNode) else None
        self.scheduler = LocalDurableScheduler(self.node, self.store, callbacks, record) if self.store is not None else Scheduler(self.node, callbacks)
        self.opened = False
        self.closed = False

    async def open(self) -> None:
        if self.opened:
            return
        try:
            await self.node.start()
        except (GatewayStartError, TimeoutError) as error:
            await self.node.stop()
            raise BackendStartError(str(error)) from error
        try:
            await self._recover()
        except (duckdb.Error, OSError) as error:
            await self.node.stop()
            assert self.store is not None
            raise BackendStartError(f"cannot open the rollout server's state {self.store.path}: {error}") from error
        self.opened = True

    async def _recover(self) -> None:
        """A previous run's tasks back (once its sandboxes are gone): the sessions it had started end failed."""
        if self.store is None or not isinstance(self.scheduler, LocalDurableScheduler):
            return
        stored = await asyncio.to_thread(self.store.tasks)
        died = [(task, session_id) for task in stored for session_id, (_, status, final) in task.sessions.items() if status == "dispatched" and final is None]
        if died and self.owner is not None:
            await asyncio.to_thread(reap_sandboxes, self.owner, docker={task.request.runtime.backend for task, _ in died} >= {"docker"})
        recovered = self.scheduler.recover()
        if recovered:
            log.info(f"polar-mitm rollout: {recovered} task(s) back from {self.store.path}; {len(died)} session(s) that ran when the server stopped are failed, not run again")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.scheduler.close()
        await self.node.stop()
        if self.store is not None:
            self.store.close()

    def health(self) -> dict[str, Any]:
        return self.node.health()

    async def control(self, call: ControlCall) -> dict[str, GatewayReply]:
        return {self.node.gateway_url: await gateway_control(self.node.gateway_url, call)}


def reap_sandboxes(owner: str, docker: bool) -> None:
    """Remove what is left of `owner`'s sandboxes: processes carrying its marker and then their directories, and
    (`docker`) its containers."""
    from polar_mitm.rollout.runtimes import local

    local.kill_owned(owner)
    local.remove_owned(owner)
    if docker:
        from polar_mitm.rollout.runtimes import docker as docker_runtime

        try:
            docker_runtime.remove_owned(owner)
        except Exception as error:  # noqa: BLE001 - no engine now: nothing of ours can be running in it either
            log.warning(f"polar-mitm rollout: could not remove the containers a stopped server left: {type(error).__name__}: {error}")


def _message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    return "; ".join(parts)


def _invalid(errors: list[dict[str, Any]]) -> JSONResponse:
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
    return JSONResponse(status_code=422, content={"message": _message(detail), "detail": detail})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"message": message, "detail": message})


def _not_found(what: str, key: str) -> JSONResponse:
    return _error(404, f"no {what} {key!r}")


ONE_NODE = "this rollout server runs one gateway node (it was started without --ray)"


def create_app(backend: Backend, api_token: str | None = None) -> FastAPI:
    """The API over `backend`; the app's lifespan opens it (if it is not open yet) and closes it. With `api_token`,
    every route (the dashboard at /ui and the docs too) answers 401 unless the request carries
    `Authorization: Bearer <api_token>` (polar_mitm/api_auth.py; `rollout serve` needs one beyond loopback)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.open()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="polar-mitm rollout server", version=getattr(polar_mitm, "__version__", "0"), lifespan=lifespan, description=__doc__)
    app.state.backend = backend
    scheduler = app.state.scheduler = backend.scheduler

    if api_token:
        @app.middleware("http")
        async def bearer_token(request: Request, call_next: Any) -> Any:
            if not api_auth.bearer_matches(request.headers.get("authorization"), api_token):
                answer = _error(401, f"the rollout server needs 'Authorization: Bearer <token>' (the token of its --api-token / ${api_auth.ROLLOUT_TOKEN_ENV})")
                answer.headers["www-authenticate"] = "Bearer"
                return answer
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return _invalid(list(error.errors()))

    @app.post("/tasks", status_code=202, response_model=TaskAccepted, responses={422: {"description": "invalid or unrunnable request"}, 409: {"description": "task_id taken by another request"}, 503: {"description": "the server cannot persist the task now (its state file cannot be written)"}})
    async def submit(body: TaskRequest) -> Any:
        try:
            task = await scheduler.submit(body)
        except RequestRejected as error:
            return _invalid([{"loc": ("body", *error.loc), "msg": str(error), "type": "value_error"}])
        except TaskConflict as error:
            return _error(409, str(error))
        except StateUnavailable as error:  # not persisted, so not accepted: the caller may submit it again
            return _error(503, f"the task was not accepted: {error}")
        return TaskAccepted(task_id=task.task_id, session_ids=list(task.sessions), status_url=f"/tasks/{task.task_id}")

    @app.get("/tasks", response_model=list[TaskResult])
    async def list_tasks() -> Any:
        tasks = scheduler.tasks.values()
        await scheduler.count_exchanges_now(s for task in tasks for s in task.sessions.values())
        return [task.result() for task in tasks]

    @app.get("/tasks/{task_id}", response_model=TaskResult, responses={404: {}})
    async def get_task(task_id: str) -> Any:
        if task_id not in scheduler.tasks:
            return _not_found("task", task_id)
        await scheduler.count_exchanges_now(scheduler.task(task_id).sessions.values())
        return scheduler.task(task_id).result()

    @app.get("/tasks/{task_id}/sessions", response_model=list[SessionResult], responses={404: {}})
    async def get_task_sessions(task_id: str) -> Any:
        if task_id not in scheduler.tasks:
            return _not_found("task", task_id)
        await scheduler.count_exchanges_now(scheduler.task(task_id).sessions.values())
        return scheduler.task(task_id).result().sessions

    @app.get("/sessions/{session_id}", response_model=SessionResult, responses={404: {}})
    async def get_session(session_id: str) -> Any:
        if session_id not in scheduler.session_tasks:
            return _not_found("session", session_id)
        await scheduler.count_exchanges_now([scheduler.session(session_id)])
        return scheduler.session(session_id)

    @app.delete("/tasks/{task_id}", status_code=202, response_model=TaskResult, responses={404: {}})
    async def cancel_task(task_id: str) -> Any:
        if task_id not in scheduler.tasks:
            return _not_found("task", task_id)
        return scheduler.cancel_task(task_id).result()

    @app.delete("/sessions/{session_id}", status_code=202, response_model=SessionResult, responses={404: {}})
    async def cancel_session(session_id: str) -> Any:
        if session_id not in scheduler.session_tasks:
            return _not_found("session", session_id)
        return scheduler.cancel_session(session_id)

    async def fan_out(request: Request, call: ControlCall) -> JSONResponse:
        """The call on every gateway of the backend; the first refusal (if any) is answered with its status."""
        replies = await backend.control(call.model_copy(update={"authorization": request.headers.get("authorization")}))
        if not replies:
            return _error(503, "no gateway node is alive")
        answered = {name: reply.body for name, reply in replies.items() if reply.status < 400}
        refused = {name: reply for name, reply in replies.items() if reply.status >= 400}
        if refused:
            name, first = next(iter(refused.items()))
            return JSONResponse(status_code=first.status, content={**first.body, "node": name, "nodes": answered, "refused": {n: r.body for n, r in refused.items()}})
        return JSONResponse(content={"nodes": answered})

    @app.post("/control/pause")
    async def control_pause(request: Request) -> JSONResponse:
        return await fan_out(request, ControlCall(method="POST", action="pause", body=(await request.body()).decode("utf-8", "replace") or None))

    @app.post("/control/resume")
    async def control_resume(request: Request) -> JSONResponse:
        return await fan_out(request, ControlCall(method="POST", action="resume", body=(await request.body()).decode("utf-8", "replace") or None))

    @app.get("/control/status")
    async def control_status(request: Request) -> JSONResponse:
        return await fan_out(request, ControlCall(method="GET", action="status"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        tasks = scheduler.tasks.values()
        sessions = Counter(s.status for task in tasks for s in task.sessions.values())
        report = backend.health()
        status = "degraded" if report.get("engine_reachable") is False else "ok"
        return {"status": status, **report, "tasks": len(tasks), "sessions": dict(sessions)}

    @app.get("/nodes", responses={404: {}})
    async def nodes() -> Any:
        if backend.fleet is None:
            return _error(404, f"{ONE_NODE}: no nodes to list; its gateway is in GET /health")
        return backend.fleet.status()

    @app.delete("/nodes/{name}", status_code=202, responses={404: {}})
    async def drain(name: str) -> Any:
        if backend.fleet is None:
            return _error(404, f"{ONE_NODE}: no node to drain")
        try:
            return backend.fleet.drain(name)
        except KeyError:
            return _not_found("node", name)

    @app.post("/nodes/{name}/engines/{action}", responses={400: {}, 404: {}})
    async def engine_service(name: str, action: str, url: str = Body(embed=True)) -> Any:
        if backend.fleet is None:
            return _error(404, f"{ONE_NODE}: start it with several --upstream and the gateway routes around an engine that fails")
        if action not in ("take-out", "put-back"):
            return _error(404, f"no action {action!r} (take-out, put-back)")
        try:
            return await backend.fleet.set_engine_service(name, url, in_service=action == "put-back")
        except KeyError:
            return _not_found("node", name)
        except ValueError as error:  # the node's answer (an unknown URL, a single engine)
            return _error(400, str(error))

    @app.get("/sql", responses={400: {}, 404: {}})
    async def sql(q: str) -> Any:
        if backend.sql is None:
            db = backend.health().get("db")
            return _error(404, f"{ONE_NODE}: query its store directly, e.g. polar-mitm sql --db {db or 'DB'} \"SELECT ...\"")
        try:
            columns, rows = await backend.sql.query(q)
        except Exception as error:  # noqa: BLE001 - the query's error, to the caller
            return _error(400, f"{type(error).__name__}: {error}")
        return {"columns": columns, "rows": jsonable_encoder([list(r) for r in rows]), "catalog": str(backend.sql.catalog)}

    from polar_mitm.ui import rollout_dashboard  # the read-only dashboard at /ui (issue 30): polar_mitm/ui/

    app.mount("/ui", rollout_dashboard(backend))
    return app


class _ProgressHandler(logging.StreamHandler):
    """The handler show_progress adds (one per logger, however often it is called)."""


def show_progress(stream: TextIO | None = None) -> None:
    """Print the server's own lines (tasks accepted and finished, failed callbacks, nodes joining and lost) on
    `stream` (stderr), whatever the rest of logging does: mitmproxy's handlers on the root logger print only
    with -v, and not at INFO."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    if not any(isinstance(handler, _ProgressHandler) for handler in logger.handlers):
        handler = _ProgressHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, here (with -v the root's terminal log would print it again)


def serve(server: uvicorn.Server, ready: str) -> int:
    """Run `server` (its app from create_app) until it stops: the backend is opened first, so a backend that
    cannot start is one line on stderr and exit status 2 with nothing served; `ready` is printed once the API
    listens. Returns the exit status."""
    app = server.config.app
    assert isinstance(app, FastAPI), "an app made by create_app"
    backend: Backend = app.state.backend
    show_progress()

    async def main() -> int:
        try:
            await backend.open()
        except BackendStartError as error:
            print(f"polar-mitm rollout: {error}", file=sys.stderr, flush=True)
            return 2
        try:
            serving = asyncio.create_task(server.serve())
            while not server.started and not serving.done():
                await asyncio.sleep(0.05)
            if server.started:
                print(ready, file=sys.stderr, flush=True)
            await serving
        finally:
            await backend.close()  # already closed by the app's lifespan unless uvicorn never ran it
        return 0

    return asyncio.run(main())
