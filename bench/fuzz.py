"""Fuzz over the wire (issue 28), the full run: hypothesis-made requests for every dialect through one real gateway.

    python bench/fuzz.py --count 10000 [--api gemini ...] [--seed 28] [--concurrency 4] [--out bench/fuzz_results.md]

The cases and the invariants are tests/support/fuzz_wire.py's (tests/integration/test_fuzz_wire.py runs a few of
them): a plausible body of each API, mutated, in one of several wire encodings, to the provider's own host through
HTTPS_PROXY with the gateway's CA; the engine is the stand-in bench/stub_upstream.py (a fixed reply at once).
Per dialect it prints requests, statuses by class, rows, violations and times; the cases go in chunks of 500 (each
chunk its own seed), so memory stays flat however many are asked for. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import platform
import signal
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import fuzz_wire  # noqa: E402

CHUNK = 500


def run_api(gateway, api: str, count: int, seed: int, concurrency: int, until: float = float("inf")) -> fuzz_wire.Figures:
    figures = fuzz_wire.Figures(api)
    session_id = f"fuzz-{api}-{uuid.uuid4().hex[:8]}"
    answers_seen: list[fuzz_wire.Answer] = []
    with fuzz_wire.client(gateway, session_id, connections=concurrency) as http:
        for chunk, start in enumerate(range(0, count, CHUNK)):
            if time.monotonic() > until:
                print(f"  {api}: --time-limit reached after {figures.requests} requests", flush=True)
                break
            started = time.monotonic()
            batch = fuzz_wire.generate(api, min(CHUNK, count - start), seed=seed * 1000 + chunk)
            figures.generate_s += time.monotonic() - started
            started = time.monotonic()
            answers = fuzz_wire.send_all(http, batch, concurrency)
            figures.send_s += time.monotonic() - started
            figures.add(answers)
            # the row check needs only ids and statuses: keep those, not the bodies
            answers_seen += [fuzz_wire.Answer(fuzz_wire.Case(a.case.api, a.case.path, {}, a.case.body[:200], a.case.kind), a.status, {"x-polar-exchange-id": a.exchange_id or ""}, b"") for a in answers]
            print(f"  {api}: {figures.requests}/{count} sent, {dict(figures.statuses)}, {len(figures.violations)} violations", flush=True)
    problems = fuzz_wire.rows_violations(gateway, session_id, answers_seen)
    figures.rows = len(gateway.rows("SELECT exchange_id FROM exchanges WHERE session_id = ?", [session_id]))
    figures.violations += problems
    if not fuzz_wire.serves(gateway, f"{session_id}-after"):
        figures.violations.append("the gateway no longer answers a plain request")
    return figures


def internal_errors(gateway) -> None:
    """The gateway's own tracebacks (a bug of ours behind a 5xx), each kind once."""
    text = gateway.log.read_text(errors="replace") if gateway.log and gateway.log.exists() else ""
    seen = set()
    for block in text.split("Traceback (most recent call last):")[1:]:
        lines = [line for line in block.splitlines() if line.strip()]
        last = next((line for line in lines if not line.startswith((" ", "["))), lines[-1] if lines else "")
        where = [line.strip() for line in lines if line.strip().startswith("File ")][-1:]
        key = (last[:200], tuple(where))
        if key not in seen:
            seen.add(key)
            print(f"GATEWAY TRACEBACK: {last[:300]} ({where[0] if where else '?'})")


def table(results: list[fuzz_wire.Figures]) -> str:
    lines = [
        "| dialect | requests | 2xx | 4xx | 5xx | no answer | rows | violations | generate s | send s | requests/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in results:
        lines.append(
            f"| {f.api} | {f.requests} | {f.statuses['2xx']} | {f.statuses['4xx']} | {f.statuses['5xx']} | {f.statuses['no answer']} | {f.rows} | "
            f"{len(f.violations)} | {f.generate_s:.0f} | {f.send_s:.0f} | {f.requests / max(f.send_s, 1e-9):.0f} |"
        )
    kinds: dict[str, int] = {}
    for f in results:
        for kind, n in f.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + n
    lines += ["", "Bodies by kind (all dialects): " + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="requests per dialect")
    parser.add_argument("--api", action="append", choices=fuzz_wire.APIS, help="only these dialects (repeatable; default all four)")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--concurrency", type=int, default=4, help="connections (and requests in flight) per dialect")
    parser.add_argument("--render", choices=["chat", "tokens"], default="chat", help="the gateway's render mode (tokens: it renders the chat template itself)")
    parser.add_argument("--time-limit", type=float, default=float("inf"), help="seconds: no new chunk starts after this (the figures say how many were sent)")
    parser.add_argument("--out", type=Path, help="write the figures (markdown) here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its gateway and engine
    with tempfile.TemporaryDirectory(prefix="polar-fuzz-") as tmp:
        base = Path(tmp)
        tokens = args.render == "tokens"
        engine = fuzz_wire.StubEngine(base / "stub.log", fuzz_wire.tokens_model_dir() if tokens else None)
        try:
            gateway = fuzz_wire.start_gateway(base, engine.url, "--render", args.render)
            started = time.monotonic()
            try:
                until = started + args.time_limit
                results = [run_api(gateway, api, args.count, args.seed, args.concurrency, until) for api in args.api or fuzz_wire.APIS]
            finally:
                gateway.stop()
                internal_errors(gateway)
            elapsed = time.monotonic() - started
        finally:
            engine.stop()
    report = "\n".join([
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} ({platform.machine()}, {__import__('os').cpu_count()} CPUs), "
        f"`python bench/fuzz.py --count {args.count} --seed {args.seed} --concurrency {args.concurrency} --render {args.render}`: {elapsed:.0f} s in all.",
        "",
        table(results),
    ])
    print(report)
    for f in results:
        for violation in f.violations[:20]:
            print(f"VIOLATION {f.api}: {violation}")
    if args.out:
        args.out.write_text(report + "\n")
    return 1 if any(f.violations for f in results) else 0


if __name__ == "__main__":
    sys.exit(main())
