"""What fuzzing over the wire (tests/integration/test_fuzz_wire.py) found at the gateway's edge, one test each: a body
nested deeper than Python's json parses stopped the exchange before its row existed, and mitmproxy then forwarded
the unanswered model call upstream, to the real provider, with the harness's key."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from mitmproxy import http
from mitmproxy.addons import proxyserver
from mitmproxy.test import taddons, tflow

from polar_mitm import redact
from polar_mitm.gateway import flows
from polar_mitm.gateway.addon import PolarAddon
from tests.unit.gateway.test_addon_outcomes import FailingStandinEngine, _checked

DEEP = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}"


def test_the_model_of_a_body_nested_too_deep_is_unknown_not_a_crash() -> None:
    # was RecursionError out of peek_model (json.loads), for the row of a body the dialect had refused
    assert flows.peek_model(DEEP, "/v1/chat/completions") is None
    assert flows.peek_model(b'{"model": "gpt-5"}', "/v1/chat/completions") == "gpt-5"


def test_secrets_are_found_in_a_body_nested_too_deep_to_parse_and_in_a_deep_one() -> None:
    # was RecursionError out of the body-field scan (json.loads, then a recursive walk): no row, request forwarded
    assert redact.secret_values([], [], DEEP) == []
    nested = {"api_key": "abcd-secret-1"}
    for _ in range(5_000):  # json parses it (3.13), a recursive walk over it raised RecursionError
        nested = {"a": nested}
    assert redact.secret_values([], [], json.dumps(nested).encode()) == ["abcd-secret-1"]


def test_a_bug_before_the_row_is_made_is_answered_in_the_providers_shape_never_forwarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_request_row(*args: object, **kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")  # what a deep body did in redact.py

    monkeypatch.setattr(flows, "request_row", broken_request_row)
    addon = PolarAddon(start_line=io.StringIO())

    async def run() -> http.HTTPFlow:
        with taddons.context(proxyserver.Proxyserver(), addon) as tctx:
            tctx.configure(addon, polar_upstream="http://127.0.0.1:9/v1", polar_db=str(tmp_path / "store.duckdb"), confdir=str(tmp_path / "confdir"))
            addon.engine = _checked(FailingStandinEngine(None))
            await addon.running()
            flow = tflow.tflow()
            flow.request = http.Request.make("POST", "https://api.anthropic.com/v1/messages", b'{"model": "m"}', {"content-type": "application/json"})
            try:
                await addon.request(flow)
            finally:
                await addon.done()
            return flow

    flow = asyncio.run(run())
    assert flow.response is not None, "a model call the hook left unanswered is forwarded upstream by mitmproxy"
    assert flow.response.status_code == 500
    body = json.loads(flow.response.content)
    assert body["type"] == "error" and body["error"]["type"] == "api_error" and "RecursionError" in body["error"]["message"]
