"""`polar-mitm diff SESSION --db PATH [--turn K]`: what changed in the prompt between a turn and the next one.

A turn is one trajectory exchange of the session (status 'ok', action 'generate', not a replay), named by its
seq. For turn K and the turn after it, the diff shows
  - messages: turn K's messages plus its reply, against what the next turn sent — unchanged, re-sent, edited,
    added, removed (the chat form the engine saw, whichever API the harness used);
  - tokens: whether the next prompt starts with turn K's prompt + sampled tokens (a strict prefix: the two merge
    into one training sequence), else the first token index where they differ, with the text around it, and
    the break class from the assembler's diagnosis (retokenized, rerendered, rewritten, truncated, unknown).
Without --turn, one line per consecutive pair.

Python API (the notebooks use it), in polar_mitm.debug.diff: `load_turns(db, session)`,
`diff_turns(db, session, turn)` -> TurnDiff, `format_diff(diff)`, `overview(db, session)`.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="what changed in the prompt between a turn and the next (messages, tokens, break class)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("session", help="session id")
    parser.add_argument("--db", required=True, help="DuckDB store")
    parser.add_argument("--turn", type=int, help="seq of the turn to diff against the next one (default: one line per pair)")
    parser.add_argument("--tokenizer", help="directory with the engine's tokenizer.json (default: the local engine's model)")
    parser.set_defaults(func=_diff)


def _diff(args: argparse.Namespace) -> int:
    from polar_mitm.debug.diff import diff_turns, format_diff, overview, summary_line

    try:
        if args.turn is not None:
            print(format_diff(diff_turns(args.db, args.session, args.turn, args.tokenizer)))
            return 0
        diffs = overview(args.db, args.session, args.tokenizer)
    except (LookupError, FileNotFoundError, ValueError) as error:
        print(f"polar-mitm diff: {error}", file=sys.stderr)
        return 1
    if not diffs:
        print(f"session {args.session}: one trajectory exchange, nothing to diff")
        return 0
    print(f"session {args.session} · {len(diffs) + 1} turns")
    for diff in diffs:
        print(f"  {summary_line(diff)}")
    print("details: polar-mitm diff SESSION --db DB --turn SEQ")
    return 0
