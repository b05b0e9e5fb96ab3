"""Several engines behind one gateway (`--upstream A,B`): a real `polar-mitm gateway` process, the official OpenAI SDK
through the proxy with session credentials, and two named stand-in engines (tests/upstream_standins.py) that
record what each one received, so where every call went is seen from the engines' side, not the router's."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway
from tests.support.upstream_standins import RecordingVLLMStandin


@pytest.fixture
def engines():
    made = [RecordingVLLMStandin(), RecordingVLLMStandin()]
    yield made
    for engine in made:
        engine.stop()


@pytest.fixture
def routed_gateway(engines, tmp_path):
    gateway = Gateway(port=free_port(), db=tmp_path / "store.duckdb", confdir=tmp_path / "confdir", upstream=",".join(e.url for e in engines)).start()
    yield gateway
    gateway.stop()


def chat(gateway: Gateway, session_id: str, turns: int) -> None:
    """One session: `turns` calls, each naming the session in its user text (how the engines' records are read)."""
    http = httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=30)
    client = openai.OpenAI(api_key="sk-test", http_client=http, max_retries=0)
    messages = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"session={session_id} turn={turn}"})
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        assert reply.choices[0].message.content == "Hi!"
        messages.append({"role": "assistant", "content": "Hi!"})
    http.close()


def sessions_seen(engine: RecordingVLLMStandin) -> dict[str, int]:
    seen: dict[str, int] = {}
    for body in engine.requests:
        session = body["messages"][-1]["content"].split()[0].removeprefix("session=")
        seen[session] = seen.get(session, 0) + 1
    return seen


def test_sessions_stick_to_one_engine_and_a_dead_engine_is_taken_out_and_put_back(routed_gateway: Gateway, engines) -> None:
    a, b = engines
    first = [f"route-{i}" for i in range(6)]
    for session_id in first:
        chat(routed_gateway, session_id, 1)
    for session_id in first:  # three more calls of every session, after every session's first
        chat(routed_gateway, session_id, 3)
    seen_a, seen_b = sessions_seen(a), sessions_seen(b)
    # every call of a session at one engine (1 + 3 calls each), and the sessions spread over both engines
    assert set(seen_a) | set(seen_b) == set(first) and not set(seen_a) & set(seen_b), (seen_a, seen_b)
    assert all(n == 4 for n in [*seen_a.values(), *seen_b.values()])
    assert len(seen_a) == len(seen_b) == 3
    # every exchange committed as usual, each with the engine's token ids
    rows = routed_gateway.rows("SELECT session_id, status, completion_token_ids FROM exchanges WHERE session_id LIKE 'route-%'")
    assert len(rows) == 24 and all(r["status"] == "ok" and r["completion_token_ids"] == [13048, 0] for r in rows)

    # engine B goes down: its sessions and every new session are served by A, no call fails
    b.stop()
    b_sessions = sorted(seen_b)
    before_a = len(a.requests)
    chat(routed_gateway, b_sessions[0], 1)
    later = [f"route-down-{i}" for i in range(3)]
    for session_id in later:
        chat(routed_gateway, session_id, 2)
    assert len(a.requests) - before_a == 1 + 6
    assert set(later) <= set(sessions_seen(a))
    failed = routed_gateway.rows("SELECT count(*) AS n FROM exchanges WHERE session_id LIKE 'route-%' AND status <> 'ok'")
    assert failed[0]["n"] == 0

    # B comes back on its port: after the router's probe (5 s cooldown) new sessions go to it again
    b.start()
    time.sleep(5.5)
    back = [f"route-back-{i}" for i in range(4)]
    for session_id in back:
        chat(routed_gateway, session_id, 2)
    assert set(sessions_seen(b)) & set(back), (sessions_seen(a), sessions_seen(b))
    for session_id in back:  # still sticky
        assert (session_id in sessions_seen(a)) != (session_id in sessions_seen(b))
