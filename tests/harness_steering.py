"""Engine hook for the harness tests: constrain the real engine's output so a random-weight model acts like an agent.

Loaded by the gateway (`--engine-hook tests/harness_steering.py:steer`). For a request that offers the
harness's shell tool and has no tool result yet, the output is forced (structured-output regex, parsed by the
engine's hermes tool parser) to one shell tool call writing PROOF_CONTENT into PROOF_FILE; once a tool
result is in the conversation, to FINAL_TEXT. Side calls without a shell tool get their own short answer.
The engine still samples every token; only the grammar is fixed.
"""

from __future__ import annotations

import json
import re
from typing import Any

PROOF_FILE = "polar_proof.txt"
PROOF_CONTENT = "written-by-the-harness-shell-tool"
FINAL_TEXT = "Done: the file is written."
# each harness's shell tool and the argument holding the command
SHELL_TOOLS = {"run_shell_command": "command", "exec_command": "cmd", "Bash": "command", "shell": "command"}
SIDE_CALL_TEXT = "OK"
# Gemini CLI's model router asks for a JSON verdict; a well-formed one keeps it on its normal path
ROUTER_JSON = '{"complexity_reasoning": "Simple, explicit single-step task.", "complexity_score": 10}'


def literal(text: str) -> str:
    """A regex matching exactly `text`, escaping only metacharacters (the engine's regex dialect is not Python's)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", "\\n")


def shell_call(tool: str, command: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": {SHELL_TOOLS[tool]: command}}) + "\n</tool_call>"


def proof_command() -> str:
    return f"printf %s {PROOF_CONTENT} > {PROOF_FILE}"


def _tool_names(request: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in request.get("tools") or [] if isinstance(tool.get("function"), dict)]


def _has_tool_result(request: dict[str, Any]) -> bool:
    return any(message.get("role") == "tool" for message in request.get("messages") or [])


def _wants_json(request: dict[str, Any]) -> bool:
    fmt = request.get("response_format") or {}
    return fmt.get("type") in ("json_object", "json_schema")


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = next((name for name in _tool_names(request) if name in SHELL_TOOLS), None)
    if shell and not _has_tool_result(request):
        forced = shell_call(shell, proof_command())
        request["tool_choice"] = "auto"
    elif shell:
        forced = FINAL_TEXT
    elif _wants_json(request):
        forced = ROUTER_JSON
        request.pop("response_format", None)  # the regex is the stricter constraint; vLLM takes one
    else:
        forced = SIDE_CALL_TEXT
    request["structured_outputs"] = {"regex": literal(forced)}
    request["temperature"] = 0
    request["max_tokens"] = 256
    return request
