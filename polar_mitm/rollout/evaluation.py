"""Rewards: an evaluator command run in the sandbox, or a Python function run on the server.

A command's reward is the `reward` of the last line of its stdout that is a JSON object with one (its other
keys become `details`); without such a line, 1.0 for exit status 0 and 0.0 otherwise. A Python evaluator
('module:function' or 'path/file.py:function') is called in a worker thread with an EvaluationContext and
returns a number or a dict with `reward`.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from polar_mitm.errors import EvaluatorError
from polar_mitm.rollout.models import Evaluation, Evaluator, TaskRequest
from polar_mitm.rollout.runtimes import ExecResult, Sandbox, tail
from polar_mitm.util import load_function


@dataclass
class EvaluationContext:
    """What a Python evaluator sees. `exec` and `read_file` reach into the session's sandbox."""

    session_id: str
    task: TaskRequest
    harness_exit_code: int | None
    n_exchanges: int
    sandbox: Sandbox
    loop: asyncio.AbstractEventLoop

    def exec(self, command: str, timeout: float = 60.0) -> ExecResult:
        return asyncio.run_coroutine_threadsafe(self.sandbox.exec(command, timeout), self.loop).result()

    def read_file(self, path: str) -> bytes:
        return asyncio.run_coroutine_threadsafe(self.sandbox.read_file(path), self.loop).result()


def reward_from_output(stdout: str, exit_code: int) -> tuple[float, dict[str, Any]]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "reward" in data:
            return _number(data.pop("reward")), data
    return (1.0 if exit_code == 0 else 0.0), {}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EvaluatorError(f"the evaluator's reward must be a finite number, got {value!r}")
    return float(value)


async def evaluate(evaluator: Evaluator, sandbox: Sandbox, context: EvaluationContext) -> Evaluation:
    """Raises TimeoutError past evaluator.timeout_seconds, EvaluatorError when it gives no usable reward."""
    if evaluator.command is not None:
        result = await sandbox.exec(evaluator.command, evaluator.timeout_seconds)
        reward, details = reward_from_output(result.stdout, result.exit_code)
        return Evaluation(reward=reward, exit_code=result.exit_code, output=tail(result.stdout + result.stderr, 2000), details=details)
    try:
        function = load_function(evaluator.python or "")
    except Exception as error:  # noqa: BLE001 - an unloadable evaluator is the evaluator's error
        raise EvaluatorError(f"cannot load evaluator {evaluator.python!r}: {error}") from error
    async with asyncio.timeout(evaluator.timeout_seconds):
        value = await asyncio.to_thread(function, context)
    if isinstance(value, dict):
        details = dict(value)
        if "reward" not in details:
            raise EvaluatorError(f"evaluator {evaluator.python!r} returned a dict without 'reward'")
        return Evaluation(reward=_number(details.pop("reward")), details=details)
    return Evaluation(reward=_number(value))
