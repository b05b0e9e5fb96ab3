"""The node side's parts that need no sandbox (polar_mitm/rollout/session_run.py): the one "queued" result, and
the cause a failed or timed-out session names first when its model calls failed (issue 31: 56 engine_unreachable
rows, and the session said only that its budget ran out)."""

from __future__ import annotations

import asyncio

from polar_mitm.rollout.models import TaskRequest
from polar_mitm.rollout.session_run import (
    OrderedSlots,
    SessionRun,
    SessionWork,
    StageLimits,
    Stages,
    exchange_cause,
    queued_result,
)


def test_the_dominant_exchange_failure_is_named_with_its_count_and_message() -> None:
    unreachable = "the inference engine at http://127.0.0.1:1/v1 is unreachable: ClientConnectorError(...)"
    cause = exchange_cause({"engine_unreachable": (56, unreachable), "ok": (2, None), "engine_timeout": (3, "timed out")})
    assert cause == f"56 of 61 model call(s) failed with engine_unreachable: {unreachable}"
    # what is no cause: answered calls, calls cut by pause(abort) and issued again, the harness hanging up at its end
    assert exchange_cause({"ok": (5, None), "aborted": (1, "aborted"), "client_disconnected": (1, "gone")}) is None
    assert exchange_cause({}) is None
    long = "x" * 1000
    assert exchange_cause({"engine_rejected": (1, long)}) == f"1 of 1 model call(s) failed with engine_rejected: {'x' * 300}…"


def test_a_queued_result_carries_the_request_s_harness_model_and_metadata() -> None:
    request = TaskRequest.model_validate({"instruction": "x", "agent": {"harness": "codex", "model": "m"}, "metadata": {"group": "g"}})
    result = queued_result(SessionWork(session_id="s", task_id="t", sample_index=3, request=request))
    assert (result.status, result.harness, result.model, result.metadata, result.sample_index, result.task_id) == ("queued", "codex", "m", {"group": "g"}, 3, "t")


# -- prepare slots go in the order sessions were made (CI 2026-12-02: with one slot, sample 3 prepared before 0)


def test_ordered_slots_serve_places_in_order_whatever_order_they_ask_in() -> None:
    async def scenario() -> list[int]:
        slots = OrderedSlots(1)
        places = [slots.place() for _ in range(5)]
        served: list[int] = []

        async def take(place: int, delay: float) -> None:
            try:
                await asyncio.sleep(delay)
                async with slots.held(place):
                    served.append(place)
                    await asyncio.sleep(0.01)
            finally:
                slots.withdraw(place)  # as SessionRun does: a place that will not ask must not hold the line

        runs = {place: asyncio.create_task(take(place, delay)) for place, delay in zip(places, [0.04, 0.03, 0.05, 0.0, 0.02], strict=True)}
        await asyncio.sleep(0.045)
        runs[2].cancel()  # asked? no (0.05): its withdrawal lets 3 pass
        await asyncio.gather(*runs.values(), return_exceptions=True)
        return served

    # 3 asked first, yet waited for 0 and 1 (not asked yet when it did); 2 was cancelled before it asked
    assert asyncio.run(scenario()) == [0, 1, 3, 4]


def test_a_waiter_cancelled_in_line_passes_its_turn_and_a_cancelled_holder_frees_its_slot() -> None:
    async def scenario() -> list[int]:
        slots = OrderedSlots(1)
        first, second, third = slots.place(), slots.place(), slots.place()
        served: list[int] = []
        await slots.acquire(first)
        waiting = asyncio.create_task(slots.acquire(second))
        last = asyncio.create_task(slots.acquire(third))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        slots.release()
        await last
        served.append(third)
        slots.release()
        assert slots.free == 1
        return served

    assert asyncio.run(scenario()) == [2]


def test_sessions_whose_queued_rows_land_in_reverse_still_prepare_in_sample_order(tmp_path) -> None:
    request = TaskRequest.model_validate({"instruction": "x", "agent": {"harness": "codex"}, "num_samples": 4})
    prepared: list[int] = []

    class Bench:
        output_dir = tmp_path

        async def record(self, result) -> None:
            if result.status == "queued":
                await asyncio.sleep(0.01 * (4 - result.sample_index))  # sample 3's row is written first

        async def create_sandbox(self, work: SessionWork):
            prepared.append(work.sample_index)
            raise RuntimeError("no sandbox in this test")

        async def settle_exchanges(self, session_id: str, timeout: float) -> int:
            return 0

        async def exchange_outcomes(self, session_id: str):
            return {}

        async def build(self, session_id, builder, options):
            raise RuntimeError("nothing to build")

    async def scenario() -> list[str]:
        stages = Stages(StageLimits(prepare=1))
        works = [SessionWork(session_id=f"s-{i}", task_id="t", sample_index=i, request=request) for i in range(4)]
        runs = [asyncio.create_task(SessionRun(work, Bench(), stages, lambda _: None).run()) for work in works]
        return [result.status for result in await asyncio.gather(*runs)]

    assert asyncio.run(scenario()) == ["failed"] * 4
    assert prepared == [0, 1, 2, 3]
