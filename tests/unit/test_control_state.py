"""The gateway's pause/resume state machine (gateway/control.py) on its own: engine calls are coroutines here, so
the orderings that are hard to hit through a real engine (a caller that goes away, abort while calls wait) are
checked exactly. The same API against the real engine: tests/integration/test_control.py."""

from __future__ import annotations

import asyncio

import pytest

from polar_mitm.errors import ControlError
from polar_mitm.gateway.control import EngineCallAborted, PauseRequest, PolicyControl, ResumeRequest


def run(coroutine):
    return asyncio.run(coroutine)


def test_drain_waits_for_in_flight_and_holds_new_calls_until_resume() -> None:
    async def main() -> None:
        control = PolicyControl(policy_version=3)
        release = asyncio.Event()
        seen: list[tuple[int, str | None]] = []

        async def call(version: int, model: str | None) -> str:
            seen.append((version, model))
            await release.wait()
            return "done"

        first = asyncio.create_task(control.run(call))
        await asyncio.sleep(0)
        pause = asyncio.create_task(control.pause(PauseRequest(mode="drain", timeout_seconds=5)))
        await asyncio.sleep(0.01)
        assert not pause.done() and control.status().state == "draining" and control.status().in_flight == 1
        second = asyncio.create_task(control.run(call))
        await asyncio.sleep(0.01)
        assert control.status().waiting == 1 and len(seen) == 1  # held, not started
        release.set()
        status = await pause
        assert status.state == "paused" and status.in_flight == 0 and await first == (3, "done")
        await control.resume(ResumeRequest(policy_version=4, engine_model="adapter-4"))
        assert await second == (4, "done") and seen == [(3, None), (4, "adapter-4")]

    run(main())


def test_abort_cancels_in_flight_calls_and_the_caller_can_retry_after_resume() -> None:
    async def main() -> None:
        control = PolicyControl()
        calls = 0

        async def call(version: int, model: str | None) -> int:
            nonlocal calls
            calls += 1
            if calls == 1:
                await asyncio.sleep(60)
            return version

        async def caller() -> tuple[list[int], int]:
            aborted = []
            while True:
                try:
                    return aborted, (await control.run(call))[1]
                except EngineCallAborted as error:
                    aborted.append(error.policy_version)

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        status = await control.pause(PauseRequest(mode="abort"))
        assert status.state == "paused" and status.in_flight == 0 and status.aborted_total == 1
        await asyncio.sleep(0.01)
        assert control.status().waiting == 1
        await control.resume(ResumeRequest(policy_version=1))
        assert await task == ([0], 1)

    run(main())


def test_a_caller_that_goes_away_takes_its_engine_call_with_it_and_is_not_an_abort() -> None:
    async def main() -> None:
        control = PolicyControl()
        engine_call_cancelled = asyncio.Event()

        async def call(version: int, model: str | None) -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                engine_call_cancelled.set()
                raise

        task = asyncio.create_task(control.run(call))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine_call_cancelled.is_set() and control.status().in_flight == 0 and control.status().aborted_total == 0

    run(main())


def test_drain_timeout_is_504_and_serving_again() -> None:
    async def main() -> None:
        control = PolicyControl()

        async def call(version: int, model: str | None) -> None:
            await asyncio.sleep(0.3)

        task = asyncio.create_task(control.run(call))
        await asyncio.sleep(0.01)
        with pytest.raises(ControlError) as caught:
            await control.pause(PauseRequest(mode="drain", timeout_seconds=0.05))
        assert caught.value.status == 504 and control.status().state == "serving"
        await task

    run(main())


def test_refusals() -> None:
    async def main() -> None:
        async def exists(name: str) -> bool:
            return name == "known"

        control = PolicyControl(policy_version=2, model_exists=exists)
        assert (await control.handle("POST", "/control/resume", b"{}"))[0] == 409
        assert (await control.handle("POST", "/control/pause", b"{}"))[0] == 200
        assert (await control.handle("POST", "/control/pause", b"{}"))[0] == 409
        assert (await control.handle("POST", "/control/resume", b'{"policy_version": 1}'))[0] == 409
        status, body = await control.handle("POST", "/control/resume", b'{"engine_model": "unknown"}')
        assert status == 404 and "unknown" in body["error"]["message"]
        assert (await control.handle("POST", "/control/resume", b'{"mode": "x"}'))[0] == 422
        assert (await control.handle("POST", "/control/pause", b"[")) [0] == 400
        assert control.status().paused and control.policy_version == 2 and control.engine_model is None
        status, body = await control.handle("POST", "/control/resume", b'{"policy_version": 2, "engine_model": "known"}')
        assert status == 200 and body["state"] == "serving" and body["engine_model"] == "known"

    run(main())
