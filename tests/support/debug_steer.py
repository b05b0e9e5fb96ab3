"""Engine hook for the debugging-tools run (`--engine-hook tests/support/debug_steer.py:steer`).

The random-weight engine is steered with a structured-output regex so the conversations look like agent turns:
while a shell tool is offered and no tool result has come back, one shell call; after a tool result, a fixed
text; without tools, a greeting. The engine still samples every token (logprob 0.0 on forced ones); the
client's max_tokens is kept, so a small one still cuts the sample off.

A forced text is normally not sampled in its canonical tokenization, so the next prompt (which re-renders it)
would not extend it. In tool conversations the canonical ids of the text are biased (logit_bias) so that
those turns merge; the greeting is left unbiased.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from polar_mitm.assembler.diagnosis import load_tokenizer
from polar_mitm.local_engine.steering import force, has_tool_result, shell_call, shell_tool

SHELL_COMMAND = "ls"
AFTER_TOOL = "The repository holds README.md."
GREETING = "Hello from the engine, how can I help you today?"


@cache
def _tokenizer(model: str) -> Any:
    return load_tokenizer(None, model)


def canonical_bias(model: str, text: str) -> dict[str, int]:
    tokenizer = _tokenizer(model)
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.tokenizer.token_to_id("<|im_end|>")]
    return {str(i): 100 for i in ids}


def steer(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    shell = shell_tool(request)
    answered = has_tool_result(request)
    if shell and not answered:
        forced = shell_call(shell, SHELL_COMMAND)
    elif answered:
        forced = AFTER_TOOL
    else:
        forced = GREETING
    if shell or answered:
        request["logit_bias"] = canonical_bias(request["model"], forced)
    # the client's max_tokens is kept, so a small one still cuts the sample off
    return force(request, forced, max_tokens=min(request.get("max_tokens") or 128, 128))
