"""One trainer sample per rollout session: what TRL's `rollout_func` and verl's `AgentLoop` both return, read
from a finished TaskResult and its Parquet file.

A trainer asks for a fixed number of completions per prompt, so each session gives exactly one sample, and a
session without one (failed, timed out, nothing trainable assembled) still gives an empty one the caller pads and
masks out. A session the assembler split into several sequences (chat mode, where a turn re-rendered differently
from what was sampled; tokens mode keeps a session one sequence) gives its last sequence, the one that ends with
the answer its reward judged; `sequences` says how many there were, so a trainer can count what it dropped.

The split of a sequence: `prompt_ids` are its tokens before the first sampled one (the harness's system prompt,
tools and task); `completion_ids` all after, the policy's turns and what came back between them (tool results,
the harness's next request). `completion_mask` is 1 on a token the policy sampled, 0 on one it did not;
`completion_logprobs` is the engine's logprob of each sampled token as stored (0.0 elsewhere), and
`policy_versions` the version that sampled it (-1 elsewhere or unrecorded).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from polar_mitm.api_clients import RolloutClient
from polar_mitm.errors import ClientError

JSON = dict[str, Any]


@dataclass(frozen=True)
class Sample:
    session_id: str
    task_id: str
    sample_index: int
    status: str
    reward: float | None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    sequences: int = 0
    num_turns: int = 0
    error: str | None = None

    @property
    def trainable(self) -> bool:
        return any(self.completion_mask)

    @property
    def sampled_versions(self) -> list[int]:
        """The policy versions that sampled this sample's tokens, each once, oldest first."""
        return sorted({v for v, m in zip(self.policy_versions, self.completion_mask, strict=True) if m and v >= 0})


def run_tasks(client: RolloutClient, requests: Sequence[Mapping[str, Any]], timeout: float | None) -> list[JSON]:
    """Submit every request first (their sessions run side by side on the server), then wait for each; the
    TaskResults in the requests' order."""
    accepted = [client.submit(request) for request in requests]
    deadline = None if timeout is None else time.monotonic() + timeout
    results = []
    for task in accepted:
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        results.append(client.wait(task["task_id"], timeout=left))
    return results


def samples_of(result: Mapping[str, Any]) -> list[Sample]:
    """The task's sessions as samples, in sample_index order (see the module docstring)."""
    rows_by_session: dict[str, list[JSON]] = {}
    if result.get("trajectories"):
        for row in pq.read_table(result["trajectories"]).to_pylist():
            rows_by_session.setdefault(row["session_id"], []).append(row)
    samples = []
    for session in sorted(result["sessions"], key=lambda s: s["sample_index"]):
        rows = [r for r in rows_by_session.get(session["session_id"], []) if r.get("trainable", True)]
        base = {
            "session_id": session["session_id"], "task_id": session["task_id"], "sample_index": session["sample_index"],
            "status": session["status"], "reward": session.get("reward"), "error": session.get("error"),
        }
        if not rows:
            samples.append(Sample(**base))
            continue
        samples.append(_split(rows[-1], base, len(rows)))
    return samples


def _split(row: JSON, base: JSON, sequences: int) -> Sample:
    ids, mask, logprobs = list(row["input_ids"]), [int(m) for m in row["loss_mask"]], list(row["rollout_logprobs"])
    if not any(mask):
        return Sample(**base, sequences=sequences)
    cut = mask.index(1)
    versions = row.get("token_policy_versions")
    if versions is None:
        single = row.get("min_policy_version")
        known = single if single is not None and single == row.get("max_policy_version") else -1
        versions = [known if m else -1 for m in mask]
    return Sample(
        **base,
        prompt_ids=ids[:cut],
        completion_ids=ids[cut:],
        completion_mask=mask[cut:],
        completion_logprobs=[float(lp) if m else 0.0 for lp, m in zip(logprobs[cut:], mask[cut:], strict=True)],
        policy_versions=[int(v) if m else -1 for v, m in zip(versions[cut:], mask[cut:], strict=True)],
        sequences=sequences,
        num_turns=int(row.get("n_exchanges") or 0),
    )


def group_prompts(prompts: Sequence[Any], group_size: int) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count) groups of at most `group_size` (TRL's sampler repeats each
    prompt `num_generations` times in a row)."""
    if group_size < 1:
        raise ClientError(f"group size must be at least 1, not {group_size}")
    groups: list[tuple[Any, int]] = []
    for prompt in prompts:
        if groups and groups[-1][0] == prompt and groups[-1][1] < group_size:
            groups[-1] = (prompt, groups[-1][1] + 1)
        else:
            groups.append((prompt, 1))
    return groups


def instruction_of(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """A trainer's prompt as the harness's instruction: a string as is; a conversation (TRL's conversational
    format) by its last user message, since the harness writes its own system prompt and history."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(list(prompt)):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise ClientError("a conversational prompt needs a user message: it becomes the harness's instruction")


def task_template(task: Mapping[str, Any] | None = None, task_file: str | Path | None = None) -> dict[str, Any]:
    """The fields every sample's task shares: `task` as given, or a task file's (minus instruction, samples and id;
    an evaluator's relative path resolved against the file's folder)."""
    if (task is None) == (task_file is None):
        raise ClientError("give exactly one of a task (its fields) and a task file")
    if task is not None:
        return dict(task)
    path = Path(task_file).resolve()  # type: ignore[arg-type]
    loaded = yaml.safe_load(path.read_text())
    for key in ("instruction", "num_samples", "task_id"):
        loaded.pop(key, None)
    evaluator = loaded.get("evaluator") or {}
    if evaluator.get("python"):
        file, function = evaluator["python"].rsplit(":", 1)
        evaluator["python"] = f"{(path.parent / file).resolve()}:{function}"
    return loaded
