"""The rollout server end to end: `polar-mitm rollout serve` as its own process, real Qwen Code sessions in local
and docker sandboxes, the real engine behind the server's own gateway node, a real evaluator, and a real
HTTP callback receiver.

The random-weight engine is steered by examples/steer_tiny_model.py (the gateway's engine hook): turn 1 of every
agent loop is a shell tool call running the instruction's STEER-COMMAND, turn 2 a final text. The sandbox's
evaluator is tests/support/rollout_check.py, uploaded by a prepare step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from polar_mitm import harnesses, store
from polar_mitm.local_engine import LocalEngine
from polar_mitm.rollout.runtimes.local import marked_processes
from polar_mitm.util import free_port
from tests.support.processes import stop_process_group
from tests.support.rollout_runs import HOOK, REPO, TASK_WAIT, Receiver, RolloutServer, coding_task

pytestmark = [pytest.mark.harness, pytest.mark.engine]

# blocks the shell tool (Qwen Code refuses a bare `sleep N`)
BLOCK = 'python3 -c "import time; time.sleep(600)"'
STAGES = ["queued", "preparing", "running", "post_run", "building", "evaluating", "completed"]


def docker_socket() -> Path:
    # where sandboxes/docker/dockerd.sh puts its engine's socket
    return Path(os.environ.get("POLAR_MITM_HOME") or "~/.cache/polar-mitm").expanduser() / "docker" / "docker.sock"


@pytest.fixture(scope="module")
def server(engine_url: str, harness_installed: None, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("rollout")
    port = free_port()
    log = base / "server.log"
    env = {**os.environ, "DOCKER_HOST": os.environ.get("DOCKER_HOST") or f"unix://{docker_socket()}"}
    command = [
        sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--port", str(port), "--upstream", engine_url,
        "--db", str(base / "store.duckdb"), "--confdir", str(base / "confdir"), "--engine-hook", HOOK,
        "--prepare-limit", "2", "--run-limit", "2", "--evaluate-limit", "2", "-v",
    ]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rollout = RolloutServer(f"http://127.0.0.1:{port}", base / "store.duckdb", log, process)
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited with {process.returncode}:\n{rollout.log_tail()}")
        try:
            if rollout.client.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout server did not come up:\n{rollout.log_tail()}")
        time.sleep(0.2)
    yield rollout
    rollout.client.close()
    stop_process_group(process, grace=60)


def sandbox_left(session_id: str) -> list[str]:
    """What is left of a local sandbox: its directory, processes carrying its marker."""
    left = [str(p) for p in Path(tempfile.gettempdir()).glob(f"polar-sandbox-{session_id[:60]}-*")]
    return left + [f"pid {pid}" for pid in marked_processes(session_id)]


def check_completed_task(server: RolloutServer, rx: Receiver, accepted: dict[str, Any], result: dict[str, Any], samples: int) -> None:
    """Everything a trainer gets for a task whose sessions all completed."""
    task_id = accepted["task_id"]
    sessions = {s["session_id"]: s for s in result["sessions"]}
    assert set(sessions) == set(accepted["session_ids"]) and len(sessions) == samples
    assert result["status"] == "completed" and result["counts"] == {"completed": samples}, json.dumps(result)[:3000]
    store_rows = {r["session_id"]: r for r in server.rows("SELECT * FROM sessions WHERE task_id = ?", [task_id])}
    for session_id, session in sessions.items():
        assert session["status"] == "completed", f"{session_id}: {session['error']}\n{session['harness_output'][-2000:]}"
        # the agent's tool wrote this session's id in this session's sandbox; the evaluator read it and scored it
        evaluation = session["evaluation"]
        assert evaluation["details"]["content"] == session_id
        assert evaluation["details"]["seed"] == "seeded"  # the prepare steps ran before the harness
        assert session["reward"] == evaluation["reward"] == session["sample_index"] / 2
        assert session["harness_exit_code"] == 0 and session["error"] is None
        assert list(session["timings"]) == STAGES
        starts = [session["timings"][stage]["started_at"] for stage in STAGES]
        assert starts == sorted(starts)
        # two model exchanges (tool call, final text), committed and assembled
        assert session["n_exchanges"] == 2
        trajectory = session["trajectory"]
        # on the server's defaults (--render auto: tokens mode, the engine's model being here) one sequence
        assert trajectory["exchanges"] == 2 and trajectory["sequences"] == 1
        # what a trainer checks before training on it: both turns rendered here, the second bridged, no tool call
        # that failed to parse, version 0
        assert (trajectory["tool_call_parse_failures"], trajectory["tokens_mode_exchanges"], trajectory["bridged_fraction"]) == (0, 2, 1.0)
        assert trajectory["policy_version"] == 0 and trajectory["staleness"] == [0] * trajectory["sequences"]
        assert trajectory["sequence_policy_versions"] == [[0, 0]] * trajectory["sequences"]
        assert session["metadata"] == {"group": task_id, "policy_version": 7}
        row = store_rows[session_id]
        assert (row["status"], row["reward"], row["n_exchanges"], row["harness"]) == ("completed", session["reward"], 2, "qwen")
        assert json.loads(row["timings"])["running"]["seconds"] > 0
        exchanges = server.rows("SELECT status, finish_reason FROM exchanges WHERE session_id = ? ORDER BY seq", [session_id])
        assert [(e["status"], e["finish_reason"]) for e in exchanges] == [("ok", "tool_calls"), ("ok", "stop")]

    # the server's limits (--run-limit 2, --prepare-limit 2): never more than two harnesses at once, and the
    # third session prepared while the first two ran
    running = sorted((s["timings"]["running"]["started_at"], s["timings"]["running"]["ended_at"]) for s in sessions.values())
    assert max(sum(start <= t < end for start, end in running) for t, _ in running) <= 2
    last = max(sessions.values(), key=lambda s: s["timings"]["running"]["started_at"])
    first_end = min(end for _, end in running)
    assert last["timings"]["running"]["started_at"] >= first_end > last["timings"]["preparing"]["ended_at"]
    assert server.client.get(f"/tasks/{task_id}/sessions").json() == result["sessions"]

    # callbacks: one SessionResult per session, then the TaskResult listing them all
    task_result = rx.wait_for_task_result()
    delivered = {r["session_id"]: r for r in rx.results("session_result")}
    assert set(delivered) == set(sessions)
    assert {sid: r["reward"] for sid, r in delivered.items()} == {sid: s["reward"] for sid, s in sessions.items()}
    assert task_result["task_id"] == task_id and task_result["status"] == "completed"
    assert sorted(s["session_id"] for s in task_result["sessions"]) == sorted(sessions)
    assert rx.attempts[-1]["kind"] == "task_result"  # after every session's own delivery

    # the task's Parquet (rewards final, group advantages) and the store's trajectories table
    table = pq.read_table(result["trajectories"]).to_pylist()
    assert {r["session_id"] for r in table} == set(sessions)
    for row in table:
        assert row["reward"] == sessions[row["session_id"]]["reward"] and row["task_id"] == task_id and row["trainable"]
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["rollout_logprobs"]) and sum(row["loss_mask"]) > 0
    advantage = {r["session_id"]: r["advantage"] for r in table}
    by_reward = sorted(sessions, key=lambda sid: sessions[sid]["reward"])
    assert advantage[by_reward[0]] < 0 < advantage[by_reward[-1]]
    stored = server.rows("SELECT DISTINCT session_id FROM trajectories WHERE task_id = ?", [task_id])
    assert {r["session_id"] for r in stored} == set(sessions)
    assert result["trajectory_stats"]["sequences"] == len(table)


def test_invalid_requests_get_a_422_naming_the_field(server: RolloutServer) -> None:
    base = {"instruction": "x", "agent": {"harness": "qwen"}}
    cases = [
        ({**base, "num_samples": 0}, "num_samples"),
        ({"instruction": "x"}, "agent"),
        ({**base, "runtime": {"backend": "local", "cpu": 2}}, "runtime.cpu"),
        ({**base, "runtime": {"backend": "docker", "workdir": "relative"}}, "workdir"),
        ({**base, "agent": {"harness": "qwen", "env": {"OPENAI_BASE_URL": "http://x"}}}, "agent.env"),
        ({**base, "evaluator": {"command": "true", "python": "m:f"}}, "evaluator"),
        ({**base, "runtime": {"prepare": [{"upload": {"source": "/nonexistent/polar", "target": "x"}}]}}, "runtime.prepare.0.upload.source"),
        ({**base, "task_id": "has space"}, "task_id"),
    ]
    for body, field_name in cases:
        response = server.client.post("/tasks", json=body)
        assert response.status_code == 422, (body, response.text)
        assert field_name in response.json()["message"], response.json()
    assert server.client.get("/health").json()["status"] == "ok"


def test_unknown_harness_is_a_clear_error_and_the_server_keeps_serving(server: RolloutServer, tmp_path: Path) -> None:
    response = server.client.post("/tasks", json={"instruction": "x", "agent": {"harness": "cursor"}})
    assert response.status_code == 422
    message = response.json()["message"]
    assert message.startswith("agent.harness:") and all(name in message for name in harnesses.NAMES), message
    assert server.client.get("/tasks/no-such-task").status_code == 404
    assert server.client.delete("/sessions/no-such-session").status_code == 404
    health = server.client.get("/health").json()
    assert health["status"] == "ok" and health["gateway_listening"]
    assert "TaskRequest" in server.client.get("/openapi.json").json()["components"]["schemas"]
    # the same through the client command
    bad = tmp_path / "bad.yaml"
    bad.write_text("instruction: fix it\nagent:\n  harness: cursor\n")
    submitted = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "rollout", "submit", str(bad), "--server", server.url], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 2 and "HTTP 422" in submitted.stderr and "agent.harness:" in submitted.stderr, submitted.stderr


def test_local_task_three_samples_evaluated_assembled_and_delivered(server: RolloutServer, engine_url: str, receiver) -> None:
    # the TaskResult's receiver answers its first two attempts with 503: delivered once all the same
    rx = receiver(fail_first={"task_result": 2})
    task = coding_task("local-three", engine_url, "local", 3)
    task["callback_url"] = rx.url
    accepted = server.submit(task)
    # accepted at once: no session has ended yet
    assert all(s["status"] not in ("completed", "failed", "timed_out") for s in server.task(accepted["task_id"])["sessions"])
    result = server.wait(accepted["task_id"])
    check_completed_task(server, rx, accepted, result, 3)
    for session_id in accepted["session_ids"]:
        assert sandbox_left(session_id) == []

    task_attempts = [a for a in rx.attempts if a["kind"] == "task_result"]
    assert [a["status"] for a in task_attempts] == [503, 503, 200]
    assert len({a["delivery_id"] for a in task_attempts}) == 1 and task_attempts[0]["idempotency_key"] == task_attempts[0]["delivery_id"]
    assert len(rx.results("task_result")) == 1
    deliveries = {d["delivery_id"]: d for d in server.task(accepted["task_id"])["deliveries"]}
    assert deliveries[f"{accepted['task_id']}:task_result"]["attempts"] == 3
    assert all(d["status"] == "delivered" for d in deliveries.values()) and len(deliveries) == 4


def test_timeout_keeps_the_exchanges_and_removes_the_sandbox(server: RolloutServer, engine_url: str) -> None:
    # turn 1's tool call sleeps past the budget: the harness never gets to turn 2
    task = coding_task("slow", engine_url, "local", 1)
    task.update(instruction=f"Wait.\nSTEER-COMMAND: {BLOCK}", timeout_seconds=45)
    accepted = server.submit(task)
    result = server.wait(accepted["task_id"])
    (session,) = result["sessions"]
    assert session["status"] == "timed_out", session
    assert "45s budget" in session["error"]
    assert session["reward"] is None and session["evaluation"] is None
    assert {"post_run", "building", "timed_out"} <= set(session["timings"]) and "evaluating" not in session["timings"]
    # the call made before the timeout: kept, and assembled
    rows = server.rows("SELECT status, finish_reason FROM exchanges WHERE session_id = ?", [session["session_id"]])
    assert [(r["status"], r["finish_reason"]) for r in rows] == [("ok", "tool_calls")]
    assert session["n_exchanges"] == 1 and session["trajectory"]["sequences"] == 1
    assert server.rows("SELECT status FROM sessions WHERE session_id = ?", [session["session_id"]]) == [{"status": "timed_out"}]
    # the summary `rollout submit --wait` prints does not call this task completed
    from polar_mitm.rollout.console import summary_table

    assert f"task {accepted['task_id']}: all sessions ended, 0 of 1 completed; timed_out 1" in summary_table(result)
    # the sandbox is gone, the tool's `sleep` included
    assert sandbox_left(session["session_id"]) == []


def test_cancel_a_session_and_a_task_mid_run(server: RolloutServer, engine_url: str) -> None:
    task = coding_task("cancelled", engine_url, "local", 2)
    task.update(instruction=f"Wait.\nSTEER-COMMAND: {BLOCK}", timeout_seconds=300)
    accepted = server.submit(task)
    first, second = accepted["session_ids"]
    deadline = time.monotonic() + 240
    while len(server.rows("SELECT DISTINCT session_id FROM exchanges WHERE session_id IN (?, ?)", [first, second])) < 2:
        assert time.monotonic() < deadline, server.task(accepted["task_id"])
        time.sleep(1)
    # mid-run, the task already counts the exchanges its sessions made
    assert [s["n_exchanges"] for s in server.task(accepted["task_id"])["sessions"]] == [1, 1]
    assert server.client.get(f"/sessions/{first}").json()["n_exchanges"] == 1
    response = server.client.delete(f"/sessions/{first}")
    assert response.status_code == 202 and response.json()["session_id"] == first
    deadline = time.monotonic() + 60
    while server.client.get(f"/sessions/{first}").json()["status"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert server.client.get(f"/sessions/{second}").json()["status"] == "running"  # the other goes on
    assert server.client.delete(f"/tasks/{accepted['task_id']}").status_code == 202
    result = server.wait(accepted["task_id"], timeout=60)
    assert result["status"] == "cancelled" and result["counts"] == {"cancelled": 2}
    for session in result["sessions"]:
        assert session["n_exchanges"] == 1 and "post_run" in session["timings"] and "building" not in session["timings"]
        assert sandbox_left(session["session_id"]) == []
    assert {r["status"] for r in server.rows("SELECT status FROM sessions WHERE task_id = ?", [accepted["task_id"]])} == {"cancelled"}
    assert server.client.get("/health").json()["sessions"]["cancelled"] >= 2


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[str]:
    """A real Docker engine and the sandbox image, made by the scripts users run; a skip says why not. A dockerd
    this fixture started is stopped at the end of the module (one already running is reused and left running)."""
    started_here = False
    if not os.environ.get("DOCKER_HOST"):
        try:
            started = subprocess.run([str(REPO / "sandboxes" / "docker" / "dockerd.sh")], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("sandboxes/docker/dockerd.sh did not finish within 300s")
        if started.returncode != 0:
            pytest.skip(f"dockerd cannot start here (sandboxes/docker/dockerd.sh exit {started.returncode}): {started.stderr.strip()[-1500:]}")
        host = started.stdout.strip().splitlines()[-1].partition("=")[2]
        assert host == f"unix://{docker_socket()}"
        started_here = "dockerd.sh: started dockerd" in started.stderr
    env = {**os.environ, "DOCKER_HOST": os.environ.get("DOCKER_HOST") or f"unix://{docker_socket()}"}
    built = subprocess.run([str(REPO / "sandboxes" / "docker" / "build-image.sh")], capture_output=True, text=True, timeout=900, env=env)
    if built.returncode != 0:
        if started_here:
            subprocess.run([str(REPO / "sandboxes" / "docker" / "dockerd.sh"), "stop"], capture_output=True, timeout=60)
        pytest.skip(f"the sandbox image cannot be built here (sandboxes/docker/build-image.sh exit {built.returncode}): {built.stderr.strip()[-1500:]}")
    yield env["DOCKER_HOST"]
    if started_here:
        stopped = subprocess.run([str(REPO / "sandboxes" / "docker" / "dockerd.sh"), "stop"], capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0 and "stopped dockerd" in stopped.stdout, stopped.stdout + stopped.stderr


@pytest.mark.docker
def test_docker_task_three_samples(server: RolloutServer, engine_url: str, receiver, docker_engine: str) -> None:
    import docker

    missing = coding_task("docker-missing-image", engine_url, "docker", 1, image="polar-mitm/no-such-image:0")
    response = server.client.post("/tasks", json=missing)
    assert response.status_code == 422 and response.json()["message"].startswith("runtime.image:"), response.text
    rx = receiver()
    task = coding_task("docker-three", engine_url, "docker", 3, memory="1g", cpus=1.0)
    task["callback_url"] = rx.url
    accepted = server.submit(task)
    result = server.wait(accepted["task_id"])
    check_completed_task(server, rx, accepted, result, 3)
    for session in result["sessions"]:
        details = session["evaluation"]["details"]
        assert details["engine_reachable"] is False  # no network: only the gateway, through the relay
        assert details["memory_limit"] == 1 << 30
    engine = docker.DockerClient(base_url=docker_engine)
    try:
        left = engine.containers.list(all=True, filters={"label": "polar-mitm.session"})
        assert [c.labels["polar-mitm.session"] for c in left if c.labels["polar-mitm.session"] in accepted["session_ids"]] == []
    finally:
        engine.close()


@pytest.mark.docker
def test_a_dockerd_restart_mid_session_fails_it_cleanly_and_the_next_runs(server: RolloutServer, engine_url: str, receiver, docker_engine: str) -> None:
    """dockerd stopped (its containers with it: no live-restore) while a session's harness runs, then started again:
    that session fails once, saying so, its container is removed; the next task's session completes."""
    import docker

    if docker_engine != f"unix://{docker_socket()}":
        pytest.skip(f"DOCKER_HOST={docker_engine} is not the engine sandboxes/docker/dockerd.sh restarts")
    dockerd = str(REPO / "sandboxes" / "docker" / "dockerd.sh")
    rx = receiver()
    task = coding_task("docker-restart", engine_url, "docker", 1)
    task.update(instruction=f"Wait.\nSTEER-COMMAND: {BLOCK}", timeout_seconds=300, callback_url=rx.url)
    accepted = server.submit(task)
    (session_id,) = accepted["session_ids"]
    deadline = time.monotonic() + 120
    while not server.rows("SELECT 1 FROM exchanges WHERE session_id = ?", [session_id]):  # turn 1 done: its tool blocks
        assert time.monotonic() < deadline and server.task(accepted["task_id"])["status"] == "running", server.task(accepted["task_id"])
        time.sleep(0.5)
    assert server.client.get(f"/sessions/{session_id}").json()["status"] == "running"
    stopped = subprocess.run([dockerd, "stop"], capture_output=True, text=True, timeout=60)
    try:
        assert "stopped dockerd" in stopped.stdout, stopped.stdout + stopped.stderr
        # the engine stays away until the session has noticed (it must not wait for it to come back to do so), and
        # a few seconds more: its sandbox's removal meets no engine
        deadline = time.monotonic() + 30
        while server.client.get(f"/sessions/{session_id}").json()["status"] == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
        noticed = server.client.get(f"/sessions/{session_id}").json()["status"]
        time.sleep(5)
    finally:
        started = subprocess.run([dockerd], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert noticed != "running", "the session did not notice within 30 s that its Docker engine stopped"
    result = server.wait(accepted["task_id"], timeout=90)
    (session,) = result["sessions"]
    assert session["status"] == "failed" and result["counts"] == {"failed": 1}, json.dumps(session)[:3000]
    assert "Docker engine" in session["error"] and "container" in session["error"], session["error"]
    assert server.rows("SELECT status, error FROM sessions WHERE session_id = ?", [session_id]) == [{"status": "failed", "error": session["error"]}]
    rx.wait_for_task_result()
    assert [(r["session_id"], r["status"]) for r in rx.results("session_result")] == [(session_id, "failed")]
    assert sum(a["kind"] == "session_result" for a in rx.attempts) == 1  # delivered once: the session ended once
    engine = docker.DockerClient(base_url=docker_engine)
    try:
        assert engine.containers.list(all=True, filters={"label": f"polar-mitm.session={session_id}"}) == []
        # the same server, its engine back: the next task's session runs in a new container and completes
        after = server.submit(coding_task("docker-after-restart", engine_url, "docker", 1))
        (next_session,) = server.wait(after["task_id"], timeout=180)["sessions"]
        assert next_session["status"] == "completed", f"{next_session['error']}\n{next_session['harness_output'][-2000:]}"
        assert next_session["evaluation"]["details"]["content"] == next_session["session_id"] and next_session["n_exchanges"] == 2
        assert engine.containers.list(all=True, filters={"label": f"polar-mitm.session={next_session['session_id']}"}) == []
    finally:
        engine.close()


@pytest.mark.docker
def test_a_container_whose_engine_stays_away_is_removed_when_it_answers_again(docker_engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox's removal waits (here 1 s) for a stopped dockerd, says it could not remove the container, and the
    next sandbox's start removes it once the engine is back."""
    from polar_mitm.errors import DockerUnavailable
    from polar_mitm.rollout.models import DEFAULT_IMAGE
    from polar_mitm.rollout.runtimes import docker as docker_runtime

    if docker_engine != f"unix://{docker_socket()}":
        pytest.skip(f"DOCKER_HOST={docker_engine} is not the engine sandboxes/docker/dockerd.sh restarts")
    monkeypatch.setenv("DOCKER_HOST", docker_engine)
    monkeypatch.setattr(docker_runtime, "_client", None)
    monkeypatch.setattr(docker_runtime, "REMOVE_WAIT", 1.0)
    dockerd = str(REPO / "sandboxes" / "docker" / "dockerd.sh")
    container = docker_runtime.client().containers.run(DEFAULT_IMAGE, ["sleep", "infinity"], detach=True, init=True, network_mode="none", labels={"polar-mitm.session": "engine-away"})
    try:
        subprocess.run([dockerd, "stop"], capture_output=True, text=True, timeout=60, check=True)
        try:
            with pytest.raises(DockerUnavailable, match=f"container {container.id[:12]} is not removed: the Docker engine did not answer for 1s"):
                docker_runtime._remove_container(container.id)
            assert container.id in docker_runtime._unremoved
            docker_runtime._sweep()  # no engine: kept for the next sweep, nothing raised
            assert container.id in docker_runtime._unremoved
        finally:
            subprocess.run([dockerd], capture_output=True, text=True, timeout=120, check=True)
        docker_runtime._sweep()
        assert docker_runtime._unremoved == set()
        assert docker_runtime.client().containers.list(all=True, filters={"id": container.id}) == []
    finally:
        docker_runtime._unremoved.discard(container.id)
        if docker_runtime.client().containers.list(all=True, filters={"id": container.id}):
            container.remove(force=True)


def test_rollout_run_cli_leaves_a_store(engine_url: str, harness_installed: None, tmp_path: Path) -> None:
    """The README's main job, one sample: `polar-mitm rollout run examples/hello-task.yaml`."""
    import yaml

    task = yaml.safe_load((REPO / "examples" / "hello-task.yaml").read_text())
    task["num_samples"] = 1
    task_file = tmp_path / "hello.yaml"
    task_file.write_text(yaml.safe_dump(task))
    db = tmp_path / "store.duckdb"
    # as the README runs it: no --upstream, the local engine reused (the one the suite runs on, when it is that one)
    local = engine_url == LocalEngine().base_url
    upstream = [] if local else ["--upstream", engine_url]
    command = [sys.executable, "-m", "polar_mitm.cli", "rollout", "run", str(task_file), *upstream, "--db", str(db), "--confdir", str(tmp_path / "confdir"), "--engine-hook", HOOK]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TASK_WAIT, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1/1 sessions done" in done.stderr
    if local:  # the engine it leaves up on purpose is named on exit, with its memory and how to stop it
        [note] = [line for line in done.stderr.splitlines() if "the local engine is still running" in line]
        assert re.search(r"at http://127\.0\.0\.1:8011/v1 \(pid \d+; \d+ process(es)?, \d+\.\d GiB resident\); `polar-mitm engine stop` ends it$", note), note
    header, row = done.stdout.splitlines()[:2]
    assert header.split()[:3] == ["session", "status", "reward"] and row.split()[1:3] == ["completed", "1"]
    assert store.query_dicts(db, "SELECT status, reward FROM sessions WHERE task_id = 'hello'") == [{"status": "completed", "reward": 1.0}]
    assert pq.read_table(tmp_path / "store.rollouts" / "hello.parquet").num_rows >= 1
