"""A streamed reply in four parts (opening, keepalive, body, error), engine-free: the parts make up exactly the
one-piece stream, keepalives change nothing the dialect's own reader (the content view's path) assembles, and an
error after the opening is a failure in the provider's in-stream grammar."""

from __future__ import annotations

import inspect

import pytest

from polar_mitm import dialects
from polar_mitm.dialects import Dialect, read_reply
from polar_mitm.dialects.common import sse_events
from polar_mitm.exchange import DialectError, StreamState
from tests.support.dialect_samples import COMPLETION, parsed_request

APIS = list(dialects.DIALECTS)
ENGINE_FAILURE = DialectError(502, "engine_error", "the inference engine failed with HTTP 500: boom")


@pytest.mark.parametrize("api", APIS)
def test_the_parts_make_up_the_one_piece_stream_with_the_protocols_signatures(api: str) -> None:
    dialect = dialects.get(api)
    for method in ("stream_opening", "stream_keepalive", "stream_body", "stream_error"):
        expected = [p for p in inspect.signature(getattr(Dialect, method)).parameters if p != "self"]
        assert list(inspect.signature(getattr(dialect, method)).parameters) == expected, f"{api}.{method}"
    parsed = parsed_request(api)
    state = StreamState.of(COMPLETION)
    assert dialect.stream_opening(parsed, state) + dialect.stream_body(parsed, state, COMPLETION) == dialect.render_stream(parsed, COMPLETION)


@pytest.mark.parametrize("api", APIS)
def test_keepalives_change_nothing_a_reader_assembles(api: str) -> None:
    dialect = dialects.get(api)
    parsed = parsed_request(api)
    state = StreamState.of(COMPLETION)
    opening = dialect.stream_opening(parsed, state)
    keepalives = [dialect.stream_keepalive(parsed, state) for _ in range(3)]
    assert all(keepalives) and all(len(sse_events(k)) == 1 for k in keepalives)
    kept = opening + b"".join(keepalives) + dialect.stream_body(parsed, state, COMPLETION)
    assert read_reply(dialect, kept, dialect.STREAM_CONTENT_TYPE) == read_reply(dialect, dialect.render_stream(parsed, COMPLETION), dialect.STREAM_CONTENT_TYPE)
    if api == "openai_responses":  # numbered on across opening, keepalives and body
        assert [data["sequence_number"] for _, data in sse_events(kept)] == list(range(len(sse_events(kept))))


# the in-stream error event of each API: (SSE event name, where the message is)
ERRORS = {
    "openai_chat": (None, lambda data: data["error"]["message"]),
    "openai_responses": ("response.failed", lambda data: data["response"]["error"]["message"]),
    "anthropic_messages": ("error", lambda data: data["error"]["message"]),
    "gemini": (None, lambda data: data["error"]["message"]),
}


@pytest.mark.parametrize("api", APIS)
def test_an_error_after_the_opening_is_the_providers_in_stream_failure(api: str) -> None:
    dialect = dialects.get(api)
    parsed = parsed_request(api)
    state = StreamState(id="chatcmpl-opened", created=1_700_000_000)
    stream = dialect.stream_opening(parsed, state) + dialect.stream_keepalive(parsed, state) + dialect.stream_error(parsed, state, ENGINE_FAILURE)
    event, data = sse_events(stream)[-1]
    name, message = ERRORS[api]
    assert event == name and message(data) == ENGINE_FAILURE.message
    if api == "openai_responses":
        assert data["response"]["status"] == "failed" and data["response"]["error"]["code"] == "server_error"
        assert data["sequence_number"] == 3 and data["response"]["id"] == "resp_opened"
    if api == "gemini":
        assert data["error"]["code"] == 502  # google-genai picks its error class by this code (ServerError for 5xx)
