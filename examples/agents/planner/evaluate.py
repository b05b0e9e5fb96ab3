"""The planner task's evaluator (`python: evaluate.py:evaluate`, run on the rollout server): a strict reward.

1.0 only when answer.txt is exactly the trip's total (3 nights at 120 plus 2 tickets at 45.50: 451, written as
the calculator writes numbers) and the tool log shows `calculator` ran and returned that total; else 0.0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/agents/evaluation.py
from evaluation import sandbox_text, tool_calls  # noqa: E402

TOTAL = 3 * 120 + 2 * 45.50


def evaluate(context: Any) -> dict[str, Any]:
    expected = f"{TOTAL:g}"
    answer = (sandbox_text(context, "answer.txt") or "").strip()
    calculated = any(c["tool"] == "calculator" and c["result"] == expected for c in tool_calls(context))
    return {"reward": 1.0 if answer == expected and calculated else 0.0, "answer": answer, "calculated": calculated}
