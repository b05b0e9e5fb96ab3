"""The soak's clients: one request of any of the four provider APIs through the gateway, as a harness sends it
(CONNECT to the provider's host with the session's proxy credentials, TLS with the gateway's CA: bench/client.py's
`Target`), with the client-side faults, and what the client got (`Sent`).

A request's text carries its id (`soakreq-...`, found again in the row's request_body) and, for the stand-in
engine, `fault=KIND` (bench/soak_engine.py). Client-side kinds:

    hangup_stream   a streamed request closed after its first body bytes, while the engine still works (slow)
    hangup          a non-streamed request closed before the engine's answer (slow engine; 0.2-1.2 s in)
    malformed       a body that is not JSON
    oversized       a ~600 KB prompt, past the engine's 65,536-token context
    no_auth         CONNECT without Proxy-Authorization (the gateway requires auth)
    wrong_auth      CONNECT with a token that is not the session's
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import ssl
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench.client import Conn, Target
from tests.support.dialect_samples import REQUESTS

APIS = ("openai_chat", "openai_responses", "anthropic_messages", "gemini")
HOSTS = {"openai_chat": "api.openai.com", "openai_responses": "api.openai.com", "anthropic_messages": "api.anthropic.com", "gemini": "generativelanguage.googleapis.com"}
API_KEYS = {
    "openai_chat": ("authorization", "Bearer sk-soak-not-a-key"), "openai_responses": ("authorization", "Bearer sk-soak-not-a-key"),
    "anthropic_messages": ("x-api-key", "sk-ant-soak-not-a-key"), "gemini": ("x-goog-api-key", "AIza-soak-not-a-key"),
}
# what a complete successful reply holds: the stand-in's text (JSON) or the API's last success event (a stream)
REPLY_TEXT = b"repository layout"
STREAM_DONE = {"openai_chat": b"data: [DONE]", "openai_responses": b"event: response.completed", "anthropic_messages": b"event: message_stop", "gemini": b'"finishReason"'}
STREAM_ERROR = {"openai_chat": b'data: {"error"', "openai_responses": b"event: response.failed", "anthropic_messages": b"event: error", "gemini": b'data: {"error"'}

ENGINE_FAULTS = ("engine_5xx", "reset", "garbage", "truncated", "hang")
CLIENT_FAULTS = ("hangup_stream", "hangup", "malformed", "oversized", "no_auth", "wrong_auth")
# faults after which the client must never hold a complete successful reply, nor the store an ok row
MUST_FAIL = (*ENGINE_FAULTS, "malformed", "no_auth", "wrong_auth")
HANGUPS = ("hangup_stream", "hangup")
# how often each fault is planned, per request (the rest: none)
FAULT_WEIGHTS = {
    "engine_5xx": 0.03, "reset": 0.03, "garbage": 0.03, "truncated": 0.03, "hang": 0.015,
    "hangup_stream": 0.03, "hangup": 0.03, "malformed": 0.02, "oversized": 0.005, "no_auth": 0.01, "wrong_auth": 0.01,
}
REPLY_TIMEOUT_S = 30.0


@dataclass
class Sent:
    """One request and what its client got."""

    rid: str
    phase: str
    session: str
    api: str
    stream: bool
    fault: str | None
    status: int | None = None
    exchange_id: str | None = None
    success: bool = False  # a complete successful reply was read
    error: str | None = None  # why not, as a class ("HTTP 502 engine_error", "ConnectionResetError", ...)
    seconds: float = 0.0
    generation: int = 0  # how many times the gateway had been restarted when the reply came
    across_kill: bool = False  # in flight when the gateway was SIGKILLed (or sent while it was down)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_fault(rng: random.Random) -> str | None:
    draw = rng.random()
    for kind, weight in FAULT_WEIGHTS.items():
        if draw < weight:
            return kind
        draw -= weight
    return None


def build_request(api: str, stream: bool, rid: str, fault: str | None) -> tuple[str, bytes]:
    """(host, the whole HTTP/1.1 request) for one request of `api`."""
    path, query, sample = REQUESTS[api]
    body = json.loads(json.dumps(sample))
    tag = f"Soak request {rid}. fault={fault or 'none'}"
    if fault in ("slow", "hangup", "hangup_stream"):
        tag = f"Soak request {rid}. fault=slow"
    text = ("lorem ipsum dolor sit amet " * 22_000 + tag) if fault == "oversized" else f"List the files. {tag}"
    if api == "openai_chat":
        body["messages"][-1]["content"] = text
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    elif api == "openai_responses":
        body["input"], body["stream"] = text, stream
    elif api == "anthropic_messages":
        body["messages"][-1]["content"] = text
        body["stream"], body["max_tokens"] = stream, 2048
    else:
        body["contents"][-1]["parts"][0]["text"] = text
        path = path.replace(":streamGenerateContent", ":streamGenerateContent" if stream else ":generateContent")
        query = {"alt": "sse"} if stream else {}
    payload = json.dumps(body).encode()
    if fault == "malformed":  # the id first, so the row's request_body still names the request
        payload = json.dumps({"soak": tag}).encode()[:-1] + b', "messages": [{"role": "user", \x00 not json'
    target = path + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
    key_header, key = API_KEYS[api]
    host = HOSTS[api]
    head = (
        f"POST {target} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\nuser-agent: polar-soak/1\r\n"
        f"{key_header}: {key}\r\nanthropic-version: 2023-06-01\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    return host, head.encode() + payload


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ", 2)[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], first_chunk_only: bool = False) -> tuple[bytes, bool]:
    """The body (or, with `first_chunk_only`, its first piece) and whether the connection may carry another request."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return b"".join(parts), headers.get("connection", "").lower() != "close"
            parts.append((await reader.readexactly(size + 2))[:-2])
            if first_chunk_only:
                return b"".join(parts), False
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
        return body, headers.get("connection", "").lower() != "close"
    if first_chunk_only:
        return await reader.read(4096), False
    return await reader.read(), False


def complete_success(api: str, stream: bool, status: int, body: bytes) -> bool:
    if status != 200:
        return False
    if stream:
        return STREAM_DONE[api] in body and STREAM_ERROR[api] not in body
    return REPLY_TEXT in body


def error_class(status: int, body: bytes) -> str:
    """`HTTP <status> <the provider error type>`, or the in-stream error type, for a reply that is not a success."""
    kind = ""
    text = body[-4000:] if status == 200 else body[:4000]
    for line in reversed(text.splitlines()):
        line = line.removeprefix(b"data: ").strip()
        if line.startswith(b"{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            error = value.get("error") or (value.get("response") or {}).get("error") if isinstance(value, dict) else None
            if isinstance(error, dict):
                kind = str(error.get("type") or error.get("status") or error.get("code") or "")
                break
    if status == 200:
        return f"in-stream error {kind or 'unfinished stream'}"
    return f"HTTP {status} {kind}".rstrip()


class Session:
    """One simulated harness session: its own keep-alive tunnel to its API's host, requests one at a time."""

    def __init__(self, target: Target, index: int, session_id: str, phase: str, api: str, rng: random.Random, bad_target: Target):
        self.target, self.bad_target = target, bad_target
        self.index, self.session_id, self.phase, self.api, self.rng = index, session_id, phase, api, rng
        self.conn: Conn | None = None
        self.count = 0

    def next_request(self) -> Sent:
        self.count += 1
        fault = plan_fault(self.rng)
        stream = fault == "hangup_stream" or (fault != "hangup" and self.rng.random() < 0.5)
        return Sent(f"soakreq-{self.phase}-{self.index:03d}-{self.count:05d}", self.phase, self.session_id, self.api, stream, fault)

    async def send(self, sent: Sent) -> Sent:
        host, raw = build_request(self.api, sent.stream, sent.rid, sent.fault)
        started = time.perf_counter()
        try:
            if sent.fault in ("no_auth", "wrong_auth"):
                await self._refused_connect(host, raw, sent)
            else:
                await asyncio.wait_for(self._exchange(host, raw, sent), REPLY_TIMEOUT_S)
        except TimeoutError:
            sent.error = "client timeout"
            self._drop()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ssl.SSLError) as error:
            sent.error = type(error).__name__
            self._drop()
        sent.seconds = time.perf_counter() - started
        return sent

    async def _exchange(self, host: str, raw: bytes, sent: Sent) -> None:
        if self.conn is None or self.conn.closed:
            self.conn = await self.target.connect(host, self.index)
        conn = self.conn
        conn.writer.write(raw)
        if sent.fault == "hangup":
            # gone before the engine's answer (it takes --slow-s): nobody will read this reply
            await asyncio.sleep(self.rng.uniform(0.2, 1.2))
            sent.error = "hung up (planned)"
            self._drop()
            return
        status, headers = await read_head(conn.reader)
        sent.status, sent.exchange_id = status, headers.get("x-polar-exchange-id")
        if sent.fault == "hangup_stream":
            first, _ = await read_body(conn.reader, headers, first_chunk_only=True)
            self._drop()
            # the first piece may already be the whole reply (a stream that opens with nothing and had no
            # keepalive yet): then the client did read it, and it counts as such
            sent.success = complete_success(self.api, sent.stream, status, first)
            sent.error = None if sent.success else "hung up mid-stream (planned)"
            return
        body, reusable = await read_body(conn.reader, headers)
        if not reusable:
            self._drop()
        sent.success = complete_success(self.api, sent.stream, status, body)
        if not sent.success:
            sent.error = error_class(status, body)

    async def _refused_connect(self, host: str, raw: bytes, sent: Sent) -> None:
        """A one-off tunnel with missing or wrong proxy credentials (the session's own tunnel is left alone)."""
        if sent.fault == "wrong_auth":
            try:
                conn = await self.bad_target.connect(host, self.index)
            except ConnectionError as error:  # Target.connect: "CONNECT refused: b'HTTP/1.1 407 ...'"
                if not str(error).startswith("CONNECT refused"):
                    raise
                said = re.search(r"HTTP/1\.[01] (\d{3})", str(error))
                sent.status = int(said.group(1)) if said else None
                sent.error = f"CONNECT {sent.status}"
                return
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.target.port)
            writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
            status, _ = await read_head(reader)
            writer.close()
            sent.status, sent.error = status, f"CONNECT {status}"
            return
        # credentials accepted: the gateway did not require auth
        conn.writer.write(raw)
        status, headers = await read_head(conn.reader)
        body, _ = await read_body(conn.reader, headers)
        conn.close()
        sent.status, sent.exchange_id = status, headers.get("x-polar-exchange-id")
        sent.success = complete_success(self.api, sent.stream, status, body)

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.writer.transport.abort()
        self.conn = None


def wrong_credentials(session_id: str) -> tuple[str, str]:
    return session_id, base64.b64encode(b"not-this-sessions-token").decode()

