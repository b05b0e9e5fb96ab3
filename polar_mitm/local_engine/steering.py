"""Steering the tiny random-weight engine with structured outputs, so that it acts like an agent's policy.

The engine still samples every token; a regex only fixes what the reply may say. Engine hooks
(`--engine-hook`, in examples/ and tests/) decide what each turn is forced to; these are their common parts.
"""

from __future__ import annotations

import json
import re
from typing import Any

# each harness's shell tool and the argument holding the command
SHELL_TOOLS = {"run_shell_command": "command", "exec_command": "cmd", "Bash": "command", "shell": "command"}
# Gemini CLI's model router asks for a JSON verdict; a well-formed one keeps it on its normal path
ROUTER_JSON = '{"complexity_reasoning": "Simple, explicit single-step task.", "complexity_score": 10}'


def literal(text: str) -> str:
    """A regex matching exactly `text`, escaping only metacharacters (the engine's regex dialect is not Python's)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", "\\n")


def shell_tool(request: dict[str, Any]) -> str | None:
    """The first shell tool the request offers, in the request's order."""
    names = [(tool.get("function") or {}).get("name") for tool in request.get("tools") or [] if isinstance(tool, dict)]
    return next((name for name in names if name in SHELL_TOOLS), None)


def has_tool_result(request: dict[str, Any]) -> bool:
    return any(message.get("role") == "tool" for message in request.get("messages") or [])


def wants_json(request: dict[str, Any]) -> bool:
    return (request.get("response_format") or {}).get("type") in ("json_object", "json_schema")


def shell_call(tool: str, command: str) -> str:
    """The hermes-format tool call the engine's tool parser turns into a real tool call."""
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": {SHELL_TOOLS[tool]: command}}) + "\n</tool_call>"


def force(request: dict[str, Any], text: str, max_tokens: int | None = None, greedy: bool = False) -> dict[str, Any]:
    """The request, constrained to answer exactly `text`; the harness's own output budget and sampling stay.

    The regex ends the sample by itself (only end-of-text is allowed once `text` is complete), so no cap is
    needed. Sampling at the harness's temperature picks among the token sequences that spell `text`, so the
    ids can be non-canonical, as a real policy's can. `max_tokens` / `greedy` only for a hook that needs them
    (tests/support/debug_steer.py wants canonical greedy tokens for its break diagnoses).
    """
    if text.startswith("<tool_call>"):
        request["tool_choice"] = "auto"  # the hermes parser only runs under auto
    if text == ROUTER_JSON:
        request.pop("response_format", None)  # the regex is the stricter constraint; vLLM takes one
    request["structured_outputs"] = {"regex": literal(text)}
    if greedy:
        request["temperature"] = 0
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return request
