"""The real addon, in-process (mitmproxy's taddons and tflow), driven through each failure class on both paths: a
JSON reply and a stream whose headers went out before the engine failed. Both record one row status, and tell the
client the same error (Gemini's error body carries the HTTP status, so the row's response_body shows it for the
stream too). The engine is a stand-in that only injects failures; the store is a real DuckDB store."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.addons import proxyserver
from mitmproxy.connection import ConnectionState
from mitmproxy.test import taddons, tflow

from polar_mitm import store
from polar_mitm.dialects.common import sse_events
from polar_mitm.engines import EngineClient, Reachability
from polar_mitm.errors import DialectError, EngineError, RenderError
from polar_mitm.exchange import Completion, Notes
from polar_mitm.gateway import addon as addon_module
from polar_mitm.gateway.addon import PolarAddon
from tests.support.rows import fill_the_disk_under

# longer than the addon holds a streamed call's headers (STREAM_HOLD_S): the stream has started when the call fails
FAIL_AFTER_S = addon_module.STREAM_HOLD_S + 0.3
STREAMED = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
UNSTREAMED = "/v1beta/models/gemini-2.5-flash:generateContent"
BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


class FailingStandinEngine:
    """A stand-in engine for failure injection only (an EngineClient): every generation waits `delay` seconds,
    then raises `failure`, or waits until cancelled when there is none (for the client and the gateway to leave)."""

    kind = "vllm"
    base_url = "http://127.0.0.1:9/v1"
    max_model_len: int | None = 4096

    def __init__(self, failure: BaseException | None, delay: float = FAIL_AFTER_S):
        self.failure, self.delay = failure, delay
        self.cancelled = 0

    async def discover(self) -> str:
        return "standin"

    async def list_models(self) -> list[str]:
        return ["standin"]

    async def models(self) -> list[dict[str, Any]]:
        return [{"id": "standin", "max_model_len": self.max_model_len}]

    def build_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        return {**chat, "model": model, "stream": False}

    async def complete(self, engine_request: dict[str, Any], notes: Notes | None = None, timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any], Completion]:
        await self._fail()
        raise AssertionError("unreachable")

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        await self._fail()
        raise AssertionError("unreachable")

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        return {"model": model, "messages": chat["messages"]}

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        await self._fail()
        raise AssertionError("unreachable")

    def reachability(self) -> list[Reachability]:
        return []

    async def close(self) -> None:
        pass

    async def _fail(self) -> None:
        try:
            await asyncio.sleep(self.delay if self.failure is not None else 3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        assert self.failure is not None
        raise self.failure


def _checked(engine: FailingStandinEngine) -> EngineClient:
    return engine  # a type checker sees the stand-in satisfy the protocol here


def gemini_flow(path: str, session_id: str) -> http.HTTPFlow:
    flow = tflow.tflow()
    query = "?alt=sse" if "stream" in path else ""
    flow.request = http.Request.make("POST", f"https://generativelanguage.googleapis.com{path}{query}", json.dumps(BODY), {"content-type": "application/json"})
    flow.metadata["polar_session"] = session_id
    return flow


async def run_both(
    tmp_path: Path, engine: FailingStandinEngine, during: Callable[[PolarAddon, list[http.HTTPFlow]], Any] | None = None,
    break_store: bool = False,
) -> tuple[dict[str, dict[str, Any]], dict[str, http.HTTPFlow]]:
    """One addon with the stand-in engine: a JSON call and a streamed call at once; `during(addon, flows)` runs
    while both wait on the engine. Returns the rows and the flows by path ("json", "stream"), the addon stopped."""
    addon = PolarAddon(start_line=io.StringIO())
    db = tmp_path / "store.duckdb"
    with taddons.context(proxyserver.Proxyserver(), addon) as tctx:
        # chat mode: the stand-in replaces the engine after configure, so the engine's model directory (for auto's
        # tokens mode) is never asked for; the failures are the engine call's, raised the same in either mode
        tctx.configure(addon, polar_upstream="http://127.0.0.1:9/v1", polar_db=str(db), confdir=str(tmp_path / "confdir"), polar_keepalive_interval=0.1, polar_render="chat")
        addon.engine = _checked(engine)
        await addon.running()
        assert addon.store is not None
        stopped = False
        try:
            if break_store:
                fill_the_disk_under(addon.store)  # a real failure of the real store: its disk is full
            flows = {"json": gemini_flow(UNSTREAMED, "json"), "stream": gemini_flow(STREAMED, "stream")}
            calls = [asyncio.ensure_future(addon.request(flow)) for flow in flows.values()]
            if during is not None:
                await asyncio.sleep(addon_module.STREAM_HOLD_S + 0.1)  # both wait on the engine; the stream has begun
                if await during(addon, list(flows.values())) == "stopped":
                    stopped = True
            await asyncio.wait_for(asyncio.gather(*calls), 20)
            if addon.stream_tasks:
                await asyncio.wait_for(asyncio.gather(*addon.stream_tasks), 20)
        finally:
            if not stopped:
                await addon.done()
    rows = {} if break_store else {row["session_id"]: row for row in store.query_dicts(db, "SELECT * FROM exchanges ORDER BY seq")}
    return rows, flows


def sent_stream(flow: http.HTTPFlow) -> bytes:
    assert flow.response is None  # a stream leaves through the loopback server; the flow keeps what was sent
    return flow.metadata["polar_stream_sent"]


def last_event(flow: http.HTTPFlow) -> Any:
    return sse_events(sent_stream(flow))[-1][1]


# failure raised by the engine call -> (row status, the client's HTTP status)
RAISED: list[tuple[str, BaseException, str, int]] = [
    ("engine_error", EngineError("engine_error", "the inference engine failed with HTTP 500", 502, {"message": "boom"}), "engine_error", 502),
    ("engine_timeout", EngineError("engine_timeout", "the inference engine did not answer within 1s", 504), "engine_timeout", 504),
    ("engine_unreachable", EngineError("engine_unreachable", "the inference engine is unreachable", 503), "engine_unreachable", 503),
    ("render_error", RenderError(500, "bad_chat_template", "the model's chat template does not parse"), "render_error", 500),
    ("dialect_4xx", DialectError(400, "invalid_request_error", "a request the gateway refuses"), "bad_request", 400),
    ("dialect_5xx", DialectError(502, "adapter_unavailable", "the adapter is not loaded"), "internal_error", 502),
    ("bug", ZeroDivisionError("division by zero"), "internal_error", 500),
]


@pytest.mark.parametrize(("failure", "status", "http_status"), [case[1:] for case in RAISED], ids=[case[0] for case in RAISED])
def test_a_failure_after_the_stream_began_is_recorded_and_answered_as_a_json_call_is(tmp_path: Path, failure: BaseException, status: str, http_status: int) -> None:
    rows, flows = asyncio.run(run_both(tmp_path, FailingStandinEngine(failure)))
    json_row, stream_row = rows["json"], rows["stream"]
    assert json_row["status"] == stream_row["status"] == status
    assert (json_row["http_status"], stream_row["http_status"]) == (http_status, 200)  # a stream's status line went first
    # one answer: the same error body, the stream's in its own grammar after the opening
    assert json_row["response_body"] == stream_row["response_body"] and json.loads(json_row["response_body"])["error"]["code"] == http_status
    assert json_row["error"] == stream_row["error"]
    assert flows["json"].response is not None and flows["json"].response.status_code == http_status
    assert json.loads(flows["json"].response.content) == json.loads(json_row["response_body"])
    assert last_event(flows["stream"]) == json.loads(json_row["response_body"])  # after the opening and keepalives
    assert json.loads(stream_row["engine_request"])["model"] == "standin" and stream_row["engine_started_at"] is not None
    if isinstance(failure, EngineError) and failure.engine_body is not None:
        assert json.loads(json_row["engine_response"]) == json.loads(stream_row["engine_response"]) == failure.engine_body


def test_a_client_that_leaves_is_client_disconnected_499_on_both_paths(tmp_path: Path) -> None:
    engine = FailingStandinEngine(None)

    async def leave(addon: PolarAddon, flows: list[http.HTTPFlow]) -> None:
        for flow in flows:
            flow.client_conn.state = ConnectionState.CLOSED  # what mitmproxy's connection says once its client closed

    rows, _ = asyncio.run(run_both(tmp_path, engine, leave))
    assert rows["json"]["status"] == rows["stream"]["status"] == "client_disconnected"
    assert (rows["json"]["http_status"], rows["stream"]["http_status"]) == (499, 200)
    assert json.loads(rows["json"]["response_body"]) == json.loads(rows["stream"]["response_body"])
    assert json.loads(rows["stream"]["response_body"])["error"]["code"] == 499  # was 503 for a stream
    assert engine.cancelled == 2  # both engine calls were cancelled (the engine aborts them)


def test_a_stop_with_calls_in_flight_is_gateway_shutdown_503_on_both_paths(tmp_path: Path) -> None:
    engine = FailingStandinEngine(None)

    async def stop(addon: PolarAddon, flows: list[http.HTTPFlow]) -> str:
        await addon.done()
        return "stopped"

    rows, flows = asyncio.run(run_both(tmp_path, engine, stop))
    assert rows["json"]["status"] == rows["stream"]["status"] == "gateway_shutdown"
    assert (rows["json"]["http_status"], rows["stream"]["http_status"]) == (503, 200)
    assert json.loads(rows["json"]["response_body"]) == json.loads(rows["stream"]["response_body"])
    assert json.loads(rows["stream"]["response_body"])["error"]["code"] == 503
    assert "gateway was stopped" in last_event(flows["stream"])["error"]["message"] and engine.cancelled == 2


def test_a_row_the_store_refuses_is_a_500_store_error_on_both_paths(tmp_path: Path) -> None:
    _, flows = asyncio.run(run_both(tmp_path, FailingStandinEngine(EngineError("engine_timeout", "late", 504)), break_store=True))
    response = flows["json"].response
    assert response is not None and response.status_code == 500
    error = json.loads(response.content)["error"]
    assert (error["code"], error["status"]) == (500, "INTERNAL") and "could not record the exchange" in error["message"]
    error = last_event(flows["stream"])["error"]  # the stream's last event: not the engine's 504
    assert error["code"] == 500 and "could not record the exchange" in error["message"]
