"""Small helpers every view uses to read through a `StoreReader`: rows as dicts, optional parts, JSON values.

Rows come as tuples from a reader in this process and as JSON lists through a gateway's SQL endpoint (timestamps
as ISO text there), so the views select times as epoch seconds (`epoch(x)`) and JSON columns as text.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import duckdb

from polar_mitm.store import StoreReader

log = logging.getLogger("polar_mitm.ui")


def dicts(reader: StoreReader, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
    columns, rows = reader.query(sql, params)
    return [dict(zip(columns, row, strict=True)) for row in rows]


def one(reader: StoreReader, sql: str, params: list[Any] | None = None) -> dict[str, Any]:
    found = dicts(reader, sql, params)
    return found[0] if found else {}


def optional(reader: StoreReader, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]] | None:
    """The rows, or None when the statement cannot run on this store (no `trajectories` table yet, a union of
    nodes without some view): the page leaves that part out."""
    try:
        return dicts(reader, sql, params)
    except (duckdb.Error, RuntimeError) as error:  # RuntimeError: the same error through a gateway's endpoint
        log.debug(f"polar ui: left out ({error})")
        return None


def json_value(value: Any) -> Any:
    """A JSON column's value: parsed from text (in process) or as it came (through an endpoint)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def when(epoch: float | None) -> str:
    """A time for a table cell: UTC, to the second."""
    if not isinstance(epoch, (int, float, str)):  # None, or a template's undefined value
        return ""
    return datetime.fromtimestamp(float(epoch), UTC).strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float | None) -> str:
    if not isinstance(seconds, (int, float, str)):
        return ""
    seconds = float(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
