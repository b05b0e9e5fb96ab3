"""What the rollout server's terminal shows (issue 31: it was silent): one line per task accepted and finished,
one per callback delivery that failed, from the real Scheduler and CallbackSender over the stand-in node of
tests/support/rollout_standins.py (a session there completes at once with the reward its task names), and a
callback URL where nothing listens or a receiver that refuses."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.models import TaskRequest
from polar_mitm.rollout.scheduler import Scheduler
from tests.support.rollout_standins import StandinNode


class Refusing(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(404)
        self.send_header("content-length", "9")
        self.end_headers()
        self.wfile.write(b"not here!")

    def log_message(self, *args: object) -> None:
        pass


def test_a_line_per_task_accepted_and_finished_and_per_failed_callback(caplog: pytest.LogCaptureFixture) -> None:
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    refusing = f"http://127.0.0.1:{receiver.server_address[1]}/results"

    async def main() -> None:
        node = StandinNode("http://127.0.0.1:9")
        scheduler = Scheduler(node, CallbackSender(attempts=2, backoff=0.01))  # type: ignore[arg-type]  # the stand-in is a Node structurally
        node.scheduler = scheduler
        request = TaskRequest.model_validate({"task_id": "lines", "instruction": "x", "num_samples": 2, "agent": {"harness": "qwen"}, "metadata": {"rewards": [0.0, 1.0]}, "callback_url": refusing})
        await scheduler.wait((await scheduler.submit(request)).task_id)
        await scheduler.close()

    try:
        with caplog.at_level(logging.INFO, logger="polar_mitm.rollout"):
            asyncio.run(main())
    finally:
        receiver.shutdown()
    lines = [record.getMessage() for record in caplog.records if record.name == "polar_mitm.rollout"]
    assert "polar-mitm rollout: task lines accepted: 2 session(s) of qwen in local sandboxes" in lines, lines
    assert "polar-mitm rollout: task lines finished: 2 session(s), completed 2; reward mean 0.5 over 2" in lines, lines
    failed = [line for line in lines if "callback" in line]
    # a 404 is final: each delivery (two sessions, then the task) tried once and named with its URL and the answer
    assert len(failed) == 3 and all(f"to {refusing} failed after 1 attempt(s): HTTP 404: not here!" in line for line in failed), failed
    assert sum(":session_result to" in line for line in failed) == 2 and failed[-1].startswith("polar-mitm rollout: callback lines:task_result")


def test_a_callback_to_where_nothing_listens_is_one_line_after_its_retries(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/results"  # bound, not listening: refused
        from polar_mitm.rollout.models import Delivery

        async def main() -> Delivery:
            sender = CallbackSender(attempts=3, backoff=0.01)
            try:
                return await sender.deliver(Delivery(delivery_id="t:task_result", kind="task_result", url=url), {"kind": "task_result"})
            finally:
                await sender.close()

        with caplog.at_level(logging.INFO, logger="polar_mitm.rollout"):
            delivery = asyncio.run(main())
    assert delivery.status == "failed" and delivery.attempts == 3
    (line,) = [record.getMessage() for record in caplog.records if "callback" in record.getMessage()]
    assert line.startswith(f"polar-mitm rollout: callback t:task_result to {url} failed after 3 attempt(s): ConnectError"), line
