"""The single-machine rollout server survives its own death (issue 28): `polar-mitm rollout serve`, the real
console script started as a user starts it (from its own working directory, relative paths), SIGKILLed mid-task
and restarted on the same state; and its state's disk filling up (a size-limited tmpfs the test mounts).

No engine is needed: the task's sessions end in their prepare steps (real processes in real local sandboxes),
chosen by the session's sample index (the sandbox marker ends `-<index>-<suffix>`): 0 and 1 fail at once, 2
blocks (a shell whose child sleeps) and 3 waits for the one prepare slot (slots go in sample order). The callback
receiver is a real HTTP server on loopback that counts deliveries by id and refuses sample 0's until told otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from polar_mitm import harnesses, store
from polar_mitm.rollout.runtimes.local import marked_processes
from polar_mitm.util import free_port
from tests.support.callback_endpoint import CallbackEndpoint
from tests.support.upstream_standins import StandinUpstream

CONSOLE_SCRIPT = Path(sys.executable).with_name("polar-mitm")
PREPARE = 'case "$POLAR_MITM_SANDBOX" in *-0-*|*-1-*) exit 3;; esac; sleep 300 & sleep 301; wait'
DIED = "the rollout server stopped while this session ran"


@pytest.fixture(scope="module")
def qwen_installed() -> None:
    try:
        harnesses.get("qwen").executable()  # the local runtime's check; the sessions never get to run it
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))


class Receiver(CallbackEndpoint):
    """Callback deliveries by id; sample 0's session result is answered 503 while `refusing`."""

    def __init__(self) -> None:
        self.attempts: list[tuple[str, int]] = []  # (delivery id, status answered)
        self.refusing = True
        super().__init__()

    def answer(self, headers: Message, body: dict[str, Any]) -> int:
        refused = self.refusing and body.get("kind") == "session_result" and body.get("sample_index") == 0
        self.attempts.append((headers["x-polar-delivery-id"], 503 if refused else 200))
        return 503 if refused else 200

    def answered(self, status: int) -> Counter[str]:
        return Counter(delivery for delivery, answer in self.attempts if answer == status)


class Serve:
    """`polar-mitm rollout serve` in `cwd`, its log, an HTTP client."""

    def __init__(self, cwd: Path, *args: str):
        self.port = free_port()
        self.log = cwd / f"serve-{self.port}.log"
        command = [str(CONSOLE_SCRIPT), "rollout", "serve", "--port", str(self.port), "--upstream", "http://127.0.0.1:9/v1", "--db", "polar.duckdb", "--confdir", "confdir", *args]
        self.process = subprocess.Popen(command, cwd=cwd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30, trust_env=False)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, f"rollout serve exited with {self.process.returncode}:\n{self.text()}"
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"rollout serve did not come up:\n{self.text()}"
            time.sleep(0.2)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def sessions(self, task_id: str) -> list[dict[str, Any]]:
        response = self.client.get(f"/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return response.json()["sessions"]

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def until(condition, what: str, timeout: float = 60, state: Any = None) -> Any:
    """condition()'s first true value; fails after `timeout` naming `what` and (a callable) `state`'s answer."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}" + (f"\n{state()}" if state else "")
        time.sleep(0.1)
    return value


def test_a_sigkilled_server_takes_its_sandboxes_and_a_restart_reports_every_session_once(qwen_installed: None, tmp_path: Path) -> None:
    rx = Receiver()
    task = {
        "task_id": "durable", "instruction": "wait", "num_samples": 4, "timeout_seconds": 600, "agent": {"harness": "qwen"},
        "runtime": {"backend": "local", "prepare": [{"exec": PREPARE}]}, "callback_url": rx.url,
    }
    first = Serve(tmp_path, "--prepare-limit", "1")
    second: Serve | None = None
    ids: list[str] = []
    try:
        accepted = first.client.post("/tasks", json=task)
        assert accepted.status_code == 202, accepted.text
        ids = accepted.json()["session_ids"]
        # before the kill: 0 failed (its delivery refused, so not acknowledged), 1 failed and acknowledged,
        # 2 blocked in its sandbox, 3 queued behind it
        until(lambda: rx.answered(503)[f"{ids[0]}:session_result"] and rx.answered(200)[f"{ids[1]}:session_result"], "the first two deliveries", state=lambda: (rx.attempts, first.sessions("durable"), first.text()[-3000:]))
        statuses = until(lambda: sorted(s["status"] for s in first.sessions("durable")) == ["failed", "failed", "preparing", "queued"] and first.sessions("durable"), "2 failed, 1 preparing, 1 queued", state=lambda: first.sessions("durable"))
        before = {s["session_id"]: s for s in statuses}
        blocked, waiting = ids[2], ids[3]  # prepare slots go in sample order
        assert (before[blocked]["status"], before[waiting]["status"]) == ("preparing", "queued"), before
        until(lambda: len(marked_processes(blocked)) >= 3, "the blocked session's sandbox processes", state=lambda: first.sessions("durable"))
        relay_folders = list(Path(tempfile.gettempdir()).glob(f"polar-node-{first.process.pid}-*"))
        assert len(relay_folders) == 1, relay_folders  # its node's relay socket, which a SIGKILL leaves behind
        first.process.send_signal(signal.SIGKILL)  # the server alone: its sandboxes get no signal from us
        first.process.wait()
        killed = time.monotonic()
        until(lambda: not marked_processes(blocked), "the blocked session's processes gone after the server's SIGKILL", timeout=5)
        assert len(list(Path(tempfile.gettempdir()).glob(f"polar-sandbox-{blocked[:60]}-*"))) == 1  # its directory is left
        print(f"\nsandbox processes gone {time.monotonic() - killed:.2f}s after the SIGKILL")

        rx.refusing = False
        second = Serve(tmp_path, "--prepare-limit", "1")
        assert not relay_folders[0].exists()  # removed by the restarted server's node (its process is gone)
        assert not list(Path(tempfile.gettempdir()).glob(f"polar-sandbox-{blocked[:60]}-*"))  # its sandbox's directory too
        listed = second.client.get("/tasks").json()
        assert [t["task_id"] for t in listed] == ["durable"], listed
        # the one never started is started now (it blocks as the other did); cancelled here to end the task
        until(lambda: marked_processes(waiting), "the queued session started by the restarted server", state=lambda: second.sessions("durable"))
        assert second.client.delete(f"/sessions/{waiting}").status_code == 202
        result = until(lambda: (r := second.client.get("/tasks/durable").json())["status"] != "running" and r, "the task to finish")
        sessions = {s["session_id"]: s for s in result["sessions"]}
        assert [sessions[i]["status"] for i in (ids[0], ids[1], blocked, waiting)] == ["failed", "failed", "failed", "cancelled"], sessions
        assert sessions[ids[0]]["error"] == before[ids[0]]["error"] and "exited with 3" in sessions[ids[0]]["error"]  # kept
        assert DIED in sessions[blocked]["error"]
        row = store.query_dicts(tmp_path / "polar.duckdb", "SELECT status, error FROM sessions WHERE session_id = ?", [blocked])
        assert row and row[0]["status"] == "failed" and DIED in row[0]["error"], row  # the store's row says so too
        # each delivery acknowledged exactly once; the one acknowledged before the kill never sent again
        until(lambda: rx.answered(200)["durable:task_result"], "the TaskResult delivered")
        expected = {f"{i}:session_result" for i in ids} | {"durable:task_result"}
        assert rx.answered(200) == Counter(expected), rx.attempts
        assert sum(1 for delivery, _ in rx.attempts if delivery == f"{ids[1]}:session_result") == 1, rx.attempts
        assert "1 task(s) back from" in second.text() and "1 session(s) that ran when the server stopped are failed" in second.text()
    finally:
        for server in (first, second):
            if server is not None:
                server.stop()
        rx.close()
        for session_id in ids:
            for pid in marked_processes(session_id):
                os.kill(pid, signal.SIGKILL)
    assert not [pid for session_id in ids for pid in marked_processes(session_id)]
    assert (tmp_path / "polar.rollout.duckdb").exists()  # the state's default place: beside the store


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    return filler


def test_a_full_state_disk_refuses_new_tasks_with_503_in_one_line_and_recovers(qwen_installed: None, tmp_path: Path, small_disk: Path) -> None:
    task = {"instruction": "x", "agent": {"harness": "qwen"}, "runtime": {"backend": "local", "prepare": [{"exec": "exit 3"}]}}
    state = small_disk / "state.duckdb"
    server = Serve(tmp_path, "--state", str(state))
    accepted: list[str] = []
    try:
        assert server.client.post("/tasks", json={**task, "task_id": "before"}).status_code == 202
        accepted.append("before")
        filler = fill(small_disk)
        answers = {}
        for n in range(20):  # a write may still fit in a page the file already has: until the first refusal
            answers[f"full-{n}"] = reply = server.client.post("/tasks", json={**task, "task_id": f"full-{n}"})
            if reply.status_code != 202:
                break
            accepted.append(f"full-{n}")
        refused = [task_id for task_id, reply in answers.items() if reply.status_code != 202]
        assert len(refused) == 1 and answers[refused[0]].status_code == 503, {k: r.text for k, r in answers.items()}
        body = answers[refused[0]].json()
        assert "was not accepted" in body["message"] and "No space left on device" in body["message"], body
        assert server.client.post("/tasks", json={**task, "task_id": "full-again"}).status_code == 503  # still full
        assert {t["task_id"] for t in server.client.get("/tasks").json()} == set(accepted)  # refused: no task
        assert server.client.get(f"/tasks/{refused[0]}").status_code == 404
        filler.unlink()
        again = server.client.post("/tasks", json={**task, "task_id": refused[0]})
        assert again.status_code == 202, again.text
        accepted.append(refused[0])
        until(lambda: server.client.get(f"/tasks/{refused[0]}").json()["status"] != "running", "the task after recovery")
        log = server.text()
        assert log.count("cannot write the server's state") == 1 and log.count("is writable again") == 1, log
    finally:
        server.stop()
    # every task answered 202 is in the state file (and none other)
    with duckdb.connect(str(state), read_only=True) as con:
        assert {row[0] for row in con.execute("SELECT task_id FROM head_tasks").fetchall()} == set(accepted)


@pytest.mark.harness
def test_a_timed_out_session_counts_the_model_call_it_had_in_flight(qwen_installed: None, tmp_path: Path) -> None:
    """The engine never answers: the session's budget runs out with Qwen Code's call in flight. Its result is counted
    only once that call's row is in the store (the gateway cancels the call when the killed harness's connection
    closes, and records it): n_exchanges and the rows agree when the result is returned, not some time after."""
    engine = StandinUpstream("hang", delay=300)
    server = Serve(tmp_path, "--upstream", engine.url)
    try:
        task = {"task_id": "in-flight", "instruction": "say hi", "timeout_seconds": 25, "agent": {"harness": "qwen"}, "runtime": {"backend": "local"}}
        assert server.client.post("/tasks", json=task).status_code == 202
        result = until(lambda: (r := server.client.get("/tasks/in-flight").json())["status"] != "running" and r, "the session's budget to run out", timeout=120)
        # read at once: a row committed after the result was counted would be missing from n_exchanges
        rows = store.query_dicts(tmp_path / "polar.duckdb", "SELECT status FROM exchanges WHERE session_id = ? ORDER BY seq", [result["sessions"][0]["session_id"]])
    finally:
        server.stop()
        engine.close()
    session = result["sessions"][0]
    assert session["status"] == "timed_out", session
    assert rows and rows[-1]["status"] == "client_disconnected", rows  # the call in flight, cancelled and recorded
    assert session["n_exchanges"] == len(rows), (session["n_exchanges"], rows)
