"""Wire dialects: one module per provider API, each with the same small surface.

    API                       the `exchanges.api` value
    recognizes(method, path)  path first: is this request ours?
    parse(body, path, query)  -> ParsedRequest (engine chat-completions form), or raises DialectError
    render_body(parsed, completion) -> dict        the provider's non-streaming JSON
    render_stream(parsed, completion) -> bytes     the provider's SSE event stream
    error_body(error) -> dict                      the provider's error shape
    render_count_tokens(parsed, n) -> dict         where the API has a token-count endpoint
    STREAM_CONTENT_TYPE
"""

from __future__ import annotations

from types import ModuleType

from polar_mitm.dialects import anthropic_messages, gemini, openai_chat, openai_responses

DIALECTS: list[ModuleType] = [openai_chat, openai_responses, anthropic_messages, gemini]


def dialect_for(method: str, path: str) -> ModuleType | None:
    """The dialect that owns this request path, if any (path without query string)."""
    for module in DIALECTS:
        if module.recognizes(method, path):
            return module
    return None
