"""Trainer formats (TRL rollout_func, verl AgentLoopOutput, slime Sample) from a real run's assembled rows:
multi-turn tool-calling sessions with breaks, retries, groups and rewards (the debug_store fixture)."""

from __future__ import annotations

import duckdb
import pytest

from polar_mitm.trainer_formats import to_slime_samples, to_trl_rollout, to_verl_agent_loop_output


@pytest.fixture(scope="module")
def rows(debug_store) -> list[dict]:
    con = duckdb.connect(str(debug_store.db), read_only=True)
    try:
        cursor = con.execute("SELECT * FROM trajectories WHERE builder = 'prefix_merging' ORDER BY sequence_id")
        names = [d[0] for d in cursor.description]
        out = [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]
    finally:
        con.close()
    assert len(out) >= 8 and any(r["n_exchanges"] > 1 for r in out) and len({r["group_id"] for r in out}) >= 2
    return out


def test_trl_rollout_splits_at_the_prompt_and_keeps_every_sampled_token(rows) -> None:
    trl = to_trl_rollout(rows)
    assert set(trl) == {"prompt_ids", "completion_ids", "env_mask", "logprobs", "reward"}
    for i, row in enumerate(rows):
        assert trl["prompt_ids"][i] + trl["completion_ids"][i] == row["input_ids"]
        assert len(trl["env_mask"][i]) == len(trl["completion_ids"][i]) == len(trl["logprobs"][i])
        assert sum(trl["env_mask"][i]) == sum(row["loss_mask"])
        assert trl["reward"][i] == row["reward"]
    # multi-turn rows keep tool results inside the completion, masked out
    assert any(0 in mask and 1 in mask for mask in trl["env_mask"])


def test_verl_and_slime_carry_mask_logprobs_groups_and_versions(rows) -> None:
    samples = to_slime_samples(rows)
    group_of: dict[str, int] = {}
    for row, sample in zip(rows, samples, strict=True):
        verl = to_verl_agent_loop_output(row)
        cut = row["prompt_len"]
        assert verl["prompt_ids"] + verl["response_ids"] == row["input_ids"] == sample["tokens"]
        assert verl["response_mask"] == sample["loss_mask"] == row["loss_mask"][cut:]
        assert verl["response_logprobs"] == sample["rollout_log_probs"] == row["rollout_logprobs"][cut:]
        assert sample["response_length"] == len(row["input_ids"]) - cut
        assert verl["uid"] == row["group_id"] and verl["reward_score"] == sample["reward"] == row["reward"]
        assert verl["extra_fields"]["min_policy_version"] == sample["metadata"]["min_policy_version"] == row["min_policy_version"]
        assert group_of.setdefault(row["group_id"], sample["group_index"]) == sample["group_index"]
    assert sorted(set(group_of.values())) == list(range(len(group_of)))


def test_a_mask_inside_the_prompt_is_refused(rows) -> None:
    broken = dict(rows[0], loss_mask=[1] + list(rows[0]["loss_mask"][1:]))
    with pytest.raises(ValueError, match="inside the prompt"):
        to_slime_samples([broken])
