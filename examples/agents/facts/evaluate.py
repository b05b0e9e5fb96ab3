"""The facts task's evaluator (`python: evaluate.py:evaluate`, run on the rollout server): a strict reward.

1.0 only when answer.txt is exactly the fact the task uploaded to facts/polarine.txt (stripped) and the tool log
shows `lookup` ran on topic "polarine" and returned that fact; else 0.0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/agents/evaluation.py
from evaluation import sandbox_text, tool_calls, uploaded  # noqa: E402


def evaluate(context: Any) -> dict[str, Any]:
    expected = uploaded(context, "facts/polarine.txt").strip()
    answer = (sandbox_text(context, "answer.txt") or "").strip()
    calls = tool_calls(context)
    looked_up = any(c["tool"] == "lookup" and c["arguments"] == {"topic": "polarine"} and c["result"] == expected for c in calls)
    return {"reward": 1.0 if answer == expected and looked_up else 0.0, "answer": answer, "looked_up": looked_up, "tool_calls": len(calls)}
