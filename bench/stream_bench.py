"""Streamed replies with a slow engine: time to first byte per dialect, and what keepalives cost at 64 sessions.

The engine is bench/stub_upstream.py answering after --delay-ms (a stand-in: the gateway is measured, not the
engine); the gateway is a real `polar-mitm gateway`; the client is httpx through the proxy, as a harness would be.

  time to first byte   per dialect, --requests streamed requests, --concurrency at a time: the time from sending
                       the request to the response's headers, and to its first body bytes (the provider's opening
                       events; Gemini's grammar has none, so its first body bytes are the first keepalive)
  keepalive cost       64 streams held open for --hold-s by the slow engine, keepalives every second against none:
                       the gateway's extra CPU per keepalive event, and what that is at the default 5 s interval

Run: python bench/stream_bench.py [--requests 40] [--concurrency 4] [--delay-ms 3000] [--hold-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

# `python bench/stream_bench.py` puts bench/ first on sys.path; its helpers are imported as the package `bench`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, Service, free_port, percentile  # noqa: E402

REQUESTS = {
    "openai_chat": ("https://api.openai.com/v1/chat/completions", {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    "openai_responses": ("https://api.openai.com/v1/responses", {"model": "gpt-4o", "stream": True, "input": "hi"}),
    "anthropic_messages": ("https://api.anthropic.com/v1/messages", {"model": "claude-opus-4-8", "max_tokens": 256, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    "gemini": ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
}


def engine(port: int, delay_ms: int, work: Path) -> Service:
    command = [sys.executable, str(ROOT / "bench" / "stub_upstream.py"), "--port", str(port), "--delay-ms", str(delay_ms)]
    service = Service("stand-in engine", port, command, work / "engine.log").start()
    service.wait(60)
    return service


def gateway(engine_port: int, work: Path, interval: float) -> Service:
    port = free_port()
    command = [sys.executable, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", f"http://127.0.0.1:{engine_port}/v1", "--db", str(work / f"store-{port}.duckdb"), "--confdir", str(work / "confdir"), "--keepalive-interval", str(interval)]
    service = Service("gateway", port, command, work / f"gateway-{port}.log", env={"PYTHONPATH": str(ROOT)}).start()
    service.wait(60, ready=(work / "confdir" / "mitmproxy-ca-cert.pem").exists)
    return service


async def one(client: httpx.AsyncClient, dialect: str) -> tuple[float, float]:
    url, body = REQUESTS[dialect]
    started = time.perf_counter()
    async with client.stream("POST", url, json=body, headers={"authorization": "Bearer sk-bench", "x-api-key": "sk-bench", "x-goog-api-key": "bench"}) as response:
        headers = time.perf_counter() - started
        first = None
        async for chunk in response.aiter_raw():
            if first is None and chunk:
                first = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{dialect}: HTTP {response.status_code}")
    return headers, first if first is not None else headers


async def first_bytes(proxy: str, ca: Path, dialect: str, requests: int, concurrency: int) -> list[tuple[float, float]]:
    results: list[tuple[float, float]] = []
    queue = list(range(requests))
    async with httpx.AsyncClient(proxy=proxy, verify=str(ca), trust_env=False, timeout=600) as client:
        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one(client, dialect))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def hold_open(proxy: str, ca: Path, sessions: int) -> None:
    async def session(index: int) -> None:
        async with httpx.AsyncClient(proxy=proxy.replace("http://", f"http://bench{index}:x@"), verify=str(ca), trust_env=False, timeout=600) as client:
            await one(client, "openai_chat")

    await asyncio.gather(*(session(i) for i in range(sessions)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="streamed requests per dialect (default 40)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--delay-ms", type=int, default=3000, help="the stand-in engine's answer time (default 3000)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long the slow engine holds the 64 streams (default 20)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        work = Path(tmp)
        ca = work / "confdir" / "mitmproxy-ca-cert.pem"
        services: list[Service] = []
        try:
            engine_port = free_port()
            services.append(engine(engine_port, args.delay_ms, work))
            services.append(fast := gateway(engine_port, work, 1.0))
            print(f"time to first byte, engine answering after {args.delay_ms} ms, keepalive every 1 s, {args.requests} requests per dialect, {args.concurrency} at a time")
            print("| dialect | headers p50 / p99 | first body bytes p50 / p99 |\n|---|---|---|")
            for dialect in REQUESTS:
                timings = asyncio.run(first_bytes(f"http://127.0.0.1:{fast.port}", ca, dialect, args.requests, args.concurrency))
                heads, bodies = [t[0] * 1000 for t in timings], [t[1] * 1000 for t in timings]
                print(f"| {dialect} | {percentile(heads, 50):.0f} / {percentile(heads, 99):.0f} ms | {percentile(bodies, 50):.0f} / {percentile(bodies, 99):.0f} ms |")
            for service in services:
                service.stop()

            # the keepalive cost: the same held streams, with a keepalive every second and with none
            services.append(engine(engine_port, int(args.hold_s * 1000), work))
            cpu: dict[float, float] = {}
            for interval in (1.0, 0.0):
                services.append(held := gateway(engine_port, work, interval))
                proxy = f"http://127.0.0.1:{held.port}"
                asyncio.run(first_bytes(proxy, ca, "openai_chat", 1, 1))  # warm: certificate, engine discovery
                before = held.cpu_s()
                asyncio.run(hold_open(proxy, ca, args.sessions))
                cpu[interval] = held.cpu_s() - before
                held.stop()
            keepalives = args.sessions * int(args.hold_s)  # one per second per held stream
            per_event = (cpu[1.0] - cpu[0.0]) / keepalives
            print(f"\nkeepalive cost: {args.sessions} streams held {args.hold_s:g} s: gateway CPU {cpu[1.0]:.2f} s with a keepalive every second, {cpu[0.0]:.2f} s without")
            print(f"  {per_event * 1e6:.0f} us CPU per keepalive event; at the default 5 s interval, {args.sessions} waiting streams cost {per_event * args.sessions / 5 * 100:.2f}% of one core")
            print(json.dumps({"cpu_s": cpu, "keepalives": keepalives, "us_per_keepalive": per_event * 1e6}))
        finally:
            for service in services:
                service.stop()


if __name__ == "__main__":
    main()
