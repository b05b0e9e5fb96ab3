"""Engine hook for the harness tests: constrain the real engine's output so a random-weight model acts like an agent.

Loaded by the gateway (`--engine-hook tests/support/harness_steering.py:steer`). For a request that offers the
harness's shell tool and has no tool result yet, the output is forced (structured-output regex, parsed by the
engine's hermes tool parser) to one shell tool call writing PROOF_CONTENT into PROOF_FILE; once a tool
result is in the conversation, to FINAL_TEXT. Side calls without a shell tool get their own short answer.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.local_engine.steering import ROUTER_JSON, force, has_tool_result, shell_call, shell_tool, wants_json

PROOF_FILE = "polar_proof.txt"
PROOF_CONTENT = "written-by-the-harness-shell-tool"
FINAL_TEXT = "Done: the file is written."
SIDE_CALL_TEXT = "OK"


def proof_command() -> str:
    return f"printf %s {PROOF_CONTENT} > {PROOF_FILE}"


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    if shell and not has_tool_result(request):
        forced = shell_call(shell, proof_command())
    elif shell:
        forced = FINAL_TEXT
    elif wants_json(request):
        forced = ROUTER_JSON
    else:
        forced = SIDE_CALL_TEXT
    return force(request, forced, max_tokens=256)
