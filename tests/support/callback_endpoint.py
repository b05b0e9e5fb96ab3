"""A real HTTP callback receiver on loopback, what a trainer runs to get the rollout server's results: each POST's
headers and JSON body go to `answer`, whose status is the reply (no body). Subclasses keep what they saw and decide
the answer; they set their state before calling `__init__`, which starts serving."""

from __future__ import annotations

import json
import threading
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CallbackEndpoint:
    def __init__(self, path: str = "/results"):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.send_response(endpoint.answer(self.headers, body))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}{path}"

    def answer(self, headers: Message, body: dict[str, Any]) -> int:
        """The HTTP status for one delivery attempt (called on the server's thread, one per request)."""
        raise NotImplementedError

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
