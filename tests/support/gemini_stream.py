"""A Gemini streamGenerateContent SSE body as its chunks, and which of them are keepalives (shared by the unit and
the live Gemini dialect tests)."""

from __future__ import annotations

import json
from typing import Any


def sse_events(stream: str) -> list[dict[str, Any]]:
    """The stream's chunks, keepalives left out."""
    assert stream.endswith("\r\n\r\n") and "event:" not in stream
    return [chunk for event in stream.split("\r\n\r\n") if event and not is_keepalive(chunk := json.loads(event.removeprefix("data: ")))]


def is_keepalive(chunk: dict[str, Any]) -> bool:
    """What the gateway sends while the engine works (a slow engine makes some): a chunk with one empty text part."""
    candidates = chunk.get("candidates") or [{}]
    return candidates[0].get("content", {}).get("parts") == [{"text": ""}] and "finishReason" not in candidates[0]
