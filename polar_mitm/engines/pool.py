"""Several engines behind one gateway: session-sticky, least-outstanding routing with engines taken out and put back.

A session's first call goes to the healthy engine with the fewest calls in flight (ties: the fewest sessions
pinned to it); every later call of that session goes to the same engine, so its prefix cache is reused (verl's
agent loop does the same). An engine whose connection is refused or dropped (`engine_unreachable`: no answer can
come from it) is taken out at once and the call goes to another engine, the session re-pinned there; HTTP errors
and timeouts are answered as they are (the engine is up; the harness retries as it would against one engine). An
engine that is out is probed (GET /models, 2 s) at most every `cooldown` seconds from the request path and put
back when it answers.
Operators can take one out and put it back by hand (`take_out` / `put_back`, e.g. for a weight reload).

The router satisfies `engines._api.EngineClient`, as one engine does; the gateway addon sets `CURRENT_SESSION`
for each exchange. All engines must serve the same model and be of the same kind (vllm or sglang).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from polar_mitm.engines._api import Reachability
from polar_mitm.engines.base import Engine
from polar_mitm.exchange import Completion, EngineError, Notes

T = TypeVar("T")

CURRENT_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("polar_engine_session", default=None)
MAX_PINNED_SESSIONS = 100_000  # the oldest pins are forgotten past this (a forgotten session is routed afresh)


@dataclass
class Route:
    engine: Engine
    outstanding: int = 0
    calls: int = 0
    failures: int = 0
    sessions: int = 0  # sessions pinned to it
    out_since: float | None = None  # monotonic time it was taken out; None: in service
    manual: bool = False  # taken out by hand: never probed back in
    next_probe: float = 0.0


class EngineRouter:
    def __init__(self, engines: list[Engine], cooldown: float = 5.0):
        if not engines:
            raise ValueError("the router needs at least one engine")
        kinds = {engine.kind for engine in engines}
        if len(kinds) > 1:
            raise ValueError(f"all routed engines must be of one kind, got {sorted(kinds)}")
        self.routes = [Route(engine) for engine in engines]
        self.kind = engines[0].kind
        self.base_url = ",".join(engine.base_url for engine in engines)
        self.cooldown = cooldown
        self.pinned: OrderedDict[str, Route] = OrderedDict()

    # -- the EngineClient surface (engines/_api.py) the gateway uses
    @property
    def served_model(self) -> str | None:
        return self.routes[0].engine.served_model

    @property
    def max_model_len(self) -> int | None:
        return self.routes[0].engine.max_model_len

    async def discover(self) -> str:
        last: EngineError | None = None
        for route in self._in_service() or self.routes:
            try:
                return await route.engine.discover()
            except EngineError as error:
                last = error
        assert last is not None
        raise last

    def build_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        return self.routes[0].engine.build_request(chat, model)

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        return self.routes[0].engine.build_count_request(chat, model)

    async def complete(self, engine_request: dict[str, Any], notes: Notes | None = None, timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any], Completion]:
        return await self._call(lambda engine: engine.complete(engine_request, notes, timeout))

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        return await self._call(lambda engine: engine.complete_tokens(request))

    async def list_models(self) -> list[str]:
        return await self._call(lambda engine: engine.list_models())

    async def models(self) -> list[dict[str, Any]]:
        return await self._call(lambda engine: engine.models())

    def reachability(self) -> list[Reachability]:
        return [reach for route in self.routes for reach in route.engine.reachability()]

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        return await self._call(lambda engine: engine.count_tokens(count_request))

    async def close(self) -> None:
        await asyncio.gather(*(route.engine.close() for route in self.routes), return_exceptions=True)

    # -- operations
    def take_out(self, base_url: str) -> None:
        route = self._route(base_url)
        route.out_since, route.manual = time.monotonic(), True

    def put_back(self, base_url: str) -> None:
        route = self._route(base_url)
        route.out_since, route.manual = None, False

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "url": r.engine.base_url, "in_service": r.out_since is None, "taken_out_by_hand": r.manual, "outstanding": r.outstanding,
                "calls": r.calls, "failures": r.failures, "sessions": r.sessions,
            }
            for r in self.routes
        ]

    # -- routing
    async def _call(self, send: Callable[[Engine], Awaitable[T]]) -> T:
        session = CURRENT_SESSION.get()
        await self._probe_due()
        tried: set[int] = set()
        while True:
            route = self._pick(session, tried)
            route.outstanding += 1
            route.calls += 1
            try:
                return await send(route.engine)
            except EngineError as error:
                if error.status_class != "engine_unreachable":
                    raise
                route.failures += 1
                route.out_since = route.out_since or time.monotonic()
                route.next_probe = time.monotonic() + self.cooldown
                tried.add(id(route))
                if session is not None:
                    self._unpin(session)
                if not any(id(r) not in tried for r in self._in_service()):
                    raise
            finally:
                route.outstanding -= 1

    def _pick(self, session: str | None, tried: set[int]) -> Route:
        if session is not None:
            route = self.pinned.get(session)
            if route is not None and route.out_since is None and id(route) not in tried:
                self.pinned.move_to_end(session)
                return route
        candidates = [r for r in self._in_service() if id(r) not in tried]
        if not candidates:
            # nothing in service: try the engine out longest (it may be back; its error is the answer otherwise)
            candidates = sorted((r for r in self.routes if not r.manual and id(r) not in tried), key=lambda r: r.out_since or 0.0)[:1]
            if not candidates:
                raise EngineError("engine_unreachable", "every inference engine behind this gateway is taken out", 503)
        route = min(candidates, key=lambda r: (r.outstanding, r.sessions))
        if session is not None:
            self._unpin(session)
            self.pinned[session] = route
            route.sessions += 1
            while len(self.pinned) > MAX_PINNED_SESSIONS:
                _, oldest = self.pinned.popitem(last=False)
                oldest.sessions -= 1
        return route

    def _unpin(self, session: str) -> None:
        route = self.pinned.pop(session, None)
        if route is not None:
            route.sessions -= 1

    def _in_service(self) -> list[Route]:
        return [r for r in self.routes if r.out_since is None]

    async def _probe_due(self) -> None:
        now = time.monotonic()
        due = [r for r in self.routes if r.out_since is not None and not r.manual and r.next_probe <= now]
        if due:
            for route in due:
                route.next_probe = now + self.cooldown  # one probe per cooldown, however many calls arrive meanwhile
            await asyncio.gather(*(self._probe(route) for route in due))

    async def _probe(self, route: Route) -> None:
        try:
            await asyncio.wait_for(route.engine.models(), 2.0)
        except (EngineError, TimeoutError):
            return
        route.out_since = None

    def _route(self, base_url: str) -> Route:
        for route in self.routes:
            if route.engine.base_url == base_url.rstrip("/"):
                return route
        raise KeyError(f"no engine {base_url!r} behind this router ({self.base_url})")
