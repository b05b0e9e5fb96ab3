"""What a client's socket says about a reply (gateway/delivery.py), on real loopback TCP connections: the kernel's
FIN and reset as ClientLine reads them, and the marks Deliveries commits for replies committed `ok` that their
client could not have read. The flows are mitmproxy's test flows; the line is the accepted end of a real socket
pair, as mitmproxy's proxyserver would hold it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from mitmproxy import flow as mflow
from mitmproxy import http
from mitmproxy.test import tflow

from polar_mitm.gateway import delivery
from polar_mitm.gateway.delivery import ClientLine, Deliveries


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(client, gateway side) of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    yield client, served
    client.close()
    served.close()


def settled_state(line: ClientLine, want: str, within: float = 2.0) -> str:
    """The line's state once it is `want`, or what it is after `within` seconds (the kernel is quick, not instant)."""
    deadline = time.monotonic() + within
    while (state := line.state()) != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return state


def test_a_line_is_open_until_its_client_closes_and_reset_once_the_close_refused_bytes(connection) -> None:
    client, served = connection
    line = ClientLine(served, None)
    assert line.state() == "open"
    client.sendall(b"a request nobody has read yet")
    assert line.state() == "open"  # data waiting is not a close
    client.close()
    assert settled_state(line, "closed") == "closed"  # the FIN, behind the unread data
    served.sendall(b"a reply that comes too late")
    assert settled_state(line, "reset") == "reset"  # the closed client's kernel refused it
    served.close()
    assert line.state() == "closed"  # closed on our side: no socket left to ask


def test_a_client_that_read_everything_and_closed_leaves_a_fin_and_never_a_reset(connection) -> None:
    client, served = connection
    line = ClientLine(served, None)
    served.sendall(b"the whole reply")
    assert client.recv(100) == b"the whole reply"
    client.close()
    assert settled_state(line, "closed") == "closed"
    time.sleep(delivery.SETTLE_S * 2)
    assert line.state() == "closed"


def test_a_client_that_closes_with_the_reply_unread_resets(connection) -> None:
    client, served = connection
    line = ClientLine(served, None)
    served.sendall(b"a reply the client never reads")
    time.sleep(0.05)
    client.close()  # unread bytes in its receive queue: its kernel answers with a reset, not a FIN
    assert settled_state(line, "reset") == "reset"


class Marks:
    def __init__(self) -> None:
        self.made: list[tuple[str, str, str]] = []

    async def __call__(self, exchange_id: str, status: str, error: str) -> None:
        self.made.append((exchange_id, status, error))


def watched(monkeypatch: pytest.MonkeyPatch, served: socket.socket) -> tuple[Deliveries, Marks, http.HTTPFlow]:
    marks = Marks()
    deliveries = Deliveries(marks)
    monkeypatch.setattr(delivery, "client_line", lambda flow: ClientLine(served, None))
    flow = tflow.tflow()
    deliveries.opened(flow)
    return deliveries, marks, flow


async def json_reply_written(deliveries: Deliveries, flow: http.HTTPFlow, served: socket.socket, exchange_id: str) -> None:
    """An HTTP/1 JSON reply committed ok, its client still there as mitmproxy writes it, and now in its kernel."""
    deliveries.committed(flow, exchange_id, "ok", streamed=False)
    await deliveries.response(flow)
    served.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
    flow.live = False


def test_a_json_reply_whose_client_closed_after_the_commit_is_marked(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        deliveries.committed(flow, "x1", "ok", streamed=False)
        client.close()
        await asyncio.sleep(0.05)
        await deliveries.response(flow)  # about to be written: the FIN is there already
        await deliveries.settled()
        return marks.made

    [(exchange_id, status, error)] = asyncio.run(run())
    assert (exchange_id, status) == ("x1", "client_disconnected") and "had closed its connection as the reply was written" in error


def test_an_http2_json_reply_written_just_after_its_client_closed_is_marked_by_the_reset(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        flow.request.http_version = "HTTP/2.0"  # streams share the connection: only a reset within SETTLE_S counts
        deliveries.committed(flow, "x2", "ok", streamed=False)
        await deliveries.response(flow)  # the client is still there
        client.close()  # and leaves as mitmproxy writes
        served.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        flow.live = False  # written
        await deliveries.settled()
        return marks.made

    [(exchange_id, status, error)] = asyncio.run(run())
    assert (exchange_id, status) == ("x2", "client_disconnected") and "reset" in error


def test_a_json_reply_its_client_left_unread_is_marked_however_late_it_closes(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    """A client whose event loop is starved closes long after the reply reached its kernel (its timer fired first):
    on HTTP/1 its reset, whenever it comes before another request, says the reply was never read."""
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        await json_reply_written(deliveries, flow, served, "x4")
        await asyncio.sleep(delivery.SETTLE_S * 6)
        client.close()  # unread: a reset
        assert await asyncio.to_thread(settled_state, ClientLine(served, None), "reset") == "reset"
        deliveries.left(flow.client_conn.id)  # mitmproxy's client_disconnected
        await deliveries.settled()
        return marks.made

    [(exchange_id, status, error)] = asyncio.run(run())
    assert (exchange_id, status) == ("x4", "client_disconnected") and "reset with the reply unread" in error


def test_a_json_reply_is_read_once_its_client_asks_again_whatever_becomes_of_the_next_call(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        await json_reply_written(deliveries, flow, served, "x5")
        await asyncio.to_thread(client.recv, 100)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # the next call on the same connection
        deliveries.asked(flow.client_conn.id)  # mitmproxy's requestheaders
        served.sendall(b"HTTP/1.1 200 OK\r\n")  # whose reply the client abandons
        await asyncio.sleep(0.05)
        client.close()
        assert await asyncio.to_thread(settled_state, ClientLine(served, None), "reset") == "reset"
        deliveries.left(flow.client_conn.id)
        await deliveries.settled()
        return marks.made

    assert asyncio.run(run()) == []


def test_a_json_reply_its_client_read_is_not_marked(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        await json_reply_written(deliveries, flow, served, "x3")
        await asyncio.to_thread(client.recv, 100)
        client.close()  # a one-shot client: reads its reply, hangs up
        assert await asyncio.to_thread(settled_state, ClientLine(served, None), "closed") == "closed"
        await asyncio.sleep(delivery.SETTLE_S * 2)  # a FIN, and no reset after it
        deliveries.left(flow.client_conn.id)
        await deliveries.settled()
        return marks.made

    assert asyncio.run(run()) == []


def test_a_stream_whose_client_read_its_last_events_and_closed_is_not_marked(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        deliveries.committed(flow, "s1", "ok", streamed=True)
        served.sendall(b"data: [DONE]\n\n")
        await asyncio.to_thread(client.recv, 100)
        client.close()  # before the stream's final chunk: a FIN, and no reset while the final chunk waits
        await asyncio.sleep(0.05)
        await deliveries.response(flow)
        served.sendall(b"0\r\n\r\n")  # the final chunk, which this client resets
        await deliveries.settled()
        return marks.made

    assert asyncio.run(run()) == []


def test_a_stream_whose_client_hung_up_before_its_last_events_is_marked(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        deliveries.committed(flow, "s2", "ok", streamed=True)  # the client is there at the commit
        client.close()
        served.sendall(b"data: {\"last\": true}\n\ndata: [DONE]\n\n")  # the last events, after its close
        await asyncio.sleep(0.05)
        await deliveries.response(flow)
        await deliveries.settled()
        return marks.made

    [(exchange_id, status, error)] = asyncio.run(run())
    assert (exchange_id, status) == ("s2", "client_disconnected") and "last events came after the client's close" in error


def test_a_stream_mitmproxy_ended_is_marked_and_a_failed_exchange_never_is(monkeypatch: pytest.MonkeyPatch, connection) -> None:
    client, served = connection

    async def run() -> list:
        deliveries, marks, flow = watched(monkeypatch, served)
        deliveries.committed(flow, "s3", "ok", streamed=True)
        flow.error = mflow.Error("Client disconnected.")
        deliveries.error(flow)
        failed = tflow.tflow()
        deliveries.opened(failed)
        deliveries.committed(failed, "f1", "engine_error", streamed=False)
        client.close()
        await asyncio.sleep(0.05)
        await deliveries.response(failed)
        await deliveries.settled()
        return marks.made

    [(exchange_id, status, error)] = asyncio.run(run())
    assert (exchange_id, status) == ("s3", "client_disconnected") and "Client disconnected." in error
