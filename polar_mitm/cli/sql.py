"""`polar-mitm sql`: query the store, also while a gateway is writing to it.

    polar-mitm sql --db runs/store.duckdb --list                 the views, with what each answers
    polar-mitm sql --db runs/store.duckdb session_timeline       a view by name (SELECT * FROM it)
    polar-mitm sql --db runs/store.duckdb "SELECT ... FROM exchanges ..."
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from polar_mitm.debug.tables import format_table

LIST_SQL = "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' ORDER BY view_name"


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
            print(json.dumps(dict(zip(columns, row, strict=True)), default=str))
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
