"""TRL's `GRPOTrainer` drives polar-mitm: its `rollout_func` runs each prompt's group through the rollout server
with a real harness, and the trainer gets the tokens the harness's model calls really were.

    from trl import GRPOConfig, GRPOTrainer
    from polar_mitm.integrations.trl import PolarRollouts, LoraSync, evaluator_reward

    rollouts = PolarRollouts(
        "http://127.0.0.1:8070",                                        # `polar-mitm rollout serve ...`
        task={"agent": {"harness": "openai-agents-facts"}, "evaluator": {...}, "runtime": {...}},
        weights=LoraSync(engine="http://127.0.0.1:8012/v1", adapter_dir="adapters"),
    )
    trainer = GRPOTrainer(model=..., reward_funcs=evaluator_reward, train_dataset=..., peft_config=...,
                          args=GRPOConfig(num_generations=4, use_vllm=False, ...), rollout_func=rollouts)

What a call does (TRL calls it with the generation batch's prompts, each repeated `num_generations` times in a row):
1. Weights. When the trainer's `global_step` moved since the engine was last given its weights (and once before
   the first rollout, so step 0 samples the trainer's own starting adapter), `weights` saves the LoRA adapter and
   swaps it into the running vLLM engine between a drain and a resume of every gateway the server owns
   (`polar_mitm.weight_sync.sync_lora`). Step k is served as policy version first + k, first being one past
   the newest version the server's gateways serve when the run starts (a gateway never goes back a version).
   TRL's own vLLM sync is for its `trl vllm-serve` server, which is not what serves here: keep `use_vllm=False`.
2. Rollouts. Each run of equal prompts (at most `num_generations`) becomes one TaskRequest, `task` plus the
   prompt as its instruction (a conversational prompt: its last user message; the harness writes its own system
   prompt) and the run's length as `num_samples`: one GRPO group, sampled by the harness as shipped. Every task is
   submitted before any is waited for.
3. Tokens. Each session gives one completion (polar_mitm.integrations.samples: its last sequence; prompt = the
   tokens before the first sampled one). `env_mask` is 0 on the tokens the policy did not sample (tool results,
   the harness's text between turns), so TRL's loss skips them; `logprobs` are the engine's, as stored. A session
   with nothing trainable (failed, or no sampled token) gives one pad token, masked out, with reward None, which
   TRL counts as unscorable (advantage 0).
Extra keys reach the reward functions: `polar_reward` (the task evaluator's reward), `polar_session_id`,
`polar_status`, `polar_policy_versions`, `polar_sequences`. `evaluator_reward` hands TRL the evaluator's reward.
"""

from __future__ import annotations

import copy
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm.api_clients import RolloutClient
from polar_mitm.integrations.samples import Sample, group_prompts, instruction_of, run_tasks, samples_of
from polar_mitm.weight_sync import ServerGateways, SyncReport, VLLMLoraEngine, sync_lora

if TYPE_CHECKING:
    from trl import GRPOTrainer

TaskTemplate = Mapping[str, Any] | Callable[[str], Mapping[str, Any]]


@dataclass
class LoraSync:
    """The trainer's LoRA adapter into a vLLM engine serving runtime LoRA (`polar-mitm engine start --lora-rank R`).
    Each version is saved to `adapter_dir/v<version>` and served as `<name_prefix><version>`; the previous one is
    unloaded once no call uses it, and its folder removed unless `keep_adapters`. The default prefix is new for
    each run (`trl-<8 hex>-v`): vLLM refuses a name it already serves, and a run killed earlier leaves its
    adapters loaded."""

    engine: str | VLLMLoraEngine
    adapter_dir: str | Path
    name_prefix: str = field(default_factory=lambda: f"trl-{uuid.uuid4().hex[:8]}-v")
    drain_timeout: float = 300.0
    keep_adapters: bool = False
    served: str | None = field(default=None, init=False)
    reports: list[SyncReport] = field(default_factory=list, init=False)

    def __call__(self, trainer: GRPOTrainer, server: RolloutClient, version: int) -> SyncReport:
        engine = self.engine if isinstance(self.engine, VLLMLoraEngine) else VLLMLoraEngine(self.engine)
        folder = Path(self.adapter_dir) / f"v{version}"
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(folder)
        previous = self.served
        report = sync_lora([ServerGateways(server)], engine, folder, version, name_prefix=self.name_prefix, previous=previous, drain_timeout=self.drain_timeout)
        self.served = report.engine_model
        self.reports.append(report)
        if previous is not None and not self.keep_adapters:
            shutil.rmtree(Path(self.adapter_dir) / f"v{previous.removeprefix(self.name_prefix)}", ignore_errors=True)
        return report


WeightSync = Callable[["GRPOTrainer", RolloutClient, int], Any]


@dataclass
class PolarRollouts:
    """TRL's `rollout_func` (see the module docstring). `task`: the TaskRequest fields every group shares (agent,
    runtime, evaluator, builder, timeout_seconds, metadata), or a function of the instruction giving them.
    `weights`: how the engine gets the trainer's weights (LoraSync, or any callable (trainer, server, version));
    None: the engine's weights never change (evaluation). `timeout`: seconds for one call's tasks together.
    `max_staleness`: a session any of whose tokens a policy version older than the step's own minus `max_staleness`
    sampled is masked out like a failed one (with the sync before every call, none is; a trainer that skips syncs
    or shares a server is what it guards). `history` holds one record per call: the step, seconds syncing and
    rolling out, sessions, trainable sessions, the policy versions that sampled them, sessions masked as stale."""

    server: str | RolloutClient
    task: TaskTemplate
    weights: WeightSync | None = None
    timeout: float | None = 3600.0
    token: str | None = None
    max_staleness: int | None = None
    synced_step: int | None = field(default=None, init=False)
    last_samples: list[Sample] = field(default_factory=list, init=False)
    history: list[dict[str, Any]] = field(default_factory=list, init=False)
    calls: int = field(default=0, init=False)
    first_version: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.client = self.server if isinstance(self.server, RolloutClient) else RolloutClient(self.server, token=self.token)

    def _next_version(self) -> int:
        """The run's first policy version: one past the newest any gateway serves (a gateway refuses a version lower
        than its current one, and a server that served an earlier run is still on that run's last version)."""
        nodes = self.client.control("status").get("nodes", {})
        return 1 + max((int(status.get("policy_version") or 0) for status in nodes.values()), default=0)

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        step = int(trainer.state.global_step)
        if self.first_version is None:
            self.first_version = self._next_version() if self.weights is not None else 0
        version = self.first_version + step
        started = time.monotonic()
        if self.weights is not None and self.synced_step != step:
            self.weights(trainer, self.client, version)
            self.synced_step = step
        synced = time.monotonic()
        groups = group_prompts(prompts, int(trainer.num_generations if trainer.model.training else trainer.num_generations_eval))
        requests = [self.request(prompt, count, version, index) for index, (prompt, count) in enumerate(groups)]
        samples = [sample for result in run_tasks(self.client, requests, self.timeout) for sample in samples_of(result)]
        if len(samples) != len(prompts):  # the server ran another count than asked: never misalign rewards
            raise RuntimeError(f"the rollout server returned {len(samples)} sessions for {len(prompts)} prompts")
        stale = [s for s in samples if self.max_staleness is not None and s.trainable and min(s.sampled_versions, default=version) < version - self.max_staleness]
        samples = [Sample(**{**vars(s), "completion_mask": [0] * len(s.completion_mask)}) if s in stale else s for s in samples]
        self.history.append({
            "step": step, "policy_version": version, "sync_seconds": synced - started, "rollout_seconds": time.monotonic() - synced, "sessions": len(samples),
            "trainable": sum(s.trainable for s in samples), "policy_versions": sorted({v for s in samples for v in s.sampled_versions}),
            "stale_masked": len(stale),
        })
        self.last_samples, self.calls = samples, self.calls + 1
        return to_trl(samples, pad_id=_pad_id(trainer))

    def request(self, prompt: Any, count: int, version: int, index: int) -> dict[str, Any]:
        instruction = instruction_of(prompt)
        shared = self.task(instruction) if callable(self.task) else self.task
        request = copy.deepcopy(dict(shared))
        metadata = {**request.get("metadata", {}), "policy_version": version, "trl_call": self.calls, "trl_group": index}
        return {**request, "instruction": instruction, "num_samples": count, "metadata": metadata}


def to_trl(samples: Sequence[Sample], pad_id: int) -> dict[str, list[Any]]:
    """TRL's rollout dict: one completion per sample, in order (see the module docstring for an empty one)."""
    out: dict[str, list[Any]] = {key: [] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "polar_reward", "polar_session_id", "polar_status", "polar_policy_versions", "polar_sequences")}
    for sample in samples:
        usable = sample.trainable
        out["prompt_ids"].append(sample.prompt_ids if usable else [pad_id])
        out["completion_ids"].append(sample.completion_ids if usable else [pad_id])
        out["logprobs"].append(sample.completion_logprobs if usable else [0.0])
        out["env_mask"].append(sample.completion_mask if usable else [0])
        out["polar_reward"].append(sample.reward if usable else None)
        out["polar_session_id"].append(sample.session_id)
        out["polar_status"].append(sample.status)
        out["polar_policy_versions"].append(sample.sampled_versions)
        out["polar_sequences"].append(sample.sequences)
    return out


def evaluator_reward(prompts: list[Any], completions: list[Any], polar_reward: list[float | None], **_: Any) -> list[float | None]:
    """A TRL reward function: the task evaluator's reward of each session (None where it gave none)."""
    return list(polar_reward)


def _pad_id(trainer: GRPOTrainer) -> int:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)
