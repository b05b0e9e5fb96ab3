"""`polar-mitm assemble`: build training sequences from the store, write Parquet and the trajectories table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "assemble",
        help="build token-faithful training sequences from the store (Parquet + trajectories table)",
        description="Build training sequences from the exchanges in the store. Writes the `trajectories` table (through "
        "the gateway's writer while a gateway holds the store), and Parquet with --out.",
    )
    parser.add_argument("--db", required=True, help="DuckDB store")
    parser.add_argument("--builder", choices=["per_request", "prefix_merging"], default="prefix_merging")
    parser.add_argument("--session", help="assemble only this session")
    parser.add_argument("--out", help="Parquet file to write (one row per sequence)")
    parser.add_argument("--rewards", help="CSV with columns session_id,reward[,task_id]; overrides the store's rewards")
    parser.add_argument("--include-incomplete", action="store_true", help="train on sessions that did not complete (default: reward 0, mask 0)")
    parser.add_argument("--lenient", action="store_true", help="prefix_merging only: Polar-style prompt-to-prompt merging, NOT token-faithful (for comparison)")
    parser.add_argument("--tokenizer", help="directory with the engine's tokenizer.json, for break diagnosis (default: the local engine's model)")
    parser.add_argument("--max-staleness", type=int, help="drop sequences sampled more than K policy versions before --current-version")
    parser.add_argument("--current-version", type=int, help="with --max-staleness: the trainer's policy version now")
    parser.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    parser.set_defaults(func=_assemble)


def _assemble(args: argparse.Namespace) -> int:
    from polar_mitm.assembler import Assembler
    from polar_mitm.assembler.export import ParquetSink, store_trajectories

    db = Path(args.db)
    if not db.exists():
        print(f"polar-mitm assemble: no store at {db}", file=sys.stderr)
        return 1
    try:
        assembler = Assembler(
            db, args.builder, args.session, lenient=args.lenient, rewards_csv=args.rewards,
            include_incomplete=args.include_incomplete, tokenizer=args.tokenizer,
            max_staleness=args.max_staleness, current_version=args.current_version,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"polar-mitm assemble: {error}", file=sys.stderr)
        return 2
    # without --out the Parquet file next to the store is kept only if the table cannot be written
    parquet = Path(args.out) if args.out else db.with_name(f"{db.name}.trajectories-{assembler.stats.builder}.parquet")
    sink = ParquetSink(parquet)
    try:
        for batch in assembler.batches():
            sink.write(batch)
    except (LookupError, ValueError, RuntimeError) as error:
        print(f"polar-mitm assemble: {error}", file=sys.stderr)
        return 1
    finally:
        sink.close()
    outcome = store_trajectories(db, parquet)
    if not args.out and outcome.written:
        parquet.unlink()
    stats = assembler.stats.summary()
    if args.json:
        print(json.dumps({**stats, "parquet": str(parquet) if parquet.exists() else None, "table_written": outcome.written, "message": outcome.message}))
        return 0
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        print(f"{key.ljust(width)}  {_shown(key, value, stats)}")
    if stats["breaks"]["unknown"]:
        print("breaks of kind 'unknown': no tokenizer was found for the engine's model; pass --tokenizer DIR to classify them")
    if parquet.exists():
        print(f"wrote {sink.rows} sequences to {parquet.resolve()}")
    print(outcome.message)
    return 0


def _shown(key: str, value: object, stats: dict) -> object:
    """A statistic as printed: the tokenizer is loaded only to classify a break, so None says why there is none."""
    if key == "tokenizer" and value is None:
        return "none needed (no break to classify)" if not any(stats["breaks"].values()) else "none found for the engine's model"
    return value
