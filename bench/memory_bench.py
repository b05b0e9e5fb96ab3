"""The gateway's memory under load, before vs after its memory settings: `python bench/memory_bench.py [--quick]`.

Gateways run side by side against one stand-in engine (bench/stub_upstream.py, 25 ms): `bounded`, this tree with
the defaults of polar_mitm/gateway/options.py; with `--baseline DIR`, `before`: the gateway of another source tree
(e.g. `git archive` of the commit before the memory bounds), same venv; with `--set NAME=FLAGS`, this tree with other
flags (e.g. `unbounded=--store-memory-mb 0 --store-journal-mb 0`). Each level (64, then 512 concurrent sessions)
runs phases rotating over the gateways (A B, then B A, ...: the noise of a shared machine falls on all alike).
A session is a harness's few turns: a new session id on a new CONNECT with its own proxy credentials, `--turns`
non-streamed exchanges of a real Qwen Code request (bench/requests/, 24-58 KB; ~14k prompt token ids recorded per
row), then the next session.

Reported per gateway and level: RSS at the start, middle and end of its phases (sampled every 0.25 s; a leak
shows as a slope), its peak, exchanges/s (median over its phases) and errors. The file-descriptor limit is
raised to its hard limit first: 512 sessions hold 512 client connections and up to 512 engine connections.
Results: bench/memory_results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import Conn, Target, reply_ok
from bench.common import (
    BENCH,
    ROOT,
    STUB_MODEL,
    Service,
    check_alive,
    flags_and_env,
    free_port,
    load_requests,
    raise_fd_limit,
    stop_all,
)
from bench.report import machine
from polar_mitm import session

CONFIGS: dict[str, list[str]] = {"bounded": []}


def start(services: dict[str, Service], tmp: Path, delay_ms: float, names: list[str], extra: dict[str, list[str]], baseline: Path | None) -> None:
    """Start the stub and the gateways into `services` as it goes, so the caller stops them all even if one fails."""
    python = sys.executable
    confdir = tmp / "confdir"
    stub_port = free_port()
    services["stub"] = Service("stub", stub_port, [python, str(BENCH / "stub_upstream.py"), "--port", str(stub_port), "--delay-ms", str(delay_ms)], tmp / "stub.log").start()
    services["stub"].wait(30)
    for name in names:
        port = free_port()
        db = tmp / f"{name}.duckdb"
        flags, env = flags_and_env(extra[name])
        command = [python, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", f"http://127.0.0.1:{stub_port}/v1", "--db", str(db),
                   "--confdir", str(confdir), "--engine-model", STUB_MODEL, "--require-auth", *flags]
        services[name] = Service(name, port, command, tmp / f"{name}.log", env=env, cwd=baseline if name == "before" and baseline else ROOT).start()
        services[name].wait(90, ready=lambda db=db: (confdir / "mitmproxy-ca-cert.pem").exists() and Path(str(db) + ".control.json").exists())


class Sessions:
    """`size` workers, each running sessions of `turns` exchanges one after another, each on a new connection."""

    def __init__(self, target: Target, specs: list[dict[str, Any]], size: int, turns: int, base: int):
        self.target, self.turns = target, turns
        self.requests = [target.request(specs[i % len(specs)], False) for i in range(size)]
        self.next_session = base
        self.errors: list[str] = []

    async def run_for(self, seconds: float) -> tuple[int, float]:
        done = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def worker(index: int) -> None:
            nonlocal done
            host, raw = self.requests[index]
            while time.perf_counter() < deadline:
                self.next_session += 1
                conn: Conn | None = None
                try:
                    conn = await self.target.connect(host, self.next_session)
                    for _ in range(self.turns):
                        status, body = await conn.exchange(raw)
                        if not reply_ok(status, body, False):
                            self.errors.append(f"HTTP {status}: {body[:200]!r}")
                            break
                        done += 1
                        if time.perf_counter() >= deadline:
                            break
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as error:
                    self.errors.append(f"{type(error).__name__}: {error}")
                    await asyncio.sleep(0.05)
                finally:
                    if conn is not None:
                        conn.close()

        await asyncio.gather(*(worker(i) for i in range(len(self.requests))))
        return done, time.perf_counter() - t0


async def sample(service: Service, samples: list[tuple[float, float]], stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - t0, service.rss_mb()))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def measure(services: dict[str, Service], targets: dict[str, Target], specs: list[dict[str, Any]], levels: list[int], rounds: int, seconds: float, turns: int) -> dict[str, Any]:
    names = list(targets)
    results: dict[str, Any] = {}
    for level in levels:
        sessions = {name: Sessions(targets[name], specs, level, turns, base=100_000 * (1 + names.index(name)) + 10_000 * levels.index(level)) for name in names}
        per: dict[str, dict[str, Any]] = {name: {"rates": [], "samples": [], "exchanges": 0, "cpu_s": 0.0} for name in names}
        t0 = time.monotonic()
        for round_index in range(rounds):
            for name in names[round_index % 2 :] + names[: round_index % 2]:
                stop = asyncio.Event()
                samples: list[tuple[float, float]] = []
                sampler = asyncio.create_task(sample(services[name], samples, stop, t0))
                cpu_before = services[name].cpu_s()
                done, elapsed = await sessions[name].run_for(seconds)
                per[name]["cpu_s"] += services[name].cpu_s() - cpu_before
                stop.set()
                await sampler
                per[name]["rates"].append(done / elapsed)
                per[name]["samples"].extend(samples)
                per[name]["exchanges"] += done
        for name in names:
            rss = [mb for _, mb in per[name]["samples"]]
            third = max(1, len(rss) // 3)
            per[name].update(
                rate=statistics.median(per[name]["rates"]), cpu_ms=1000 * per[name]["cpu_s"] / max(per[name]["exchanges"], 1), errors=len(sessions[name].errors), first_errors=sessions[name].errors[:3],
                rss_start=statistics.median(rss[:third]), rss_middle=statistics.median(rss[third : 2 * third] or rss), rss_end=statistics.median(rss[-third:]),
                rss_peak=max(rss), sessions_started=sessions[name].next_session - (100_000 * (1 + names.index(name)) + 10_000 * levels.index(level)),
            )
            print(f"  {level} sessions, {name}: {per[name]['rate']:.0f} exchanges/s, {per[name]['cpu_ms']:.1f} ms CPU each, RSS {per[name]['rss_start']:.0f} / {per[name]['rss_middle']:.0f} / {per[name]['rss_end']:.0f} MB "
                  f"(peak {per[name]['rss_peak']:.0f}), {per[name]['errors']} errors", flush=True)
        results[str(level)] = per
    return results


def render(results: dict[str, Any], args: argparse.Namespace, fd_limit: int, names: list[str]) -> str:
    m = results["machine"]
    lines = [
        "# Gateway memory: bounded store settings vs the old ones",
        "",
        f"`python bench/memory_bench.py{' --quick' if args.quick else ''}` at {results['when']} ({results['wall_s']:.0f} s), commit {m['commit']} plus the working tree. "
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.0f} GiB; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        f"Load average at start {results['load'][0]:.2f}, at the end {results['load_end'][0]:.2f} (a shared machine: other work ran beside it).",
        f"Stand-in engine answering after {args.delay_ms:g} ms; real Qwen Code requests (24-58 KB, ~14k prompt token ids recorded per row), non-streamed; "
        f"each session {args.turns} turns on its own CONNECT and credentials, then a new session. {args.rounds} interleaved phases of {args.seconds:g} s per "
        f"gateway and level; RSS of the gateway process sampled every 0.25 s (start / middle / end = the median of the first, middle and last third of "
        f"its samples at that level). CPU per exchange: the gateway process's user + system time over its phases / its exchanges (on a shared "
        f"machine the steadier number; exchanges/s there follow the load). File-descriptor limit raised to {fd_limit}.",
        "",
        "| sessions | gateway | exchanges/s | gateway CPU per exchange (ms) | RSS start (MB) | RSS middle (MB) | RSS end (MB) | peak RSS (MB) | exchanges | sessions run | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level, per in results["levels"].items():
        for name in names:
            r = per[name]
            lines.append(f"| {level} | {name} | {r['rate']:.0f} | {r['cpu_ms']:.1f} | {r['rss_start']:.0f} | {r['rss_middle']:.0f} | {r['rss_end']:.0f} | {r['rss_peak']:.0f} | {r['exchanges']} | {r['sessions_started']} | {r['errors']} |")
    described = {name: f"this tree, {' '.join(CONFIGS[name]) or 'the defaults'}" for name in names}
    if "before" in described:
        described["before"] = f"the source tree {args.baseline}"
    lines += ["", "Gateways: " + "; ".join(f"`{name}`: {text}" for name, text in described.items()) + "."]
    for level, per in results["levels"].items():
        for name in names:
            if per[name]["first_errors"]:
                lines.append(f"\nFirst errors, {name} at {level}: {per[name]['first_errors']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="gateway RSS at 64 and 512 sessions, bounded vs old store settings (see the docstring)")
    parser.add_argument("--quick", action="store_true", help="2 phases of 8 s per gateway and level")
    parser.add_argument("--levels", default="64,512")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=25.0)
    parser.add_argument("--only", default="", help="comma-separated gateways (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=FLAGS", help="another gateway of this tree, with these extra flags (and VAR=VALUE environment)")
    parser.add_argument("--baseline", type=Path, help="also run the gateway of this polar_mitm source tree, as `before`")
    parser.add_argument("--output", type=Path, default=BENCH / "memory_results.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.seconds = args.seconds or (8.0 if args.quick else 20.0)
    if args.baseline:
        CONFIGS["before"] = []
    for entry in args.set:
        name, _, flags = entry.partition("=")
        CONFIGS[name] = flags.split()
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    fd_limit = raise_fd_limit()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still stops its gateways (finally)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="polar-membench-"))
    results: dict[str, Any] = {"machine": machine(), "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "load": os.getloadavg()}
    services: dict[str, Service] = {}
    try:
        start(services, tmp, args.delay_ms, names, CONFIGS, args.baseline)
        context = ssl.create_default_context(cafile=str(tmp / "confdir" / "mitmproxy-ca-cert.pem"))
        secret = session.load_secret(tmp / "confdir")
        targets = {name: Target(name, services[name].port, "connect", context, provider_paths=True,
                                credentials=lambda index: (f"mem-{index}", session.session_token(secret, f"mem-{index}"))) for name in names}
        results["levels"] = asyncio.run(measure(services, targets, load_requests(), [int(x) for x in args.levels.split(",")], args.rounds, args.seconds, args.turns))
        check_alive(services)
    finally:
        stop_all(services)
    results["wall_s"] = time.monotonic() - started
    results["load_end"] = os.getloadavg()
    report = render(results, args, fd_limit, names)
    args.output.write_text(report)
    print(report)
    if args.keep:
        print(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if any(importlib.util.find_spec(dependency) is None for dependency in ("mitmproxy", "duckdb")):
        venv_python = ROOT / ".venv" / "bin" / "python"
        os.execv(str(venv_python), [str(venv_python), *sys.argv])
    sys.exit(main())
