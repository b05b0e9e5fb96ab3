"""What a user sees when something goes wrong: abandoned calls, stops with calls in flight, startup and option
errors, stale state files, wrong credentials. CLI checks run the real console script in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from polar_mitm import store
from tests.gatewayproc import Gateway

REPO = Path(__file__).resolve().parents[1]
POLAR_MITM = str(Path(sys.executable).with_name("polar-mitm"))
LONG_CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 3000}


def cli(*args: str, cwd: Path, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """The installed console script, running this worktree's code, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([POLAR_MITM, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def engine_metric(engine_url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(engine_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^" + re.escape(name) + r"\{([^}]*)\} ([0-9.e+-]+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total += float(match.group(2))
    return total


def curl_chat(gw: Gateway, session_id: str, body: dict, max_time: float) -> subprocess.Popen:
    return subprocess.Popen(
        ["curl", "-sS", "--max-time", str(max_time), "--proxy", gw.proxy_url(session_id), "--cacert", str(gw.ca_cert),
         "https://api.openai.com/v1/chat/completions", "-H", "content-type: application/json", "-H", "authorization: Bearer sk-test",
         "-d", json.dumps(body)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_for_rows(gw: Gateway, session_id: str, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rows := gw.exchanges(session_id):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"no row for {session_id} within {timeout}s")


def _time(value):
    return datetime.fromisoformat(value) if isinstance(value, str) else value


# -- abandoned calls


def engine_connections(pid: int, engine_url: str) -> set[int]:
    """Local ports of the process's open TCP connections to the engine."""
    import psutil

    engine_port = urlsplit(engine_url).port
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr and c.raddr.port == engine_port and c.status == "ESTABLISHED"}


def engine_log(engine_url: str) -> Path | None:
    """The local engine's request log (uvicorn's access lines), when the engine is ours."""
    from polar_mitm.local_engine import LocalEngine

    engine = LocalEngine(port=urlsplit(engine_url).port or 80)
    return engine.log_file if engine.base_url == engine_url and engine.log_file.exists() else None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_call_the_client_abandons_is_aborted_on_the_engine_and_recorded_client_disconnected(make_gateway, engine_url: str, session_id: str, stream: bool) -> None:
    from polar_mitm.assembler import assemble

    gw = make_gateway()
    log = engine_log(engine_url)
    started = time.monotonic()
    # the tiny model has random weights: it generates until max_tokens, ~10 s here; curl gives up after 2
    client = curl_chat(gw, session_id, {**LONG_CHAT, "max_tokens": 1000, "stream": stream}, max_time=2)
    ports: set[int] = set()
    while client.poll() is None:
        ports |= engine_connections(gw.process.pid, engine_url)
        time.sleep(0.1)
    assert client.returncode == 28, client.stderr.read()  # curl's "operation timed out": it hung up
    assert ports, "the gateway never called the engine"
    hung_up = time.monotonic()
    [row] = wait_for_rows(gw, session_id, timeout=15)
    # recorded as soon as the client was gone, not after the generation ran out
    assert time.monotonic() - hung_up < 5
    assert row["status"] == "client_disconnected", row["error"]
    assert row["http_status"] == 499 and "closed its connection" in row["error"]
    assert row["completion_token_ids"] is None and json.loads(row["engine_request"])["max_tokens"] == 1000
    assert (_time(row["engine_ended_at"]) - _time(row["engine_started_at"])).total_seconds() < 5
    # the gateway closed its engine connection: vLLM aborts a request whose connection closed
    assert not ports & engine_connections(gw.process.pid, engine_url)
    if log is not None:
        # the engine's request log: a request it finished has an access line from the gateway's port; an aborted
        # one never gets one (a full generation would have ended by now)
        while time.monotonic() - started < 25:
            time.sleep(1)
        finished = [line for line in log.read_text(errors="replace").splitlines() if "POST /v1/chat/completions" in line and any(f"127.0.0.1:{port} " in line for port in ports)]
        assert not finished, finished
    # never trajectory material
    with pytest.raises(LookupError, match="no trajectory material"):
        assemble(gw.db, "per_request", session_id)


def test_stopping_the_gateway_with_a_call_in_flight_records_gateway_shutdown(make_gateway, engine_url: str, session_id: str) -> None:
    gw = make_gateway()
    client = curl_chat(gw, session_id, LONG_CHAT, max_time=60)
    deadline = time.monotonic() + 20
    while not gw.rows("SELECT 1 FROM sessions WHERE session_id = ?", [session_id]) and time.monotonic() < deadline:
        time.sleep(0.3)  # the session row appears with the first exchange's commit: poll the engine instead
        if engine_metric(engine_url, "vllm:num_requests_running") >= 1:
            break
    time.sleep(1.5)
    stopped = time.monotonic()
    gw.stop(signal.SIGTERM)
    assert time.monotonic() - stopped < 15  # it cancelled the 3000-token call instead of waiting for it
    client.wait(timeout=30)
    [row] = gw.exchanges(session_id)
    assert row["status"] == "gateway_shutdown", row["error"]
    assert "engine_unreachable" not in (row["error"] or "") and "stopped" in row["error"]
    assert row["http_status"] == 503
