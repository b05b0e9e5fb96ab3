"""`polar-mitm sql`: query the store, also while a gateway is writing to it.

    polar-mitm sql --db runs/store.duckdb --list                 the views, with what each answers
    polar-mitm sql --db runs/store.duckdb session_timeline       a view by name (SELECT * FROM it)
    polar-mitm sql --db runs/store.duckdb "SELECT ... FROM exchanges ..."
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from datetime import datetime
from typing import Any

LIST_SQL = "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' ORDER BY view_name"
ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sql",
        help="run SQL on the store (works while the gateway runs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--db", required=True, help="DuckDB store")
    parser.add_argument("--list", action="store_true", help="list the views and what each one answers")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--max-width", type=int, default=60, help="truncate cells in the table view (display only)")
    parser.add_argument("--limit", type=int, default=None, help="print at most this many rows (the count says how many there were)")
    parser.add_argument("query", nargs="?", help="SQL, or the name of a view (see --list)")
    parser.set_defaults(func=_sql)


def _sql(args: argparse.Namespace) -> int:
    from polar_mitm import store

    if args.list:
        return _list(args.db)
    if not args.query:
        print("polar-mitm sql: give a query or a view name (polar-mitm sql --db DB --list shows the views)", file=sys.stderr)
        return 2
    query = args.query.strip()
    sql = query if any(c.isspace() for c in query) else f"SELECT * FROM {query}"
    try:
        columns, rows = store.query(args.db, sql)
    except Exception as error:  # noqa: BLE001 - shown to the user
        print(f"polar-mitm sql: {error}", file=sys.stderr)
        if "trajectories" in str(error) and "does not exist" in str(error):
            print(f"polar-mitm sql: the trajectories table is written by `polar-mitm assemble --db {args.db}`; run it first", file=sys.stderr)
        return 1
    if args.json:
        for row in rows[: args.limit]:
            print(json.dumps(dict(zip(columns, row)), default=str))
    else:
        print(format_table(columns, rows, args.max_width, args.limit))
    return 0


def _list(db: str) -> int:
    from polar_mitm import store

    try:
        _, views = store.query(db, LIST_SQL)
    except Exception as error:  # noqa: BLE001 - shown to the user
        print(f"polar-mitm sql: {error}", file=sys.stderr)
        return 1
    for name, comment in views:
        print(name)
        for line in textwrap.wrap(comment or "(no description)", width=100):
            print(f"    {line}")
        print()
    print(f"({len(views)} views; tables: exchanges, sessions, trajectories after `polar-mitm assemble`)")
    return 0


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
        return " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    more = f", {len(shown)} shown" if len(shown) < len(rows) else ""
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{more})")
    return "\n".join(out)
