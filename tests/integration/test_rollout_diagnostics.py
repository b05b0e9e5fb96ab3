"""What `polar-mitm rollout serve` tells its user when the engine is down (issue 31: /health said "ok", the session
said only that its budget ran out, the terminal printed nothing, callbacks failed silently).

The real console script, with `--upstream` a loopback port where nothing listens; one real Qwen Code session in a
local sandbox; a callback receiver that answers 404. Checked: GET /health names the unreachable engine, the
session's error leads with its model calls' failure (engine_unreachable), and the server's terminal has one line
for the task accepted, one for it finished and one for each failed callback delivery (URL and error).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from polar_mitm import harnesses, store
from polar_mitm.util import free_port
from tests.support.processes import stop_process_group

pytestmark = [pytest.mark.harness]

CONSOLE_SCRIPT = Path(sys.executable).with_name("polar-mitm")


class Refusing(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def qwen(installed: float) -> None:
    try:
        harnesses.get("qwen").executable()
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))


def test_an_engine_that_is_down_shows_in_health_in_the_session_error_and_on_the_terminal(qwen: None, tmp_path: Path) -> None:
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        dead = f"http://127.0.0.1:{nothing.getsockname()[1]}/v1"
        receiver = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        callback = f"http://127.0.0.1:{receiver.server_address[1]}/results"
        port, db, log = free_port(), tmp_path / "store.duckdb", tmp_path / "server.log"
        command = [str(CONSOLE_SCRIPT), "rollout", "serve", "--port", str(port), "--upstream", dead, "--db", str(db), "--confdir", str(tmp_path / "confdir")]
        process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, trust_env=False)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                try:
                    health = client.get("/health").json()
                    break
                except httpx.HTTPError:
                    time.sleep(0.5)
            assert health["status"] == "degraded" and health["engine_reachable"] is False, health
            assert health["engines"][0]["url"] == dead and health["engines"][0]["reachable"] is False

            task = {"task_id": "engine-down", "instruction": "Say hello.", "timeout_seconds": 20, "agent": {"harness": "qwen"}, "callback_url": callback}
            assert client.post("/tasks", json=task).status_code == 202
            deadline = time.monotonic() + 240
            while (result := client.get("/tasks/engine-down").json())["status"] == "running":
                assert time.monotonic() < deadline, result
                time.sleep(1)
        finally:
            client.close()
            stop_process_group(process, grace=60)
            receiver.shutdown()

    (session,) = result["sessions"]
    rows = store.query_dicts(db, "SELECT status, count(*) AS n FROM exchanges WHERE session_id = ? GROUP BY status", [session["session_id"]])
    assert rows and {r["status"] for r in rows} == {"engine_unreachable"}, rows
    calls = rows[0]["n"]
    # the cause first: what the model calls ran into, then how the session ended
    assert session["status"] in ("failed", "timed_out"), session
    assert session["error"].startswith(f"{calls} of {calls} model call(s) failed with engine_unreachable: the inference engine at {dead}"), session["error"]

    terminal = log.read_text()
    assert "polar-mitm rollout: task engine-down accepted: 1 session(s) of qwen in local sandboxes" in terminal, terminal
    assert f"polar-mitm rollout: task engine-down finished: 1 session(s), {session['status']} 1; no reward" in terminal, terminal
    failed = [line for line in terminal.splitlines() if line.startswith("polar-mitm rollout: callback ")]
    assert failed == [
        f"polar-mitm rollout: callback {session['session_id']}:session_result to {callback} failed after 1 attempt(s): HTTP 404",
        f"polar-mitm rollout: callback engine-down:task_result to {callback} failed after 1 attempt(s): HTTP 404",
    ], failed
