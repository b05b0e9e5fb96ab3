"""Engine hooks for the tokens-mode tests (`--engine-hook tests/tokens_steering.py:NAME`), on top of the harness
steering (tests/harness_steering.py: a shell call, then a final text; forced, so not canonically tokenized).

think: the shell call comes after a reasoning block, which the Qwen3-style template drops from that turn once
a later user query follows: a chat-mode re-render no longer extends the sampled tokens.
broken_call: the tool call's JSON is cut short, so it does not parse.
coder_xml: the shell call in Qwen3-Coder's XML format (`--tool-parser qwen3_coder`), then the final text.
two_calls: the harness steering's shell call, then a second one reading the file back, then the final text: a
lineage of three model turns, two of them extending the one before.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.local_engine.steering import SHELL_TOOLS, force, has_tool_result, shell_call, shell_tool
from tests.support import harness_steering

REASONING = "The user wants a file; one shell command writes it."


def think(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    if shell and not has_tool_result(request):
        return force(request, f"<think>\n{REASONING}\n</think>\n\n" + shell_call(shell, harness_steering.proof_command()), max_tokens=256)
    return harness_steering.steer(request, context)


def broken_call(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    return force(request, shell_call(shell, "ls").replace("}}", "}"), max_tokens=256)


def coder_xml(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    if shell and not has_tool_result(request):
        argument = SHELL_TOOLS[shell]
        call = f"<tool_call>\n<function={shell}>\n<parameter={argument}>\n{harness_steering.proof_command()}\n</parameter>\n</function>\n</tool_call>"
        return force(request, call, max_tokens=256)
    return harness_steering.steer(request, context)


CHECK_COMMAND = f"cat {harness_steering.PROOF_FILE}"


def two_calls(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    results = sum(message.get("role") == "tool" for message in request.get("messages") or [])
    if shell and results == 1:
        return force(request, shell_call(shell, CHECK_COMMAND), max_tokens=256)
    return harness_steering.steer(request, context)
