"""The gateway's store in a process of its own (`--store-process`): the DuckDB writer and compactor off the proxy's.

In the gateway's process the store's writer and compactor threads compete with mitmproxy's event loop for one GIL:
DuckDB's Python client takes it back several times per statement, so a journal INSERT that costs 2.0 ms of CPU
alone cost 4.1-4.6 ms beside one busy Python thread (bench/README.md, "What the store costs"), and DuckDB's buffer
pool and a compaction's transient memory sat in the proxy's RSS. Here the gateway keeps a `StoreProcess` (an
`ExchangeStore`, as `Store` is) and a child process runs the real `Store`; they talk over one socketpair.

Contract, the same as `Store`'s: `commit_exchange` returns only once the child has committed the row (its group
commit acknowledged it), so commit-before-reply holds. The gateway sends each row pickled, its engine texts as the
text they crossed the wire as (WireJSON.texts: not the parsed reply, which the store never reads); seqs are issued
in the gateway's memory from the child's at start. Reads (`query`, `arrow`, `snapshot`), `execute_write` and
`serve_sql` are calls answered by the child (the SQL endpoint other processes read is the child's).

Lifetimes: the child ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a `killpg` reaches the whole group; the
gateway's own shutdown then closes the store, compacting it) and exits when told to close, or at once when its
socket reads end of file: the gateway died, and what it had acknowledged is committed (a restart recovers the
journals, as after a crash of a gateway with the store inside it). A child that dies fails every commit waiting on
it and every later one with a store error, said in one line.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from polar_mitm.engines.base import TokenIds, WireJSON
from polar_mitm.store import ExchangeRow, NodeSnapshot, Store, control_file, live_holder
from polar_mitm.store.reading import Rows
from polar_mitm.store.session_counts import IssuedSeqs
from polar_mitm.store.session_reads import Sessions

log = logging.getLogger("polar_mitm.gateway")

_HEADER = struct.Struct("!Q")
# calls the child answers beside the commits: reads, snapshots and statements run on threads of their own there
CALL_THREADS = 4
RESTART_EVERY_S = 1.0  # after its store process died, how often the gateway starts a new one until one opens the store
CLOSE_TIMEOUT_S = 660.0  # the store's close waits up to 600 s for its compactor, then compacts what is left


class StoreProcessError(OSError):
    """The store's process failed a call with an error that could not be sent back as itself, or is gone."""


class _RowPickler(pickle.Pickler):
    """Pickles an exchange row with its engine request and reply as their wire texts (WireJSON.texts) and its
    prompt ids as the slice of the reply they are (TokenIds: the same str object, so sent once)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is WireJSON:
            return WireJSON.restored, obj.texts()
        if type(obj) is TokenIds:
            return TokenIds, (obj.source, obj.start, obj.end)
        return NotImplemented


def _dumps(message: Any, rows: bool = False) -> bytes:
    if not rows:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = io.BytesIO()
    _RowPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)))
    sock.sendall(payload)


def _receive(reader: io.BufferedReader) -> Any:
    """The next message, or None at end of file (the other side is gone)."""
    header = reader.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = reader.read(size)
    if len(payload) < size:
        return None
    return pickle.loads(payload)


def _sendable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (DuckDB's do, so the gateway tells a lock from a full disk), else
    its class and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error that does not round-trip
        return StoreProcessError(f"{type(error).__name__}: {error}")


@dataclass
class _Child:
    """One store process and the gateway's end of its socket."""

    process: subprocess.Popen[bytes]
    sock: socket.socket
    reader: io.BufferedReader
    seqs: dict[str, int]


class StoreProcess:
    """The gateway's side of a store in its own process: an ExchangeStore. Methods are safe from any thread;
    `commit_exchange` and `commit_mark` from an event loop."""

    def __init__(self, db: Path, memory_mb: int, journal_mb: int, compact_slice_mb: int, merge_fanin: int, report: Callable[[str], None]):
        """Start the child and wait until its store is open (opening may wait for a reader's lock, as
        open_when_readers_leave does); raises the child's error if it could not open it."""
        self.path = Path(db)
        self.report = report
        self._config = {"db": str(db), "memory_mb": memory_mb, "journal_mb": journal_mb, "compact_slice_mb": compact_slice_mb, "merge_fanin": merge_fanin}
        self._ids = itertools.count(1)
        self._waiting: dict[int, Callable[[BaseException | None, Any], None]] = {}
        self._waiting_lock = threading.Lock()
        self._gone: BaseException | None = None  # the child died: every commit is refused with this until one is back
        self._closing = False
        self._sql_port: int | None = None  # serve_sql's: a new child serves again on it
        self._outbox: queue.SimpleQueue[tuple[Any, bool] | None] = queue.SimpleQueue()
        self._child = self._start()
        self._seq = IssuedSeqs(self._child.seqs)
        # rows are pickled and sent on a thread of their own (the socket write releases the GIL); each child's
        # replies are read on a thread of its own and settle their waiters
        self._sender = threading.Thread(target=self._send_loop, name="polar-store-sender", daemon=True)
        self._sender.start()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self._child.process

    def _start(self) -> _Child:
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "polar_mitm.gateway.store_process", str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )
        theirs.close()
        reader = ours.makefile("rb")
        _send(ours, _dumps(self._config))
        opened = _receive(reader)
        if opened is None or opened[0] != "ready":
            ours.close()
            process.wait(timeout=30)
            if opened is None:
                raise StoreProcessError(f"the store's process exited with code {process.returncode} before it opened {self.path}")
            raise opened[1]
        child = _Child(process, ours, reader, opened[1])
        threading.Thread(target=self._receive_loop, args=(child,), name="polar-store-receiver", daemon=True).start()
        return child

    # -- sequencing, in this process's memory
    def next_seq(self, session_id: str) -> int:
        return self._seq.next(session_id)

    def issued_seqs(self, session_id: str) -> int:
        return self._seq.get(session_id, 0)

    # -- writes
    async def commit_exchange(self, row: ExchangeRow) -> None:
        await self._awaited("commit", (row,), rows=True)

    async def commit_mark(self, exchange_id: str, status: str, error: str) -> None:
        await self._awaited("mark", (exchange_id, status, error))

    def execute_write(self, sql: str, params: list[Any] | None = None) -> None:
        self._call("execute_write", sql, params)

    # -- reads and the rest, answered by the child's Store
    def query(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> Rows:
        result: Rows = self._call("query", sql, params, session)
        return result

    def arrow(self, sql: str, params: list[Any] | None = None, session: Sessions | None = None) -> pa.Table:
        result: pa.Table = self._call("arrow", sql, params, session)
        return result

    def snapshot(self, node: str, out_dir: Path | None = None) -> NodeSnapshot:
        result: NodeSnapshot = self._call("snapshot", node, out_dir)
        return result

    def serve_sql(self, port: int = 0) -> str:
        self._sql_port = port
        result: str = self._call("serve_sql", port, os.getpid())  # the control file names the gateway
        return result

    def close(self) -> None:
        """Close the store in the child (its journals compacted) and wait for the child to exit."""
        self._closing = True
        if self._gone is None:
            try:
                self._call("close", timeout=CLOSE_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - the child is gone or failed: its journals wait for the next open
                log.warning(f"polar-mitm: the store's process did not close cleanly: {error}")
        self._outbox.put(None)
        child = self._child
        try:
            child.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            child.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        child.sock.close()

    # -- the wire
    async def _awaited(self, kind: str, args: tuple[Any, ...], rows: bool = False) -> None:
        await Store.durable(lambda done: self._post(kind, args, lambda error, _result: done(error), rows))

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        done = threading.Event()
        answer: list[Any] = []

        def settle(error: BaseException | None, result: Any) -> None:
            answer[:] = [error, result]
            done.set()

        self._post("call", (method, args), settle)
        if not done.wait(timeout):
            raise StoreProcessError(f"the store's process did not answer {method} in {timeout:g} s")
        if answer[0] is not None:
            raise answer[0]
        return answer[1]

    def _post(self, kind: str, args: tuple[Any, ...], settle: Callable[[BaseException | None, Any], None], rows: bool = False) -> None:
        with self._waiting_lock:
            gone = self._gone
            if gone is None:
                number = next(self._ids)
                self._waiting[number] = settle
        if gone is not None:
            settle(gone, None)
            return
        self._outbox.put(((kind, number, *args), rows))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            message, rows = item
            try:
                payload = _dumps(message, rows)
            except Exception as error:  # noqa: BLE001 - this one message cannot be sent: its waiter is told why
                self._settle(message[1], StoreProcessError(f"cannot hand the store this {message[0]}: {error}"), None)
                continue
            try:
                _send(self._child.sock, payload)
            except OSError as error:  # the child died: its receiver fails the others
                self._settle(message[1], StoreProcessError(f"the store's process is gone: {error}"), None)

    def _receive_loop(self, child: _Child) -> None:
        while (message := _receive(child.reader)) is not None:
            if message[0] == "report":
                self.report(message[1])
                continue
            number, error, result = message
            self._settle(number, error, result)
        code = child.process.wait()
        if self._closing:
            return
        gone = StoreProcessError(f"the store's process exited (code {code}); commits are refused until a new one has opened the store")
        with self._waiting_lock:
            self._gone, waiting = gone, list(self._waiting.values())
            self._waiting.clear()
        for settle in waiting:
            settle(gone, None)
        # its SQL endpoint is gone with it: readers open the file themselves until a new child serves again
        if (live_holder(self.path) or {}).get("pid") == os.getpid():
            control_file(self.path).unlink(missing_ok=True)
        self.report(str(gone))
        child.sock.close()
        threading.Thread(target=self._restart, name="polar-store-restart", daemon=True).start()

    def _restart(self) -> None:
        """Start a new store process (what the dead one committed is in the file: it recovers the journals) and
        resume commits through it; tried every RESTART_EVERY_S until it opens or the gateway closes."""
        said = ""
        while not self._closing:
            time.sleep(RESTART_EVERY_S)
            try:
                child = self._start()
            except Exception as error:  # noqa: BLE001 - said (once, not once a try), and tried again
                if str(error) != said:
                    said = str(error)
                    self.report(f"the store's process could not be started again ({' '.join(said.split())}); trying again every {RESTART_EVERY_S:g} s")
                continue
            if self._closing:  # the gateway stopped meanwhile: this child ends unused (nothing was sent to it)
                child.sock.close()
                child.process.wait(timeout=30)
                return
            self._child = child
            self._seq.raise_to(child.seqs)  # those issued here and never committed are not issued again
            with self._waiting_lock:
                self._gone = None
            if self._sql_port is not None:
                try:
                    self.serve_sql(self._sql_port)
                except Exception as error:  # noqa: BLE001 - commits go on; readers open the file when they find no endpoint
                    self.report(f"the new store process could not serve SQL: {error}")
            self.report(f"a new store process (pid {child.process.pid}) has opened {self.path}; commits go on")
            return

    def _settle(self, number: int, error: BaseException | None, result: Any) -> None:
        with self._waiting_lock:
            settle = self._waiting.pop(number, None)
        if settle is not None:
            settle(error, result)


def serve(sock: socket.socket) -> None:
    """The child: open the store the gateway names, then answer it until it says close or goes away."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    from polar_mitm.gateway.startup import open_when_readers_leave  # the child's own import: not the module's

    reader = sock.makefile("rb")
    send_lock = threading.Lock()

    def send(message: Any) -> None:
        payload = _dumps(message)
        with send_lock:
            _send(sock, payload)

    def answer(number: int) -> Callable[[BaseException | None], None]:
        def done(error: BaseException | None) -> None:
            try:
                send((number, None if error is None else _sendable(error), None))
            except OSError:
                pass  # the gateway is gone (the loop below exits): the writer thread must not die of it

        return done

    config = _receive(reader)
    if config is None:
        return
    try:
        store = open_when_readers_leave(
            Path(config["db"]), config["memory_mb"], config["journal_mb"], config["compact_slice_mb"], config["merge_fanin"], lambda message: send(("report", message)),
        )
    except Exception as error:  # noqa: BLE001 - the gateway says why, in its own words (startup.why_not_opened)
        send(("failed", _sendable(error)))
        return
    send(("ready", store.seqs()))
    calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="polar-store-call")

    def call(number: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = getattr(store, method)(*args)
        except Exception as error:  # noqa: BLE001 - the caller gets it
            send((number, _sendable(error), None))
            return
        try:
            send((number, None, result))
        except Exception as error:  # noqa: BLE001 - a result that does not pickle
            send((number, _sendable(error), None))

    while (message := _receive(reader)) is not None:
        kind, number, *args = message
        if kind == "commit":
            store.submit_exchange(args[0], answer(number))
        elif kind == "mark":
            store.submit_mark(*args, answer(number))
        elif args[0] == "close":
            calls.shutdown(wait=True)
            store.close()
            send((number, None, None))
            return
        elif args[0] in ("query", "arrow", "snapshot", "execute_write", "serve_sql"):
            calls.submit(call, number, args[0], tuple(args[1]))
        else:
            send((number, StoreProcessError(f"the store's process has no call {args[0]!r}"), None))
    # end of file: the gateway is gone. What it was told is committed is; the rest it never answered.
    os._exit(0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    serve(socket.socket(fileno=int(sys.argv[1])))
