"""Engine hook for the assembler's retry test (loaded by a gateway with --engine-hook; holds no tests).

The first attempt of the second turn of a session is made slow (a long forced reply), so the official
openai SDK times out and retries the very same request (x-stainless-retry-count: 1). The gateway still
finishes and commits the slow attempt: the store then holds two sampled replies to one prompt.
"""

from __future__ import annotations

from typing import Any

attempts: dict[tuple[str, int], int] = {}


def slow_first_attempt(engine_request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    key = (context["session_id"], len(engine_request["messages"]))
    attempts[key] = attempts.get(key, 0) + 1
    if key[1] == 4 and attempts[key] == 1:  # system, user, assistant, user: the second turn
        return {**engine_request, "structured_outputs": {"regex": "(slow ){400}"}, "max_tokens": 800, "logit_bias": None}
    return None
