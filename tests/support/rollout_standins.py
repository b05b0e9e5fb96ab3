"""The real rollout server app (polar_mitm/rollout/server.py: its routes, Scheduler, models, error bodies and
callback sender) on loopback, over a stand-in node, for tests of its clients that need no sandbox or harness.

StandinNode is a fake, named as such: it stands in for a gateway node's sandboxed harness run. Each session
"runs" for `metadata.seconds` (default 0), then completes with reward `metadata.rewards[sample_index]` (default
none). Its gateway is a stand-in HTTP front for the gateway's real control state machine
(polar_mitm.gateway.control.PolicyControl, the object the mitmproxy addon answers /control/* with), so the
server's control fan-out reaches real pause/resume logic and its real refusals.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from polar_mitm.assembler.records import GroupStats
from polar_mitm.assembler.rewards import group_advantages
from polar_mitm.errors import RequestRejected
from polar_mitm.gateway.control import PolicyControl
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.models import SessionResult, StageTiming, TaskRequest, TrajectorySummary
from polar_mitm.rollout.scheduler import Scheduler
from polar_mitm.rollout.server import LocalBackend, create_app
from polar_mitm.rollout.session_run import Report, SessionWork
from polar_mitm.store import now


def control_app(control: PolicyControl) -> FastAPI:
    """The gateway's /control/* over HTTP, answered by the real PolicyControl (a stand-in for the addon's HTTP
    layer only: no proxy, no engine)."""
    app = FastAPI()

    @app.api_route("/control/{action}", methods=["GET", "POST"])
    async def answer(action: str, request: Request) -> Response:
        status, body = await control.handle(request.method, f"/control/{action}", await request.body())
        return JSONResponse(status_code=status, content=body)

    return app


class StandinNode:
    """A stand-in for GatewayNode (see the module docstring): the Scheduler's Node protocol, health and gateway_url."""

    def __init__(self, gateway_url: str):
        self.gateway_url = gateway_url
        self.scheduler: Scheduler | None = None  # set once the scheduler over it exists (export reads its sessions)

    async def check(self, request: TaskRequest) -> None:
        if request.runtime.backend == "docker":  # as a node without Docker answers
            raise RequestRejected(("runtime", "backend"), "docker: no Docker engine on this stand-in node")

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        metadata = work.request.metadata
        rewards = metadata.get("rewards") or []
        started = now()
        result = SessionResult(
            session_id=work.session_id, task_id=work.task_id, sample_index=work.sample_index, status="running",
            harness=work.request.agent.harness, metadata=metadata, timings={"running": StageTiming(started_at=started)},
        )
        report(result)
        await asyncio.sleep(float(metadata.get("seconds", 0)))
        ended = now()
        reward = rewards[work.sample_index] if work.sample_index < len(rewards) else None
        return result.model_copy(update={
            "status": "completed", "reward": reward, "n_exchanges": 2,
            "timings": {"running": StageTiming(started_at=started, ended_at=ended, seconds=(ended - started).total_seconds())},
            "trajectory": TrajectorySummary(builder=work.request.builder.name, sequences=1, exchanges=2, sampled_tokens=5, sequence_tokens=20),
        })

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        """No Parquet; the stats in export_sessions' shape, the group's by the assembler's own GRPO rule
        (assembler/rewards.py) over the completed sessions' rewards."""
        assert self.scheduler is not None
        sessions = [self.scheduler.session(s) for s in session_ids]
        rewards = [s.reward for s in sessions if s.status == "completed" and s.reward is not None]
        mean, std, no_signal, _ = group_advantages(rewards)
        group = GroupStats(group_id=task_id, sessions=len(sessions), scored_sessions=len(rewards), mean=mean, std=std, no_signal=no_signal)
        return None, {"builder": builder, "sequences": len(sessions), "sampled_tokens": 5 * len(sessions), "group": group.model_dump()}

    async def count_exchanges(self, session_id: str) -> int:
        return 1

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def health(self) -> dict[str, Any]:
        return {"gateway_listening": True, "gateway_url": self.gateway_url}


def rollout_app(gateway_url: str, callbacks: CallbackSender | None = None) -> FastAPI:
    """The real rollout server app over a StandinNode whose gateway is `gateway_url` (the app's LocalBackend)."""
    node = StandinNode(gateway_url)
    backend = LocalBackend(node, callbacks)
    node.scheduler = backend.scheduler
    return create_app(backend)


class LoopbackServers:
    """ASGI apps served by uvicorn on 127.0.0.1 from one background thread (its own event loop), so sync clients
    in the test's thread and async ones in another loop both reach them. `urls[i]` is app i's base URL."""

    def __init__(self, *apps: FastAPI):
        self.servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")) for app in apps]
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self.thread.start()
        for server in self.servers:
            while not server.started:
                if not self.thread.is_alive():
                    raise RuntimeError("a loopback server did not start")
                threading.Event().wait(0.02)
        self.urls = [f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}" for server in self.servers]

    async def _serve(self) -> None:
        await asyncio.gather(*(server.serve() for server in self.servers))

    def close(self) -> None:
        for server in self.servers:
            server.should_exit = True
        self.thread.join(timeout=30)
