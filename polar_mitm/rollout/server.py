"""The rollout server's HTTP API (FastAPI; the OpenAPI schema is at /openapi.json, docs at /docs).

    POST   /tasks                 TaskRequest -> 202 TaskAccepted, at once; the sessions run in the background
    GET    /tasks                 every task's TaskResult (live)
    GET    /tasks/{id}            TaskResult (live: status "running" until every session ended)
    GET    /tasks/{id}/sessions   its SessionResults
    GET    /sessions/{id}         one SessionResult
    DELETE /tasks/{id}            cancel the task's unfinished sessions -> 202 TaskResult
    DELETE /sessions/{id}         cancel one session -> 202 SessionResult
    GET    /health
    POST   /control/pause|resume, GET /control/status   the same call on every gateway node this server owns

A request that cannot run is a 422 whose `message` names the field (`agent.harness: ...`), in FastAPI's
`detail` shape too; the server goes on serving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import polar_mitm
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.models import SessionResult, TaskAccepted, TaskRequest, TaskResult
from polar_mitm.rollout.node import GatewayNode, NodeConfig
from polar_mitm.rollout.scheduler import RequestRejected, Scheduler, TaskConflict


def _message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    return "; ".join(parts)


def _invalid(errors: list[dict[str, Any]]) -> JSONResponse:
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
    return JSONResponse(status_code=422, content={"message": _message(detail), "detail": detail})


def _not_found(what: str, key: str) -> JSONResponse:
    return JSONResponse(status_code=404, content={"message": f"no {what} {key!r}", "detail": f"no {what} {key!r}"})


@asynccontextmanager
async def local_backend(config: NodeConfig, callbacks: CallbackSender | None = None) -> AsyncIterator[tuple[Any, Scheduler]]:
    """This machine's own gateway node and a scheduler over it."""
    node = GatewayNode(config)
    await node.start()
    scheduler = Scheduler(node, callbacks)
    try:
        yield node, scheduler
    finally:
        await scheduler.close()
        await node.stop()


def create_app(config: NodeConfig | None, callbacks: CallbackSender | None = None, backend: Callable[[], AbstractAsyncContextManager[tuple[Any, Scheduler]]] | None = None) -> FastAPI:
    """The API over `backend()` ((node with .health(), scheduler)); default: local_backend(config, callbacks)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert backend is not None or config is not None, "give a NodeConfig or a backend"
        async with (backend() if backend is not None else local_backend(config, callbacks)) as (node, scheduler):  # type: ignore[arg-type]
            app.state.node = node
            app.state.scheduler = scheduler
            yield

    app = FastAPI(title="polar-mitm rollout server", version=getattr(polar_mitm, "__version__", "0"), lifespan=lifespan, description=__doc__)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return _invalid(list(error.errors()))

    def scheduler(request: Request) -> Scheduler:
        return request.app.state.scheduler

    @app.post("/tasks", status_code=202, response_model=TaskAccepted, responses={422: {"description": "invalid or unrunnable request"}, 409: {"description": "task_id taken by another request"}})
    async def submit(body: TaskRequest, request: Request) -> Any:
        try:
            task = await scheduler(request).submit(body)
        except RequestRejected as error:
            return _invalid([{"loc": ("body", *error.loc), "msg": str(error), "type": "value_error"}])
        except TaskConflict as error:
            return JSONResponse(status_code=409, content={"message": str(error), "detail": str(error)})
        return TaskAccepted(task_id=task.task_id, session_ids=list(task.sessions), status_url=f"/tasks/{task.task_id}")

    @app.get("/tasks", response_model=list[TaskResult])
    async def list_tasks(request: Request) -> Any:
        tasks = scheduler(request).tasks.values()
        await scheduler(request).count_exchanges_now(s for task in tasks for s in task.sessions.values())
        return [task.result() for task in tasks]

    @app.get("/tasks/{task_id}", response_model=TaskResult, responses={404: {}})
    async def get_task(task_id: str, request: Request) -> Any:
        if task_id not in scheduler(request).tasks:
            return _not_found("task", task_id)
        await scheduler(request).count_exchanges_now(scheduler(request).task(task_id).sessions.values())
        return scheduler(request).task(task_id).result()

    @app.get("/tasks/{task_id}/sessions", response_model=list[SessionResult], responses={404: {}})
    async def get_task_sessions(task_id: str, request: Request) -> Any:
        if task_id not in scheduler(request).tasks:
            return _not_found("task", task_id)
        await scheduler(request).count_exchanges_now(scheduler(request).task(task_id).sessions.values())
        return scheduler(request).task(task_id).result().sessions

    @app.get("/sessions/{session_id}", response_model=SessionResult, responses={404: {}})
    async def get_session(session_id: str, request: Request) -> Any:
        if session_id not in scheduler(request).session_tasks:
            return _not_found("session", session_id)
        await scheduler(request).count_exchanges_now([scheduler(request).session(session_id)])
        return scheduler(request).session(session_id)

    @app.delete("/tasks/{task_id}", status_code=202, response_model=TaskResult, responses={404: {}})
    async def cancel_task(task_id: str, request: Request) -> Any:
        if task_id not in scheduler(request).tasks:
            return _not_found("task", task_id)
        return scheduler(request).cancel_task(task_id).result()

    @app.delete("/sessions/{session_id}", status_code=202, response_model=SessionResult, responses={404: {}})
    async def cancel_session(session_id: str, request: Request) -> Any:
        if session_id not in scheduler(request).session_tasks:
            return _not_found("session", session_id)
        return scheduler(request).cancel_session(session_id)

    async def fan_out(request: Request, method: str, action: str) -> JSONResponse:
        """One gateway control call on every node, in order; a node's refusal is answered with its status."""
        body = await request.body() if method == "POST" else None
        statuses: dict[str, Any] = {}
        async with httpx.AsyncClient(trust_env=False, timeout=None) as client:
            for url in [request.app.state.node.gateway_url]:
                reply = await client.request(method, f"{url}/control/{action}", content=body, headers={"content-type": "application/json"})
                if reply.status_code >= 400:
                    return JSONResponse(status_code=reply.status_code, content={**reply.json(), "node": url, "nodes": statuses})
                statuses[url] = reply.json()
        return JSONResponse(content={"nodes": statuses})

    @app.post("/control/pause")
    async def control_pause(request: Request) -> JSONResponse:
        return await fan_out(request, "POST", "pause")

    @app.post("/control/resume")
    async def control_resume(request: Request) -> JSONResponse:
        return await fan_out(request, "POST", "resume")

    @app.get("/control/status")
    async def control_status(request: Request) -> JSONResponse:
        return await fan_out(request, "GET", "status")

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        tasks = scheduler(request).tasks.values()
        sessions = Counter(s.status for task in tasks for s in task.sessions.values())
        return {"status": "ok", **request.app.state.node.health(), "tasks": len(tasks), "sessions": dict(sessions)}

    return app
