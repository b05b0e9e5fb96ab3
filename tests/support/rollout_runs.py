"""A rollout server process run by the tests, its HTTP calls, a callback receiver and the coding task the
rollout tests submit: shared by tests/integration/test_rollout.py and the Ray tests (fixtures: its conftest.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from polar_mitm import store
from tests.support.callback_endpoint import CallbackEndpoint

REPO = Path(__file__).resolve().parents[2]
HOOK = f"{REPO / 'examples' / 'steer_tiny_model.py'}:steer"
CHECK = REPO / "tests" / "support" / "rollout_check.py"
TASK_WAIT = 420
WRITE_ANSWER = 'echo "$POLAR_MITM_SESSION" > answer.txt'


@dataclass
class RolloutServer:
    url: str
    db: Path
    log: Path
    process: subprocess.Popen
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=60, trust_env=False)

    def submit(self, task: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post("/tasks", json=task)
        assert response.status_code == 202, response.text
        return response.json()

    def task(self, task_id: str) -> dict[str, Any]:
        response = self.client.get(f"/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, task_id: str, timeout: float = TASK_WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.task(task_id)
            if result["status"] != "running":
                return result
            time.sleep(1)
        raise AssertionError(f"task {task_id} still running after {timeout}s: {json.dumps(self.task(task_id))[:3000]}\n{self.log_tail()}")

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        return store.query_dicts(self.db, sql, params)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def serve(options: list[str], cwd: Path, log: Path, timeout: float = 90) -> RolloutServer:
    """`polar-mitm rollout serve --port P OPTIONS...` run from `cwd` (relative paths as a user gives them), once its
    /health answers; stop it with `stop_process_group(server.process, grace)`."""
    import sys

    from polar_mitm.util import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--port", str(port), *options], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    server = RolloutServer(f"http://127.0.0.1:{port}", cwd / "store.duckdb", log, process)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if server.client.get("/health").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout server did not come up:\n{server.log_tail()}")
        time.sleep(0.3)


class Receiver(CallbackEndpoint):
    """A trainer's callback endpoint. It counts a result once per delivery id (as a trainer should), and can
    answer the first attempts of chosen deliveries with errors (`fail_first[kind] = n`)."""

    def __init__(self, fail_first: dict[str, int] | None = None):
        self.fail_first = dict(fail_first or {})
        self.attempts: list[dict[str, Any]] = []
        self.counted: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        super().__init__()

    def answer(self, headers: Message, body: dict[str, Any]) -> int:
        delivery_id = headers["x-polar-delivery-id"]
        with self.lock:
            seen = sum(a["delivery_id"] == delivery_id for a in self.attempts)
            status = 503 if seen < self.fail_first.get(body["kind"], 0) else 200
            self.attempts.append({"delivery_id": delivery_id, "kind": body["kind"], "idempotency_key": headers["idempotency-key"], "status": status, "body": body})
            # counted at first sight, as if the answer to the first attempt was what got lost
            self.counted.setdefault(delivery_id, body)
        return status

    def results(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [body for body in self.counted.values() if body["kind"] == kind]

    def wait_for_task_result(self, timeout: float = 60) -> dict[str, Any]:
        """The TaskResult, once an attempt to deliver it was answered 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                answered = any(a["kind"] == "task_result" and a["status"] == 200 for a in self.attempts)
            if answered:
                return self.results("task_result")[0]
            time.sleep(0.2)
        raise AssertionError(f"no TaskResult delivered; attempts: {[(a['kind'], a['status']) for a in self.attempts]}")


def coding_task(task_id: str, engine_url: str, backend: str, samples: int, **runtime: Any) -> dict[str, Any]:
    """The agent writes its session id into answer.txt with its shell tool; rollout_check.py scores it."""
    return {
        "task_id": task_id,
        "instruction": f"Write your session id into answer.txt.\nSTEER-COMMAND: {WRITE_ANSWER}",
        "num_samples": samples,
        "timeout_seconds": 240,
        "runtime": {
            "backend": backend,
            "env": {"ENGINE_PORT": str(urlsplit(engine_url).port)},
            "prepare": [
                {"upload": {"source": str(CHECK), "target": "check.py"}},
                {"exec": "mkdir -p data && echo seeded > data/seed.txt"},
            ],
            **runtime,
        },
        "agent": {"harness": "qwen"},
        "builder": {"name": "prefix_merging"},
        "evaluator": {"command": "python3 check.py", "timeout_seconds": 60},
        "metadata": {"group": task_id, "policy_version": 7},
    }
