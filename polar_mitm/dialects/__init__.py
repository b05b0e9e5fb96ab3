"""Wire dialects: one module per provider API, each satisfying the declared `Dialect` protocol (_api.py).

    API                              the `exchanges.api` value
    STREAM_CONTENT_TYPE
    recognizes(method, path)         path first: is this request ours?
    parse(body, path, query)         -> ParsedRequest (engine chat-completions form), or raises DialectError
    render_body(parsed, completion)  -> dict     the provider's non-streaming JSON
    render_stream(parsed, completion) -> bytes   the provider's SSE event stream
    error_body(error)                -> dict     the provider's error shape
    parse_reply(body) / parse_reply_stream(events) -> Reply   a reply read back (the content view)
    render_count_tokens(parsed, n)   -> dict     where the API has a token-count endpoint (`CountsTokens`)

`DIALECTS.get("gemini")` by `exchanges.api` name; `dialect_for(method, path)` by request.
"""

from __future__ import annotations

from polar_mitm.dialects import (
    anthropic_messages,
    gemini,
    openai_chat,
    openai_responses,
)
from polar_mitm.dialects._api import CountsTokens, Dialect, Reply, read_reply
from polar_mitm.registry import Registry

__all__ = ["DIALECTS", "CountsTokens", "Dialect", "Reply", "dialect_for", "get", "read_reply"]

# the modules are typed against the protocol here, so a type checker verifies each one satisfies it
_MODULES: tuple[Dialect, ...] = (openai_chat, openai_responses, anthropic_messages, gemini)
DIALECTS: Registry[Dialect] = Registry("dialect", {module.API: module for module in _MODULES})
get = DIALECTS.get


def dialect_for(method: str, path: str) -> Dialect | None:
    """The dialect that owns this request path, if any (path without query string)."""
    for dialect in _MODULES:
        if dialect.recognizes(method, path):
            return dialect
    return None
