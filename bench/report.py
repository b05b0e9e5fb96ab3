"""The Markdown report (bench/results.md): the machine, then one table per measurement and the targets."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench.common import ENGINE_URL, PROXIES, ROOT, Plan, percentile
from bench.services import LITELLM_SPEC


def machine() -> dict[str, Any]:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for module in ("mitmproxy", "duckdb"):
        try:
            versions[module] = __import__(f"{module}.version" if module == "mitmproxy" else module, fromlist=["x"]).__dict__.get("VERSION") or __import__(module).__version__
        except Exception:  # noqa: BLE001 - only a label
            pass
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "load": os.getloadavg(), "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "versions": versions, "commit": commit}


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def render(results: dict[str, Any], plan: Plan, quick: bool, delay_ms: float, names: tuple[str, ...]) -> str:
    info = results["machine"]
    lines = [
        "# polar-mitm benchmark results",
        "",
        f"`python bench/run.py{' --quick' if quick else ''}` at {results['when']} (commit {info['commit']}), {results['wall_s']:.0f} s.",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']:.0f} GiB, load average at start {info['load'][0]:.2f} (shared with other work: numbers are noisy; "
        f"every configuration was sampled interleaved, {plan.rounds} rounds). Python {info['versions'].get('python')}, mitmproxy {info['versions'].get('mitmproxy')}, "
        f"DuckDB {info['versions'].get('duckdb')}, {LITELLM_SPEC if 'litellm' in names else 'LiteLLM not run'}.",
        "",
        f"**Upstream: a stand-in** (`bench/stub_upstream.py`): a fixed vLLM-shaped chat completion (text + one tool call, token ids and logprobs when asked, "
        f"~14k prompt token ids for a 56 KB request) after a fixed {delay_ms:g} ms. The proxies are what is measured, so a stand-in is right here; the real engine row is below.",
        "Requests: real Qwen Code chat-completions bodies (bench/requests/, 24-58 KB, 4-14 tools), one per session, round-robin. "
        f"The stub answered {results.get('stub_requests', 0)} completions in this run (every configuration really reached it).",
        "",
        "| configuration | path measured |",
        "|---|---|",
        "| direct | client -> stub, HTTP/1.1 keep-alive |",
        "| gateway | client -> polar-mitm gateway: CONNECT to the provider host, TLS intercepted, polar addon (parse, non-streaming engine call with token ids + logprobs, DuckDB commit before the reply, JSON/SSE rendered) -> stub |",
        "| mitmproxy | client -> mitmdump, no addons, reverse mode: client TLS terminated with the same CA, request forwarded as is -> stub (interception alone; no CONNECT) |",
        "| litellm | client -> LiteLLM proxy (1 worker, master key, no database), plain HTTP, model routed to the stub as an OpenAI-compatible backend |",
        *([f"| baseline | as gateway, running the polar_mitm source tree {results['baseline']} (the code before the changes being measured) |"] if "baseline" in names else []),
        "",
        "## Added latency over direct (ms)",
        "",
        f"Each round ran {', '.join(f'{n} requests at c={c}' for c, n in plan.requests.items())} per configuration, or fewer where that took a configuration over "
        f"{plan.batch_cap_s:g} s (column n). Added = the configuration's percentile minus direct's, over all interleaved samples; x direct = p50 / direct's p50; "
        "vs LiteLLM = added / LiteLLM's added (target for the gateway: <= 0.5 at p50, p95 and p99).",
        "",
        "| reply | conc | configuration | p50 | p95 | p99 | added p50 | added p95 | added p99 | x direct | vs LiteLLM p50/p95/p99 | n | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for stream in ("json", "stream"):
        for concurrency in (1, 8, 32):
            base = results["latency"][f"{stream}/{concurrency}/direct"]["latencies"]
            direct_p = {q: percentile(base, q) for q in (50, 95, 99)}
            added: dict[str, dict[int, float]] = {}
            for name in names:
                lat = results["latency"][f"{stream}/{concurrency}/{name}"]["latencies"]
                added[name] = {q: percentile(lat, q) - direct_p[q] for q in (50, 95, 99)}
            for name in names:
                cell = results["latency"][f"{stream}/{concurrency}/{name}"]
                lat = cell["latencies"]
                p = {q: percentile(lat, q) for q in (50, 95, 99)}
                vs = "-"
                if name in PROXIES and "litellm" in added and name != "litellm":
                    ratios = [added[name][q] / added["litellm"][q] if added["litellm"][q] > 0 else float("nan") for q in (50, 95, 99)]
                    vs = " / ".join(f"{r:.2f}" for r in ratios)
                    if name == "gateway":
                        verdicts.append((stream, concurrency, ratios))
                cols = [stream if stream == "stream" else "json", str(concurrency), name, fmt(p[50]), fmt(p[95]), fmt(p[99])]
                cols += ["-", "-", "-", "1.00"] if name == "direct" else [fmt(added[name][50]), fmt(added[name][95]), fmt(added[name][99]), f"{p[50] / direct_p[50]:.2f}"]
                cols += [vs, str(len(lat)), str(len(cell["errors"]))]
                lines.append("| " + " | ".join(cols) + " |")
    tp = results["throughput"]
    lines += [
        "",
        "## Sustained throughput (64 concurrent sessions, non-streamed, closed loop)",
        "",
        f"Median over {plan.throughput_rounds} interleaved {plan.throughput_seconds:g} s segments; the load client used {tp['client_cpu_us_per_exchange']:.0f} us of CPU per exchange. "
        f"With the stub's {delay_ms:g} ms, 64 sessions could reach {64 / (delay_ms / 1000):.0f}/s if the path cost nothing.",
        "",
        "CPU per exchange: the proxy's processes (all threads, children included), user + system; on a shared machine this is the steadier number: "
        "the exchanges/s a proxy could sustain on one free core is about 1000 / its main thread's share of it.",
        "",
        "| configuration | exchanges/s | segments | errors | proxy CPU per exchange (ms) | peak RSS (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        row = tp[name]
        rss = f"{row['peak_rss_mb']:.0f}" if row.get("peak_rss_mb") else "-"
        cpu = f"{row['cpu_ms']:.2f}" if row.get("cpu_ms") is not None else "-"
        lines.append(f"| {name} | {row['median']:.0f} | {', '.join(f'{r:.0f}' for r in row['rates'])} | {len(row['errors'])} | {cpu} | {rss} |")
    lines += [
        "", "## Gateway memory", "",
        f"Measured first, on a young store, {plan.rss_seconds:g} s per level: the gateway's RSS is mostly DuckDB's (rows not yet checkpointed, up to 256 MB of WAL, "
        "and its block cache), so it follows the rows written more than the sessions open.", "",
        "| concurrent sessions | peak RSS (MB) | exchanges in the phase | exchanges/s | errors |", "|---|---|---|---|---|",
    ]
    for row in results["rss"]:
        lines.append(f"| {row['sessions']} | {row['peak_rss_mb']:.0f} | {row['exchanges']} | {row['rate']:.0f} | {row['errors']} |")
    ingest = results["ingest"]
    lines += [
        "",
        "## DuckDB store",
        "",
        f"`polar_mitm.store.Store` alone, 64 sessions committing concurrently (group commit), each row with {ingest['tokens']} prompt + {ingest['tokens']} completion token ids, "
        f"{ingest['tokens']} logprobs and the raw engine reply: **{ingest['rate']:.0f} exchanges/s** ({ingest['exchanges']} rows in {ingest['group_commits']} commits, {ingest['db_mb']:.0f} MB). "
        "Meanwhile another process ran live SQL through `store.query` (the gateway's read-only endpoint):",
        "",
        "| query | p50 (ms) | p95 (ms) | n |",
        "|---|---|---|---|",
    ]
    for name, row in ingest["sql"].items():
        lines.append(f"| {name} | {fmt(row['p50'])} | {fmt(row['p95'])} | {row['n']} |")
    if "ingest_baseline" in results:
        base = results["ingest_baseline"]
        lines += ["", f"The baseline's Store, same rows: **{base['rate']:.0f} exchanges/s** ({base['exchanges']} rows in {base['group_commits']} commits); live SQL p50 "
                  + ", ".join(f"{fmt(row['p50'])} ms" for row in base["sql"].values()) + "."]
    engine = results.get("engine")
    lines += ["", "## Real engine (realism check)", ""]
    if engine:
        lines.append(
            f"Local vLLM engine at {ENGINE_URL} (tiny random-weight Qwen3 on CPU, shared), {engine['request']} with max_tokens 8, non-streamed, "
            f"{engine['n']} interleaved pairs after a warm-up: direct **{fmt(engine['direct'])} ms**, through the gateway **{fmt(engine['gateway'])} ms** "
            f"(median; added {fmt(engine['gateway'] - engine['direct'])} ms, errors {len(engine['errors'])})."
        )
    else:
        lines.append(f"Skipped: no engine answered at {ENGINE_URL}.")
    lines += ["", "## Targets", ""]
    if verdicts:
        worst = max(max(r for r in ratios if r == r) for _, _, ratios in verdicts)
        failing = [f"{s} c={c}" for s, c, ratios in verdicts if any(r > 0.5 for r in ratios)]
        lines.append(f"- Gateway added latency <= half of LiteLLM's at every concurrency: **{'met' if not failing else 'not met'}** (worst ratio {worst:.2f}{'; over 0.5: ' + ', '.join(failing) if failing else ''}).")
    gw = tp["gateway"]
    lines.append(f"- >= 300 exchanges/s sustained with 0 errors: **{'met' if gw['median'] >= 300 and not gw['errors'] else 'not met'}** ({gw['median']:.0f}/s, {len(gw['errors'])} errors).")
    errors = {k: v["errors"][:3] for k, v in results["latency"].items() if v["errors"]}
    if errors:
        lines += ["", "## First errors seen", "", "```", json.dumps(errors, indent=1)[:3000], "```"]
    return "\n".join(lines) + "\n"
