"""What the gateway costs, side by side with what users would otherwise run: `python bench/run.py [--quick]`.

One run, one stand-in upstream (bench/stub_upstream.py: a fixed vLLM-shaped reply after a fixed delay; the
proxies are what is measured, not the engine), four ways to reach it, sampled interleaved (A B C D, then
B C D A, ...) so the noise of a shared 2-core machine falls on all of them alike:

  direct     client -> stub over plain HTTP/1.1 keep-alive.
  gateway    client -> `polar-mitm gateway` the way a harness reaches it: HTTPS_PROXY-style CONNECT to the
             provider's hostname (never resolved), TLS intercepted with the gateway's CA, the polar addon
             (parse, one non-streaming engine call with token ids + logprobs, DuckDB commit before the reply,
             the provider's JSON or SSE rendered back) -> stub.
  mitmproxy  client -> `mitmdump` with no addons in reverse mode (TLS from the client terminated with the same
             CA, HTTP/1.1 forwarded to the stub): what TLS interception and mitmproxy's HTTP handling cost
             alone. Reverse mode, because a regular-mode CONNECT to the stub's plain-HTTP port cannot be
             forwarded with TLS intercepted; the gateway additionally pays one CONNECT per connection.
  litellm    client -> LiteLLM proxy (PyPI litellm[proxy], its own venv under ~/.cache/polar-mitm) over plain
             HTTP, routing the harness's model name to the stub as an OpenAI-compatible backend.

The load client is a small asyncio HTTP/1.1 client with one keep-alive connection per simulated session
(~50 us of CPU per exchange); httpx at concurrency 32 spent ~1.9 ms of CPU per exchange here and would have
been the bottleneck. Bodies are real Qwen Code requests (bench/requests/, 24-58 KB with 4-14 tools).

Also measured: sustained exchanges/s (closed loop, 64 sessions, errors counted) with each proxy's CPU per
exchange, the gateway's RSS at 1/32/64 concurrent sessions, DuckDB ingest through polar_mitm.store.Store with
4k-token arrays while another process runs live SQL through store.query, and one small row against the real
local engine. `--baseline DIR` adds a fifth configuration: the gateway run from another polar_mitm source tree
(e.g. `git archive` of an older commit), for before/after numbers taken in the same interleaved run.

This file is the one entry point; the parts live beside it in the package `bench`:
  common.py      paths, the run plans (QUICK, FULL), `Service` (a started process, its RSS and CPU), percentiles
  client.py      the load client: `Target` (how a configuration is reached) and `Pool` (sessions against one)
  services.py    starting the stub, the gateway(s), mitmdump and LiteLLM; the `Target` for each
  latency.py     added latency at 1/8/32 sessions, JSON and SSE; the real-engine row
  throughput.py  sustained exchanges/s at 64 sessions with CPU and RSS; the gateway's RSS per session count
  ingest.py      the DuckDB store alone; its writer and SQL reader run as processes of their own, through
                 `python -m bench.ingest write|query` (documented there), so a --baseline tree is imported cleanly
  report.py      bench/results.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# `python bench/run.py` puts bench/ first on sys.path; the bench's modules are imported as the package `bench` of
# the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import Target
from bench.common import (
    BENCH,
    CONFIGS,
    ENGINE_URL,
    FULL,
    QUICK,
    ROOT,
    Plan,
    Service,
    check_alive,
    free_port,
    load_requests,
    stop_all,
)
from bench.ingest import measure_ingest
from bench.latency import measure_engine, measure_latency
from bench.report import machine, render
from bench.services import engine_reachable, make_targets, start_services, stub_requests
from bench.throughput import measure_gateway_rss, measure_throughput


async def measure_all(services: dict[str, Service], targets: dict[str, Target], specs: list[dict[str, Any]], plan: Plan, names: tuple[str, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # memory first, while the store is small, so the numbers show sessions rather than accumulated rows
    results["rss"] = await measure_gateway_rss(targets["gateway"], services["gateway"], specs, plan)
    results["latency"] = await measure_latency(targets, specs, plan, names)
    results["throughput"] = await measure_throughput(targets, services, specs, plan, names)
    if "engine-gateway" in targets:
        results["engine"] = await measure_engine(targets, specs, plan)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="polar-mitm overhead benchmark (see bench/run.py's docstring)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter phases (< 2 minutes)")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="the stub upstream's fixed engine time (default 25)")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install)")
    parser.add_argument("--no-engine", action="store_true", help="skip the real-engine row")
    parser.add_argument("--output", type=Path, default=BENCH / "results.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    parser.add_argument("--baseline", type=Path, help="also run the gateway from this polar_mitm source tree (e.g. an older commit's `git archive`), as configuration 'baseline'")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    started = time.monotonic()
    specs = load_requests()
    names = tuple(n for n in CONFIGS if not (n == "litellm" and args.no_litellm)) + (("baseline",) if args.baseline else ())
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    results: dict[str, Any] = {"machine": machine(), "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    services: dict[str, Service] = {}
    try:
        print(f"starting stub, gateway, mitmdump{', LiteLLM' if 'litellm' in names else ''} (logs in {tmp})", flush=True)
        start_services(services, tmp, args.delay_ms, "litellm" in names, args.baseline)
        if not args.no_engine and engine_reachable():
            port = free_port()
            services["engine-gateway"] = Service(
                "engine-gateway", port,
                [sys.executable, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", ENGINE_URL, "--db", str(tmp / "engine-gateway.duckdb"), "--confdir", str(tmp / "confdir")],
                tmp / "engine-gateway.log",
            ).start()
            services["engine-gateway"].wait(60, ready=lambda: (tmp / "engine-gateway.duckdb.control.json").exists())
        targets = make_targets(services, tmp)
        results.update(asyncio.run(measure_all(services, targets, specs, plan, names)))
        results["stub_requests"] = stub_requests(services["stub"].port)
        check_alive(services)
    finally:
        stop_all(services)
    results["ingest"] = measure_ingest(tmp, plan)
    if args.baseline:
        results["baseline"] = str(args.baseline)
        results["ingest_baseline"] = measure_ingest(tmp, plan, args.baseline)
    results["wall_s"] = time.monotonic() - started
    report = render(results, plan, args.quick, args.delay_ms, names)
    args.output.write_text(report)
    print()
    print(report)
    print(f"written to {args.output}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # `python bench/run.py` from outside the project's venv (polar_mitm's source is importable from ROOT, but not
    # what it runs on): use the venv
    if any(importlib.util.find_spec(dependency) is None for dependency in ("mitmproxy", "duckdb")):
        venv_python = ROOT / ".venv" / "bin" / "python"
        if venv_python.exists() and Path(sys.executable).resolve() != venv_python.resolve():
            os.execv(str(venv_python), [str(venv_python), *sys.argv])
        sys.exit(f"{sys.executable} lacks polar-mitm's dependencies and there is no {venv_python}: run scripts/setup.sh first")
    sys.exit(main())
