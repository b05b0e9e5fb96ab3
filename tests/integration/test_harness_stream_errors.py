"""The real harnesses when the engine fails after the stream has begun: what each does with the in-stream error.

The real engine sits behind a relay (tests/support/upstream_standins.py DelayedEngineRelay with `failing`) that
answers the first agent turn's engine call, after FAIL_AFTER_S seconds, with HTTP 500 and passes every other call to
the engine unchanged. By then the gateway has sent the headers and opening events (STREAM_HOLD_S is 0.3 s), so the
failure reaches the harness as an error inside the stream in its provider's grammar. Each harness runs twice side by
side, identically but for the relay's failure: the clean run is tests/integration/test_harnesses.py's; the failed run
shows what the harness does after the error. Each of the four sends the turn again (Claude Code non-streamed) and
completes it, and its retry is recorded as a retry, not a fork: the failed attempt is a row of its own in no
trainable sequence, and the session assembles into as many sequences as the clean run's.
"""

from __future__ import annotations

import datetime
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from polar_mitm.assembler import assemble
from polar_mitm.local_engine.steering import has_tool_result, shell_tool
from tests.support import harness_steering as steering
from tests.support.harness_runs import HOOK, check_assembly, check_run, run_harness
from tests.support.matrix import harness_matrix
from tests.support.upstream_standins import DelayedEngineRelay

FAIL_AFTER_S = 2.0


def _first_agent_turn(engine_request: dict) -> bool:
    """The agent's turn that asks for the shell call: it offers the shell tool and carries no tool result yet."""
    return bool(shell_tool(engine_request)) and not has_tool_result(engine_request)


# harness -> what its failed run shows: the side calls (not agent turns) before the failed turn; the provider's
# error event in the failed row's stream, after the opening the gateway sent at once (None: Gemini has none, the
# error is all); whether the harness sends the same turn again streamed; what it prints about the error (None: nothing)
CASES = {
    # the openai SDK raises APIError (no status) on the error chunk; Qwen Code replays a status-less error only when
    # it names a request: the x-request-id reply header (polar_mitm/dialects/openai_chat.py REQUEST_ID_HEADER)
    "qwen": {"opening": '"delta":{"role":"assistant","content":""}', "error": 'data: {"error":{"message":"the inference engine failed', "retry_streams": True, "says": "Retrying provider attempt (0 buffered tool call(s) discarded)."},
    # response.failed with error.code server_error: a retryable stream error, retried under stream_max_retries
    "codex": {"opening": "event: response.created", "error": "event: response.failed", "retry_streams": True, "says": "Reconnecting... 1/5 (stream disconnected before completion: the inference engine failed with HTTP 500"},
    # event: error (api_error): Claude Code sends the turn again non-streamed, its fallback for a failed stream
    "claude": {"opening": "event: message_start", "error": 'event: error\ndata: {"type":"error","error":{"type":"api_error"', "retry_streams": False, "says": None},
    # the error chunk {"error": {"code": 502, "status": "INTERNAL", ...}}: google-genai raises ServerError, Gemini CLI
    # sends the turn again at once and counts no error in its stats
    "gemini": {"side_calls": 1, "opening": None, "error": 'data: {"error":{"code":502,"message":"the inference engine failed', "retry_streams": True, "says": None},
}


@pytest.mark.harness
# default suite: Codex (Responses, reconnects) and Claude Code (Anthropic, retries the request, not the stream);
# all four in the full matrix
@pytest.mark.parametrize("name", harness_matrix(list(CASES), default=("codex", "claude")))
def test_a_harness_retries_a_turn_after_an_error_inside_the_stream(installed, name, make_gateway, engine_url, session_id, tmp_path):
    case = CASES[name]
    relays = {"clean": DelayedEngineRelay(engine_url, 0.0, slowed=lambda request: False), "failed": DelayedEngineRelay(engine_url, FAIL_AFTER_S, failing=_first_agent_turn)}
    try:
        # chat mode: the relay picks the turn to fail by the messages and tools the engine gets (an error inside a
        # stream is written the same way in both render modes: tests/unit/test_stream_parts.py)
        gateways = {run: make_gateway("--render", "chat", "--engine-hook", HOOK, upstream=relay.url) for run, relay in relays.items()}
        with ThreadPoolExecutor(2) as pool:
            futures = {run: pool.submit(_run, gateways[run], name, session_id, tmp_path / run) for run in relays}
            results = {run: future.result() for run, future in futures.items()}
    finally:
        for relay in relays.values():
            relay.close()
    side_calls = case.get("side_calls", 0)
    clean_rows = check_run(gateways["clean"], name, session_id, tmp_path / "clean", results["clean"], side_calls=side_calls)

    failed, gateway = results["failed"], gateways["failed"]
    output = failed.stdout + failed.stderr
    report = f"exit {failed.returncode}\n--- stdout\n{failed.stdout[-3000:]}\n--- stderr\n{failed.stderr[-3000:]}"
    assert relays["failed"].completions == len(clean_rows) + 1, report  # one engine call more: the failed one
    # the harness got over the error: its tool ran, it exited 0
    assert failed.returncode == 0, report
    assert (tmp_path / "failed" / "workspace" / steering.PROOF_FILE).read_text() == steering.PROOF_CONTENT, report
    if case["says"] is None:  # it retried without a word
        assert "the inference engine failed" not in output, report
    else:
        assert case["says"] in output, report

    rows = [{**row, "engine_request": json.loads(row["engine_request"])} for row in gateway.exchanges(session_id)]
    summary = [(r["seq"], r["status"], r["http_status"], r["stream"], r["error"]) for r in rows]
    print(f"\n{name} after an error inside the stream: exit {failed.returncode}, rows (seq, status, http_status, stream, error) {summary}")
    assert [r["seq"] for r in rows] == list(range(1, len(clean_rows) + 2)), summary
    failed_turn, retry = rows[side_calls], rows[side_calls + 1]
    # the failed call: a row of its own, 200 as sent, its stream the opening at once and then the provider's error
    assert (failed_turn["status"], failed_turn["http_status"], failed_turn["stream"]) == ("engine_error", 200, True), summary
    assert failed_turn["error"] == "the inference engine failed with HTTP 500: stand-in relay: engine failure after its delay"
    assert _seconds(failed_turn) >= FAIL_AFTER_S
    stream = failed_turn["response_stream"]
    assert case["error"] in stream, stream[-1000:]
    before = stream[: stream.index(case["error"])]
    assert case["opening"] in before if case["opening"] else before == "", stream[-1000:]
    assert "[DONE]" not in stream and not failed_turn["completion_token_ids"]
    # the retry: the next seq, the same turn (the same messages to the engine), served
    assert [r["status"] for r in rows if r is not failed_turn] == ["ok"] * len(clean_rows), summary
    assert retry["engine_request"]["messages"] == failed_turn["engine_request"]["messages"]
    assert retry["stream"] is case["retry_streams"], summary
    assert retry["finish_reason"] == "tool_calls" and has_tool_result(rows[-1]["engine_request"])

    # a retry, not a fork: the failed attempt is in no sequence, and the session assembles as the clean one does
    served = [row for row in rows if row is not failed_turn]
    check_assembly(gateway, session_id, served)
    for builder in ("prefix_merging", "per_request"):
        assembly = assemble(gateway.db, builder=builder, session=session_id)
        clean = assemble(gateways["clean"].db, builder=builder, session=session_id)
        assert failed_turn["exchange_id"] not in {e for s in assembly.sequences for e in s.exchange_ids}
        assert sorted(e for s in assembly.sequences for e in s.exchange_ids) == sorted(r["exchange_id"] for r in served)
        assert [len(s.exchange_ids) for s in assembly.sequences] == [len(s.exchange_ids) for s in clean.sequences], builder
        assert (assembly.stats.exchanges_skipped, assembly.stats.retries) == (1, clean.stats.retries), builder


def _run(gateway, name: str, session_id: str, tmp_path):
    tmp_path.mkdir()
    return run_harness(gateway, name, session_id, tmp_path)


def _seconds(row: dict) -> float:
    return (datetime.datetime.fromisoformat(str(row["ended_at"])) - datetime.datetime.fromisoformat(str(row["started_at"]))).total_seconds()
