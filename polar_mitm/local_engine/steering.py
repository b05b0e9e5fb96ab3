"""Steering the tiny random-weight engine with structured outputs, so that it acts like an agent's policy.

The engine still samples every token; a regex only fixes what the reply may say. `steer` is the hook the README
gives the bundled engine (`--engine-hook polar_mitm.local_engine.steering:steer`, importable from any folder);
the other hooks (tests/support/) decide other turns and share the parts below. A real policy needs no hook.
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


# the line of a task's instruction naming the command the steered model's one shell call runs (examples/hello-task.yaml)
STEER_LINE = re.compile(r"^STEER-COMMAND: (.+)$", re.MULTILINE)
FINAL_TEXT = "Done."


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def steer_command(request: dict[str, Any]) -> str | None:
    """The command on a `STEER-COMMAND: ...` line of the request's user messages, if any."""
    for message in request.get("messages") or []:
        if message.get("role") == "user" and (match := STEER_LINE.search(_text(message.get("content")))):
            return match.group(1).strip()
    return None


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """The engine hook that makes the tiny random-weight model act like a policy that finishes.

    The first turn of an agent loop whose instruction has a `STEER-COMMAND:` line is one call of the harness's
    shell tool running that command; every other turn is the short final text FINAL_TEXT (so a plain
    instruction, e.g. "fix the tests", ends after one engine call instead of sampling toward the harness's whole
    output budget). Requests without a shell tool that want JSON (Gemini CLI's model router) get its verdict.
    Only the output is constrained: the harness's own max_tokens and sampling reach the engine unchanged.
    """
    shell, command = shell_tool(request), steer_command(request)
    if shell and command and not has_tool_result(request):
        forced = shell_call(shell, command)
    elif not shell and wants_json(request):
        forced = ROUTER_JSON
    else:
        forced = FINAL_TEXT
    return force(dict(request), forced)
