"""A real local Ray cluster for the tests (a head and two workers on 127.0.0.1, each with the polar_node resource and a
polar-node label) and `rollout serve --ray` processes on it: shared by tests/integration/test_ray*.py. The
`ray_cluster` fixture is in tests/integration/conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import psutil

from polar_mitm.rollout.runtimes.local import marked_processes
from polar_mitm.util import free_port
from tests.support.rollout_runs import HOOK, RolloutServer, coding_task

NODES = ("n0", "n1", "n2")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SLEEP = 'python3 -c "import time; time.sleep({seconds})"'


def start_ray_node(start: Any, attempts: int = 3) -> Any:
    """`start()` a Ray node (or the head) at a raised priority; on this loaded machine its raylet may still give up
    on its agents, so what that attempt left (the Ray processes it started, none other) is ended and it is retried."""
    for attempt in range(attempts):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            with ray_startup_priority():
                return start()
        except Exception:
            if attempt == attempts - 1:
                raise
            for process in psutil.Process().children(recursive=True):
                with suppress(psutil.Error):
                    if process.pid not in before and "ray" in " ".join(process.cmdline()):
                        process.kill()
            time.sleep(2)
    raise AssertionError("unreachable")


@contextmanager
def ray_startup_priority():
    """A raylet gives its node's Python agents a fixed ~15 s to come up and dies otherwise; on this shared 2-core
    machine they can take longer. Started at a raised priority, then every process started meanwhile goes back
    to normal, so the sessions and everything else run as usual."""
    os.setpriority(os.PRIO_PROCESS, 0, -10)
    try:
        yield
    finally:
        for child in psutil.Process().children(recursive=True):
            with suppress(psutil.Error):
                child.nice(0)
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def start_server(ray_cluster, engine_url: str, base: Path, *extra: str, db: Path | None = None, nodes: tuple[str, ...] = NODES) -> RolloutServer:
    port = free_port()
    base.mkdir(parents=True, exist_ok=True)
    log = base / f"server-{port}.log"
    db = db or base / "store.duckdb"
    command = [
        sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--ray", ray_cluster.address, "--port", str(port), "--upstream", engine_url,
        "--db", str(db), "--confdir", str(base / "confdir"), "--engine-hook", HOOK, "--prepare-limit", "1", "--run-limit", "1", "-v", *extra,
    ]
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    server = RolloutServer(f"http://127.0.0.1:{port}", db, log, process)
    deadline = time.monotonic() + 240
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            health = server.client.get("/health")
            if health.status_code == 200 and all(health.json()["nodes"].get(n) for n in nodes):
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise TimeoutError(f"rollout server did not come up:\n{server.log_tail()}")
        time.sleep(0.5)


def stop_server(server: RolloutServer, sig: int = signal.SIGTERM) -> None:
    server.client.close()
    try:
        os.killpg(server.process.pid, sig)
        server.process.wait(timeout=90)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


def sql(server: RolloutServer, query: str) -> list[dict[str, Any]]:
    response = server.client.get("/sql", params={"q": query})
    assert response.status_code == 200, response.text
    body = response.json()
    return [dict(zip(body["columns"], row, strict=True)) for row in body["rows"]]


def sleeping_task(task_id: str, engine_url: str, samples: int, seconds: int, **fields: Any) -> dict[str, Any]:
    task = coding_task(task_id, engine_url, "local", samples)
    task["instruction"] = f"Wait.\nSTEER-COMMAND: {SLEEP.format(seconds=seconds)}"
    task["evaluator"] = None
    return {**task, **fields}


def wait_task(server: RolloutServer, task_id: str, timeout: float) -> dict[str, Any]:
    """RolloutServer.wait, riding over a dropped keep-alive connection (uvicorn may close one as a request goes out)."""

    def finished() -> dict[str, Any] | None:
        try:
            result = server.task(task_id)
        except httpx.TransportError:
            return None
        return result if result["status"] != "running" else None

    return wait_for(finished, timeout, f"task {task_id} to finish", interval=1.0)


def wait_for(check, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def end_sessions_left(session_ids: list[str]) -> None:
    """Harness processes of sessions whose node was killed under them (nothing else would stop them)."""
    for session_id in session_ids:
        for pid in marked_processes(session_id):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
