"""Sustained load: exchanges/s at 64 sessions in a closed loop (interleaved segments) with each proxy's CPU per
exchange and peak RSS, and the gateway's RSS at 1/32/64 sessions on a young store."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.client import Pool, Target
from bench.common import Plan, Service


async def sample_rss(service: Service, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], service.rss_mb())
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def measure_throughput(targets: dict[str, Target], services: dict[str, Service], specs: list[dict[str, Any]], plan: Plan, names: tuple[str, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    pools = {name: Pool(targets[name], specs, 64, False, session_base=5000) for name in names}
    for pool in pools.values():
        await pool.warm()
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}
    peaks = {name: [0.0] for name in names}
    cpu0 = time.process_time()
    total = 0
    for round_index in range(plan.throughput_rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(services[name], peaks[name], stop)) if name in services else None
            cpu_before = services[name].cpu_s() if name in services else 0.0
            done, elapsed = await pools[name].run_for(plan.throughput_seconds)
            if name in services:
                cpu_ms[name].append((services[name].cpu_s() - cpu_before) / max(done, 1) * 1000)
            stop.set()
            if sampler:
                await sampler
            rates[name].append(done / elapsed)
            total += done
    client_cpu_us = (time.process_time() - cpu0) / max(total, 1) * 1e6
    for name, pool in pools.items():
        results[name] = {
            "rates": rates[name], "median": statistics.median(rates[name]), "errors": pool.errors, "peak_rss_mb": peaks[name][0] or None,
            "cpu_ms": statistics.median(cpu_ms[name]) if cpu_ms[name] else None,
        }
        pool.close()
    results["client_cpu_us_per_exchange"] = client_cpu_us
    print("  throughput: " + ", ".join(f"{n} {results[n]['median']:.0f}/s ({len(results[n]['errors'])} errors)" for n in names), flush=True)
    return results


async def measure_gateway_rss(target: Target, gateway: Service, specs: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for sessions in (1, 32, 64):
        pool = Pool(target, specs, sessions, False, session_base=9000 + 100 * sessions)
        peak = [gateway.rss_mb()]
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(gateway, peak, stop))
        done, elapsed = await pool.run_for(plan.rss_seconds)
        stop.set()
        await sampler
        rows.append({"sessions": sessions, "peak_rss_mb": peak[0], "exchanges": done, "rate": done / elapsed, "errors": len(pool.errors)})
        pool.close()
    print("  gateway RSS: " + ", ".join(f"{r['sessions']} sessions {r['peak_rss_mb']:.0f} MB" for r in rows), flush=True)
    return rows
