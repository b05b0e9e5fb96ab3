"""How a real gateway process ends an exchange, and what it tells its user.

- One outcome for both paths: an abandoned call (its client left, or the gateway stopped) and a dialect-level 5xx
  (tokens mode cannot render) record the same status whether the call was streamed or not, and tell the client
  the same error (Gemini's error body carries the HTTP status: the row's response_body shows it for a stream too).
- An engine that is down, or comes back, is said once each on the terminal, without -v, and in /control/status.
- A second gateway on a held store names the gateway that holds it; the start line names the render mode.

Stand-in upstreams only where the real engine cannot be made to hang or to be down; the engine that comes back
is the real one, behind a relay on the port the gateway was given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway
from tests.support.upstream_standins import StandinUpstream

REPO = Path(__file__).resolve().parents[2]
POLAR_MITM = str(Path(sys.executable).with_name("polar-mitm"))
GEMINI = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 2}}
PATHS = {"json": ":generateContent", "stream": ":streamGenerateContent?alt=sse"}


def gemini_call(gw: Gateway, session_id: str, path: str) -> subprocess.Popen:
    """curl as a harness: through the proxy, TLS to Google's host, the gateway answers."""
    return subprocess.Popen(
        ["curl", "-sS", "-N", "--proxy", gw.proxy_url(session_id), "--cacert", str(gw.ca_cert), GEMINI + path,
         "-H", "content-type: application/json", "-H", "x-goog-api-key: test", "-d", json.dumps(BODY)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def control(gw: Gateway, method: str, name: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    response = httpx.request(method, f"{gw.proxy_url()}/control/{name}", json=body, trust_env=False, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(condition, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def rows_by_session(gw: Gateway, sessions: list[str], timeout: float = 20) -> dict[str, dict[str, Any]]:
    wait_until(lambda: all(gw.exchanges(s) for s in sessions), timeout, f"a row for each of {sessions}")
    return {s: gw.exchanges(s)[0] for s in sessions}


def assert_one_outcome(rows: dict[str, dict[str, Any]], status: str, http_status: int) -> None:
    """The JSON call and the stream: one status and error body; the stream's status line (200) went first."""
    json_row, stream_row = rows.values()
    assert json_row["status"] == stream_row["status"] == status, (json_row["error"], stream_row["error"])
    assert (json_row["http_status"], stream_row["http_status"]) == (http_status, 200)
    assert json.loads(json_row["response_body"])["error"]["code"] == json.loads(stream_row["response_body"])["error"]["code"] == http_status


def in_flight(gw: Gateway, count: int) -> bool:
    return control(gw, "GET", "status")["in_flight"] == count


# -- one outcome, streamed or not


def test_an_abandoned_call_has_one_outcome_streamed_or_not(make_gateway, session_id: str) -> None:
    """Clients that leave: client_disconnected, 499; then a stop with calls in flight: gateway_shutdown, 503."""
    hanging = StandinUpstream("hang", delay=60)  # the engine works on every call until it is cancelled
    try:
        gw = make_gateway(upstream=hanging.url)
        leaving = [f"{session_id}-{kind}-leaves" for kind in PATHS]
        clients = [gemini_call(gw, session, PATHS[kind]) for session, kind in zip(leaving, PATHS, strict=True)]
        wait_until(lambda: in_flight(gw, 2), what="both calls at the engine")
        time.sleep(0.5)  # the stream's headers and opening went out (the gateway holds them 0.3 s)
        for client in clients:
            client.kill()
            client.wait()
        rows = rows_by_session(gw, leaving)
        assert_one_outcome(rows, "client_disconnected", 499)
        assert all("closed" in row["error"] for row in rows.values())

        stopped = [f"{session_id}-{kind}-stopped" for kind in PATHS]
        clients = [gemini_call(gw, session, PATHS[kind]) for session, kind in zip(stopped, PATHS, strict=True)]
        wait_until(lambda: in_flight(gw, 2), what="both calls at the engine")
        time.sleep(0.5)
        gw.stop()
        answers = [client.communicate(timeout=30)[0] for client in clients]
        assert_one_outcome(rows_by_session(gw, stopped), "gateway_shutdown", 503)
        # both clients were told, the stream in its own grammar after its opening
        assert all(b"the gateway was stopped" in answer for answer in answers), answers
    finally:
        hanging.close()


def test_a_dialect_5xx_after_the_stream_began_is_recorded_as_a_json_call_records_it(make_gateway, session_id: str, tmp_path: Path) -> None:
    """Tokens mode with a render model that has no chat template: every call is a RenderError 500. A paused
    gateway holds the calls past the stream's start, so the stream's failure comes after its headers."""
    model = tmp_path / "no-template"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path.home() / ".cache/polar-mitm/models/qwen3-tiny" / name, model / name)
    upstream = StandinUpstream("hang", delay=60)  # never called: the prompt cannot be rendered
    try:
        gw = make_gateway("--render", "tokens", "--render-model", str(model), upstream=upstream.url)
        control(gw, "POST", "pause", {"mode": "drain"})
        sessions = [f"{session_id}-{kind}" for kind in PATHS]
        clients = [gemini_call(gw, session, PATHS[kind]) for session, kind in zip(sessions, PATHS, strict=True)]
        wait_until(lambda: control(gw, "GET", "status")["waiting"] == 2, what="both calls held by the pause")
        time.sleep(0.5)  # the stream has begun
        control(gw, "POST", "resume", {})
        answers = [client.communicate(timeout=30)[0] for client in clients]
        rows = rows_by_session(gw, sessions)
        assert_one_outcome(rows, "render_error", 500)
        assert all(b"has no chat template" in answer for answer in answers), answers
        assert all(row["render_mode"] == "tokens" for row in rows.values())
    finally:
        upstream.close()


# -- an engine that is down, then back


class _Relay(BaseHTTPRequestHandler):
    """Forwards every request to the real engine (`target`, its root): the engine 'comes back' on the port the
    gateway was given."""

    target = ""

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0)) if self.command == "POST" else None
        request = urllib.request.Request(self.target + self.path, data=body, method=self.command, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, data = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, data = error.code, error.read()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _forward

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def engine_back_on(port: int, engine_url: str) -> Iterator[None]:
    server = ThreadingHTTPServer(("127.0.0.1", port), type("Relay", (_Relay,), {"target": engine_url}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def chat(gw: Gateway, session_id: str) -> httpx.Response:
    with httpx.Client(proxy=gw.proxy_url(session_id), verify=gw.ssl_context(), trust_env=False, timeout=120) as client:
        return client.post("https://api.openai.com/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_an_engine_down_then_back_is_said_once_each_and_in_the_status(make_gateway, engine_url: str, session_id: str) -> None:
    port = free_port()
    gw = make_gateway(upstream=f"http://127.0.0.1:{port}/v1")
    assert gw.log is not None
    for _ in range(3):
        answer = chat(gw, session_id)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unreachable"
    status = control(gw, "GET", "status")
    assert status["engine_reachable"] is False
    [engine] = status["engines"]
    assert engine["url"] == f"http://127.0.0.1:{port}/v1" and engine["reachable"] is False and engine["failed_calls"] >= 4
    assert "Connect" in engine["last_error"]
    with engine_back_on(port, engine_url.removesuffix("/v1")):
        for _ in range(2):
            assert chat(gw, session_id).status_code == 200
        status = control(gw, "GET", "status")
        assert status["engine_reachable"] is True and status["engines"][0]["reachable"] is True
    log = gw.log.read_text()
    down = [line for line in log.splitlines() if "is unreachable (" in line]
    back = [line for line in log.splitlines() if "answers again" in line]
    # once each: the start's discovery and three calls found it down, two calls found it back
    assert len(down) == 1 and f"engine http://127.0.0.1:{port}/v1 is unreachable" in down[0], log[-3000:]
    assert len(back) == 1 and "calls failed meanwhile" in back[0], log[-3000:]
    assert [row["status"] for row in gw.exchanges(session_id)] == ["engine_unreachable"] * 3 + ["ok"] * 2


def test_an_engine_down_is_said_without_v(tmp_path: Path) -> None:
    """Without -v mitmproxy's log is not shown: the one warning is printed, once, on stderr."""
    port, engine_port = free_port(), free_port()
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    command = [POLAR_MITM, "gateway", "--port", str(port), "--upstream", f"http://127.0.0.1:{engine_port}/v1", "--db", "s.duckdb", "--confdir", str(tmp_path / "confdir")]
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        wait_until(lambda: "listening on" in out.read_text(), 60, "the start line")
        gw = Gateway(port=port, db=tmp_path / "s.duckdb", confdir=tmp_path / "confdir", upstream="")
        for _ in range(2):
            assert chat(gw, "quiet").status_code == 503
    finally:
        process.terminate()
        process.wait(timeout=30)
    said = err.read_text()
    [line] = [line for line in said.splitlines() if "unreachable" in line] or [said]
    assert line.startswith(f"polar-mitm gateway: engine http://127.0.0.1:{engine_port}/v1 is unreachable (Client"), said
    assert line.endswith("); model calls are answered 503 engine_unreachable until it answers"), said
    assert "Traceback" not in said
    assert out.read_text().strip().endswith("(not answering yet), render auto (tokens or chat: chosen when the engine answers)")


# -- what the start says


def test_a_second_gateway_on_a_held_store_names_the_gateway_that_holds_it(make_gateway, tmp_path: Path, engine_url: str) -> None:
    first = make_gateway()
    assert first.process is not None
    result = subprocess.run(
        [POLAR_MITM, "gateway", "--port", str(free_port()), "--upstream", engine_url, "--db", str(first.db), "--confdir", str(first.confdir)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert (result.stdout + result.stderr).strip() == (
        f"polar-mitm gateway: cannot open the store {first.db}: the gateway at http://127.0.0.1:{first.port} "
        f"(pid {first.process.pid}) holds this store; stop it or use another --db"
    )


@pytest.mark.parametrize("render, said", [("chat", "chat"), ("tokens", "tokens"), ("auto", "auto: tokens"), (None, "auto: tokens")])
def test_the_start_line_names_the_render_mode(make_gateway, render: str | None, said: str) -> None:
    gw = make_gateway(*(["--render", render] if render else []))  # None: the default, auto
    line = gw.start_line()
    assert line.endswith(f"serving 'qwen3-tiny', render {said}"), line
