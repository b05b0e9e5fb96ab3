"""Engine hook for the debugging-tools run (`--engine-hook tests/debug_steer.py:steer`).

The random-weight engine is steered with a structured-output regex so the conversations look like agent turns:
while a shell tool is offered and no tool result has come back, one shell call; after a tool result, a fixed
text; without tools, a greeting. The engine still samples every token (logprob 0.0 on forced ones); the
client's max_tokens is kept, so a small one still cuts the sample off.

A forced text is normally not sampled in its canonical tokenization, so the next prompt (which re-renders it)
would not extend it. In tool conversations the canonical ids of the text are biased (logit_bias) so that
those turns merge; the greeting is left unbiased.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

from polar_mitm.assembler.diagnosis import load_tokenizer

SHELL_TOOLS = {"exec_command": "cmd", "Bash": "command", "run_shell_command": "command"}
SHELL_COMMAND = "ls"
AFTER_TOOL = "The repository holds README.md."
GREETING = "Hello from the engine, how can I help you today?"


def literal(text: str) -> str:
    """A regex matching exactly `text` (the engine's regex dialect escapes like this, not like Python's re.escape)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", "\\n")


def shell_call(tool: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": {SHELL_TOOLS[tool]: SHELL_COMMAND}}) + "\n</tool_call>"


@cache
def _tokenizer(model: str) -> Any:
    return load_tokenizer(None, model)


def canonical_bias(model: str, text: str) -> dict[str, int]:
    tokenizer = _tokenizer(model)
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.tokenizer.token_to_id("<|im_end|>")]
    return {str(i): 100 for i in ids}


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    names = [(tool.get("function") or {}).get("name") for tool in request.get("tools") or []]
    shell = next((name for name in names if name in SHELL_TOOLS), None)
    answered = any(message.get("role") == "tool" for message in request.get("messages") or [])
    if shell and not answered:
        forced = shell_call(shell)
        request["tool_choice"] = "auto"
    elif answered:
        forced = AFTER_TOOL
    else:
        forced = GREETING
    request["structured_outputs"] = {"regex": literal(forced)}
    if shell or answered:
        request["logit_bias"] = canonical_bias(request["model"], forced)
    request["temperature"] = 0
    request["max_tokens"] = min(request.get("max_tokens") or 128, 128)
    return request
