"""The rollout API clients (polar_mitm/api_clients.py), sync and async, against the real rollout server app
(routes, Scheduler, models, error bodies, callbacks) served by uvicorn on loopback over a stand-in node, and its
control fan-out reaching the gateway's real control logic (tests/support/rollout_standins.py); the CLI's
`rollout submit` summary through the same server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from polar_mitm.api_clients import AsyncGatewayControl, AsyncRolloutClient, GatewayControl, RolloutClient
from polar_mitm.cli import main
from polar_mitm.errors import ClientError, ControlError, ServerRefused
from polar_mitm.gateway.control import PolicyControl
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.console import load_task, summary_table
from polar_mitm.rollout.models import TaskRequest
from polar_mitm.util import free_port
from tests.support.rollout_standins import LoopbackServers, control_app, rollout_app

AGENT = {"harness": "qwen"}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every async client of the module (an httpx.AsyncClient stays on the loop it started on)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    servers = LoopbackServers(control_app(PolicyControl()))
    yield servers.urls[0]
    servers.close()


@pytest.fixture(scope="module")
def server(gateway: str) -> Iterator[str]:
    # callbacks give up fast: a failed delivery is what the summary must name
    servers = LoopbackServers(rollout_app(gateway, CallbackSender(attempts=2, backoff=0.01, timeout=5)))
    yield servers.urls[0]
    servers.close()


class Awaited:
    """An async client driven from the test's own code: every method call runs to its end on `loop`, so one test
    body checks both clients."""

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop):
        self.client, self.loop = client, loop

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())


@pytest.fixture(params=["sync", "async"])
def rollouts(request: pytest.FixtureRequest, server: str, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    client = RolloutClient(server) if request.param == "sync" else Awaited(AsyncRolloutClient(server), loop)
    yield client
    client.close()


@pytest.fixture(params=["sync", "async"])
def control(request: pytest.FixtureRequest, gateway: str, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    client = GatewayControl(gateway) if request.param == "sync" else Awaited(AsyncGatewayControl(gateway), loop)
    yield client
    client.close()


def task(task_id: str, rewards: list[float], seconds: float = 0.0, **more: Any) -> dict[str, Any]:
    return {"task_id": task_id, "instruction": "x", "num_samples": len(rewards), "agent": AGENT, "metadata": {"rewards": rewards, "seconds": seconds}, **more}


def test_sync_and_async_clients_give_the_same_answers(server: str, loop: asyncio.AbstractEventLoop) -> None:
    sync, asynchronous = RolloutClient(server), Awaited(AsyncRolloutClient(server), loop)
    try:
        request = task("same", [0.0, 1.0, 1.0], seconds=0.2)
        accepted = sync.submit(request)
        # the same request as a TaskRequest, from the other client: the same task (a resubmission)
        assert asynchronous.submit(TaskRequest.model_validate(request)) == accepted
        assert accepted["task_id"] == "same" and len(accepted["session_ids"]) == 3 and accepted["status_url"] == "/tasks/same"
        results = sync.wait("same", timeout=30, poll_seconds=0.05), asynchronous.wait("same", timeout=30, poll_seconds=0.05)
        assert results[0] == results[1] and results[0]["status"] == "completed" and results[0]["counts"] == {"completed": 3}
        session_id = accepted["session_ids"][1]
        for name, args in (("task", ["same"]), ("sessions", ["same"]), ("session", [session_id]), ("tasks", []), ("health", []), ("control", ["status"])):
            assert getattr(sync, name)(*args) == getattr(asynchronous, name)(*args), name
        assert sync.session(session_id)["reward"] == 1.0 and [s["session_id"] for s in sync.sessions("same")] == accepted["session_ids"]
        assert "same" in [t["task_id"] for t in sync.tasks()] and sync.health()["status"] == "ok"
    finally:
        sync.close()
        asynchronous.close()


def test_wait_polls_until_the_task_is_final(rollouts: Any, request: pytest.FixtureRequest) -> None:
    task_id = f"polled-{request.node.callspec.id}"
    rollouts.submit(task(task_id, [1.0, 0.0], seconds=0.5))
    polled: list[dict[str, Any]] = []
    result = rollouts.wait(task_id, timeout=30, poll_seconds=0.05, on_poll=polled.append)
    statuses = [r["status"] for r in polled]
    assert statuses[-1] == "completed" and set(statuses[:-1]) == {"running"} and len(statuses) >= 3, statuses
    assert result == polled[-1] and result["counts"] == {"completed": 2}


def test_wait_times_out_with_a_client_error_then_cancel_ends_the_task(rollouts: Any, request: pytest.FixtureRequest) -> None:
    task_id = f"slow-{request.node.callspec.id}"
    rollouts.submit(task(task_id, [1.0], seconds=60))
    started = time.monotonic()
    with pytest.raises(ClientError, match=rf"^task {task_id} still running after 0.4s \(running 1\)$") as caught:
        rollouts.wait(task_id, timeout=0.4, poll_seconds=0.1)
    assert 0.4 <= time.monotonic() - started < 5 and not isinstance(caught.value, ServerRefused)
    cancelled = rollouts.cancel(task_id)
    assert cancelled["task_id"] == task_id
    result = rollouts.wait(task_id, timeout=30, poll_seconds=0.05)
    assert result["status"] == "cancelled" and result["counts"] == {"cancelled": 1}


def test_http_errors_are_client_errors_with_the_servers_message(rollouts: Any, request: pytest.FixtureRequest) -> None:
    def refused(call: Callable[..., Any], *args: Any) -> ServerRefused:
        with pytest.raises(ServerRefused) as caught:
            call(*args)
        assert isinstance(caught.value, ClientError) and isinstance(caught.value, ControlError)
        return caught.value

    for call, what in ((rollouts.task, "task"), (rollouts.sessions, "task"), (rollouts.cancel, "task"), (rollouts.session, "session"), (rollouts.cancel_session, "session")):
        error = refused(call, "nope")
        assert (error.status, error.kind, error.server_message) == (404, "not_found", f"no {what} 'nope'"), error
        assert str(error).endswith(f": HTTP 404: no {what} 'nope'")

    task_id = f"taken-{request.node.callspec.id}"
    rollouts.submit(task(task_id, [1.0]))
    conflict = refused(rollouts.submit, task(task_id, [1.0, 1.0]))
    assert conflict.status == 409 and conflict.kind == "conflict" and "exists with a different request" in conflict.server_message

    invalid = refused(rollouts.submit, {"instruction": "x", "agent": AGENT, "num_samples": 0})
    assert invalid.status == 422 and invalid.kind == "invalid_request" and invalid.server_message.startswith("num_samples:")
    unrunnable = refused(rollouts.submit, {"instruction": "x", "agent": AGENT, "runtime": {"backend": "docker"}})
    assert unrunnable.status == 422 and unrunnable.server_message == "runtime.backend: docker: no Docker engine on this stand-in node"
    # a single-node server has no /nodes (a Ray head has)
    assert refused(rollouts.nodes).status == 404


def test_control_through_the_server_and_on_the_gateway(rollouts: Any, control: Any, gateway: str) -> None:
    (node, status), = rollouts.control("status")["nodes"].items()
    assert node == gateway and status["state"] == "serving"
    version = status["policy_version"] + 1
    assert rollouts.control("pause", mode="drain", timeout_seconds=5)["nodes"][gateway]["state"] == "paused"
    with pytest.raises(ServerRefused) as again:
        rollouts.control("pause")
    assert (again.value.status, again.value.kind) == (409, "already_paused") and "already paused" in again.value.message
    assert again.value.server_message.endswith(f"(node {gateway})")
    assert control.status()["state"] == "paused"
    resumed = control.resume(policy_version=version, engine_model=None)
    assert resumed["state"] == "serving" and resumed["policy_version"] == version
    with pytest.raises(ServerRefused) as not_paused:
        control.resume()
    assert (not_paused.value.status, not_paused.value.kind) == (409, "not_paused")
    paused = control.pause(mode="abort")
    assert paused["state"] == "paused" and paused["pause_mode"] == "abort"
    with pytest.raises(ControlError) as backwards:  # relayed by the server, as ControlError always was
        rollouts.control("resume", policy_version=version - 1)
    assert (backwards.value.status, backwards.value.kind) == (409, "version_backwards") and "lower than the current" in backwards.value.message
    assert rollouts.control("resume")["nodes"][gateway]["policy_version"] == version


def test_an_unreachable_server_is_a_client_error(loop: asyncio.AbstractEventLoop) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for client, kind in ((RolloutClient(url), "rollout server"), (Awaited(AsyncRolloutClient(url), loop), "rollout server"), (GatewayControl(url), "gateway")):
        with pytest.raises(ClientError, match=rf"^cannot reach the {kind} at {url}: ConnectError") as caught:
            client.health() if kind == "rollout server" else client.status()
        assert not isinstance(caught.value, ServerRefused)
        client.close()


def test_submit_wait_summary_names_rewards_no_signal_and_failed_callbacks(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    callback = f"http://127.0.0.1:{free_port()}/results"  # nobody listens: every delivery fails
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"task_id: flat\ninstruction: x\nnum_samples: 2\nagent: {{harness: qwen}}\ncallback_url: {callback}\nmetadata: {{rewards: [1, 1], seconds: 0.2}}\n")
    assert main(["rollout", "submit", str(flat), "--wait", "--server", server]) == 0
    out, err = capsys.readouterr()
    assert "task flat: 2 sessions (" in err and "2/2 sessions done" in err
    assert "task flat: completed (2 of 2 sessions); completed 2; " in out and "callback deliveries failed" in out
    assert "rewards: mean 1 ± 0 over 2 scored sessions; no signal: every reward is the same, so every advantage is 0" in out
    with RolloutClient(server) as client:
        for session_id in client.task("flat")["sessions"]:
            assert f"  failed {session_id['session_id']}:session_result after 2 attempts: ConnectError" in out, out

        client.submit(task("spread", [0.0, 1.0, 1.0, 0.0]))
        spread = summary_table(client.wait("spread", timeout=30, poll_seconds=0.05))
    assert "rewards: mean 0.5 ± 0.577 over 4 scored sessions\n" in spread + "\n" and "no signal" not in spread
    assert "task spread: completed (4 of 4 sessions); completed 4\n" in spread and "callbacks" not in spread

    # refused: the CLI's one line and exit status, as before
    docker = tmp_path / "docker.yaml"
    docker.write_text("instruction: x\nagent: {harness: qwen}\nruntime: {backend: docker}\n")
    assert main(["rollout", "submit", str(docker), "--server", server]) == 2
    assert capsys.readouterr().err == "polar-mitm rollout: the server refused the task (HTTP 422): runtime.backend: docker: no Docker engine on this stand-in node\n"


def test_load_task_resolves_relative_paths_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "task.yaml"
    path.write_text("instruction: x\nagent: {harness: qwen}\nevaluator: {python: 'check.py:score'}\nruntime: {prepare: [{upload: {source: data, target: data}}]}\n")
    loaded = load_task(path)
    assert loaded["evaluator"]["python"] == f"{tmp_path / 'sub' / 'check.py'}:score"
    assert loaded["runtime"]["prepare"][0]["upload"]["source"] == str(tmp_path / "sub" / "data")
