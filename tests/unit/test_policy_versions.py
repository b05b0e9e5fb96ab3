"""Policy versions in trajectories: a chain whose exchanges were sampled under two versions carries both, per
token; the stored rows' versions come from the gateway (tests/integration/test_control.py)."""

from __future__ import annotations

import numpy as np

from polar_mitm.assembler.chain import Chain
from polar_mitm.assembler.rewards import SessionScore
from polar_mitm.assembler.source import Exchange


def exchange(seq: int, prompt: list[int], completion: list[int], version: int | None) -> Exchange:
    return Exchange(
        f"e{seq}", "s", seq, np.array(prompt, dtype=np.int32), np.array(completion, dtype=np.int32),
        np.full(len(completion), -0.5), "stop", None, None, "openai.chat", None, "m", "m", version,
    )


SCORE = SessionScore(group_id="g", task_id=None, reward=1.0, trainable=True, advantage=0.5)


def test_a_chain_spanning_two_versions_carries_them_per_token() -> None:
    first = exchange(1, [1, 2, 3], [4, 5], version=3)
    second = exchange(2, [1, 2, 3, 4, 5, 6, 7], [8, 9, 10], version=4)
    chain = Chain.start("prefix_merging", first)
    chain.append(second, second.prompt[len(first.prompt) + len(first.completion):])
    sequence = chain.to_sequence(SCORE)
    assert sequence.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert (sequence.min_policy_version, sequence.max_policy_version) == (3, 4)
    assert sequence.token_policy_versions == [-1, -1, -1, 3, 3, -1, -1, 4, 4, 4]
    assert [m for m in sequence.loss_mask] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]


def test_one_version_needs_no_per_token_list_and_unrecorded_versions_stay_null() -> None:
    single = Chain.start("per_request", exchange(1, [1, 2], [3], version=7)).to_sequence(SCORE)
    assert (single.min_policy_version, single.max_policy_version, single.token_policy_versions) == (7, 7, None)
    old = Chain.start("per_request", exchange(1, [1, 2], [3], version=None)).to_sequence(SCORE)
    assert (old.min_policy_version, old.max_policy_version, old.token_policy_versions) == (None, None, None)
