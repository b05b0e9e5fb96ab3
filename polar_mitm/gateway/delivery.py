"""Whether a reply reached its client: what the client's socket says, asked of the kernel, not of the event loop.

A reply is committed before it is written (commit-before-reply), so the row is decided before anyone knows
whether the client will read it. mitmproxy learns that its client closed only when its event loop gets to the
connection's read, and it queues the close while our request hook runs; under load that came up to 1.8 s late,
after the engine's answer (issue 28: 4 of 19 abandoned calls stored `ok`). The kernel knows at once, so the
addon asks it (`poll()` on the client's socket, nothing read):

    FIN (POLLRDHUP)        the client closed its side: an HTTP client that closes does not read what comes next
    reset (POLLERR, or the reader's ConnectionResetError)
                           the client's kernel refused bytes: our reply came after its close, or sat unread

When it asks: while the engine works and when the reply is ready (`Deliveries.gone`, with mitmproxy's view):
FIN or reset -> the call is cancelled, or its row committed `client_disconnected` at once. Then, for a reply
committed `ok` (`Deliveries.committed`, then `response`):

    after the commit             FIN or reset -> marked
    JSON reply, as mitmproxy is about to write it (response hook): FIN or reset -> marked; then, on HTTP/1, a reset
                                 before the client's next request on that connection (mitmproxy's client_disconnected
                                 hook): nothing else comes down an HTTP/1 connection until then, so its kernel reset
                                 our reply's unread bytes, however late its loop got to close (a client starved
                                 beside busy cores closed 40-130 ms after the commit, 2026-12-07). HTTP/2's streams
                                 share their connection: there a reset counts only within SETTLE_S of the write.
    stream, its last events written (response hook, before the stream's final chunk): a reset -> marked; a FIN
                                 alone: asked again SETTLE_S later, a reset then -> marked (a client that closed
                                 after reading everything leaves a FIN only)
    mitmproxy ended the flow (error hook: the client left a stream before its end)  -> marked

"Marked": the row gets a mark (Store.commit_mark, schema.MARKS_TABLE) with status `client_disconnected` and the
reason; the `exchanges` view shows the mark instead of the committed status, so the reply is never trained on.
What no kernel can say: a client that read the bytes into its own buffers and then gave up on them anyway (a
timer that fired in the same instant); that reply was delivered, as far as TCP goes. Nor a streamed client that
closes a few ms after the last events reached it (the line still open when they were written), not having read
them: its reset looks just like that of a client that read them and left the final chunk unread, which is kept
`ok`; telling them apart would mean holding every stream's final chunk back (tests/integration/test_client_received.py:
0 to 2 of its ~135 abandoned calls a run, each one whose client held the reply's last events unread when it closed).

Only plain TCP client connections have a socket to ask (regular and transparent proxy modes); mitmproxy's own
replays and its Rust-side modes (WireGuard, local) fall back to mitmproxy's view (`flows.client_gone`).
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from mitmproxy import ctx, http

from polar_mitm.gateway import flows

log = logging.getLogger("polar_mitm.gateway")

# how long after a reply's last bytes went out a reset answering them is waited for (loopback and a local network
# answer within a millisecond; a client that closed after reading everything never resets)
SETTLE_S = 0.05
# how long a JSON reply's bytes may take to leave (mitmproxy writes them once the response hook returns)
WRITE_WAIT_S = 5.0
STATUS = "client_disconnected"

LineState = Literal["open", "closed", "reset"]
POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux's "the peer sent its FIN"; elsewhere only resets are seen


class _Reader(Protocol):
    def exception(self) -> BaseException | None: ...

    def at_eof(self) -> bool: ...


class _Socket(Protocol):
    def fileno(self) -> int: ...  # -1 once closed


@dataclass
class ClientLine:
    """The client end of one connection, as the kernel sees it. Holds mitmproxy's reader of the connection, which
    keeps the reset it read after mitmproxy has closed the socket."""

    sock: _Socket
    reader: _Reader | None

    def state(self) -> LineState:
        reader_error = self.reader.exception() if self.reader is not None else None
        if isinstance(reader_error, OSError):
            return "reset"
        fd = self.sock.fileno()
        if fd < 0:
            return "closed"  # mitmproxy closed it: after the client's FIN (a reset would be the reader's error)
        poller = select.poll()
        poller.register(fd, POLLRDHUP | select.POLLERR | select.POLLHUP)
        events = poller.poll(0)
        mask = events[0][1] if events else 0
        if mask & select.POLLERR:
            return "reset"
        if mask & (POLLRDHUP | select.POLLHUP):
            return "closed"
        return "open"


def client_line(flow: http.HTTPFlow) -> ClientLine | None:
    """The flow's client connection (mitmproxy's proxyserver holds it by the client's id), or None where it has no
    kernel socket (a replay, WireGuard or local mode, a connection already gone)."""
    proxyserver = ctx.master.addons.get("proxyserver") if not flow.is_replay else None
    handler = getattr(proxyserver, "connections", {}).get(flow.client_conn.id)
    io = handler.transports.get(flow.client_conn) if handler is not None else None
    if io is None or io.writer is None:
        return None
    sock = io.writer.get_extra_info("socket")
    if sock is None or getattr(sock, "type", None) != socket.SOCK_STREAM:
        return None
    reader = io.reader if isinstance(io.reader, asyncio.StreamReader) else None
    return ClientLine(sock, reader)


WHY = {"closed": "the client had closed its connection", "reset": "the client's connection was reset"}


@dataclass
class _Pending:
    exchange_id: str
    line: ClientLine | None
    streamed: bool


class Deliveries:
    """The addon's replies committed `ok` whose delivery is not settled yet, by flow; marks the undelivered.

    `mark(exchange_id, status, error)` commits a mark (Store.commit_mark). Each mark is its own task, so a reply
    never waits for one; `settled()` waits for those in flight (before the store closes)."""

    def __init__(self, mark: Callable[[str, str, str], Awaitable[None]]) -> None:
        self._mark = mark
        # by flow: an entry goes with its flow (an exchange that never commits, a gateway that stops)
        self._lines: weakref.WeakKeyDictionary[http.HTTPFlow, ClientLine | None] = weakref.WeakKeyDictionary()
        self._pending: weakref.WeakKeyDictionary[http.HTTPFlow, _Pending] = weakref.WeakKeyDictionary()
        # by client connection id: the JSON reply last written on an HTTP/1 connection, until the client asks again
        # (it read the reply) or leaves (a reset: it did not)
        self._unread: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def asked(self, client_id: str) -> None:
        """A request on this client connection: on HTTP/1 its client has read the reply before."""
        self._unread.pop(client_id, None)

    def left(self, client_id: str) -> None:
        """mitmproxy's client_disconnected hook: a reset there means the last reply written on it was never read."""
        pending = self._unread.pop(client_id, None)
        if pending is not None and (why := _reset(pending.line)):
            self._spawn(self._commit_mark(pending.exchange_id, f"the reply was committed ok but not delivered: {why} with the reply unread"))

    def opened(self, flow: http.HTTPFlow) -> None:
        """An exchange starts: find its client's socket now, while mitmproxy still holds the connection."""
        self._lines[flow] = client_line(flow)

    def gone(self, flow: http.HTTPFlow) -> str | None:
        """Why nobody will read this flow's reply (mitmproxy's view, then the kernel's), or None."""
        if why := flows.client_gone(flow):
            return why
        line = self._lines.get(flow)
        state = line.state() if line is not None else "open"
        return f"{WHY[state]} before the reply" if state != "open" else None

    def committed(self, flow: http.HTTPFlow, exchange_id: str, status: str, streamed: bool) -> None:
        """The exchange's row is committed; a reply committed `ok` is watched until it is written."""
        line = self._lines.pop(flow, None)
        if status != "ok":
            return
        self._pending[flow] = _Pending(exchange_id, line, streamed)
        if why := flows.client_gone(flow) or _kernel_says(line):
            self._settle(flow, f"{why}, after the row was committed")

    async def response(self, flow: http.HTTPFlow) -> None:
        """mitmproxy's response hook: a JSON reply is about to be written; a stream's last events were (its final
        chunk goes after this hook)."""
        pending = self._pending.get(flow)
        if pending is None:
            return
        if not pending.streamed:
            if why := flows.client_gone(flow) or _kernel_says(pending.line):
                self._settle(flow, f"{why} as the reply was written")
            elif pending.line is not None and flow.request.http_version.startswith("HTTP/1"):
                self._unread[flow.client_conn.id] = self._pending.pop(flow)
            else:
                self._spawn(self._reset_after(flow, pending))
            return
        if pending.line is not None and pending.line.state() == "closed":
            # a FIN: after reading the last events (then no reset follows), or before they came (a reset does);
            # the final chunk waits, since a client that read everything resets what comes after its close
            await asyncio.sleep(SETTLE_S)
        # mitmproxy's view is no help here: a client that closed after reading the last events looks to it just like
        # one that closed before they came; only the kernel's reset tells them apart (and a flow mitmproxy ended)
        if why := _ended(flow) or _reset(pending.line):
            self._settle(flow, f"{why}: the reply's last events came after the client's close")
        else:
            self._pending.pop(flow, None)

    def error(self, flow: http.HTTPFlow) -> None:
        """mitmproxy ended the flow before its reply was all written (the client left a stream)."""
        self._lines.pop(flow, None)
        if flow in self._pending:
            self._settle(flow, f"{flows.client_gone(flow) or 'the flow was ended'} before the reply was all written")

    async def settled(self) -> None:
        """Wait for the marks in flight (and those the checks in flight make)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _reset_after(self, flow: http.HTTPFlow, pending: _Pending) -> None:
        """A JSON reply on HTTP/2: once mitmproxy has written it (the flow is no longer live) and SETTLE_S later, a
        reset means its bytes came after the client's close (or sat unread when it closed)."""
        deadline = time.monotonic() + WRITE_WAIT_S
        while flow.live and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(SETTLE_S)
        if self._pending.get(flow) is not pending:
            return
        if why := _reset(pending.line):
            self._settle(flow, f"{why}: the reply's bytes came after the client's close")
        else:
            self._pending.pop(flow, None)

    def _settle(self, flow: http.HTTPFlow, why: str) -> None:
        pending = self._pending.pop(flow, None)
        if pending is not None:
            self._spawn(self._commit_mark(pending.exchange_id, f"the reply was committed ok but not delivered: {why}"))

    async def _commit_mark(self, exchange_id: str, error: str) -> None:
        try:
            await self._mark(exchange_id, STATUS, error)
        except Exception as failure:  # noqa: BLE001 - the row stays as committed (the store says why it cannot write)
            log.warning(f"polar: could not mark exchange {exchange_id} {STATUS}: {failure}")

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _kernel_says(line: ClientLine | None) -> str | None:
    state = line.state() if line is not None else "open"
    return WHY[state] if state != "open" else None


def _ended(flow: http.HTTPFlow) -> str | None:
    return f"the flow was ended by the proxy: {flow.error.msg}" if flow.error is not None else None


def _reset(line: ClientLine | None) -> str | None:
    return WHY["reset"] if line is not None and line.state() == "reset" else None
