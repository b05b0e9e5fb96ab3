"""Engine hook that makes the tiny random-weight test model act like a policy
(`--engine-hook examples/steer_tiny_model.py:steer`).

Used by the README's main job and the rollout tests; a real policy needs no hook.

The random test model cannot solve a task, so this steers it, with vLLM structured outputs, the way a good
policy would act: the first turn of an agent loop is one call of the harness's shell tool running the command
named on a `STEER-COMMAND: ...` line of the instruction, the turn after the tool result is a short final text.
Requests without a shell tool (side calls some harnesses make) get a short text, or the JSON verdict Gemini
CLI's model router asks for.
"""

from __future__ import annotations

import re
from typing import Any

from polar_mitm.local_engine.steering import ROUTER_JSON, force, has_tool_result, shell_call, shell_tool, wants_json

STEER_LINE = re.compile(r"^STEER-COMMAND: (.+)$", re.MULTILINE)
FINAL_TEXT = "Done."


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    command = next((m.group(1).strip() for msg in request.get("messages") or [] if msg.get("role") == "user" for m in [STEER_LINE.search(_text(msg.get("content")))] if m), None)
    if shell and command and not has_tool_result(request):
        forced = shell_call(shell, command)
    elif not shell and wants_json(request):
        forced = ROUTER_JSON
    else:
        forced = FINAL_TEXT
    return force(dict(request), forced, max_tokens=200)
