"""Engine hooks for the PyPI agents' tests (tests/integration/test_agents_pypi.py): a real action, then the agent's
own way of finishing, forced so that the tiny random-weight model acts like a policy.

Each agent acts and finishes its own way (`context["harness"]`, told by the user agent its preset sets):

    agent            action (what really runs)                 how a run ends
    mini-swe-agent   tool call `bash {"command": ...}`          `bash`: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
    gptme            tool call `shell {"command": ...}`         a call of its `complete` tool
    aider            a whole-file listing (its `whole` edit     the one reply per message is the edit
                     format): the file name, a fenced block
    others           tool call of their shell tool              a plain text reply (FINAL_TEXT)

steer: one action writing the proof file, then the ending. two_calls: that action, a second one reading the file
back (aider: one edit, it has no second action), then the ending. Requests without the agent's action tool (side
calls) get a JSON verdict or a short answer. Only the output is constrained (a regex): `max_tokens` and sampling
stay the agent's own, so every run under these hooks is one "without any output cap or sampling change by a
hook". Tools marked `strict` lose the mark: vLLM would constrain the call to the tool's schema and drop the regex.
"""

from __future__ import annotations

import json
from typing import Any

from polar_mitm.local_engine.steering import ROUTER_JSON, force, wants_json
from tests.support.harness_steering import FINAL_TEXT, PROOF_CONTENT, PROOF_FILE, SIDE_CALL_TEXT, proof_command
from tests.support.tokens_steering import CHECK_COMMAND

# each agent's shell tool and the argument holding the command
SHELL_TOOLS = {"bash": "command", "terminal": "command", "shell": "command", "Shell": "command"}
MINI_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
AIDER_EDIT = f"{PROOF_FILE}\n```\n{PROOF_CONTENT}\n```"


def shell_tool(request: dict[str, Any]) -> str | None:
    names = [(tool.get("function") or {}).get("name") for tool in request.get("tools") or [] if isinstance(tool, dict)]
    return next((name for name in names if name in SHELL_TOOLS), None)


def tool_results(request: dict[str, Any]) -> int:
    return sum(message.get("role") == "tool" for message in request.get("messages") or [])


def tool_call(tool: str, arguments: dict[str, Any]) -> str:
    """The hermes-format tool call the engine's tool parser (and tokens mode's) turns into a real tool call."""
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


def shell_call(tool: str, command: str) -> str:
    return tool_call(tool, {SHELL_TOOLS[tool]: command})


def ending(harness: str | None, shell: str) -> str:
    """What the agent's loop takes as the end, once the actions are done."""
    if harness == "mini-swe-agent":
        return shell_call(shell, MINI_SUBMIT)
    if harness == "gptme":
        return tool_call("complete", {})
    return FINAL_TEXT


def _turn(request: dict[str, Any], context: dict[str, Any], calls: tuple[str, ...]) -> dict[str, Any]:
    harness, shell, done = context.get("harness"), shell_tool(request), tool_results(request)
    if harness == "aider":
        forced = AIDER_EDIT if "file listing" in json.dumps(request.get("messages") or []) else SIDE_CALL_TEXT
    elif shell and done < len(calls):
        forced = shell_call(shell, calls[done])
    elif shell:
        forced = ending(harness, shell)
    elif wants_json(request):
        forced = ROUTER_JSON
    else:
        forced = SIDE_CALL_TEXT
    for tool in request.get("tools") or []:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"].pop("strict", None)
    return force(request, forced)


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    return _turn(request, context, (proof_command(),))


def two_calls(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    return _turn(request, context, (proof_command(), CHECK_COMMAND))
