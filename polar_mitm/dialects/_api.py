"""The declared surface of a wire dialect (in the spirit of mitmproxy's contentviews/_api.py).

A dialect is a module (one per provider API) that satisfies `Dialect`; the gateway serves a model call
through it (parse -> engine -> render) and the content view reads replies back with it (parse_reply).
Dialects with a token-count endpoint also satisfy `CountsTokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from polar_mitm.dialects.common import SSEEvent, sse_events
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, StreamState


@dataclass
class Reply:
    """An assistant turn as a provider's reply carries it, whichever API: what the content view shows."""

    content: str = ""
    reasoning: str = ""
    # {"id", "name", "arguments"}: arguments as the wire has them (a JSON string, or an object)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None  # in the provider's own words (stop_reason, finishReason, status)
    error: str | None = None


@runtime_checkable
class Dialect(Protocol):
    """One provider API: request in, reply and stream out, in that provider's exact wire grammar."""

    API: str  # the `exchanges.api` value
    STREAM_CONTENT_TYPE: str
    # Optional (not a member, so a plugin dialect without it still conforms): REQUEST_ID_HEADER, the reply header the
    # provider names its requests by. The SDKs put its value on their errors, and Qwen Code retries an in-stream
    # error only when that names a request.

    def recognizes(self, method: str, path: str) -> bool:
        """Is this request (path without the query string) a model call in this API?"""
        ...

    def parse(self, body: bytes, path: str = "", query: dict[str, str] | None = None) -> ParsedRequest:
        """The request in the engine's chat-completions form; raises DialectError for what cannot be served."""
        ...

    def render_body(self, parsed: ParsedRequest, completion: Completion) -> dict[str, Any]:
        """The provider's non-streaming reply."""
        ...

    def render_stream(self, parsed: ParsedRequest, completion: Completion) -> bytes:
        """The provider's server-sent event stream of the same reply."""
        ...

    def error_body(self, error: DialectError) -> dict[str, Any]:
        """The provider's error shape."""
        ...

    # A streamed reply in four parts, so its first bytes can go out before the engine answers (gateway/streaming.py):
    # render_stream(parsed, completion) == stream_opening(parsed, state) + stream_body(parsed, state, completion)
    # for state = StreamState.of(completion); keepalives may come between the two, an error instead of the body.

    def stream_opening(self, parsed: ParsedRequest, state: StreamState) -> bytes:
        """The events the provider sends before any output (may be empty: then only status and headers go first)."""
        ...

    def stream_keepalive(self, parsed: ParsedRequest, state: StreamState) -> bytes:
        """One event that keeps the stream alive and changes nothing a client assembles."""
        ...

    def stream_body(self, parsed: ParsedRequest, state: StreamState, completion: Completion) -> bytes:
        """Everything after the opening: the reply's events, to the provider's end of stream."""
        ...

    def stream_error(self, parsed: ParsedRequest, state: StreamState, error: DialectError) -> bytes:
        """A failure after the headers, in the provider's in-stream error grammar; the stream ends after it."""
        ...

    def parse_reply(self, body: dict[str, Any]) -> Reply:
        """A provider reply body (render_body's shape, or the real provider's) read back as an assistant turn."""
        ...

    def parse_reply_stream(self, events: list[SSEEvent]) -> Reply:
        """A provider event stream (render_stream's grammar) read back as an assistant turn."""
        ...


@runtime_checkable
class CountsTokens(Dialect, Protocol):
    """A dialect whose API has a token-count endpoint (parse returns action 'count_tokens' for it)."""

    def render_count_tokens(self, parsed: ParsedRequest, count: int) -> dict[str, Any]: ...


def read_reply(dialect: Dialect, data: bytes, content_type: str = "") -> Reply:
    """The assistant turn in a provider's response bytes, JSON or SSE; an error body gives `Reply.error`."""
    if content_type.startswith("text/event-stream") or data.lstrip().startswith((b"data:", b"event:")):
        return dialect.parse_reply_stream(sse_events(data))
    body = json.loads(data)
    if isinstance(body, dict) and body.get("error"):  # a Responses object carries "error": null
        return Reply(error=error_text(body))
    return dialect.parse_reply(body)


def error_text(body: dict[str, Any]) -> str:
    """The message of a provider error body (`{"error": {"message": ...}}` in all four APIs)."""
    error = body.get("error")
    return error.get("message", json.dumps(error)) if isinstance(error, dict) else str(error)
