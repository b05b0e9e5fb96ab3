"""gateway/outcome.py without mitmproxy: each failure class maps to one row status, row error and client answer
(the table in `outcome_of`'s docstring), and `settle` writes an engine call's record and outcome onto a row."""

from __future__ import annotations

import gc
import weakref
from datetime import UTC, datetime

import pytest

from polar_mitm.errors import CallAbandoned, DialectError, EngineError, RenderError
from polar_mitm.exchange import Completion, EngineRecord
from polar_mitm.gateway.outcome import OK, CommitFailed, Outcome, apply_record, forget_tracebacks, outcome_of, settle
from polar_mitm.store import ExchangeRow

ENGINE_BODY = {"object": "error", "message": "boom"}

# failure -> (row status, row error, client status, client error kind)
CASES: list[tuple[str, BaseException, tuple[str, str, int, str]]] = [
    ("client_disconnected", CallAbandoned("client_disconnected", "the client closed its connection"), ("client_disconnected", "the client closed its connection", 499, "client_disconnected")),
    ("gateway_shutdown", CallAbandoned("gateway_shutdown", "the gateway was stopped"), ("gateway_shutdown", "the gateway was stopped", 503, "gateway_shutdown")),
    ("render_error", RenderError(500, "no_chat_template", "no template"), ("render_error", "no template", 500, "no_chat_template")),
    ("render_error_4xx", RenderError(400, "image_unsupported", "no images"), ("render_error", "no images", 400, "image_unsupported")),
    ("dialect_4xx", DialectError(404, "model_not_found", "no such model", "model"), ("bad_request", "no such model", 404, "model_not_found")),
    ("dialect_5xx", DialectError(502, "adapter_unavailable", "adapter gone"), ("internal_error", "adapter gone", 502, "adapter_unavailable")),
    ("engine_error", EngineError("engine_error", "HTTP 500", 502, ENGINE_BODY), ("engine_error", "HTTP 500", 502, "engine_error")),
    ("engine_timeout", EngineError("engine_timeout", "no answer in 5s", 504), ("engine_timeout", "no answer in 5s", 504, "engine_timeout")),
    ("engine_unreachable", EngineError("engine_unreachable", "refused", 503), ("engine_unreachable", "refused", 503, "engine_unreachable")),
    ("store_error", CommitFailed(OSError("disk full")), ("store_error", "polar-mitm could not record the exchange: disk full", 500, "store_error")),
    ("bug", KeyError("choices"), ("internal_error", "KeyError: 'choices'", 500, "internal_error")),
]


@pytest.mark.parametrize(("failure", "expected"), [(failure, expected) for _, failure, expected in CASES], ids=[name for name, _, _ in CASES])
def test_each_failure_class_maps_to_one_status_error_and_answer(failure: BaseException, expected: tuple[str, str, int, str]) -> None:
    outcome = outcome_of(failure)
    status, error, http_status, kind = expected
    assert (outcome.status, outcome.error) == (status, error)
    assert outcome.answer is not None and (outcome.answer.status, outcome.answer.kind) == (http_status, kind)
    assert outcome.http_status == http_status
    # the client is told what the row says, never a different story
    assert error in outcome.answer.message
    # a late client never changes a failure's outcome: the failure says what happened
    assert view(outcome_of(failure, client_gone="the client closed its connection before the reply")) == view(outcome)


def view(outcome: Outcome) -> tuple[object, ...]:
    answer = outcome.answer
    return (outcome.status, outcome.error, outcome.engine_response, *((answer.status, answer.kind, answer.message) if answer else ()))


def test_an_engine_errors_body_is_recorded_and_its_context_numbers_reach_the_client() -> None:
    error = EngineError("context_length_exceeded", "too long", 400, ENGINE_BODY, prompt_tokens=5000, max_context=4096)
    outcome = outcome_of(error)
    assert outcome.engine_response == ENGINE_BODY
    assert outcome.answer is not None and (outcome.answer.prompt_tokens, outcome.answer.max_context) == (5000, 4096)


def test_a_reply_is_ok_unless_its_client_left_before_it() -> None:
    assert outcome_of(None) == OK and OK.answer is None and OK.http_status == 200
    late = outcome_of(None, client_gone="the client closed its connection before the reply")
    assert late == Outcome("client_disconnected", "the client closed its connection before the reply")
    assert late.answer is None and late.http_status == 200  # the reply was made; it is kept, unread


def test_the_mapping_is_the_same_for_a_subclass_of_a_known_class() -> None:
    class PluginDialectError(DialectError):
        pass

    assert outcome_of(PluginDialectError(503, "overloaded", "busy")).status == "internal_error"
    assert outcome_of(PluginDialectError(422, "bad", "bad")).status == "bad_request"


COMPLETION = Completion(
    id="c1", created=1, content="hi", reasoning=None, tool_calls=[], finish_reason="stop", prompt_token_ids=[1, 2],
    completion_token_ids=[3], completion_logprobs=[-0.5], logprobs_content=None, prompt_tokens=2, completion_tokens=1,
)
T0, T1, T2 = (datetime(2025, 1, 1, 0, 0, second, tzinfo=UTC) for second in (1, 2, 3))


def test_settle_writes_the_record_and_the_outcome_once() -> None:
    row: ExchangeRow = {"exchange_id": "x", "session_id": "s", "seq": 0, "model_engine": "base"}
    record = EngineRecord(
        engine_request={"model": "adapter"}, engine_response={"id": "c1"}, completion=COMPLETION, policy_version=3,
        model_engine="adapter", engine_started_at=T0, engine_ended_at=T1, render_mode="tokens", bridged=True,
    )
    settle(row, record, OK, http_status=200, response_body={"ok": 1}, response_stream=None, ended_at=T2)
    assert row == {
        "exchange_id": "x", "session_id": "s", "seq": 0, "model_engine": "adapter", "engine_request": {"model": "adapter"},
        "engine_response": {"id": "c1"}, "policy_version": 3, "engine_started_at": T0, "engine_ended_at": T1,
        "render_mode": "tokens", "bridged": True, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
        "completion_logprobs": [-0.5], "finish_reason": "stop", "prompt_tokens": 2, "completion_tokens": 1,
        "status": "ok", "http_status": 200, "response_body": {"ok": 1}, "ended_at": T2,
    }


def test_settle_keeps_how_far_a_failed_call_got_and_the_engines_error_body() -> None:
    row: ExchangeRow = {"exchange_id": "x", "session_id": "s", "seq": 0}
    record = EngineRecord(engine_request={"max_tokens": 10}, engine_started_at=T0, engine_ended_at=T1, render_mode="chat", policy_version=0)
    outcome = outcome_of(EngineError("engine_error", "HTTP 500", 502, ENGINE_BODY))
    settle(row, record, outcome, http_status=outcome.http_status, response_body={"error": {}}, response_stream=None, ended_at=T2)
    assert (row["status"], row["error"], row["http_status"], row["engine_response"]) == ("engine_error", "HTTP 500", 502, ENGINE_BODY)
    assert (row["engine_request"], row["engine_started_at"], row["policy_version"]) == ({"max_tokens": 10}, T0, 0)
    assert "completion_token_ids" not in row and "bridged" not in row  # never sampled, never rendered by the gateway


def test_an_aborted_attempt_gets_the_record_only() -> None:
    attempt: ExchangeRow = {"exchange_id": "a", "session_id": "s", "seq": 0}
    apply_record(attempt, EngineRecord(engine_request={"m": 1}, policy_version=1, engine_started_at=T0))
    assert attempt == {"exchange_id": "a", "session_id": "s", "seq": 0, "engine_request": {"m": 1}, "policy_version": 1, "engine_started_at": T0}


class _Body:
    """Stands for what an exchange's frame holds (the flow, the request's body, the engine's reply)."""


def _failed_exchange(forget: bool) -> weakref.ref[_Body]:
    """A frame that keeps its failure in a local, as the addon's exchange does, with a chained cause below it."""
    body = _Body()
    failure: Exception | None = None
    try:
        try:
            raise ConnectionResetError("engine reset")
        except ConnectionResetError as reset:
            raise EngineError("engine_unreachable", "reset", 503) from reset
    except EngineError as error:
        failure = error
    assert outcome_of(failure).status == "engine_unreachable"
    if forget:
        forget_tracebacks(failure)
    return weakref.ref(body)


def test_a_decided_failure_no_longer_keeps_its_frame_alive() -> None:
    """Without forget_tracebacks the failure's traceback holds the frame that holds the failure: a cycle only the
    cyclic collector frees (the soak saw ~100 such frames of failed engine calls every 40 s); with it, the frame and
    what it held go when the call returns."""
    gc.disable()
    try:
        kept = _failed_exchange(forget=False)
        assert kept() is not None  # the cycle: waiting for the collector
        freed = _failed_exchange(forget=True)
        assert freed() is None
    finally:
        gc.enable()
        gc.collect()
    assert kept() is None
