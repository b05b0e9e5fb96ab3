"""Engine hooks for the npm agents' tests (tests/integration/test_agents_npm.py): harness_steering's turns, for the
shell tools those agents name differently.

`polar_mitm.local_engine.steering.SHELL_TOOLS` knows the four original harnesses' shell tools (Continue CLI's `Bash`
among them); the agents here add `bash` (OpenCode, Pi, Kilo Code), `run_commands` (Cline, a list of commands)
and `exec` (OpenClaw). The hooks are the same turns as the originals:

steer: turn 1 one shell call writing the proof file, then FINAL_TEXT (tests/support/harness_steering.py:steer).
two_calls: that call, a second one reading the file back, then FINAL_TEXT (tests/support/tokens_steering.py:two_calls).
Both only constrain the output (a regex); `max_tokens` and sampling are the agent's own, so a run under either is
a run "without any output cap or sampling change by a hook". Pi marks its tools `strict`: vLLM then constrains a
tool call to the tool's JSON schema and silently drops the regex, so the hooks take the mark off (the regex is the
stricter constraint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from polar_mitm.local_engine.steering import ROUTER_JSON, SHELL_TOOLS, force, wants_json
from tests.support import harness_steering
from tests.support.tokens_steering import CHECK_COMMAND

# tool name -> the arguments of a call running `command`, for every agent the tests run (the originals' first)
AGENT_SHELL_TOOLS: dict[str, Callable[[str], dict[str, Any]]] = {
    **{name: (lambda command, argument=argument: {argument: command}) for name, argument in SHELL_TOOLS.items()},
    "bash": lambda command: {"command": command},
    "run_commands": lambda command: {"commands": [command]},  # Cline: a list of commands
    "exec": lambda command: {"command": command},  # OpenClaw
}


def shell_tool(request: dict[str, Any]) -> str | None:
    """The first shell tool the request offers, in the request's order."""
    names = [(tool.get("function") or {}).get("name") for tool in request.get("tools") or [] if isinstance(tool, dict)]
    return next((name for name in names if name in AGENT_SHELL_TOOLS), None)


def tool_results(request: dict[str, Any]) -> int:
    return sum(message.get("role") == "tool" for message in request.get("messages") or [])


def shell_call(tool: str, command: str) -> str:
    """The hermes-format tool call the engine's tool parser (and tokens mode's) turns into a real tool call."""
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": AGENT_SHELL_TOOLS[tool](command)}) + "\n</tool_call>"


def _turn(request: dict[str, Any], calls: tuple[str, ...]) -> dict[str, Any]:
    """The next of `calls` while results for fewer are in the conversation, then the final text; side calls (no
    shell tool) get a JSON verdict or a short answer, as in harness_steering."""
    shell, done = shell_tool(request), tool_results(request)
    if shell and done < len(calls):
        forced = shell_call(shell, calls[done])
    elif shell:
        forced = harness_steering.FINAL_TEXT
    elif wants_json(request):
        forced = ROUTER_JSON
    else:
        forced = harness_steering.SIDE_CALL_TEXT
    for tool in request.get("tools") or []:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"].pop("strict", None)
    return force(request, forced)


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    return _turn(request, (harness_steering.proof_command(),))


def two_calls(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    return _turn(request, (harness_steering.proof_command(), CHECK_COMMAND))
