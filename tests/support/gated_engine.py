"""GatedEngineRelay: the real engine behind a gate the test opens one call at a time.

A fake only in what it holds back, named as a stand-in: each chat completion that `held` selects waits at the
relay until the test lets it through (`release`), then goes to the real engine unchanged, reply and all. It makes
"an engine call is in flight on every node" a state a test can hold for as long as it needs, which a real
engine (or a fixed delay) cannot do on a loaded machine. Everything else (GET /models, unselected calls) passes
straight through.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class GatedEngineRelay:
    def __init__(self, engine_url: str, held: Callable[[dict], bool] = lambda request: True):
        self.target = engine_url.rstrip("/").removesuffix("/v1")
        self.held = held
        self.gate = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.waiting = 0  # held calls at the gate now
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
                if method == "POST" and self.path.endswith("/chat/completions") and relay.held(json.loads(body or b"{}")):
                    relay._wait_at_gate()
                request = urllib.request.Request(relay.target + self.path, data=body, method=method, headers={"content-type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=600) as response:
                        status, data = response.status, response.read()
                except urllib.error.HTTPError as error:
                    status, data = error.code, error.read()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the gateway gave up on this call meanwhile

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                self._forward("GET")

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                self._forward("POST")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _wait_at_gate(self) -> None:
        with self.lock:
            self.waiting += 1
        self.gate.acquire()
        with self.lock:
            self.waiting -= 1

    def release(self, calls: int = 1) -> None:
        """Let `calls` held calls (now waiting, or the next to come) through to the engine."""
        self.gate.release(calls)

    def close(self) -> None:
        self.gate.release(10_000)  # nothing stays held
        self.server.shutdown()
        self.server.server_close()
