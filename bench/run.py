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
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "polar-mitm"
LITELLM_VENV = CACHE / "bench-litellm"
LITELLM_SPEC = "litellm[proxy]==1.108.7"
# LiteLLM refuses to start without a master key; a fresh one per run, checked on every request as in production
LITELLM_KEY = "sk-bench-" + os.urandom(16).hex()
ENGINE_URL = os.environ.get("POLAR_MITM_ENGINE_URL", "http://127.0.0.1:8011/v1").rstrip("/")
STUB_MODEL = "qwen3-tiny-stub"
CONFIGS = ("direct", "gateway", "mitmproxy", "litellm")
PROXIES = ("gateway", "mitmproxy", "litellm", "baseline")
# what the stub's fixed reply contains; a reply without it is counted as an error
REPLY_MARKER = b"run_shell_command"


@dataclass
class Plan:
    rounds: int
    requests: dict[int, int]  # concurrency -> requests per configuration per round
    batch_cap_s: float  # ...or fewer, when a configuration takes longer than this for them
    throughput_rounds: int
    throughput_seconds: float
    rss_seconds: float
    ingest_seconds: float
    engine_pairs: int


QUICK = Plan(rounds=3, requests={1: 8, 8: 24, 32: 64}, batch_cap_s=2.5, throughput_rounds=2, throughput_seconds=2.5, rss_seconds=2.0, ingest_seconds=6.0, engine_pairs=2)
FULL = Plan(rounds=8, requests={1: 50, 8: 48, 32: 128}, batch_cap_s=20.0, throughput_rounds=3, throughput_seconds=6.0, rss_seconds=5.0, ingest_seconds=20.0, engine_pairs=4)


# -- processes ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Service:
    name: str
    port: int
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    process: subprocess.Popen | None = None

    def start(self) -> Service:
        env = {**os.environ, **self.env}
        for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(key, None)
        self.process = subprocess.Popen(self.command, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.cwd)
        return self

    def wait(self, timeout: float, ready: Any = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            if listening(self.port) and (ready is None or ready()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not come up in {timeout:g}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def rss_mb(self) -> float:
        """Resident memory of the service and its children."""
        return sum(_rss_kb(pid) for pid in process_tree(self.process.pid)) / 1024 if self.process else 0.0

    def cpu_s(self) -> float:
        """CPU time (user + system, all threads) used so far by the service and its children."""
        return sum(_cpu_s(pid) for pid in process_tree(self.process.pid)) if self.process else 0.0


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ensure_litellm() -> Path:
    """LiteLLM lives in its own venv (cached), so the project's venv stays clean."""
    litellm = LITELLM_VENV / "bin" / "litellm"
    marker = LITELLM_VENV / "bench-spec.txt"
    if litellm.exists() and marker.exists() and marker.read_text().strip() == LITELLM_SPEC:
        return litellm
    print(f"installing {LITELLM_SPEC} into {LITELLM_VENV} (once; cached)...", flush=True)
    shutil.rmtree(LITELLM_VENV, ignore_errors=True)
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base_python, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_SPEC], check=True)
    marker.write_text(LITELLM_SPEC + "\n")
    return litellm


# -- the load client ---------------------------------------------------------------------------------------


@dataclass
class Target:
    """How one configuration is reached; `connect` gives a ready keep-alive connection for one session."""

    name: str
    port: int
    mode: str  # "plain" | "tls" (TLS straight to the listener) | "connect" (CONNECT, then TLS to the provider)
    ssl_context: ssl.SSLContext | None = None
    provider_paths: bool = False  # the request's own provider host and path (gateway) or /v1/chat/completions
    model: str | None = None  # overrides the body's model (direct calls to a real engine)
    max_tokens: int | None = None
    credentials: Any = None  # session index -> (user, token), for the gateway's proxy credentials
    api_key: str | None = None  # replaces the harness's Authorization (LiteLLM's master key)

    async def connect(self, host: str, session: int) -> Conn:
        limit = 1 << 24
        if self.mode == "plain":
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=limit)
        elif self.mode == "tls":
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=self.ssl_context, limit=limit)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=limit)
            user, token = self.credentials(session)
            auth = base64.b64encode(f"{user}:{token}".encode()).decode()
            writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                raise ConnectionError(f"CONNECT refused: {head[:200]!r}")
            await writer.start_tls(self.ssl_context, server_hostname=host)
        return Conn(reader, writer)

    def request(self, spec: dict[str, Any], stream: bool) -> tuple[str, bytes]:
        """(host to CONNECT to, the whole HTTP/1.1 request) for one harness request in this configuration."""
        body = dict(spec["body"])
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
        if self.model:
            body["model"] = self.model
            # a real engine gets only what the gateway would forward
            for key in ("metadata", "preserve_thinking", "prompt_cache_key"):
                body.pop(key, None)
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        host, path = (spec["host"], spec["path"]) if self.provider_paths else (f"127.0.0.1:{self.port}", "/v1/chat/completions")
        header_map = {**spec["headers"], **({"authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        headers = "".join(f"{name}: {value}\r\n" for name, value in header_map.items())
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{headers}content-length: {len(payload)}\r\n\r\n"
        return spec["host"], head.encode() + payload


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.closed = False
        self.last_used = time.monotonic()

    async def exchange(self, raw: bytes) -> tuple[int, bytes]:
        self.last_used = time.monotonic()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"\r\ntransfer-encoding: chunked" in lower:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append((await self.reader.readexactly(size + 2))[:-2])
            body = b"".join(parts)
        elif (start := lower.find(b"\r\ncontent-length:")) >= 0:
            body = await self.reader.readexactly(int(lower[start + 17 : lower.index(b"\r\n", start + 2)]))
        else:
            body = await self.reader.read()
            self.closed = True
        if b"\r\nconnection: close" in lower:
            self.closed = True
        self.last_used = time.monotonic()
        return status, body

    def close(self) -> None:
        self.writer.close()


def reply_ok(status: int, body: bytes, stream: bool, marker: bytes | None = REPLY_MARKER) -> bool:
    if status != 200 or (marker is not None and marker not in body):
        return False
    return not stream or body.rstrip().endswith(b"data: [DONE]")


# uvicorn (LiteLLM) closes keep-alive connections idle for 5 s; a client pool retires them sooner, as real ones do
IDLE_RECONNECT_S = 2.0


class Pool:
    """`size` concurrent sessions against one target, each on its own keep-alive connection."""

    def __init__(self, target: Target, specs: list[dict[str, Any]], size: int, stream: bool, session_base: int = 0, marker: bytes | None = REPLY_MARKER):
        self.target, self.stream, self.marker = target, stream, marker
        self.sessions = [session_base + i for i in range(size)]
        self.requests = [target.request(specs[i % len(specs)], stream) for i in range(size)]
        self.conns: list[Conn | None] = [None] * size
        self.errors: list[str] = []

    async def _ready(self, worker: int) -> None:
        """A live connection for this session, made outside the timed part (as a warm client pool has one)."""
        conn = self.conns[worker]
        if conn is not None and not conn.closed and time.monotonic() - conn.last_used < IDLE_RECONNECT_S:
            return
        if conn is not None:
            conn.close()
        self.conns[worker] = None
        try:
            self.conns[worker] = await self.target.connect(self.requests[worker][0], self.sessions[worker])
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as error:
            self.errors.append(f"connect: {type(error).__name__}: {error}")

    async def _send(self, worker: int) -> bool:
        host, raw = self.requests[worker]
        try:
            conn = self.conns[worker]
            if conn is None or conn.closed:
                conn = self.conns[worker] = await self.target.connect(host, self.sessions[worker])
            status, body = await conn.exchange(raw)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ssl.SSLError) as error:
            self.conns[worker] = None
            self.errors.append(f"{type(error).__name__}: {error}")
            return False
        if not reply_ok(status, body, self.stream, self.marker):
            self.errors.append(f"HTTP {status}: {body[:300]!r}")
            return False
        return True

    async def warm(self) -> None:
        await asyncio.gather(*(self._send(i) for i in range(len(self.sessions))))

    async def run_count(self, n: int, cap_s: float = float("inf")) -> list[float]:
        """n exchanges at this pool's concurrency (fewer if cap_s runs out); the latency (s) of each successful one."""
        latencies: list[float] = []
        started = 0
        give_up = time.perf_counter() + cap_s

        async def worker(index: int) -> None:
            nonlocal started
            while started < n and time.perf_counter() < give_up:
                started += 1
                await self._ready(index)
                t0 = time.perf_counter()
                if await self._send(index):
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(i) for i in range(len(self.sessions))))
        return latencies

    async def run_for(self, seconds: float) -> tuple[int, float]:
        """Closed loop for `seconds`: (successful exchanges, elapsed)."""
        done = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def worker(index: int) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await self._ready(index)
                if await self._send(index):
                    done += 1

        await asyncio.gather(*(worker(i) for i in range(len(self.sessions))))
        return done, time.perf_counter() - t0

    def close(self) -> None:
        for conn in self.conns:
            if conn is not None:
                conn.close()


async def sample_rss(service: Service, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], service.rss_mb())
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


# -- the measurements --------------------------------------------------------------------------------------


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


def measure_ingest(tmp: Path, plan: Plan, source: Path = ROOT) -> dict[str, Any]:
    """Store ingest with live SQL beside it; `source`: the polar_mitm source tree whose Store is measured."""
    db = tmp / f"ingest-{abs(hash(source))}.duckdb"
    env = {**os.environ, "BENCH_POLAR_SOURCE": str(source)}
    ingest = subprocess.Popen([sys.executable, __file__, "--ingest-worker", str(db), str(plan.ingest_seconds)], stdout=subprocess.PIPE, cwd=source, env=env)
    deadline = time.monotonic() + 60
    while not (Path(str(db) + ".control.json").exists() or time.monotonic() > deadline):
        time.sleep(0.1)
    probe = subprocess.run([sys.executable, __file__, "--sql-probe", str(db), str(plan.ingest_seconds - 1)], capture_output=True, check=True, cwd=source, env=env)
    out, _ = ingest.communicate(timeout=plan.ingest_seconds + 120)
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["sql"] = json.loads(probe.stdout.decode().strip().splitlines()[-1])
    print(f"  DuckDB ingest: {result['rate']:.0f} exchanges/s; live SQL p50 " + ", ".join(f"{q['p50'] * 1000:.0f} ms" for q in result["sql"].values()), flush=True)
    return result


def ingest_worker(db: str, seconds: float) -> None:
    """Commit exchanges with 4k-token arrays through Store, as the gateway does, 64 in flight."""
    sys.path.insert(0, os.environ.get("BENCH_POLAR_SOURCE", str(ROOT)))
    from polar_mitm.store import Store, now

    spec = load_requests()[0]
    rng = random.Random(1)
    tokens = 4096
    prompt_ids = [rng.randrange(151000) for _ in range(tokens)]
    completion_ids = [rng.randrange(151000) for _ in range(tokens)]
    logprobs = [round(-rng.random() * 3, 6) for _ in range(tokens)]
    engine_request = {**spec["body"], "model": STUB_MODEL, "stream": False, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
    engine_response = {
        "id": "chatcmpl-ingest",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 2000}, "finish_reason": "length", "token_ids": completion_ids,
                     "logprobs": {"content": [{"token": "tok", "logprob": lp, "bytes": [116, 111, 107], "top_logprobs": []} for lp in logprobs]}}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": tokens, "total_tokens": 2 * tokens},
        "prompt_token_ids": prompt_ids,
    }
    request_body = json.dumps(spec["body"])
    # the gateway records the engine request and reply as the texts that crossed the wire
    engine_request_text = json.dumps(engine_request, separators=(",", ":"))
    engine_response_text = json.dumps(engine_response, separators=(",", ":"))
    try:  # what the gateway hands the store: the engine's request and reply as WireJSON (text + parsed value)
        from polar_mitm.engines.base import WireJSON, _decode
        from polar_mitm.store import journal_records  # noqa: F401 - present since the journal store
    except ImportError:  # an older tree (--baseline): its gateway handed over the texts
        engine_request_wire, engine_response_wire = engine_request_text, engine_response_text
    else:
        engine_request_wire, engine_response_wire = WireJSON(engine_request, engine_request_text), _decode(engine_response_text)
        prompt_ids = engine_response_wire["prompt_token_ids"]
    store = Store(db)
    store.serve_sql(0)
    count = 0

    async def one_session(index: int, deadline: float) -> None:
        nonlocal count
        session_id = f"ingest-{index}"
        while time.perf_counter() < deadline:
            row = {
                "exchange_id": f"{index}-{count}-{rng.random()}", "session_id": session_id, "seq": store.next_seq(session_id), "api": "openai_chat",
                "action": "generate", "stream": False, "status": "ok", "http_status": 200, "model_requested": "qwen3-coder-plus", "model_engine": STUB_MODEL,
                "engine_kind": "vllm", "method": "POST", "host": "api.openai.com", "path": "/v1/chat/completions", "harness": "qwen",
                "request_headers": spec["headers"], "request_body": request_body, "engine_request": engine_request_wire, "engine_response": engine_response_wire,
                "response_body": {"choices": [{"message": {"content": "x" * 2000}}]}, "prompt_token_ids": prompt_ids, "completion_token_ids": completion_ids,
                "completion_logprobs": logprobs, "finish_reason": "length", "prompt_tokens": tokens, "completion_tokens": tokens,
                "started_at": now(), "engine_started_at": now(), "engine_ended_at": now(), "ended_at": now(),
            }
            await store.commit_exchange(row)
            count += 1

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_session(i, t0 + seconds) for i in range(64)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    store.close()
    # the DuckDB file and, since the journal store, its Parquet segments beside it
    size = Path(db).stat().st_size + sum(f.stat().st_size for f in Path(db + ".segments").glob("*") if f.is_file())
    print(json.dumps({"rate": count / elapsed, "exchanges": count, "group_commits": store.commits, "db_mb": size / 2**20, "tokens": tokens}))


SQL_PROBES = {
    "sessions overview": "SELECT session_id, count(*) AS n, sum(prompt_tokens + completion_tokens) AS tokens, max(ended_at) AS last FROM exchanges GROUP BY session_id ORDER BY n DESC LIMIT 10",
    "one trajectory's last 4 turns (token ids + logprobs)": "SELECT seq, completion_token_ids, completion_logprobs FROM exchanges WHERE session_id = 'ingest-7' ORDER BY seq DESC LIMIT 4",
}


def sql_probe(db: str, seconds: float) -> None:
    """From another process, the way a researcher watches a run: store.query through the gateway's endpoint."""
    sys.path.insert(0, os.environ.get("BENCH_POLAR_SOURCE", str(ROOT)))
    from polar_mitm import store

    latencies: dict[str, list[float]] = {name: [] for name in SQL_PROBES}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for name, sql in SQL_PROBES.items():
            t0 = time.perf_counter()
            store.query(db, sql)
            latencies[name].append(time.perf_counter() - t0)
        time.sleep(0.1)
    print(json.dumps({name: {"p50": percentile(v, 50), "p95": percentile(v, 95), "n": len(v)} for name, v in latencies.items()}))


# -- orchestration -----------------------------------------------------------------------------------------


def load_requests() -> list[dict[str, Any]]:
    specs = []
    for path in sorted((BENCH / "requests").glob("*.json"), key=lambda p: -p.stat().st_size):
        spec = json.loads(path.read_text())
        spec["file"] = path.name
        specs.append(spec)
    return specs


def engine_reachable() -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(ENGINE_URL + "/models", timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def start_services(services: dict[str, Service], tmp: Path, stub_delay_ms: float, with_litellm: bool, baseline: Path | None = None) -> None:
    """Start every service into `services` as it goes, so the caller stops them all even if one fails to come up."""
    python = sys.executable
    confdir = tmp / "confdir"
    stub_port, gateway_port, mitm_port, litellm_port = (free_port() for _ in range(4))
    stub_base = f"http://127.0.0.1:{stub_port}/v1"
    services.update({
        "stub": Service("stub", stub_port, [python, str(BENCH / "stub_upstream.py"), "--port", str(stub_port), "--delay-ms", str(stub_delay_ms)], tmp / "stub.log"),
        "gateway": Service(
            "gateway", gateway_port,
            [python, "-m", "polar_mitm.cli", "gateway", "--port", str(gateway_port), "--upstream", stub_base, "--db", str(tmp / "gateway.duckdb"),
             "--confdir", str(confdir), "--engine-model", STUB_MODEL, "--require-auth"],
            tmp / "gateway.log",
        ),
    })
    mitmdump = Path(python).parent / "mitmdump"
    services["mitmproxy"] = Service(
        "mitmproxy", mitm_port,
        [str(mitmdump) if mitmdump.exists() else "mitmdump", "--mode", f"reverse:http://127.0.0.1:{stub_port}@{mitm_port}", "--set", f"confdir={confdir}", "-q"],
        tmp / "mitmdump.log",
    )
    if with_litellm:
        services["litellm"] = Service(
            "litellm", litellm_port,
            [str(ensure_litellm()), "--config", str(BENCH / "litellm_config.yaml"), "--host", "127.0.0.1", "--port", str(litellm_port), "--num_workers", "1"],
            tmp / "litellm.log",
            env={"BENCH_UPSTREAM_BASE": stub_base, "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"},
        )
    services["stub"].start().wait(30)
    services["gateway"].start().wait(60, ready=lambda: (confdir / "mitmproxy-ca-cert.pem").exists() and (tmp / "gateway.duckdb.control.json").exists())
    if baseline is not None:
        # another polar_mitm source tree (e.g. `git archive` of an older commit), same venv: `-m` imports it from
        # its cwd
        port = free_port()
        command = [python, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", stub_base, "--db", str(tmp / "baseline.duckdb"),
                   "--confdir", str(confdir), "--engine-model", STUB_MODEL, "--require-auth"]
        services["baseline"] = Service("baseline", port, command, tmp / "baseline.log", cwd=baseline).start()
        services["baseline"].wait(60, ready=lambda: (tmp / "baseline.duckdb.control.json").exists())
    for name in ("mitmproxy", "litellm"):
        if name in services:
            services[name].start()
    services["mitmproxy"].wait(60)
    if "litellm" in services:
        services["litellm"].wait(180, ready=lambda: _http_ok(litellm_port, "/health/liveliness"))


def _stub_requests(port: int) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as response:
        return int(json.loads(response.read())["requests"])


def _http_ok(port: int, path: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def make_targets(services: dict[str, Service], tmp: Path) -> dict[str, Target]:
    sys.path.insert(0, str(ROOT))
    from polar_mitm import session

    ca = tmp / "confdir" / "mitmproxy-ca-cert.pem"
    context = ssl.create_default_context(cafile=str(ca))
    secret = session.load_secret(tmp / "confdir")

    def credentials(index: int) -> tuple[str, str]:
        user = f"bench-{index}"
        return user, session.session_token(secret, user)

    targets = {
        "direct": Target("direct", services["stub"].port, "plain"),
        "gateway": Target("gateway", services["gateway"].port, "connect", context, provider_paths=True, credentials=credentials),
        "mitmproxy": Target("mitmproxy", services["mitmproxy"].port, "tls", context),
    }
    if "litellm" in services:
        targets["litellm"] = Target("litellm", services["litellm"].port, "plain", api_key=LITELLM_KEY)
    if "baseline" in services:
        targets["baseline"] = Target("baseline", services["baseline"].port, "connect", context, provider_paths=True, credentials=credentials)
    if "engine-gateway" in services:
        engine_port = int(ENGINE_URL.split(":")[-1].split("/")[0])
        targets["engine-direct"] = Target("engine-direct", engine_port, "plain", model="qwen3-tiny", max_tokens=8)
        targets["engine-gateway"] = Target("engine-gateway", services["engine-gateway"].port, "connect", context, provider_paths=True, max_tokens=8, credentials=credentials)
    return targets


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
    parser.add_argument("--ingest-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--sql-probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ingest_worker:
        ingest_worker(args.ingest_worker[0], float(args.ingest_worker[1]))
        return 0
    if args.sql_probe:
        sql_probe(args.sql_probe[0], float(args.sql_probe[1]))
        return 0

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
        results["stub_requests"] = _stub_requests(services["stub"].port)
        for service in services.values():
            if service.process and service.process.poll() is not None:
                raise RuntimeError(f"{service.name} died during the run:\n{service.log.read_text()[-2000:]}")
    finally:
        for service in reversed(list(services.values())):
            service.stop()
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
    try:
        import polar_mitm  # noqa: F401
    except ModuleNotFoundError:
        # `python bench/run.py` from outside the project's venv: use it
        venv_python = ROOT / ".venv" / "bin" / "python"
        if venv_python.exists() and Path(sys.executable).resolve() != venv_python.resolve():
            os.execv(str(venv_python), [str(venv_python), *sys.argv])
        raise
    sys.exit(main())
