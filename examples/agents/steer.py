"""Engine hook for the example agents (examples/agents/*/): steers the tiny random-weight test model like a policy.

    polar-mitm gateway ... --engine-hook examples/agents/steer.py:steer

A task's instruction names the tool call to make on a `STEER-CALL: {"name": ..., "arguments": {...}}` line and,
optionally, the final answer on a `STEER-ANSWER: ...` line. The first turn (no assistant message yet) is forced
to that tool call; every later turn to the final answer: the STEER-ANSWER text, else the last tool result the
framework sent back verbatim (so the answer is what the tool really returned). A framework that ends through a
tool of its own gets the answer as that call: smolagents' `final_answer {"answer": ...}`, pydantic-ai's output
tool `final_result` (STEER-ANSWER is then the JSON of its arguments). Only the output is constrained (a regex):
the framework's own request, output budget and sampling reach the engine unchanged (but for tools'
`strict` flags, see without_strict_tools). A real policy needs no hook.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polar_mitm.local_engine.steering import force

STEER_CALL = re.compile(r"^STEER-CALL: (.+)$", re.MULTILINE)
STEER_ANSWER = re.compile(r"^STEER-ANSWER: (.+)$", re.MULTILINE)
# smolagents sends a tool's result back as a user message "Observation:\n<result>" (its tool-response role)
OBSERVATION = re.compile(r"Observation:\s*(.*)\Z", re.DOTALL)
FALLBACK_TEXT = "Done."


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The hermes-format tool call the engine's tool parser turns into a real one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def offered_tools(request: dict[str, Any]) -> list[str]:
    return [(tool.get("function") or {}).get("name") for tool in request.get("tools") or [] if isinstance(tool, dict)]


def last_tool_result(messages: list[dict[str, Any]]) -> str | None:
    for message in reversed(messages):
        if message.get("role") == "tool":
            return text_of(message.get("content")).strip()
        if message.get("role") == "user" and (match := OBSERVATION.search(text_of(message.get("content")))):
            return match.group(1).strip()
    return None


def without_strict_tools(request: dict[str, Any]) -> dict[str, Any]:
    """The request with its tools' `strict` flags dropped: vLLM compiles a strict tool's schema into a grammar of
    its own that replaces the steering regex (the OpenAI Agents SDK marks every function tool strict)."""
    request = dict(request)
    if request.get("tools"):
        request["tools"] = [{**tool, "function": {k: v for k, v in tool["function"].items() if k != "strict"}} if isinstance(tool.get("function"), dict) else tool for tool in request["tools"]]
    return request


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    request = without_strict_tools(request)
    messages = request.get("messages") or []
    instruction = "\n".join(text_of(m.get("content")) for m in messages if m.get("role") == "user")
    planned = STEER_CALL.search(instruction)
    if planned is None:
        return force(request, FALLBACK_TEXT)
    call = json.loads(planned.group(1))
    tools = offered_tools(request)
    if not any(m.get("role") == "assistant" for m in messages) and call["name"] in tools:
        return force(request, tool_call(call["name"], call["arguments"]))
    given = STEER_ANSWER.search(instruction)
    answer = given.group(1).strip() if given else (last_tool_result(messages) or FALLBACK_TEXT)
    if "final_answer" in tools:  # smolagents
        return force(request, tool_call("final_answer", {"answer": answer}))
    if "final_result" in tools:  # pydantic-ai's output tool: the answer is its arguments' JSON
        return force(request, tool_call("final_result", json.loads(answer)))
    return force(request, answer)
