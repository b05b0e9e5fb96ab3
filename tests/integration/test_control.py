"""Gateway control API (pause drain/abort, resume with a policy version, status) with the real engine, real
mitmproxy, and as the clients whose calls are held, aborted and re-issued: the official openai SDK, and the four real
harness binaries (Qwen Code, Codex, Claude Code, Gemini CLI) run as in tests/integration/test_harnesses.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest

from polar_mitm.assembler import assemble
from polar_mitm.client import GatewayControl
from polar_mitm.errors import ControlError
from tests.support.gatewayproc import Gateway
from tests.support.harness_runs import HOOK, check_run, run_harness
from tests.support.keepalive_cases import BASELINE_MARKS, CASES, KEEPALIVE_MARK
from tests.support.matrix import harness_matrix, long_case
from tests.support.upstream_standins import DelayedEngineRelay

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


# how long the relay in front of the engine holds each call in control_gateway: every call lasts a while whatever the
# random-weight model does (its generation time varies with the machine, and it may sample EOS early). A test that
# must act on a call in flight uses held_gateway instead.
HELD_S = 3.0

Relayed = tuple[Gateway, GatewayControl, DelayedEngineRelay]


def _relayed_gateway(make_gateway, engine_url: str, hold_s: float) -> Iterator[Relayed]:
    relay = DelayedEngineRelay(engine_url, hold_s)
    gateway = make_gateway(upstream=relay.url)
    control = GatewayControl(gateway.proxy_url())
    yield gateway, control, relay
    control.close()
    relay.close()


@pytest.fixture
def control_gateway(make_gateway, engine_url: str) -> Iterator[Relayed]:
    yield from _relayed_gateway(make_gateway, engine_url, HELD_S)


@pytest.fixture
def held_gateway(make_gateway, engine_url: str) -> Iterator[Relayed]:
    """Each call is held at the relay until the test calls `relay.release()`, not for HELD_S: a test that must act on
    a call in flight gets it for as long as it needs. On CI's loaded 2-core machine a test thread once stalled between
    seeing the call in flight and asking for the pause long enough for a 3 s hold to end (twice: a drain that found
    nothing to wait for, an abort that found nothing to abort)."""
    yield from _relayed_gateway(make_gateway, engine_url, 120)


def test_drain_with_four_sessions_mid_turn(control_gateway, session_id: str) -> None:
    gateway, control, _ = control_gateway
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


def test_abort_reissues_the_call_and_records_the_attempt_as_untrainable(held_gateway, session_id: str) -> None:
    gateway, control, relay = held_gateway
    sessions = Sessions(gateway, [session_id], turns=1).start()
    wait_for(control, lambda s: s["in_flight"] == 1)
    started = time.monotonic()
    paused = control.pause(mode="abort")
    assert time.monotonic() - started < 10, "abort must not wait for the call to finish"
    rows_now = [(r["status"], r["error"]) for r in gateway.exchanges(session_id)]
    assert paused["state"] == "paused" and paused["in_flight"] == 0 and paused["aborted_total"] == 1, (paused, rows_now)
    wait_for(control, lambda s: s["waiting"] == 1)  # the aborted call waits to be issued again
    relay.release()
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


def test_drain_timeout_answers_504_and_keeps_serving(held_gateway, session_id: str) -> None:
    gateway, control, relay = held_gateway
    sessions = Sessions(gateway, [session_id], turns=1).start()
    wait_for(control, lambda s: s["in_flight"] == 1)
    with pytest.raises(ControlError) as caught:
        control.pause(mode="drain", timeout_seconds=0.3)
    assert caught.value.status == 504 and "still in flight" in caught.value.message
    status = control.status()
    assert status["state"] == "serving" and not status["paused"] and status["in_flight"] == 1, status
    relay.release()
    assert ask(sdk(gateway, session_id + "-after"), "hello", max_tokens=4)  # new calls are served at once
    sessions.join()
    assert [r["status"] for r in gateway.exchanges(session_id)] == ["ok"]


def test_bad_control_input_is_4xx_and_loses_nothing_in_flight(control_gateway, session_id: str) -> None:
    gateway, control, _ = control_gateway

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


def test_assemble_cli_drops_stale_sequences(make_gateway, session_id: str, tmp_path) -> None:
    """`polar-mitm assemble --max-staleness K --current-version V`, the console script, run from another directory
    with relative paths, on a store whose rows span policy versions 0, 1 and 2."""
    runs = tmp_path / "runs"
    runs.mkdir()
    gateway = make_gateway(db=runs / "store.duckdb")
    control = GatewayControl(gateway.proxy_url())
    spans, once_old, once_new = (f"{session_id}-{name}" for name in ("spans", "old", "new"))
    history: list[dict] = []
    client = sdk(gateway, spans)
    try:
        for version in (0, 1, 2):
            if version:
                control.pause()
                control.resume(policy_version=version)
            history.append({"role": "user", "content": f"under version {version}"})
            ask(client, history, max_tokens=4)
            if version == 0:
                ask(sdk(gateway, once_old), "old", max_tokens=4)
        ask(sdk(gateway, once_new), "new", max_tokens=4)
    finally:
        control.close()
    versions = {(r["session_id"], r["policy_version"]) for r in gateway.rows("SELECT session_id, policy_version FROM exchanges")}
    assert versions == {(spans, 0), (spans, 1), (spans, 2), (once_old, 0), (once_new, 2)}
    gateway.stop()  # as after a run; the store is the user's file now

    elsewhere = tmp_path / "trainer"
    elsewhere.mkdir()
    script = str(Path(sys.executable).with_name("polar-mitm"))

    def assemble_cli(*options: str) -> subprocess.CompletedProcess:
        command = [script, "assemble", "--db", "../runs/store.duckdb", "--builder", "per_request", *options]
        return subprocess.run(command, cwd=elsewhere, capture_output=True, text=True, timeout=300)

    done = assemble_cli("--max-staleness", "1", "--current-version", "2", "--out", "out/fresh.parquet", "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    # per_request: one sequence per exchange; the two sampled under version 0 are more than 1 version old
    assert stats["stale_sequences"] == 2 and stats["sequences"] == 3, stats
    table = pq.read_table(elsewhere / "out" / "fresh.parquet").to_pylist()
    assert sorted((r["session_id"], r["min_policy_version"], r["max_policy_version"]) for r in table) == sorted([(spans, 1, 1), (spans, 2, 2), (once_new, 2, 2)])
    assert all(set(r["token_policy_versions"] or [r["min_policy_version"]]) == {r["min_policy_version"]} for r in table)
    everything = assemble_cli("--max-staleness", "2", "--current-version", "2", "--out", "out/all.parquet", "--json")
    assert everything.returncode == 0 and json.loads(everything.stdout)["stale_sequences"] == 0, everything.stderr
    assert pq.read_metadata(elsewhere / "out" / "all.parquet").num_rows == 5
    half = assemble_cli("--max-staleness", "1")
    assert half.returncode == 2 and "max_staleness and current_version go together" in half.stderr, half


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


# -- the real harnesses, unmodified, held by a pause: nothing but a slower reply reaches them

# Every chat completion reaches the real engine DELAY seconds late (DelayedEngineRelay), so the harnesses' calls
# overlap and are surely in flight when the pause comes. Their stream idle timeouts are shrunk (CASES: Qwen Code and
# Codex 4 s, Claude Code's byte watchdog 10 s) below HOLD, the time the paused gateway holds their next call: only
# the gateway's keepalives (every second) carry them through.
DELAY = 20.0
HOLD = 12.0


def harness_env(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    for name in names:
        for key, value in CASES[name].get("env", {}).items():
            monkeypatch.setenv(key, value)


def seconds(later, earlier) -> float:
    return (ts(later) - ts(earlier)).total_seconds()


def check_held(name: str, row: dict, resumed_at: datetime) -> None:
    """A call the paused gateway held: admitted after resume, its stream kept alive by keepalives all along."""
    assert ts(row["engine_started_at"]) >= resumed_at, row["exchange_id"]
    assert seconds(row["engine_started_at"], row["started_at"]) >= HOLD, (row["started_at"], row["engine_started_at"])
    assert row["stream"], row["exchange_id"]
    waited = seconds(row["engine_ended_at"], row["started_at"])
    assert row["response_stream"].count(KEEPALIVE_MARK[name]) >= waited - 3 + BASELINE_MARKS[name], (name, waited)


@long_case  # ~1.5 min; the drain with four sessions mid-turn is test_drain_with_four_sessions_mid_turn, real harnesses paused: test_abort_reissues_a_real_harness_call
@pytest.mark.harness
def test_drain_with_four_real_harnesses_mid_turn(installed, make_gateway, engine_url, session_id, tmp_path, monkeypatch):
    names = ["qwen", "codex", "claude", "gemini"]
    harness_env(monkeypatch, names)
    ids = {name: f"{session_id}-{name}" for name in names}
    relay = DelayedEngineRelay(engine_url, DELAY)
    gateway = make_gateway("--engine-hook", HOOK, "--keepalive-interval", "1", "--policy-version", "3", upstream=relay.url)
    control = GatewayControl(gateway.proxy_url())
    try:
        with ThreadPoolExecutor(len(names)) as pool:
            runs = {}
            for name in names:
                (tmp_path / name).mkdir()
                runs[name] = pool.submit(run_harness, gateway, name, ids[name], tmp_path / name, CASES[name].get("options", ()))
            try:
                wait_for(control, lambda s: s["in_flight"] == len(names), timeout=240)
                pause_called = datetime.now(UTC)
                paused = control.pause(mode="drain", timeout_seconds=120)
                paused_at = datetime.now(UTC)
                assert paused["state"] == "paused" and paused["in_flight"] == 0, paused
                # each harness ran its tool and sent its next turn: held, not failed
                wait_for(control, lambda s: s["waiting"] == len(names), timeout=120)
                time.sleep(HOLD)
                held = control.status()
                assert held["state"] == "paused" and held["in_flight"] == 0 and held["waiting"] == len(names), held
            finally:
                resumed_at = datetime.now(UTC)
                resumed = control.resume(policy_version=4)
            assert resumed["state"] == "serving" and resumed["policy_version"] == 4, resumed
            results = {name: run.result() for name, run in runs.items()}
    finally:
        control.close()
        relay.close()
    for name in names:
        others = tuple(ids[other] for other in names if other != name)
        rows = check_run(gateway, name, ids[name], tmp_path / name, results[name], side_calls=CASES[name].get("side_calls", 0), others=others)
        # mid-turn when the pause was called: an engine call that started before it and ended after
        assert any(ts(r["engine_started_at"]) < pause_called < ts(r["engine_ended_at"]) for r in rows), name
        before = [r for r in rows if ts(r["engine_ended_at"]) <= paused_at]
        after = [r for r in rows if ts(r["engine_ended_at"]) > paused_at]
        assert before and after, name
        assert {r["policy_version"] for r in before} == {3} and {r["policy_version"] for r in after} == {4}, name
        assert all(ts(r["engine_started_at"]) >= resumed_at for r in after), name  # nothing ran while paused
        check_held(name, after[0], resumed_at)


@pytest.mark.harness
# default suite: Claude Code (Anthropic pings) and Gemini CLI (the default suite's Gemini keepalive check);
# all four in the full matrix
@pytest.mark.parametrize("name", harness_matrix(["qwen", "codex", "claude", "gemini"], default=("claude", "gemini")))
def test_abort_reissues_a_real_harness_call(installed, name, make_gateway, engine_url, session_id, tmp_path, monkeypatch):
    harness_env(monkeypatch, [name])
    # the call in flight is held until the abort is done and the relay released (not for a fixed time: see
    # held_gateway); every call after it goes straight to the engine
    relay = DelayedEngineRelay(engine_url, 120)
    gateway = make_gateway("--engine-hook", HOOK, "--keepalive-interval", "1", "--policy-version", "3", upstream=relay.url)
    control = GatewayControl(gateway.proxy_url())
    try:
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(run_harness, gateway, name, session_id, tmp_path, CASES[name].get("options", ()))
            try:
                wait_for(control, lambda s: s["in_flight"] == 1, timeout=240)
                started = time.monotonic()
                paused = control.pause(mode="abort")
                assert time.monotonic() - started < 5, "abort must not wait for the call to finish"
                assert paused["state"] == "paused" and paused["in_flight"] == 0 and paused["aborted_total"] == 1, paused
                wait_for(control, lambda s: s["waiting"] == 1)  # the aborted call waits to be issued again
                time.sleep(HOLD)
            finally:
                relay.release()
                resumed_at = datetime.now(UTC)
                control.resume(policy_version=4)
            result = run.result()
    finally:
        control.close()
        relay.close()
    side_calls = CASES[name].get("side_calls", 0)
    rows = check_run(gateway, name, session_id, tmp_path, result, side_calls=side_calls, aborted=1)
    [aborted] = [r for r in gateway.exchanges(session_id) if r["status"] == "aborted"]
    reissued = rows[0]  # the first call was the one in flight; the harness got one answer for it
    assert aborted["seq"] == 1 and reissued["seq"] == 2
    assert aborted["policy_version"] == 3 and reissued["exchange_id"] in aborted["error"]
    assert reissued["request_body"] == aborted["request_body"]
    assert {r["policy_version"] for r in rows} == {4} and ts(reissued["engine_started_at"]) >= resumed_at
    if reissued["stream"]:  # Gemini CLI's first call, its router's, is not streamed: it just waits for its reply
        check_held(name, reissued, resumed_at)
