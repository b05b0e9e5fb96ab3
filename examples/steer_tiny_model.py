"""Engine hook that makes the tiny random-weight test model act like a policy (`--engine-hook examples/steer_tiny_model.py:steer`).

Used by the README's main job and the rollout tests; a real policy needs no hook.

The random test model cannot solve a task, so this steers it, with vLLM structured outputs, the way a good
policy would act: the first turn of an agent loop is one call of the harness's shell tool running the command
named on a `STEER-COMMAND: ...` line of the instruction, the turn after the tool result is a short final text.
Requests without a shell tool (side calls some harnesses make) get a short text, or the JSON verdict Gemini
CLI's model router asks for.
"""

from __future__ import annotations

import json
import re
from typing import Any

STEER_LINE = re.compile(r"^STEER-COMMAND: (.+)$", re.MULTILINE)
FINAL_TEXT = "Done."
# the shell tool of each harness and the argument carrying the command
SHELL_TOOLS = {"run_shell_command": "command", "exec_command": "cmd", "shell": "command", "Bash": "command"}
ROUTER_JSON = '{"complexity_reasoning": "Simple, explicit single-step task.", "complexity_score": 10}'


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    messages = request.get("messages") or []
    tools = {tool.get("function", {}).get("name") for tool in request.get("tools") or []}
    shell = next((name for name in SHELL_TOOLS if name in tools), None)
    command = next((m.group(1).strip() for msg in messages if msg.get("role") == "user" for m in [STEER_LINE.search(_text(msg.get("content")))] if m), None)
    after_tool = any(message.get("role") == "tool" for message in messages)
    request = dict(request)
    if shell and command and not after_tool:
        call = json.dumps({"name": shell, "arguments": {SHELL_TOOLS[shell]: command}})
        forced = f"<tool_call>\n{call}\n</tool_call>"
        request["tool_choice"] = "auto"
    elif not shell and (request.get("response_format") or {}).get("type") in ("json_object", "json_schema"):
        forced = ROUTER_JSON
        request.pop("response_format")  # vLLM takes one constraint; the regex is the stricter
    else:
        forced = FINAL_TEXT
    return {**request, "structured_outputs": {"regex": re.escape(forced)}, "temperature": 0, "max_tokens": 200}
