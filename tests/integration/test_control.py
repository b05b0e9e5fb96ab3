"""Gateway control API (pause drain/abort, resume with a policy version, status) with the real engine, real
mitmproxy and the official openai SDK as the clients whose calls are held, aborted and re-issued."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest

from polar_mitm.assembler import assemble
from polar_mitm.client import GatewayControl
from polar_mitm.errors import ControlError
from tests.support.gatewayproc import Gateway

# the random-weight test model rarely samples EOS: a call runs to max_tokens, long enough to be caught mid-turn
LONG = 384


def sdk(gateway: Gateway, session_id: str) -> openai.OpenAI:
    http_client = httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=300)
    return openai.OpenAI(api_key="sk-test", http_client=http_client, max_retries=0)


def ask(client: openai.OpenAI, conversation: str | list[dict], max_tokens: int = LONG) -> str:
    """One turn; a conversation (list) gets the reply appended, as a chat client keeps its history."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=max_tokens, temperature=1.0)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return reply.choices[0].finish_reason


class Sessions:
    """Threads that each run a few SDK turns; errors are collected, not lost in the thread."""

    def __init__(self, gateway: Gateway, session_ids: list[str], turns: int, max_tokens: int = LONG):
        self.errors: list[BaseException] = []
        self.finish: dict[str, list[str]] = {s: [] for s in session_ids}
        self.threads = [threading.Thread(target=self._run, args=(gateway, s, turns, max_tokens)) for s in session_ids]

    def _run(self, gateway: Gateway, session_id: str, turns: int, max_tokens: int) -> None:
        try:
            client, history = sdk(gateway, session_id), []
            for turn in range(turns):
                history.append({"role": "user", "content": f"turn {turn}: count to one hundred"})
                self.finish[session_id].append(ask(client, history, max_tokens))
        except BaseException as error:  # noqa: BLE001 - reported by join()
            self.errors.append(error)

    def start(self) -> Sessions:
        for thread in self.threads:
            thread.start()
        return self

    def join(self, timeout: float = 300) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a session never finished"
        assert not self.errors, self.errors


def ts(value: str | datetime) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


def wait_for(control: GatewayControl, predicate, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = control.status()
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"gateway never reached the state; last status {status}")


@pytest.fixture
def control_gateway(make_gateway) -> tuple[Gateway, GatewayControl]:
    gateway = make_gateway()
    control = GatewayControl(gateway.proxy_url())
    yield gateway, control
    control.close()


def test_drain_with_four_sessions_mid_turn(control_gateway, session_id: str) -> None:
    gateway, control = control_gateway
    assert control.status()["policy_version"] == 0
    ids = [f"{session_id}-{i}" for i in range(4)]
    sessions = Sessions(gateway, ids, turns=2).start()
    before = wait_for(control, lambda s: s["in_flight"] >= 4)
    assert before["state"] == "serving"
    paused = control.pause(mode="drain", timeout_seconds=120)
    paused_at = datetime.now(UTC)
    # pause returned only once nothing was in flight; the second turns are held
    assert paused["state"] == "paused" and paused["in_flight"] == 0, paused
    held = wait_for(control, lambda s: s["waiting"] >= 1, timeout=30)
    assert held["in_flight"] == 0
    time.sleep(0.5)
    assert control.status()["in_flight"] == 0  # nothing slips through while paused
    resume_called = datetime.now(UTC)
    resumed = control.resume(policy_version=1)
    assert resumed["state"] == "serving" and resumed["policy_version"] == 1
    sessions.join()
    rows = gateway.rows("SELECT session_id, seq, status, policy_version, engine_started_at, engine_ended_at FROM exchanges WHERE session_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY session_id, seq", [ids])
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows), rows
    for sid in ids:
        first, second = [r for r in rows if r["session_id"] == sid]
        assert first["policy_version"] == 0 and ts(first["engine_ended_at"]) <= paused_at, first
        assert second["policy_version"] == 1 and ts(second["engine_started_at"]) >= resume_called, second
    # trajectories: staleness against the current version (spanning sequences: unit/test_policy_versions.py)
    fresh = assemble(gateway.db, builder="per_request", max_staleness=0, current_version=1)
    assert fresh.stats.stale_sequences == 4 and sorted(s.min_policy_version for s in fresh.sequences) == [1, 1, 1, 1]


def test_abort_reissues_the_call_and_records_the_attempt_as_untrainable(control_gateway, session_id: str) -> None:
    gateway, control = control_gateway
    sessions = Sessions(gateway, [session_id], turns=1).start()
    wait_for(control, lambda s: s["in_flight"] == 1)
    started = time.monotonic()
    paused = control.pause(mode="abort")
    assert time.monotonic() - started < 10, "abort must not wait for the call to finish"
    assert paused["state"] == "paused" and paused["in_flight"] == 0 and paused["aborted_total"] == 1, paused
    wait_for(control, lambda s: s["waiting"] == 1)  # the aborted call waits to be issued again
    control.resume(policy_version=3)
    sessions.join()
    assert len(sessions.finish[session_id]) == 1  # the client got exactly one answer
    rows = gateway.exchanges(session_id)
    assert [r["status"] for r in rows] == ["aborted", "ok"], [(r["status"], r["error"]) for r in rows]
    aborted, served = rows
    assert aborted["policy_version"] == 0 and not aborted["completion_token_ids"], aborted
    assert served["exchange_id"] in aborted["error"] and "abort" in aborted["error"]
    assert served["policy_version"] == 3 and served["completion_token_ids"]
    assert served["request_body"] == aborted["request_body"]
    trained = assemble(gateway.db, builder="per_request", session=session_id)
    used = {e for seq in trained.sequences for e in seq.exchange_ids}
    assert used == {served["exchange_id"]}, used


def test_drain_timeout_answers_504_and_keeps_serving(control_gateway, session_id: str) -> None:
    gateway, control = control_gateway
    sessions = Sessions(gateway, [session_id], turns=1).start()
    wait_for(control, lambda s: s["in_flight"] == 1)
    with pytest.raises(ControlError) as caught:
        control.pause(mode="drain", timeout_seconds=0.3)
    assert caught.value.status == 504 and "still in flight" in caught.value.message
    status = control.status()
    assert status["state"] == "serving" and not status["paused"], status
    assert ask(sdk(gateway, session_id + "-after"), "hello", max_tokens=4)  # new calls are served at once
    sessions.join()
    assert [r["status"] for r in gateway.exchanges(session_id)] == ["ok"]


def test_bad_control_input_is_4xx_and_loses_nothing_in_flight(control_gateway, session_id: str) -> None:
    gateway, control = control_gateway

    def refused(call, status: int, needle: str) -> None:
        with pytest.raises(ControlError) as caught:
            call()
        assert caught.value.status == status and needle in caught.value.message, (caught.value.status, caught.value.message)

    refused(lambda: control.resume(policy_version=1), 409, "not paused")
    control.pause()
    sessions = Sessions(gateway, [session_id], turns=1, max_tokens=8).start()  # held while paused
    wait_for(control, lambda s: s["waiting"] == 1)
    refused(lambda: control.pause(), 409, "already paused")
    control.resume(policy_version=5)
    sessions.join()
    control.pause()
    refused(lambda: control.resume(policy_version=4), 409, "lower than the current 5")
    refused(lambda: control.resume(policy_version=6, engine_model="no-such-adapter"), 404, "does not serve 'no-such-adapter'")
    status = control.status()
    assert status["paused"] and status["policy_version"] == 5 and status["engine_model"] is None, status  # refused resumes change nothing
    url = gateway.proxy_url()
    with httpx.Client(trust_env=False) as raw:
        assert raw.post(url + "/control/pause", content=b"{nope").status_code == 400
        assert raw.post(url + "/control/resume", json={"policy_version": -1}).status_code == 422
        assert raw.post(url + "/control/resume", json={"policy_versoin": 6}).status_code == 422
        assert raw.get(url + "/control/pause").status_code == 405
        assert raw.get(url + "/control/nothing").status_code == 404
    control.resume(policy_version=6, engine_model=status_model(gateway))
    assert [r["policy_version"] for r in gateway.exchanges(session_id)] == [5]
    assert ask(sdk(gateway, session_id + "-b"), "hi", max_tokens=4)
    assert [r["policy_version"] for r in gateway.exchanges(session_id + "-b")] == [6]


def status_model(gateway: Gateway) -> str:
    return httpx.get(gateway.upstream + "/models", trust_env=False).json()["data"][0]["id"]


def test_control_token_and_cli(make_gateway) -> None:
    gateway = make_gateway("--control-token", "s3cret", "--policy-version", "2")
    with httpx.Client(trust_env=False) as raw:
        assert raw.get(gateway.proxy_url() + "/control/status").status_code == 401
        assert raw.get(gateway.proxy_url() + "/control/status", headers={"authorization": "Bearer wrong"}).status_code == 401

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "polar_mitm.cli", "control", *args, "--gateway", gateway.proxy_url(), "--token", "s3cret"], capture_output=True, text=True, timeout=60)

    status = cli("status")
    assert status.returncode == 0 and '"policy_version": 2' in status.stdout, status
    assert cli("pause").returncode == 0
    again = cli("pause")
    assert again.returncode == 1 and "already paused" in again.stderr
    resumed = cli("resume", "--policy-version", "3")
    assert resumed.returncode == 0 and '"policy_version": 3' in resumed.stdout and '"state": "serving"' in resumed.stdout


def test_rollout_server_fans_control_out_to_its_gateway(engine_url: str, tmp_path) -> None:
    from polar_mitm.client import RolloutClient
    from polar_mitm.util import free_port

    port = free_port()
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--port", str(port), "--upstream", engine_url, "--db", str(tmp_path / "store.duckdb"), "--confdir", str(tmp_path / "confdir")]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    rollouts = RolloutClient(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        (node, status), = rollouts.control("status")["nodes"].items()
        assert status["state"] == "serving" and status["policy_version"] == 0
        assert rollouts.control("pause", mode="drain")["nodes"][node]["state"] == "paused"
        with pytest.raises(ControlError) as caught:
            rollouts.control("pause")
        assert caught.value.status == 409 and "already paused" in caught.value.message
        resumed = rollouts.control("resume", policy_version=4)["nodes"][node]
        assert resumed["state"] == "serving" and resumed["policy_version"] == 4
        assert GatewayControl(node).status()["policy_version"] == 4  # the node's own gateway says the same
    finally:
        rollouts.close()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
