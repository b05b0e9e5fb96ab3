"""Streamed replies that start at once: status line, headers and the provider's opening events go out as soon as the
request is parsed, then the provider's own keepalive events while the reply is pending, then the reply's events
(or an error in the provider's in-stream grammar).

Why a loopback server: mitmproxy streams only what a *server* sends (`flow.response.stream`, set in the
`responseheaders` hook); a response an addon sets in the `request` hook goes out in one piece when the hook returns.
So `LoopbackStreams.route` points a streamed exchange's flow at a small HTTP/1.1 server running in the gateway's own
event loop, and that server writes the reply's chunks as they are produced. mitmproxy relays them to the client in
the protocol the client speaks (HTTP/1.1 chunked, HTTP/2 DATA frames). The provider hostname is never contacted;
the flow's original request (scheme, host, port, path, body) is put back as soon as the reply's headers are in, so
mitmweb, flow files and replays show what the client sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

from mitmproxy import http

ROUTE_PREFIX = "/polar-mitm/stream/"
ROUTED = "polar_stream_route"  # flow.metadata key: the request as the client sent it, while routed


class StreamedReply:
    """One streamed reply: `opening` at once, `keepalive()` every `interval` seconds, then the rest via `finish`.

    Keepalives run on their own timer for as long as the reply is not finished, whatever the exchange awaits
    meanwhile (the engine call, a paused gateway, a queue): that is the whole hook point. `interval` 0: none.
    `hold()` stops them and returns what was produced so far; the exchange calls it before rendering the rest, so a
    grammar that numbers its events (Responses) continues from the last keepalive.
    """

    def __init__(self, headers: dict[str, str], opening: bytes, keepalive: Callable[[], bytes], interval: float) -> None:
        self.headers = headers
        self.keepalives = 0
        self._keepalive = keepalive
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._produced: list[bytes] = []
        self._emit(opening)
        self._ticker = asyncio.get_running_loop().create_task(self._tick(interval)) if interval > 0 else None

    def _emit(self, data: bytes) -> None:
        self._produced.append(data)
        self._queue.put_nowait(data)

    async def _tick(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._emit(self._keepalive())
            self.keepalives += 1

    def hold(self) -> bytes:
        """Stop the keepalives; everything produced so far (opening and keepalives), in order."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        return b"".join(self._produced)

    def finish(self, rest: bytes) -> None:
        """The last bytes of the reply (its events, or an in-stream error); the stream ends after them."""
        self.hold()
        self._emit(rest)
        self._queue.put_nowait(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk


class LoopbackStreams:
    """The loopback HTTP/1.1 server that writes routed replies; one per gateway, on 127.0.0.1 and a free port."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pending: dict[str, StreamedReply] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def route(self, flow: http.HTTPFlow, reply: StreamedReply) -> None:
        """Send this flow's request to the loopback server, which answers with `reply` as it is produced."""
        token = uuid.uuid4().hex
        self._pending[token] = reply
        flow.metadata[ROUTED] = (token, flow.request.copy())
        request = flow.request
        request.scheme, request.host, request.port = "http", "127.0.0.1", self.port
        request.path = ROUTE_PREFIX + token
        request.content = b""  # the gateway has parsed it already; the loopback server needs only the route

    def restore(self, flow: http.HTTPFlow) -> bool:
        """Put back the request the client sent (and drop a route never taken); True if the flow was routed here."""
        routed = flow.metadata.pop(ROUTED, None)
        if routed is None:
            return False
        token, flow.request = routed
        self._pending.pop(token, None)
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # mitmproxy keeps the connection for the client connection's next routed request: serve until it closes
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target, length = _request_target(head)
                if length:
                    await reader.readexactly(length)
                reply = self._pending.pop(target.removeprefix(ROUTE_PREFIX), None) if target.startswith(ROUTE_PREFIX) else None
                if reply is None:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                await _write_reply(writer, reply)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass  # the proxy closed the connection (its client left), or sent what no route looks like
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _request_target(head: bytes) -> tuple[str, int]:
    lines = head.decode("latin-1").split("\r\n")
    target = lines[0].split(" ")[1]
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return target, length


async def _write_reply(writer: asyncio.StreamWriter, reply: StreamedReply) -> None:
    head = "".join(f"{name}: {value}\r\n" for name, value in reply.headers.items())
    writer.write(f"HTTP/1.1 200 OK\r\n{head}transfer-encoding: chunked\r\n\r\n".encode("latin-1"))
    async for chunk in reply.chunks():
        if chunk:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
