"""The single-machine server's durable state (polar_mitm/rollout/durable.py) without a gateway: the real
DurableStore file, LocalDurableScheduler and DurableCallbackSender over the stand-in node of
tests/support/rollout_standins.py, a real HTTP callback receiver; and local sandboxes dying with their server
(a real child process running a LocalSandbox, SIGKILLed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

from polar_mitm.rollout.durable import DIED_WITH_SERVER, DurableStore, LocalDurableScheduler
from polar_mitm.rollout.models import Delivery, SessionResult, TaskRequest
from polar_mitm.rollout.runtimes.local import OWNER_FILE, marked_processes, remove_owned
from polar_mitm.rollout.session_run import Report, SessionWork, queued_result
from polar_mitm.store import now
from tests.support.rollout_runs import Receiver
from tests.support.rollout_standins import StandinNode


class CountingNode(StandinNode):
    """The stand-in node, counting the sessions it was asked to run."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.ran: list[str] = []

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        self.ran.append(work.session_id)
        return await super().run_session(work, report)


def restarted(state: Path, callbacks_url: str) -> tuple[LocalDurableScheduler, CountingNode, str]:
    """A scheduler as a restarted server makes it: the store read back, every task recovered."""
    node = CountingNode()
    scheduler = LocalDurableScheduler(node, DurableStore(state))  # type: ignore[arg-type]  # the stand-in is a Node structurally
    scheduler.callbacks.backoff = 0.01
    node.scheduler = scheduler
    assert scheduler.recover() == 1
    return scheduler, node, next(iter(scheduler.tasks))


def test_a_restart_keeps_ended_sessions_fails_started_ones_starts_queued_ones_and_delivers_each_id_once(tmp_path: Path) -> None:
    rx = Receiver()
    state = tmp_path / "polar.rollout.duckdb"
    request = TaskRequest.model_validate({"task_id": "t", "instruction": "x", "num_samples": 3, "agent": {"harness": "qwen"}, "callback_url": rx.url, "metadata": {"rewards": [1.0, 0.5, 0.25]}})
    ended, died, queued = ["t-0-a", "t-1-a", "t-2-a"]
    # what a server killed mid-task leaves: one session ended (its delivery acknowledged), one started, one queued
    store = DurableStore(state)
    store.add_task("t", request, [ended, died, queued], now())
    store.dispatched(ended, "local")
    work = SessionWork(session_id=ended, task_id="t", sample_index=0, request=request)
    store.session_ended(queued_result(work).model_copy(update={"status": "completed", "reward": 1.0}))
    store.save_delivery(Delivery(delivery_id=f"{ended}:session_result", kind="session_result", url=rx.url, status="delivered", attempts=1, delivered_at=now()))
    store.dispatched(died, "local")
    store.close()

    async def main() -> tuple[list[str], dict[str, SessionResult], list[str]]:
        scheduler, node, task_id = restarted(state, rx.url)
        task = await scheduler.wait(task_id)
        sessions = dict(task.sessions)
        await scheduler.close()
        scheduler.store.close()
        # a second restart: everything ended and was acknowledged, so nothing runs and nothing is sent
        again, node_again, _ = restarted(state, rx.url)
        await again.wait(task_id)
        await again.close()
        again.store.close()
        return node.ran, sessions, node_again.ran

    try:
        ran, sessions, ran_again = asyncio.run(main())
        attempts = Counter(a["delivery_id"] for a in rx.attempts)
    finally:
        rx.close()
    assert ran == [queued] and ran_again == []  # only the session never started runs, once
    assert (sessions[ended].status, sessions[ended].reward) == ("completed", 1.0)  # kept as it ended
    assert sessions[died].status == "failed" and sessions[died].error == DIED_WITH_SERVER
    assert (sessions[queued].status, sessions[queued].reward) == ("completed", 0.25)
    # the acknowledged delivery is never sent again; every other one exactly once, over both restarts
    assert attempts == {f"{died}:session_result": 1, f"{queued}:session_result": 1, "t:task_result": 1}, attempts


SERVER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from polar_mitm.rollout.models import Runtime
    from polar_mitm.rollout.runtimes import GatewayAccess, SandboxSpec
    from polar_mitm.rollout.runtimes.local import LocalSandbox

    async def main():
        sandbox = LocalSandbox(SandboxSpec(sys.argv[1], Runtime(), GatewayAccess("http://127.0.0.1:9", Path(sys.argv[2])), owner="unit-owner"))
        await sandbox.start()
        # a shell whose child sleeps: the parent-death signal reaches only the shell, the guard the whole group
        await sandbox.exec("sleep 300 & sleep 301; wait", None)

    asyncio.run(main())
""")


def test_local_sandbox_processes_die_with_their_server(tmp_path: Path) -> None:
    sandbox_id = f"durable-unit-{os.getpid()}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, sandbox_id, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(marked_processes(sandbox_id)) < 3:  # bash and its two sleeps
            assert server.poll() is None and time.monotonic() < deadline, marked_processes(sandbox_id)
            time.sleep(0.05)
        assert len(marked_processes("unit-owner", "POLAR_MITM_SANDBOX_OWNER")) >= 3  # tagged with their server
        server.send_signal(signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 5
        while marked_processes(sandbox_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(sandbox_id) == [], "the sandbox's processes outlived their server"
        # its directory is left (no one ran destroy); a restarted server removes it by its owner
        roots = list(Path(tempfile.gettempdir()).glob(f"polar-sandbox-{sandbox_id}-*"))
        assert len(roots) == 1 and (roots[0] / OWNER_FILE).read_text() == "unit-owner", roots
        assert remove_owned("someone-else") == 0 and roots[0].exists()
        assert remove_owned("unit-owner") == 1 and not roots[0].exists()
    finally:
        server.kill()
        for pid in marked_processes(sandbox_id):
            os.kill(pid, signal.SIGKILL)
