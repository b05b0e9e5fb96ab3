"""The load client: a small asyncio HTTP/1.1 client with one keep-alive connection per simulated session (~50 us of
CPU per exchange; httpx at concurrency 32 spent ~1.9 ms of CPU per exchange here and would have been the
bottleneck). A `Target` says how one configuration is reached (plain HTTP, TLS, or CONNECT + TLS to the provider's
host as a harness does through HTTPS_PROXY); a `Pool` runs sessions against it, counting every bad reply as an error."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

from bench.common import REPLY_MARKER


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

