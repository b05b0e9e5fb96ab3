"""`polar-mitm ui --db STORE`: the rollout dashboard in the browser, for any store, offline and read-only.

    polar-mitm ui --db runs/store.duckdb                 http://127.0.0.1:8090/ui/
    polar-mitm ui --db runs/store.duckdb --port 0        a free port (the URL is printed)

Pages: Run (tasks and groups, sessions by status, policy versions, throughput, errors), Session (stage timeline,
the conversation, prompt diffs between turns, sequences) and Trajectory (one sequence token by token). It works
while a gateway writes the store (read through the gateway's SQL endpoint; the pages refresh themselves), and a
missing or empty store is a page that says so. `rollout serve` and `polar-mitm gateway` serve the same pages at
/ui on their own port. See docs/ui.md.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ui",
        help="the rollout dashboard in the browser (any store, read-only; works while a gateway writes it)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--db", required=True, help="DuckDB store (the gateway's --db)")
    parser.add_argument("--port", type=int, default=8090, help="port to serve on (0: a free one; default 8090)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; the pages show prompts)")
    parser.add_argument("--tokenizer", help="directory with the engine's tokenizer.json, for token text (default: the local engine's model)")
    parser.add_argument("--mitmweb", metavar="URL", help="mitmweb's URL (a gateway run with --web, e.g. http://127.0.0.1:8081): each exchange links to its flow")
    parser.set_defaults(func=_ui)


def _ui(args: argparse.Namespace) -> int:
    import uvicorn

    from polar_mitm.ui import PathSource, standalone_app
    from polar_mitm.ui.source import StoreProblem, check_path
    from polar_mitm.util import free_port

    source = PathSource(args.db, tokenizer=args.tokenizer, mitmweb=args.mitmweb)
    try:
        check_path(source.db)
    except StoreProblem as problem:  # served all the same: the page says so, and looks again while the path is missing
        print(f"polar-mitm ui: {problem.detail}", file=sys.stderr)
    port = args.port or free_port()
    print(f"polar-mitm ui: http://{args.host}:{port}/ui/  (store {source.db}; Ctrl-C stops)", flush=True)
    uvicorn.run(standalone_app(source), host=args.host, port=port, log_level="warning")
    return 0
