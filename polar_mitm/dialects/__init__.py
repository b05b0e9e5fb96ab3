"""Wire dialects: one module per provider API, each with the same small surface.

    API                       the `exchanges.api` value
    recognizes(method, path)  path first: is this request ours?
    parse(body, path, query)  -> ParsedRequest (engine chat-completions form), or raises DialectError
    render_body(parsed, completion) -> dict        the provider's non-streaming JSON
    render_stream(parsed, completion) -> bytes     the provider's SSE event stream
    error_body(error) -> dict                      the provider's error shape
    STREAM_CONTENT_TYPE
"""

from __future__ import annotations

from types import ModuleType

from polar_mitm.dialects import openai_chat

DIALECTS: list[ModuleType] = [openai_chat]


def register(module: ModuleType) -> None:
    if module not in DIALECTS:
        DIALECTS.append(module)


def dialect_for(method: str, path: str) -> ModuleType | None:
    """The dialect that owns this request path, if any (path without query string)."""
    for module in DIALECTS:
        if module.recognizes(method, path):
            return module
    return None


def _load_optional() -> None:
    import importlib

    for name in ("openai_responses", "anthropic_messages", "gemini"):
        try:
            register(importlib.import_module(f"polar_mitm.dialects.{name}"))
        except ModuleNotFoundError as error:
            if error.name != f"polar_mitm.dialects.{name}":
                raise


_load_optional()
