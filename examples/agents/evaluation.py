"""What the example agents' evaluators share (each runs on the rollout server, reading the sandbox's files).

Every agent logs its tool calls to tool_calls.jsonl ({"tool", "arguments", "result"} per line, written by the
tool itself when it runs); an evaluator checks the answer file AND that log, so a reward of 1.0 says the tool
really ran and the answer is the verified one. The expected values come from the task's own prepare steps
(the files uploaded into the sandbox), never from what the agent wrote.
"""

from __future__ import annotations

import json
from typing import Any


def uploaded(context: Any, target: str) -> str:
    """The content the task's prepare steps uploaded to `target`."""
    for step in context.task.runtime.prepare:
        upload = getattr(step, "upload", None)
        if upload is not None and upload.target == target and upload.content is not None:
            return upload.content
    raise LookupError(f"the task uploads no content to {target!r}")


def sandbox_text(context: Any, path: str) -> str | None:
    try:
        return context.read_file(path).decode()
    except (FileNotFoundError, IsADirectoryError):
        return None


def tool_calls(context: Any) -> list[dict[str, Any]]:
    """The tool calls the agent's tools logged, in order ([] when none ran)."""
    return [json.loads(line) for line in (sandbox_text(context, "tool_calls.jsonl") or "").splitlines() if line.strip()]
