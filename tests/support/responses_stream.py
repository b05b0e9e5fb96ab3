"""What a Responses API client makes of a stream: its events, the output it accumulates, the outline of a response
(shared by the unit and the live Responses dialect tests)."""

from __future__ import annotations

import json
from typing import Any


def sse_events(stream: bytes | str) -> list[dict[str, Any]]:
    """Split the raw SSE bytes; every event has an `event:` line naming its type, and JSON data."""
    text = stream.decode() if isinstance(stream, bytes) else stream
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and "\n" not in data
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == head.removeprefix("event: ")
        events.append(event)
    return events


def accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rebuild the output from deltas alone, checking the grammar on the way: sequence numbers, item ids,
    output and content indexes, each `.done` agreeing with its deltas. Returns the items' essentials."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
    response_id = events[0]["response"]["id"]
    # keepalives: response.in_progress again, sent while the engine works (a slow engine makes some)
    keepalives = [e for e in events[2:-1] if e["type"] == "response.in_progress"]
    assert all(e["response"] == events[1]["response"] for e in keepalives)
    assert all(e["response"]["id"] == response_id for e in (events[0], events[1], events[-1]))
    items: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    for event in events[2 + len(keepalives):-1]:
        kind, index = event["type"], event["output_index"]
        if kind == "response.output_item.added":
            assert index == len(items) and index not in items
            items[index] = {"id": event["item"]["id"], "type": event["item"]["type"], "name": event["item"].get("name"), "namespace": event["item"].get("namespace"), "text": "", "parts": []}
            continue
        item = items[index]
        assert index not in done
        if kind == "response.output_item.done":
            assert event["item"]["id"] == item["id"]
            done[index] = event["item"]
            continue
        assert event["item_id"] == item["id"]
        if kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            slot = event.get("content_index", event.get("summary_index"))
            item["parts"].append(kind)
            assert slot == sum(1 for part in item["parts"] if part == kind) - 1 and event["part"]["text"] == ""
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta", "response.custom_tool_call_input.delta", "response.reasoning_text.delta"):
            item["text"] += event["delta"]
        elif kind == "response.output_text.done" or kind == "response.reasoning_text.done":
            assert event["text"] == item["text"]
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == item["text"]
        elif kind == "response.custom_tool_call_input.done":
            assert event["input"] == item["text"]
        else:
            assert kind in ("response.content_part.done", "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"), kind
    assert sorted(done) == sorted(items)
    assert [done[i] for i in sorted(done)] == events[-1]["response"]["output"]
    return [{k: v for k, v in items[i].items() if k not in ("id", "parts")} for i in sorted(items)]


def outline(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The same essentials, read from a non-streamed Response."""
    summary = []
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            text = item["arguments"]
        elif item["type"] == "custom_tool_call":
            text = item["input"]
        elif item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
        else:
            text = ""
        summary.append({"type": item["type"], "name": item.get("name"), "namespace": item.get("namespace"), "text": text})
    return summary
