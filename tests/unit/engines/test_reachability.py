"""An engine client keeps whether its URL answers (`Reachability`) and reports each change once, not per call:
a real HTTP server on loopback that goes away and comes back on the same port. No engine needed."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from polar_mitm.engines import Reachability, make_engine
from polar_mitm.errors import EngineError
from polar_mitm.util import free_port


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "standin", "max_model_len": 128}]})


async def serve(port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_each_change_is_reported_once_with_how_long_it_lasted() -> None:
    async def main() -> None:
        port = free_port()
        engine = make_engine("vllm", f"http://127.0.0.1:{port}/v1")
        [reach] = engine.reachability()
        changes: list[tuple[bool | None, int]] = []
        reach.on_change = lambda r: changes.append((r.reachable, r.failed_calls))
        try:
            runner = await serve(port)
            assert await engine.list_models() == ["standin"]
            assert reach.reachable is True and changes == []  # the first answer is no change
            await runner.cleanup()
            for _ in range(3):
                with pytest.raises(EngineError) as failed:
                    await engine.list_models()
                assert failed.value.status_class == "engine_unreachable"
            assert changes == [(False, 1)] and reach.failed_calls == 3 and "Connect" in (reach.last_error or "")
            runner = await serve(port)
            assert await engine.discover() == "standin" and await engine.list_models() == ["standin"]
            assert changes == [(False, 1), (True, 3)] and reach.down_seconds is not None and reach.down_seconds >= 0
            await runner.cleanup()
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_router_reports_each_engine_url() -> None:
    router = make_engine("vllm", "http://127.0.0.1:9/v1, http://127.0.0.1:10/v1")
    assert [(r.url, r.reachable) for r in router.reachability()] == [("http://127.0.0.1:9/v1", None), ("http://127.0.0.1:10/v1", None)]
    reach = Reachability("u")
    reach.answered()
    reach.unreachable("refused")
    reach.unreachable("refused")
    assert (reach.reachable, reach.failed_calls, reach.last_error) == (False, 2, "refused")


def test_a_connection_the_engine_never_accepts_is_an_engine_timeout_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener whose accept queue is full (backlog 0, filled, never accepted): the kernel drops further SYNs, so
    the connection itself times out; the error names that, not the per-call read limit."""
    import socket

    from polar_mitm.engines import base

    monkeypatch.setattr(base, "CONNECT_TIMEOUT_S", 0.5)
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)

        async def main() -> None:
            engine = make_engine("vllm", f"http://127.0.0.1:{port}/v1")
            try:
                with pytest.raises(EngineError) as failure:
                    await engine.list_models()
            finally:
                await engine.close()
            assert failure.value.http_status == 504 and failure.value.status_class == "engine_timeout"
            assert str(failure.value) == f"no connection to the inference engine at http://127.0.0.1:{port}/v1 within 0.5s"

        asyncio.run(main())
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
