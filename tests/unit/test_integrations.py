"""The trainer integrations' own logic, without a trainer: prompts into groups, a TaskResult and its Parquet into
one sample per session, TRL's dict (the whole path runs in tests/integration/test_trl.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.errors import ClientError
from polar_mitm.integrations.samples import group_prompts, instruction_of, samples_of
from polar_mitm.integrations.trl import PolarRollouts, evaluator_reward, to_trl


def test_equal_prompts_in_a_row_make_groups_of_at_most_the_group_size() -> None:
    assert group_prompts(["a", "a", "a", "a", "b", "b"], 2) == [("a", 2), ("a", 2), ("b", 2)]
    assert group_prompts(["a", "b", "a"], 4) == [("a", 1), ("b", 1), ("a", 1)]
    with pytest.raises(ClientError):
        group_prompts(["a"], 0)


def test_a_conversational_prompt_gives_its_last_user_message() -> None:
    assert instruction_of("fix it") == "fix it"
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "sec"}, {"type": "text", "text": "ond"}]}]
    assert instruction_of(conversation) == "second"
    with pytest.raises(ClientError, match="user message"):
        instruction_of([{"role": "system", "content": "only"}])


def _result(tmp_path: Path) -> dict:
    rows = [
        # s1: two sequences (a chat-mode split): the last is the sample
        {"session_id": "s1", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -0.5, -0.25], "trainable": True, "token_policy_versions": None, "min_policy_version": 3, "max_policy_version": 3, "n_exchanges": 1},
        {"session_id": "s1", "input_ids": [1, 2, 9, 4, 5, 6], "loss_mask": [0, 0, 0, 1, 0, 1], "rollout_logprobs": [0.0, 0.0, 0.0, -1.0, 0.0, -2.0], "trainable": True, "token_policy_versions": [-1, -1, -1, 4, -1, 5], "min_policy_version": 4, "max_policy_version": 5, "n_exchanges": 2},
        # s2: assembled but not trainable
        {"session_id": "s2", "input_ids": [1, 7], "loss_mask": [0, 1], "rollout_logprobs": [0.0, -0.1], "trainable": False, "token_policy_versions": None, "min_policy_version": None, "max_policy_version": None, "n_exchanges": 1},
    ]
    path = tmp_path / "task.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    sessions = [
        {"session_id": "s3", "task_id": "t", "sample_index": 2, "status": "failed", "reward": None, "error": "harness exited 1"},
        {"session_id": "s2", "task_id": "t", "sample_index": 1, "status": "completed", "reward": 0.0},
        {"session_id": "s1", "task_id": "t", "sample_index": 0, "status": "completed", "reward": 1.0},
    ]
    return {"task_id": "t", "status": "completed", "sessions": sessions, "trajectories": str(path)}


def test_each_session_is_one_sample_in_sample_order_split_at_its_first_sampled_token(tmp_path: Path) -> None:
    s1, s2, s3 = samples_of(_result(tmp_path))
    assert [s.session_id for s in (s1, s2, s3)] == ["s1", "s2", "s3"]
    assert (s1.prompt_ids, s1.completion_ids, s1.completion_mask) == ([1, 2, 9], [4, 5, 6], [1, 0, 1])
    assert s1.completion_logprobs == [-1.0, 0.0, -2.0] and s1.policy_versions == [4, -1, 5] and s1.sampled_versions == [4, 5]
    assert (s1.sequences, s1.num_turns, s1.reward, s1.trainable) == (2, 2, 1.0, True)
    assert not s2.trainable and s2.sequences == 0  # its only row is not trainable
    assert not s3.trainable and s3.status == "failed" and s3.error == "harness exited 1"


def test_trl_gets_one_completion_per_session_and_an_untrainable_one_masked_out_with_no_reward(tmp_path: Path) -> None:
    out = to_trl(samples_of(_result(tmp_path)), pad_id=0)
    assert out["prompt_ids"] == [[1, 2, 9], [0], [0]] and out["completion_ids"] == [[4, 5, 6], [0], [0]]
    assert out["env_mask"] == [[1, 0, 1], [0], [0]] and out["logprobs"] == [[-1.0, 0.0, -2.0], [0.0], [0.0]]
    assert out["polar_reward"] == [1.0, None, None] and out["polar_status"] == ["completed", "completed", "failed"]
    assert out["polar_policy_versions"] == [[4, 5], [], []] and out["polar_sequences"] == [2, 0, 0]
    assert evaluator_reward(["p"] * 3, ["c"] * 3, out["polar_reward"], polar_status=out["polar_status"]) == [1.0, None, None]


def test_each_group_is_a_task_of_the_template_with_its_prompt_and_the_step_as_policy_version() -> None:
    rollouts = PolarRollouts("http://127.0.0.1:9", {"agent": {"harness": "qwen"}, "metadata": {"run": "r"}})
    request = rollouts.request([{"role": "user", "content": "do it"}], 4, version=7, index=1)
    assert request == {"agent": {"harness": "qwen"}, "instruction": "do it", "num_samples": 4, "metadata": {"run": "r", "policy_version": 7, "trl_call": 0, "trl_group": 1}}
    assert rollouts.task == {"agent": {"harness": "qwen"}, "metadata": {"run": "r"}}  # the template is not changed


def test_the_integration_imports_without_trl() -> None:
    """trl is needed only for type names: the gateway's own environment (no trl) imports the module."""
    probe = "import importlib.util, polar_mitm.integrations.trl as t; print(importlib.util.find_spec('trl') is None, t.PolarRollouts.__name__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "PolarRollouts"]


class RefusingGateway:
    """A stand-in for one gateway's control API (the real one refuses a lower version with 409; test_control.py)."""

    def __init__(self) -> None:
        self.paused, self.calls = False, []

    def pause(self, mode: str = "drain", timeout_seconds: float = 300.0) -> dict:
        self.calls.append("pause")
        self.paused = True
        return {}

    def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> dict:
        self.calls.append(f"resume {policy_version}")
        if policy_version is not None:
            raise RuntimeError("policy_version 0 is lower than the current 1")
        self.paused = False
        return {}


def test_a_refused_resume_leaves_no_gateway_paused_and_is_raised() -> None:
    from polar_mitm.weight_sync import SyncReport, _paused_update

    gateways = [RefusingGateway(), RefusingGateway()]
    with pytest.raises(RuntimeError, match="lower than the current"):
        _paused_update(gateways, "drain", 10.0, SyncReport(0, "m"), lambda: None)
    assert not any(g.paused for g in gateways)
    assert gateways[0].calls == ["pause", "resume 0", "resume None"] and gateways[1].calls == ["pause", "resume None"]


def test_a_session_sampled_by_a_too_old_version_is_masked_out(tmp_path: Path) -> None:
    from polar_mitm.integrations import trl as integration

    class Trainer:  # what PolarRollouts reads of a GRPOTrainer
        class state:
            global_step = 3

        class model:
            training = True

        num_generations = 3
        processing_class = type("Tokenizer", (), {"pad_token_id": 0, "eos_token_id": 2})()

    rollouts = PolarRollouts("http://127.0.0.1:9", {"agent": {"harness": "qwen"}}, max_staleness=1)
    rollouts.first_version = 2  # step 3 is version 5: a token of version 3 is two versions old
    result = _result(tmp_path)
    original = integration.run_tasks
    integration.run_tasks = lambda client, requests, timeout: [result]
    try:
        out = rollouts(["p", "p", "p"], Trainer())
    finally:
        integration.run_tasks = original
    assert out["env_mask"][0] == [1, 0, 1] and out["polar_reward"][0] == 1.0  # s1: versions 4 and 5, 4 >= 5 - 1
    assert rollouts.history[-1]["stale_masked"] == 0 and rollouts.history[-1]["policy_version"] == 5
    rollouts.max_staleness = 0
    integration.run_tasks = lambda client, requests, timeout: [result]
    try:
        out = rollouts(["p", "p", "p"], Trainer())
    finally:
        integration.run_tasks = original
    assert out["env_mask"][0] == [0] and out["polar_reward"][0] is None and rollouts.history[-1]["stale_masked"] == 1
