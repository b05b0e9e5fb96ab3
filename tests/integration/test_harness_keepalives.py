"""The real harnesses through an engine slower than their stream limits: keepalives carry the turn, and the same
run without them fails.

Each harness's own limit is shrunk with its own setting where one exists, the real engine is slowed by a relay
(tests/support/upstream_standins.py DelayedEngineRelay: chat completions forwarded after `delay` seconds, answered by
the real engine), and the harness runs twice side by side, identically but for the gateway's --keepalive-interval:
1 s (the tool turn completes, exactly as in tests/integration/test_harnesses.py) and 0 (no keepalives: the harness
gives up on the slowed turn, each call it made for it is a `client_disconnected` row left before the engine answered,
and no tool result ever reaches the engine).

Gemini CLI has no setting for its one limit on a stream (undici's bodyTimeout, 300 s between body bytes), so its case
waits that long: about 5.5 minutes, the two runs side by side; it runs with POLAR_MITM_FULL_MATRIX=1 (its keepalive
event is covered in the default suite by the pause tests with real harnesses, tests/integration/test_control.py).
It sends the call it abandoned again (to be abandoned again after 300 s, and so on), so its silent run is stopped
once that retry is on its way.

Default suite: Qwen Code (Chat Completions) and Codex (Responses). Claude Code's case (55 s) runs in the full matrix;
its Anthropic `ping` keepalives carry it through the held call of test_control.py's pause test in the default suite.
"""

from __future__ import annotations

import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import harness_steering as steering
from tests.support.harness_runs import HOOK, check_run, run_harness
from tests.support.keepalive_cases import BASELINE_MARKS, CASES, KEEPALIVE_MARK, every_call, has_tool_result
from tests.support.matrix import harness_matrix
from tests.support.upstream_standins import DelayedEngineRelay


@pytest.mark.harness
@pytest.mark.parametrize("name", harness_matrix(list(CASES), default=("qwen", "codex")))
def test_keepalives_carry_a_harness_through_a_slow_engine(installed, name, make_gateway, engine_url, session_id, tmp_path, monkeypatch):
    case = CASES[name]
    for key, value in case.get("env", {}).items():
        monkeypatch.setenv(key, value)
    slowed = case.get("slowed", every_call)
    relays = {run: DelayedEngineRelay(engine_url, case["delay"], slowed) for run in ("kept", "silent")}
    try:
        # chat mode: the relay picks the turns to slow, and the test the turns left unsent, by the messages the
        # engine gets (keepalives are written the same way in both render modes: tests/unit/test_stream_parts.py)
        gateways = {run: make_gateway("--render", "chat", "--engine-hook", HOOK, "--keepalive-interval", interval, upstream=relays[run].url) for run, interval in (("kept", "1"), ("silent", "0"))}
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
        assert silent_rows and not any(has_tool_result(row["engine_request"]) for row in silent_rows), report
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
