"""An Anthropic Messages stream as its events, checked against Anthropic's event grammar (shared by the unit and the
live Anthropic dialect tests)."""

from __future__ import annotations

import json
from typing import Any


def sse_events(stream: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for chunk in stream.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def assert_anthropic_grammar(stream: str) -> list[tuple[str, dict[str, Any]]]:
    """Anthropic's event order: message_start, ping, per block start/delta.../stop, message_delta, message_stop.
    Returned without keepalives: pings between message_start and the first block (the gateway sends them while
    the engine works; a slow engine makes some)."""
    events = without_keepalives(sse_events(stream))
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1
    open_index = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    return events


def without_keepalives(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    after_pings = next((index for index, (name, _) in enumerate(events) if index > 0 and name != "ping"), len(events))
    if after_pings < len(events) and events[after_pings][0] == "message_delta":
        after_pings -= 1  # a reply without content has its one grammar ping right before message_delta
    return events[:1] + events[after_pings:]
