"""The real harnesses through an engine slower than their stream limits: keepalives carry the turn, and the same
run without them fails.

Each harness's own limit is shrunk with its own setting where one exists, the real engine is slowed by a relay
(tests/support/upstream_standins.py DelayedEngineRelay: chat completions forwarded after `delay` seconds, answered by
the real engine), and the harness runs twice side by side, identically but for the gateway's --keepalive-interval:
1 s (the tool turn completes, exactly as in tests/integration/test_harnesses.py) and 0 (no keepalives: the harness
gives up on the slowed turn, each call it made for it is a `client_disconnected` row left before the engine answered,
and no tool result ever reaches the engine).

Gemini CLI has no setting for its one limit on a stream (undici's bodyTimeout, 300 s between body bytes), so its case
waits that long: about 5.5 minutes, the two runs side by side. It sends the call it abandoned again (to be abandoned
again after 300 s, and so on), so its silent run is stopped once that retry is on its way.
"""

from __future__ import annotations

import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.test_harnesses import HOOK, check_run, installed, run_harness  # noqa: F401 - installed is a fixture
from tests.support import harness_steering as steering
from tests.support.upstream_standins import DelayedEngineRelay


def _has_tool_result(engine_request: dict) -> bool:
    return any(m.get("role") == "tool" for m in engine_request.get("messages", []))


def _first_agent_turn(engine_request: dict) -> bool:
    """The agent's turn that asks for the tool call: it offers tools and carries no tool result yet."""
    return bool(engine_request.get("tools")) and not _has_tool_result(engine_request)


def _every_call(engine_request: dict) -> bool:
    return True


# harness -> its limit shrunk with its own setting (env, subcommand options), the engine's delay, which engine calls
# the relay slows (default: all), the side calls (not agent turns) of a run, and whether its silent run is stopped
# once it retries the call it abandoned
CASES = {
    # QWEN_STREAM_IDLE_TIMEOUT_MS: the no-chunk watchdog on its SDK's chunks (default 240 s)
    "qwen": {"env": {"QWEN_STREAM_IDLE_TIMEOUT_MS": "4000"}, "delay": 10.0},
    # stream_idle_timeout_ms wraps each eventsource.next() (default 300 s); one retry keeps the failing run short
    "codex": {"options": ("-c", "model_providers.polar_openai.stream_idle_timeout_ms=4000", "-c", "model_providers.polar_openai.stream_max_retries=1"), "delay": 10.0},
    # CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS: the byte watchdog on every SSE reply (on by default, floor 10 s; default
    # 180 s to api.anthropic.com). When it fires, Claude Code sends the request again non-streamed, which nothing can
    # keep alive, and gives that call API_TIMEOUT_MS (default 300 s): both shrunk below the engine's delay, or the
    # silent run would complete its turn through that fallback (at the cost of a second engine call)
    "claude": {"env": {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000", "API_TIMEOUT_MS": "12000", "CLAUDE_CODE_MAX_RETRIES": "1"}, "delay": 16.0},
    # nothing shrinks Gemini CLI's limit on a stream, undici's bodyTimeout of 300 s between body bytes (its request
    # timeout, an experiment flag, sets only headersTimeout). So its first agent turn takes 320 s; its router's
    # non-streamed call (60 s to headers) and its final turn are not slowed. Once it has abandoned the slowed call it
    # sends it again (general.maxAttempts 1 did not stop that, tried with --model gemini-2.5-pro), to be abandoned
    # again after 300 s: the silent run is stopped when that retry is on its way
    "gemini": {"delay": 320.0, "slowed": _first_agent_turn, "side_calls": 1, "stop_at_retry": True},
}


@pytest.mark.harness
@pytest.mark.parametrize("name", list(CASES))
def test_keepalives_carry_a_harness_through_a_slow_engine(installed, name, make_gateway, engine_url, session_id, tmp_path, monkeypatch):  # noqa: F811
    case = CASES[name]
    for key, value in case.get("env", {}).items():
        monkeypatch.setenv(key, value)
    slowed = case.get("slowed", _every_call)
    relays = {run: DelayedEngineRelay(engine_url, case["delay"], slowed) for run in ("kept", "silent")}
    try:
        gateways = {run: make_gateway("--engine-hook", HOOK, "--keepalive-interval", interval, upstream=relays[run].url) for run, interval in (("kept", "1"), ("silent", "0"))}
        retried = _retried(gateways["silent"], session_id, relays["silent"]) if case.get("stop_at_retry") else None
        with ThreadPoolExecutor(2) as pool:
            kept = pool.submit(_run, gateways["kept"], name, session_id, tmp_path / "kept", case.get("options", ()))
            silent = pool.submit(_run, gateways["silent"], name, session_id, tmp_path / "silent", case.get("options", ()), retried)
            result, failed = kept.result(), silent.result()

        rows = check_run(gateways["kept"], name, session_id, tmp_path / "kept", result, side_calls=case.get("side_calls", 0))
        waited = [row for row in rows if row["stream"] and slowed(row["engine_request"])]
        assert waited, [(r["seq"], r["stream"]) for r in rows]
        for row in waited:  # each slowed turn waited the delay out, with keepalives on the record
            assert _engine_seconds(row) >= case["delay"]
            assert row["response_stream"].count(KEEPALIVE_MARK[name]) >= case["delay"] - 3 + BASELINE_MARKS[name]

        proof = tmp_path / "silent" / "workspace" / steering.PROOF_FILE
        report = f"exit {failed.returncode}\n--- stdout\n{failed.stdout[-2000:]}\n--- stderr\n{failed.stderr[-2000:]}"
        assert not proof.exists() or failed.returncode != 0, report
        silent_rows = _settled_rows(gateways["silent"], session_id, relays["silent"])
        # the harness abandoned the slowed turn and never sent a tool result back; each call it made for that turn
        # (the stream, and any retry or non-streamed fallback) is a row of its own, left before the engine answered,
        # its engine call cancelled and the row marked as never seen
        assert silent_rows and not any(_has_tool_result(row["engine_request"]) for row in silent_rows), report
        abandoned = [row for row in silent_rows if slowed(row["engine_request"])]
        summary = [(r["seq"], r["stream"], r["status"], round(_seconds(r), 1), r["error"]) for r in silent_rows]
        assert abandoned and abandoned[0]["stream"], summary
        assert {row["status"] for row in abandoned} == {"client_disconnected"}, summary
        assert all(_seconds(row) < case["delay"] for row in abandoned), summary
        if retried is not None:  # stopped at its retry (exit status then says nothing): the same turn sent again
            assert len(abandoned) >= 2, summary
        print(f"\n{name} without keepalives: exit {failed.returncode}, rows (seq, stream, status, seconds, error) {summary}")
    finally:
        for relay in relays.values():
            relay.close()


# one keepalive event per dialect, and how often it appears in a reply that needed none
KEEPALIVE_MARK = {"qwen": '"delta":{},"logprobs":null,"finish_reason":null', "codex": "event: response.in_progress", "claude": "event: ping", "gemini": '"parts":[{"text":""}]'}
BASELINE_MARKS = {"qwen": 0, "codex": 1, "claude": 1, "gemini": 0}


def _run(gateway, name: str, session_id: str, tmp_path, options: tuple[str, ...], stop_when=None):
    tmp_path.mkdir()
    return run_harness(gateway, name, session_id, tmp_path, options, stop_when)


def _retried(gateway, session_id: str, relay: DelayedEngineRelay):
    """Whether the harness abandoned an engine call (a client_disconnected row) and has sent another since."""

    def holds() -> bool:
        statuses = [row["status"] for row in gateway.rows("SELECT status FROM exchanges WHERE session_id = ?", [session_id])]
        return "client_disconnected" in statuses and relay.completions > len(statuses)

    return holds


def _settled_rows(gateway, session_id: str, relay: DelayedEngineRelay, timeout: float = 30.0) -> list[dict]:
    """This session's rows once every engine call the relay received is one (an abandoned call's row is committed
    when the gateway sees its client gone, a moment after the harness exits), engine requests parsed."""
    deadline = time.monotonic() + timeout
    while len(rows := gateway.exchanges(session_id)) < relay.completions and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(rows) >= relay.completions, f"{relay.completions} engine calls, {len(rows)} rows"
    return [{**row, "engine_request": json.loads(row["engine_request"] or "{}")} for row in rows]


def _at(value) -> datetime.datetime:
    return datetime.datetime.fromisoformat(str(value))


def _seconds(row: dict) -> float:
    return (_at(row["ended_at"]) - _at(row["started_at"])).total_seconds()


def _engine_seconds(row: dict) -> float:
    return (_at(row["engine_ended_at"]) - _at(row["engine_started_at"])).total_seconds()
