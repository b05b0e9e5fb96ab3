"""Latency: every configuration at 1, 8 and 32 concurrent sessions, non-streamed and streamed, sampled interleaved
(A B C D, then B C D A, ...) so the noise of a shared machine falls on all of them alike; and the real engine's
row (direct vs through the gateway, interleaved pairs)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.client import Pool, Target
from bench.common import Plan, percentile


async def measure_latency(targets: dict[str, Target], specs: list[dict[str, Any]], plan: Plan, names: tuple[str, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stream in (False, True):
        for concurrency in (1, 8, 32):
            pools = {name: Pool(targets[name], specs, concurrency, stream, session_base=1000 * concurrency) for name in names}
            for pool in pools.values():
                await pool.warm()
            samples: dict[str, list[float]] = {name: [] for name in names}
            for round_index in range(plan.rounds):
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    samples[name].extend(await pools[name].run_count(plan.requests[concurrency], plan.batch_cap_s))
            for name, pool in pools.items():
                results[f"{'stream' if stream else 'json'}/{concurrency}/{name}"] = {"latencies": samples[name], "errors": pool.errors}
                pool.close()
            print(f"  latency {'streamed' if stream else 'non-streamed'} c={concurrency}: " + ", ".join(f"{n} p50 {percentile(samples[n], 50) * 1000:.1f} ms" for n in names), flush=True)
    return results


async def measure_engine(targets: dict[str, Target], specs: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    spec = specs[-1]  # the shortest request: the shared engine's prefill is slow on CPU
    samples: dict[str, list[float]] = {"engine-direct": [], "engine-gateway": []}
    errors: list[str] = []
    pools = {name: Pool(targets[name], [spec], 1, False, session_base=20000, marker=None) for name in samples}
    for pool in pools.values():
        await pool.warm()  # also fills the engine's prefix cache, for both alike
    for index in range(plan.engine_pairs):
        for name in (("engine-direct", "engine-gateway") if index % 2 == 0 else ("engine-gateway", "engine-direct")):
            samples[name].extend(await pools[name].run_count(1))
    for pool in pools.values():
        errors.extend(pool.errors)
        pool.close()
    direct, gateway = statistics.median(samples["engine-direct"] or [float("nan")]), statistics.median(samples["engine-gateway"] or [float("nan")])
    print(f"  real engine: direct {direct * 1000:.0f} ms, gateway {gateway * 1000:.0f} ms", flush=True)
    return {"direct": direct, "gateway": gateway, "n": len(samples["engine-direct"]), "errors": errors, "request": spec["file"]}
