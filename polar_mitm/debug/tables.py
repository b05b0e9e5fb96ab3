"""Query results as text tables for a terminal (`polar-mitm sql`, `polar-mitm demo`, notebooks)."""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Any

ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?$")


def format_cell(value: Any, max_width: int = 60) -> str:
    """One value as a short, single-line cell: token lists summarised, floats rounded, times to the second."""
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = "NaN" if math.isnan(value) else f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, datetime):
        text = value.strftime("%Y-%m-%d %H:%M:%S")
    elif isinstance(value, str) and ISO_TIME.match(value):  # timestamps come as ISO text through the gateway
        text = value[:19].replace("T", " ")
    elif isinstance(value, (list, tuple)):
        shown = ", ".join(format_cell(v, 12) for v in value[:4])
        text = f"[{shown}{', …' if len(value) > 4 else ''}] ({len(value)})" if len(value) > 4 else f"[{shown}]"
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def format_table(columns: list[str], rows: list[list[Any]], max_width: int = 60, limit: int | None = None) -> str:
    shown = rows if limit is None else rows[:limit]
    cells = [[format_cell(v, max_width) for v in row] for row in shown]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in shown if r[i] is not None) for i in range(len(columns))]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    out = [line(columns), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    more = f", {len(shown)} shown" if len(shown) < len(rows) else ""
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{more})")
    return "\n".join(out)
