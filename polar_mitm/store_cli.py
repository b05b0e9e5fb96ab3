"""`polar-mitm sql`: query the store, also while a gateway is writing to it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sql", help="run SQL on the store (works while the gateway runs)")
    parser.add_argument("--db", required=True, help="DuckDB store")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--max-width", type=int, default=60, help="truncate cells in the table view (display only)")
    parser.add_argument("query", help="SQL, or the name of a view (session_timeline, token_usage, ...)")
    parser.set_defaults(func=_sql)


def _sql(args: argparse.Namespace) -> int:
    from polar_mitm import store

    sql = args.query if " " in args.query.strip() else f"SELECT * FROM {args.query}"
    try:
        columns, rows = store.query(args.db, sql)
    except Exception as error:  # noqa: BLE001 - shown to the user
        print(f"polar-mitm sql: {error}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(dict(zip(columns, row)), default=str))
    else:
        print(format_table(columns, rows, args.max_width))
    return 0


def format_table(columns: list[str], rows: list[list[Any]], max_width: int = 60) -> str:
    def cell(value: Any) -> str:
        text = "NULL" if value is None else str(value)
        text = text.replace("\n", "\\n")
        return text if len(text) <= max_width else text[: max_width - 1] + "…"

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "+".join("-" * (w + 2) for w in widths)
    out = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)), line]
    out += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)
