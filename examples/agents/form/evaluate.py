"""The form task's evaluator (`python: evaluate.py:evaluate`, run on the rollout server): a strict reward.

1.0 only when form.json is a JSON object equal to the form read off the document the task uploaded
(documents/invoice.txt: its Vendor, Invoice number, Date and Total due lines) and the tool log shows
`read_document` ran on "invoice" and returned that document; else 0.0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/agents/evaluation.py
from evaluation import sandbox_text, tool_calls, uploaded  # noqa: E402

FIELDS = {"Vendor": "vendor", "Invoice number": "invoice_number", "Date": "date", "Total due": "total"}


def expected_form(document: str) -> dict[str, str]:
    lines = dict(line.split(": ", 1) for line in document.splitlines() if ": " in line)
    return {field: lines[label].strip() for label, field in FIELDS.items()}


def evaluate(context: Any) -> dict[str, Any]:
    document = uploaded(context, "documents/invoice.txt")
    try:
        form = json.loads(sandbox_text(context, "form.json") or "null")
    except ValueError:
        form = None
    read = any(c["tool"] == "read_document" and c["arguments"] == {"name": "invoice"} and c["result"] == document for c in tool_calls(context))
    correct = form == expected_form(document)
    return {"reward": 1.0 if correct and read else 0.0, "form_correct": correct, "document_read": read}
