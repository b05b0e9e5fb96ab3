"""The node side's parts that need no sandbox (polar_mitm/rollout/session_run.py): the one "queued" result, and
the cause a failed or timed-out session names first when its model calls failed (issue 31: 56 engine_unreachable
rows, and the session said only that its budget ran out)."""

from __future__ import annotations

from polar_mitm.rollout.models import TaskRequest
from polar_mitm.rollout.session_run import SessionWork, exchange_cause, queued_result


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
