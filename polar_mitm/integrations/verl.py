"""verl's agent loop runs a real harness through polar-mitm: `PolarAgentLoop`, registered as "polar_mitm".

verl calls an agent loop's `run()` once per sample (`rollout.n` per prompt; the GRPO grouping is verl's own), so
each run is a one-sample task on the rollout server: the task file's agent, runtime and evaluator, the dataset
row's prompt as the instruction (its last user message: the harness writes its own system prompt). What comes back
is verl's own `AgentLoopOutput` (polar_mitm.integrations.samples explains the split):

    prompt_ids          the session's last sequence up to its first sampled token
    response_ids        everything after: the policy's turns and what came back between them
    response_mask       1 on a sampled token, 0 on a tool result or the harness's own text
    response_logprobs   the engine's logprob of each sampled token as stored (0.0 where the mask is 0)
    reward_score        the task evaluator's reward (None: verl's reward function decides)
    num_turns           2 per model call (its request, its reply)
    extra_fields        polar_session_id, polar_status, polar_policy_versions (the versions that sampled the
                        tokens: verl's staleness check reads them), polar_sequences, polar_trainable

Response fields are cut to `rollout.response_length`, as verl's own loops do (`polar_truncated` says so). A session
with nothing trainable gives the instruction's tokens as the prompt and one masked-out token (`polar_trainable`
False, reward None). The harness reaches the engine through the rollout server's gateway, not through verl's
`server_manager`; the engine's weights are the trainer's to sync (`polar_mitm.weight_sync`).

Config, in verl's agent loop file (`actor_rollout_ref.rollout.agent.agent_loop_config_path`), dataset rows with
`agent_name: polar_mitm`:

    - name: polar_mitm
      _target_: polar_mitm.integrations.verl.PolarAgentLoop
      server_url: http://127.0.0.1:8070
      task_file: /abs/path/task.yaml     # or `task:` with the fields inline
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from polar_mitm.api_clients import AsyncRolloutClient
from polar_mitm.integrations.samples import Sample, instruction_of, samples_of, task_template


def agent_loop_output(sample: Sample, result: Mapping[str, Any], fallback_prompt: list[int], pad_id: int, response_length: int | None = None) -> AgentLoopOutput:
    """One session as verl's AgentLoopOutput (see the module docstring)."""
    [session] = [s for s in result["sessions"] if s["session_id"] == sample.session_id]
    timings = session.get("timings") or {}
    metrics = AgentLoopMetrics(
        generate_sequences=float((timings.get("running") or {}).get("seconds") or 0.0),
        compute_score=float((timings.get("evaluating") or {}).get("seconds") or 0.0),
    )
    extra = {
        "polar_session_id": sample.session_id, "polar_status": sample.status, "polar_policy_versions": sample.sampled_versions,
        "polar_sequences": sample.sequences, "polar_trainable": sample.trainable, "polar_truncated": False,
    }
    if not sample.trainable:
        return AgentLoopOutput(prompt_ids=fallback_prompt, response_ids=[pad_id], response_mask=[0], response_logprobs=[0.0], reward_score=None, num_turns=0, metrics=metrics, extra_fields=extra)
    limit = len(sample.completion_ids) if response_length is None else response_length
    extra["polar_truncated"] = len(sample.completion_ids) > limit
    return AgentLoopOutput(
        prompt_ids=sample.prompt_ids,
        response_ids=sample.completion_ids[:limit],
        response_mask=sample.completion_mask[:limit],
        response_logprobs=sample.completion_logprobs[:limit],
        reward_score=sample.reward,
        num_turns=2 * sample.num_turns,
        metrics=metrics,
        extra_fields=extra,
    )


@register("polar_mitm")
class PolarAgentLoop(AgentLoopBase):
    """A verl agent loop whose sample is one rollout-server session (see the module docstring)."""

    def __init__(self, *args: Any, server_url: str, task: Mapping[str, Any] | None = None, task_file: str | None = None,
                 token: str | None = None, timeout: float = 3600.0, poll_seconds: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_url, self.token, self.timeout, self.poll_seconds = server_url, token, timeout, poll_seconds
        self.task = task_template(task, task_file)
        self.response_length = self.rollout_config.get("response_length")

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        instruction = instruction_of(kwargs["raw_prompt"])
        metadata = {**self.task.get("metadata", {}), **{k: _plain(v) for k, v in (kwargs.get("extra_info") or {}).items()}}
        request = {**self.task, "instruction": instruction, "num_samples": 1, "metadata": metadata}
        client = AsyncRolloutClient(self.server_url, token=self.token)
        try:
            started = time.monotonic()
            accepted = await client.submit(request)
            result = await client.wait(accepted["task_id"], timeout=self.timeout, poll_seconds=self.poll_seconds)
        finally:
            await client.aclose()
        [sample] = samples_of(result)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        output = agent_loop_output(sample, result, self.tokenizer.encode(instruction), int(pad), self.response_length)
        output.extra_fields["polar_task_seconds"] = time.monotonic() - started
        return output


def _plain(value: Any) -> Any:
    """A dataset value as JSON (verl hands numpy scalars and arrays)."""
    return value.tolist() if hasattr(value, "tolist") else value
