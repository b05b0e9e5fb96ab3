"""Fuzz over the wire (issue 28): hypothesis-made request bodies for every dialect through a real gateway process.

Each request goes as a harness's does: HTTPS_PROXY with session credentials, the gateway's CA, to the provider's
own host (never resolved: the gateway answers). The engine is a stand-in (bench/stub_upstream.py, a fixed reply
at once, in its own process) so that many requests are cheap: it serves anything, so any 5xx is the gateway's.
Invariants per request (tests/support/fuzz_wire.py `check`): never a 5xx, always the provider's error shape or a
well-formed reply, every request a row with the status its client got; and the gateway alive after.

A few cases per dialect by default (derandomized: the same every run, no example database); 10,000 per dialect
with POLAR_MITM_FULL_MATRIX=1 (or `bench/fuzz.py --count 10000`, whose figures are in bench/fuzz_results.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support import fuzz_wire
from tests.support.fuzz_wire import Case
from tests.support.gatewayproc import Gateway
from tests.support.matrix import FULL_MATRIX

COUNT = 10_000 if FULL_MATRIX else 30


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("fuzz")
    engine = fuzz_wire.StubEngine(base / "stub.log")
    try:
        gateway = fuzz_wire.start_gateway(base, engine.url)
        yield gateway
        gateway.stop()
    finally:
        engine.stop()


def oversized_cases(api: str) -> list[Case]:
    """Beyond what hypothesis draws: a 12 MB body of the API's own shape, and a body that is 12 MB of junk."""
    path = {"openai_chat": "/v1/chat/completions", "openai_responses": "/v1/responses", "anthropic_messages": "/v1/messages", "gemini": "/v1beta/models/gemini-2.5-pro:generateContent"}[api]
    text = "\u00e9" * 6_000_000
    body = {
        "openai_chat": f'{{"model": "m", "messages": [{{"role": "user", "content": "{text}"}}]}}',
        "openai_responses": f'{{"model": "m", "input": "{text}"}}',
        "anthropic_messages": f'{{"model": "m", "max_tokens": 16, "messages": [{{"role": "user", "content": "{text}"}}]}}',
        "gemini": f'{{"contents": [{{"parts": [{{"text": "{text}"}}]}}]}}',
    }[api].encode()
    return [Case(api, path, {"content-type": "application/json"}, body, "oversized"), Case(api, path, {"content-type": "application/json"}, b"[" * 12_000_000, "oversized")]


@pytest.mark.parametrize("api", fuzz_wire.APIS)
def test_fuzzed_bodies_through_the_proxy(fuzz_gateway: Gateway, api: str) -> None:
    session_id = f"fuzz-{api}-{uuid.uuid4().hex[:8]}"
    batch = fuzz_wire.generate(api, COUNT) + oversized_cases(api)
    with fuzz_wire.client(fuzz_gateway, session_id) as http:
        answers = fuzz_wire.send_all(http, batch)
    figures = fuzz_wire.Figures(api)
    figures.add(answers)
    print(f"\n{api}: {figures.requests} requests, {dict(figures.statuses)}")
    if figures.violations:
        pytest.fail(f"{len(figures.violations)} of {figures.requests} answers broke an invariant:\n" + "\n".join(figures.violations[:10]), pytrace=False)
    assert figures.statuses["2xx"] and figures.statuses["4xx"], f"the batch should hold both served and refused bodies: {dict(figures.statuses)}"
    assert fuzz_wire.serves(fuzz_gateway, f"{session_id}-after"), "the gateway no longer answers a plain request"
    problems = fuzz_wire.rows_violations(fuzz_gateway, session_id, answers)
    if problems:
        pytest.fail("\n".join(problems[:10]), pytrace=False)
