"""The real harnesses through an engine slower than their stream idle timeout: keepalives carry the turn, and the
same run without them fails.

Each harness's own idle timeout is shrunk with its own setting so the test takes seconds, the real engine is slowed
by a relay (tests/upstream_standins.py DelayedEngineRelay: every chat completion forwarded after DELAY seconds,
answered by the real engine), and the harness runs twice, identically but for the gateway's --keepalive-interval:
1 s (the tool turn completes, exactly as in tests/test_harnesses.py) and 0 (no keepalives: the harness gives up).
"""

from __future__ import annotations

import datetime
import json
import time

import pytest

from tests.integration.test_harnesses import HOOK, check_run, installed, run_harness  # noqa: F401 - installed is a fixture
from tests.support import harness_steering as steering
from tests.support.upstream_standins import DelayedEngineRelay

# harness -> (its idle timeout, shrunk with its own setting; the engine's delay; what the failing run is allowed)
CASES = {
    # QWEN_STREAM_IDLE_TIMEOUT_MS: the no-chunk watchdog on its SDK's chunks (default 240 s)
    "qwen": {"env": {"QWEN_STREAM_IDLE_TIMEOUT_MS": "4000"}, "options": (), "delay": 10.0},
    # stream_idle_timeout_ms wraps each eventsource.next() (default 300 s); one retry keeps the failing run short
    "codex": {"env": {}, "options": ("-c", "model_providers.polar_openai.stream_idle_timeout_ms=4000", "-c", "model_providers.polar_openai.stream_max_retries=1"), "delay": 10.0},
    # CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS: the byte-level watchdog (floor 10 s). Run here, 2.1.332 with an API key
    # did not give up on a 16 s silent stream (the watchdog seems not armed for that connection); its event watchdog
    # has a 300 s floor. So only the half with keepalives is shown for it.
    "claude": {"env": {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000", "CLAUDE_CODE_MAX_RETRIES": "1"}, "options": (), "delay": 16.0, "fails_without": False},
    # no setting shrinks Gemini CLI's limits (undici: 60 s to headers, 300 s between body bytes): shown here is that
    # it takes its turn through keepalive chunks (empty-text parts); its router call is non-streamed (side_calls)
    "gemini": {"env": {}, "options": (), "delay": 8.0, "fails_without": False, "side_calls": 1},
}


@pytest.mark.harness
@pytest.mark.parametrize("name", list(CASES))
def test_keepalives_carry_a_harness_through_a_slow_engine(installed, name, make_gateway, engine_url, session_id, tmp_path, monkeypatch):  # noqa: F811
    case = CASES[name]
    for key, value in case["env"].items():
        monkeypatch.setenv(key, value)
    relay = DelayedEngineRelay(engine_url, case["delay"])
    try:
        kept = make_gateway("--engine-hook", HOOK, "--keepalive-interval", "1", upstream=relay.url)
        silent = make_gateway("--engine-hook", HOOK, "--keepalive-interval", "0", upstream=relay.url)
        (tmp_path / "kept").mkdir()
        (tmp_path / "silent").mkdir()
        result = run_harness(kept, name, session_id, tmp_path / "kept", case["options"])
        rows = check_run(kept, name, session_id, tmp_path / "kept", result, side_calls=case.get("side_calls", 0))
        for row in (row for row in rows if row["stream"]):  # every turn waited long, with keepalives on the record
            waited = datetime.datetime.fromisoformat(str(row["engine_ended_at"])) - datetime.datetime.fromisoformat(str(row["engine_started_at"]))
            assert waited >= datetime.timedelta(seconds=case["delay"])
            assert row["response_stream"].count(KEEPALIVE_MARK[name]) >= case["delay"] - 3 + BASELINE_MARKS[name]

        if not case.get("fails_without", True):
            return
        failed = run_harness(silent, name, session_id, tmp_path / "silent", case["options"])
        proof = tmp_path / "silent" / "workspace" / steering.PROOF_FILE
        report = f"exit {failed.returncode}\n--- stdout\n{failed.stdout[-2000:]}\n--- stderr\n{failed.stderr[-2000:]}"
        assert not proof.exists() or failed.returncode != 0, report
        time.sleep(case["delay"] + 2)  # each abandoned engine call finishes (and commits its row) within a delay
        silent_rows = silent.exchanges(session_id)
        # the harness abandoned the first turn: it never got to send the tool result back, and each abandoned
        # call is a row of its own, its engine call cancelled and the row marked as never seen
        assert silent_rows and not any(_has_tool_result(row) for row in silent_rows), report
        assert {row["status"] for row in silent_rows} == {"client_disconnected"}, [(r["status"], r["error"]) for r in silent_rows]
        print(f"\n{name} without keepalives: exit {failed.returncode}, {len(silent_rows)} rows {[r['status'] for r in silent_rows]}")
    finally:
        relay.close()


# one keepalive event per dialect, and how often it appears in a reply that needed none
KEEPALIVE_MARK = {"qwen": '"delta":{},"logprobs":null,"finish_reason":null', "codex": "event: response.in_progress", "claude": "event: ping", "gemini": '"parts":[{"text":""}]'}
BASELINE_MARKS = {"qwen": 0, "codex": 1, "claude": 1, "gemini": 0}


def _has_tool_result(row: dict) -> bool:
    return any(m.get("role") == "tool" for m in json.loads(row["engine_request"] or "{}").get("messages", []))
