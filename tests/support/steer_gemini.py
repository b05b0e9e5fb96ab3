"""Engine hook for the Gemini dialect tests (`--engine-hook tests/support/steer_gemini.py:steer`).

Gemini requests have no slot for vLLM's `structured_outputs`, so the test gateway adds it: a short text and a
forced get_weather call while tools are offered and no result has come back, a fixed text once it has. Forced tokens
are still real engine samples (token ids + logprob 0.0), only their choice is steered.
"""

from __future__ import annotations

import json
import re
from typing import Any

PREAMBLE = "Let me check."
TOOL_CALL = PREAMBLE + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER_AFTER_TOOL = "It is sunny in Paris."


def steer(engine_request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    if engine_request["messages"][-1]["role"] == "tool":
        text = ANSWER_AFTER_TOOL
    elif engine_request.get("tools"):
        text = TOOL_CALL
    else:
        return None
    return {**engine_request, "structured_outputs": {"regex": _literal(text)}}


def _literal(text: str) -> str:
    """A regex matching exactly `text`, escaping only metacharacters (the engine's regex dialect is not Python's)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", "\\n")


def forced_arguments() -> dict[str, Any]:
    return json.loads(TOOL_CALL.split("\n")[2])["arguments"]


THOUGHT = "Paris weather needs the get_weather tool."
THINKING_TOOL_CALL = f"<think>\n{THOUGHT}\n</think>\n\n" + TOOL_CALL.removeprefix(PREAMBLE + "\n")


def steer_thinking(engine_request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    """Like steer, but turn 1 starts with the engine's reasoning inline, as an engine without a reasoning parser
    returns it (for a gateway started with --split-reasoning)."""
    if engine_request["messages"][-1]["role"] == "tool":
        text = ANSWER_AFTER_TOOL
    elif engine_request.get("tools"):
        text = THINKING_TOOL_CALL
    else:
        return None
    return {**engine_request, "structured_outputs": {"regex": _literal(text)}}
