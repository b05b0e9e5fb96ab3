"""Stand-in upstreams for what the real engine cannot be made to do on demand (HTTP 500, a hang, a slow answer).

These are fakes, named as such: they exist only to show how the gateway behaves when its engine fails or is slow.
Every successful path in the tests uses the real vLLM engine, except the streamed-reply SDK tests, which need an
engine that takes 30 s (SlowStandinEngine); DelayedEngineRelay slows the real engine down instead.
SGLangWeightSyncStandin answers SGLang's weight-sync endpoints (pause, reload from disk, continue).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The reply shape of SGLang >= 0.5.13's /v1/chat/completions with return_meta_info and
# return_prompt_token_ids (hand-made from its protocol; no SGLang can run on these CPU machines): a sample ended by
# the stop string "STOP", which SGLang names in `matched_stop` and leaves out of the text but not out of the token ids.
SGLANG_REPLY = {
    "id": "b1f0c3",
    "object": "chat.completion",
    "created": 1795950000,
    "model": "standin",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there", "reasoning_content": None, "tool_calls": None},
            "logprobs": None,
            "finish_reason": "stop",
            "prompt_token_ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
            "matched_stop": "STOP",
            "meta_info": {"output_token_logprobs": [[-0.25, 13048, "Hi"], [-0.5, 1052, " there"], [-0.125, 45537, " STOP"]]},
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
}


class _Handler(BaseHTTPRequestHandler):
    mode = "500"
    delay = 0.0

    def _reply(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode())

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.mode == "sglang":
            self._reply(200, SGLANG_REPLY)
        elif self.mode == "hang":
            time.sleep(self.delay)
            self._reply(200, {"error": "too late"})
        else:
            self._reply(500, {"object": "error", "message": "stand-in engine failure", "type": "InternalServerError", "code": 500})

    def log_message(self, *args: object) -> None:
        pass


class _Served:
    """A handler class served on a free loopback port in a thread; `url` is its OpenAI base URL."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StandinUpstream(_Served):
    """`mode="sglang"` answers like SGLang; `mode="500"` answers every completion with HTTP 500; `mode="hang"` answers
    after `delay` seconds."""

    def __init__(self, mode: str, delay: float = 0.0):
        super().__init__(type("Handler", (_Handler,), {"mode": mode, "delay": delay}))


# -- slow engines, for streamed replies that must survive a long wait (issue 18)

SLOW_TEXT = "The slow stand-in engine answers."
SLOW_ARGUMENTS = '{"value": "42"}'


def slow_reply(request: dict) -> dict:
    """A vLLM-shaped reply (token ids, logprobs): a fixed text, and a call of the first offered tool if any."""
    tools = request.get("tools") or []
    message: dict = {"role": "assistant", "content": SLOW_TEXT, "reasoning_content": None, "tool_calls": []}
    if tools:
        message["tool_calls"] = [{"id": "chatcmpl-tool-5l0w", "type": "function", "function": {"name": tools[0]["function"]["name"], "arguments": SLOW_ARGUMENTS}}]
    tokens = ["The", " slow", " stand", "-in", " engine", " answers", "."]
    return {
        "id": "chatcmpl-slowstandin",
        "object": "chat.completion",
        "created": 1795950000,
        "model": "standin",
        "prompt_token_ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens]},
                "finish_reason": "tool_calls" if tools else "stop",
                "token_ids": [785, 6301, 2498, 3419, 4712, 11253, 13],
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
    }


class _SlowHandler(_Handler):
    failures: list[int] = [0]  # how many of the next completions fail (shared by the server's threads)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        time.sleep(self.delay)
        with self.lock:
            fail = self.failures[0] > 0
            self.failures[0] -= fail
        if fail:
            self._reply(500, {"object": "error", "message": "stand-in engine failure after its delay", "type": "InternalServerError", "code": 500})
        else:
            self._reply(200, slow_reply(request))


class SlowStandinEngine(_Served):
    """A stand-in engine that answers each chat completion after `delay` seconds with `slow_reply`; the first
    `failures` completions (all, with `fail=True`) get HTTP 500 instead. Named as a stand-in: no real engine can be
    made slow or failing on demand, and the SDK tests must not depend on one."""

    def __init__(self, delay: float = 0.0, fail: bool = False, failures: int = 0):
        attributes = {"delay": delay, "failures": [10**9 if fail else failures], "lock": threading.Lock()}
        super().__init__(type("SlowHandler", (_SlowHandler,), attributes))


class _PacedHandler(_SlowHandler):
    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        time.sleep(paced_delay(request))
        self._reply(200, slow_reply(request))


def paced_delay(request: dict) -> float:
    """The `pace=SECONDS` a chat request's last message names (0 if none)."""
    content = str((request.get("messages") or [{}])[-1].get("content") or "")
    for word in content.split():
        if word.startswith("pace="):
            return float(word.removeprefix("pace="))
    return 0.0


class PacedStandinEngine(_Served):
    """A stand-in engine that answers each chat completion with `slow_reply` after the delay its last message asks
    for (`pace=SECONDS`): one engine, a different answer time per call, so a test can set which calls its clients
    abandon and when. Named as a stand-in: no real engine answers at a set time."""

    def __init__(self) -> None:
        super().__init__(type("PacedHandler", (_PacedHandler,), {"lock": threading.Lock()}))


class _RelayHandler(_Handler):
    target = ""
    delay = 0.0
    slowed: Callable[[dict], bool] = staticmethod(lambda request: True)
    failing: Callable[[dict], bool] = staticmethod(lambda request: False)
    # set per relay: chat completions received, and how many more of those `failing` selects get the stand-in's
    # HTTP 500 (both shared by the server's threads, under lock)
    completions: list[int]
    failures: list[int] = [0]
    lock: threading.Lock
    closed: threading.Event
    released: threading.Event

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
        if method == "POST" and self.path.endswith("/chat/completions"):
            request = json.loads(body or b"{}")
            with self.lock:
                self.completions[0] += 1
                fail = self.failures[0] > 0 and self.failing(request)
                self.failures[0] -= fail
            if fail or self.slowed(request):
                self.released.wait(self.delay)
                if self.closed.is_set():
                    return  # the relay was closed while this call waited: the real engine never sees it
            if fail:
                self._reply(500, {"object": "error", "message": "stand-in relay: engine failure after its delay", "type": "InternalServerError", "code": 500})
                return
        request = urllib.request.Request(self.target + self.path, data=body, method=method, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                status, data = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, data = error.code, error.read()
        try:
            self._send(status, data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway cancelled this call meanwhile (pause(abort), its client gone): nobody to answer

    def do_GET(self) -> None:  # noqa: N802
        self._forward("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._forward("POST")


class DelayedEngineRelay(_Served):
    """In front of the real engine: each chat completion `slowed` selects (by its request body; default every one)
    is forwarded after `delay` seconds, unchanged (the reply is the real engine's, token ids and all); `completions`
    counts the chat completions received. Stands in for a busy engine or a long prefill.

    With `failing`, it stands in for an engine that fails mid-generation (a crashed worker, an OOM), which no real
    engine does on demand: the first chat completion `failing` selects waits `delay` seconds and then gets HTTP 500
    from the relay, never reaching the engine; every later one (a retry of it too) is treated as above.

    `release()` ends every wait at once, now and after: a test that must see a call in flight for as long as it
    needs (a loaded machine can stall a test thread for seconds) holds it with a long `delay` and releases it."""

    def __init__(self, engine_url: str, delay: float, slowed: Callable[[dict], bool] | None = None, failing: Callable[[dict], bool] | None = None):
        root = engine_url.rstrip("/").removesuffix("/v1")
        self._received, self._closed, self._released = [0], threading.Event(), threading.Event()
        attributes = {"target": root, "delay": delay, "completions": self._received, "lock": threading.Lock(), "closed": self._closed, "released": self._released}
        if slowed is not None:
            attributes["slowed"] = staticmethod(slowed)
        if failing is not None:
            attributes.update(failing=staticmethod(failing), failures=[1])
        super().__init__(type("RelayHandler", (_RelayHandler,), attributes))

    @property
    def completions(self) -> int:
        return self._received[0]

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._closed.set()
        self._released.set()
        super().close()


class RecordingVLLMStandin:
    """A stand-in vLLM engine for routing tests (several engines at once, one stopped and started again on its port):
    answers /v1/models and /v1/chat/completions in vLLM's shape with token ids and logprobs (a fixed two-token
    text), and records the body of every completion request it got. Not a model: `requests` is what it is for."""

    def __init__(self, port: int = 0):
        self.requests: list[dict] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._reply({"object": "list", "data": [{"id": "standin", "object": "model", "max_model_len": 4096}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                standin.requests.append(body)
                logprobs = [{"token": "Hi", "logprob": -0.25}, {"token": "!", "logprob": -0.5}]
                self._reply({
                    "id": f"chatcmpl-standin-{len(standin.requests)}", "object": "chat.completion", "created": 1795950000, "model": "standin",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": {"content": logprobs}, "finish_reason": "stop", "token_ids": [13048, 0]}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, "prompt_token_ids": [1, 2, 3],
                })

            def log_message(self, *args: object) -> None:
                pass

        self.handler = Handler
        self.port = port
        self.server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    close = stop


class SGLangWeightSyncStandin(_Served):
    """A stand-in SGLang server for weight sync (no SGLang runs on these CPU machines), speaking the endpoints of
    SGLang's srt/entrypoints/http_server.py with the bodies of srt/managers/io_struct.py:

    - POST /pause_generation {"mode": "abort"|"retract"|"in_place"} (default abort; another mode: 400) ->
      {"message": "Generation paused successfully.", "status": "ok"}; chat completions then wait for continue.
    - POST /update_weights_from_disk {"model_path", "weight_version"?, ...} -> {"success", "message",
      "num_paused_requests"}, HTTP 400 with success false when it cannot load (here: model_path is not a folder).
    - POST /continue_generation {} -> {"message": "Generation continued successfully.", "status": "ok"}.
    - GET /get_model_info -> model_path and weight_version as loaded; GET /v1/models; POST /v1/chat/completions
      answers SGLANG_REPLY.

    With `admin_api_key`, the three admin endpoints want it as a bearer token (401 otherwise), as SGLang's
    ADMIN_OPTIONAL endpoints do. Not a model: `calls` ((path, body) of every admin call, in order) is what it is for.
    """

    def __init__(self, model_path: str = "standin-base", admin_api_key: str | None = None, calls: list | None = None):
        standin = self
        self.calls: list[tuple[str, dict]] = [] if calls is None else calls
        self.model_path, self.weight_version = model_path, "default"
        self.running = threading.Event()
        self.running.set()

        class Handler(_Handler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/get_model_info":
                    self._reply(200, {"model_path": standin.model_path, "weight_version": standin.weight_version, "is_generation": True})
                else:
                    super().do_GET()

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if self.path.endswith("/chat/completions"):
                    standin.running.wait(60)
                    self._reply(200, SGLANG_REPLY)
                    return
                if self.path not in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
                    self._reply(404, {"detail": "Not Found"})
                    return
                if admin_api_key is not None and self.headers.get("authorization") != f"Bearer {admin_api_key}":
                    self._reply(401, {"error": "Unauthorized"})
                    return
                standin.calls.append((self.path, body))
                if self.path == "/pause_generation":
                    if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
                        self._reply(400, {"object": "error", "message": f"Invalid mode: {body.get('mode')!r}. Expected one of ['abort', 'retract', 'in_place'].", "type": "Bad Request", "code": 400})
                        return
                    standin.running.clear()
                    self._reply(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif self.path == "/continue_generation":
                    standin.running.set()
                    self._reply(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif not isinstance(body.get("model_path"), str):
                    self._reply(400, {"object": "error", "message": "model_path: Field required", "type": "Bad Request", "code": 400})
                elif not os.path.isdir(body["model_path"]):
                    self._reply(400, {"success": False, "message": f"Failed to update weights: no checkpoint at {body['model_path']}", "num_paused_requests": 0})
                else:
                    standin.model_path, standin.weight_version = body["model_path"], body.get("weight_version") or standin.weight_version
                    self._reply(200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

        super().__init__(Handler)
