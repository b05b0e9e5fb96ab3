"""Assembled trajectory rows (Parquet / `trajectories` table rows as dicts) in the shapes trainers take.

Plain dicts and lists: TRL, verl and slime need torch and CUDA stacks that do not install on the machines this
project is tested on, so the converters produce each framework's field names and layouts (docs/trainers.md has
the tables) and the caller builds the framework's own object from them, e.g. `slime.utils.types.Sample(**d)`.
Every converter splits a row at `prompt_len`: the prompt is never trained, the response part carries the mask
(1 = sampled by the engine, 0 = tool results and template glue inside the response) and the rollout logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Row = Mapping[str, Any]


def _split(row: Row) -> tuple[list[int], list[int], list[int], list[float]]:
    cut = int(row["prompt_len"])
    ids, mask, logprobs = list(row["input_ids"]), list(row["loss_mask"]), list(row["rollout_logprobs"])
    if any(mask[:cut]):
        raise ValueError(f"{row.get('sequence_id')}: loss_mask is 1 inside the prompt (before prompt_len {cut})")
    return ids[:cut], ids[cut:], [int(m) for m in mask[cut:]], [float(x) for x in logprobs[cut:]]


def _versions(row: Row) -> dict[str, Any]:
    return {key: row.get(key) for key in ("min_policy_version", "max_policy_version")}


def to_trl_rollout(rows: Iterable[Row]) -> dict[str, list[Any]]:
    """What a TRL `GRPOTrainer(rollout_func=...)` returns: one list per key, one entry per row (rows of one group
    are the `num_generations` completions of one prompt). TRL normalises rewards itself: `reward`, not advantage."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "logprobs": [], "reward": []}
    for row in rows:
        prompt, response, mask, logprobs = _split(row)
        out["prompt_ids"].append(prompt)
        out["completion_ids"].append(response)
        out["env_mask"].append(mask)
        out["logprobs"].append(logprobs)
        out["reward"].append(row.get("reward"))
    return out


def to_verl_agent_loop_output(row: Row) -> dict[str, Any]:
    """The fields of a verl `AgentLoopOutput` for one row, plus the GRPO `uid` (the group) for the non-tensor batch."""
    prompt, response, mask, logprobs = _split(row)
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": logprobs,
        "reward_score": row.get("reward"),
        "num_turns": int(row.get("n_exchanges") or 1),
        "uid": row.get("group_id"),
        "extra_fields": {"session_id": row.get("session_id"), "advantage": row.get("advantage"), **_versions(row)},
    }


def to_slime_samples(rows: Iterable[Row]) -> list[dict[str, Any]]:
    """Keyword arguments for slime's `Sample`, one per row; `group_index` numbers the groups in order of first
    appearance, `index` the rows; rows of one session keep its id in `session_id` and in `metadata`."""
    groups: dict[Any, int] = {}
    samples = []
    for index, row in enumerate(rows):
        prompt, response, mask, logprobs = _split(row)
        samples.append(
            {
                "group_index": groups.setdefault(row.get("group_id"), len(groups)),
                "index": index,
                "tokens": prompt + response,
                "response_length": len(response),
                "loss_mask": mask,
                "rollout_log_probs": logprobs,
                "reward": row.get("reward"),
                "session_id": row.get("session_id"),
                "metadata": {"sequence_id": row.get("sequence_id"), "finish_reason": row.get("finish_reason"), "advantage": row.get("advantage"), **_versions(row)},
            }
        )
    return samples
