"""GRPO with TRL's own `GRPOTrainer` where every completion is a real agent's model call through polar-mitm.

TRL owns the loop (optimizer, advantages, loss, logging); polar-mitm's `rollout_func`
(polar_mitm.integrations.trl.PolarRollouts) runs each prompt's group as one task on a rollout server, with the
task file's harness in fresh sandboxes, and pushes the trainer's LoRA into the running vLLM engine whenever TRL took
an optimizer step. Runs in the trainer's environment (Python >= 3.11 with torch, transformers, peft, trl; here the
local engine's venv, which `polar-mitm engine build --model smollm2 --with-trainer` equips). From any folder:

    polar-mitm engine build --model smollm2 --with-trainer
    polar-mitm engine start --model smollm2 --port 8012 --lora-rank 8
    polar-mitm rollout serve --port 8070 --upstream http://127.0.0.1:8012/v1 --db trl.duckdb --confdir trl-conf
    ~/.cache/polar-mitm/engine-venv/bin/python $REPO/examples/trl_grpo.py --server http://127.0.0.1:8070 \\
        --engine http://127.0.0.1:8012/v1 --task $REPO/examples/agents/facts/task.yaml --out trl-run --steps 2

The prompts are the task file's instruction (`--prompts N` copies of it: TRL's dataset), so the group's reward is
the task's own evaluator's. `--received FILE` writes, per session, the logprobs TRL's loss received for the tokens
the policy sampled (TRL's `sampling_per_token_logps` where `env_mask` is 1): a user can check them against the
store (`polar-mitm sql ... completion_logprobs`), as tests/integration/test_trl.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "polar_mitm").is_dir():
    sys.path.insert(0, str(CHECKOUT))  # this example's own polar_mitm, without PYTHONPATH (so from any folder)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16: said here once

import torch  # noqa: E402
import yaml  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from polar_mitm.integrations.samples import task_template  # noqa: E402
from polar_mitm.integrations.trl import LoraSync, PolarRollouts, evaluator_reward  # noqa: E402


class Recording(GRPOTrainer):
    """GRPOTrainer that also measures, per step, the train/inference mismatch (the trainer's fp32 logprob of every
    sampled token, before the step, against the engine's stored one), and writes what its loss received, per
    session (for --received)."""

    received: Path | None = None
    mismatch: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampling, mask = out["sampling_per_token_logps"], (out["tool_mask"] * out["completion_mask"]).bool()
        with torch.no_grad():
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            trainer_logps, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, out["completion_ids"].size(1))
        delta = (trainer_logps - sampling)[mask]
        ratio = torch.exp(delta)
        # the same check with the mask one token off (each stored logprob against the next token's): it must fail
        shifted = (trainer_logps[:, 1:] - sampling[:, :-1])[mask[:, :-1] & mask[:, 1:]]
        self.mismatch.append({
            "step": self.state.global_step, "tokens": int(mask.sum()),
            "mismatch_mean": float(delta.abs().mean()) if delta.numel() else None, "mismatch_max": float(delta.abs().max()) if delta.numel() else None,
            "ratio_std": float(ratio.std()) if delta.numel() > 1 else None, "ratio_min": float(ratio.min()) if delta.numel() else None,
            "ratio_max": float(ratio.max()) if delta.numel() else None,
            "shifted_mismatch_mean": float(shifted.abs().mean()) if shifted.numel() else None,
        })
        if self.received is not None:
            with self.received.open("a") as file:
                for row, example in enumerate(inputs):
                    sampled = sampling[row][mask[row]].tolist()
                    file.write(json.dumps({"step": self.state.global_step, "session_id": example["polar_session_id"], "logprobs": sampled, "reward": example["polar_reward"]}) + "\n")
        return out


def step_table(log_history: list[dict], rollouts: list[dict], mismatch: list[dict]) -> list[dict]:
    """One row per optimizer step: TRL's own logged figures, polar-mitm's rollout record and the mismatch."""
    rows = []
    for entry in (e for e in log_history if "loss" in e and "step" in e):
        step = entry["step"] - 1  # TRL logs after the step; the rollouts and the mismatch were before it
        rollout = next((r for r in rollouts if r["step"] == step), {})
        measured = next((m for m in mismatch if m["step"] == step), {})
        rows.append({
            "step": entry["step"], "reward_mean": entry.get("reward"), "reward_std": entry.get("reward_std"),
            "groups_with_signal": None if entry.get("frac_reward_zero_std") is None else 1.0 - float(entry["frac_reward_zero_std"]),
            "kl": entry.get("kl"), "clip_fraction": entry.get("clip_ratio/region_mean"), "loss": entry.get("loss"),
            "grad_norm": entry.get("grad_norm"), "policy_versions": rollout.get("policy_versions"),
            "trainable_sessions": rollout.get("trainable"), "sessions": rollout.get("sessions"),
            "seconds_sync": rollout.get("sync_seconds"), "seconds_rollout": rollout.get("rollout_seconds"),
            "seconds_step": entry.get("step_time"), **{k: v for k, v in measured.items() if k != "step"},
        })
    return rows


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """The README's figure: one panel per figure, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward_mean", "reward mean"), ("reward_std", "reward std"), ("groups_with_signal", "groups with signal"),
              ("kl", "KL to the reference"), ("clip_fraction", "clip fraction"), ("mismatch_mean", "mean |Δ logprob|"),
              ("mismatch_max", "max |Δ logprob|"), ("ratio_std", "importance ratio std"), ("seconds_rollout", "seconds rolling out")]
    figure, axes = plt.subplots(3, 3, figsize=(13, 10))
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        for name, rows in runs.items():
            points = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]
            if points:
                axis.plot(*zip(*points, strict=True), marker=".", label=name)
        axis.set_title(title)
        axis.set_xlabel("step")
    axes.flat[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the rollout server's URL")
    parser.add_argument("--engine", required=True, help="the vLLM engine's OpenAI base URL (runtime LoRA on)")
    parser.add_argument("--task", required=True, type=Path, help="a task file (YAML TaskRequest): agent, runtime, evaluator")
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache" / "polar-mitm" / "models" / "smollm2", help="the engine's model directory (the trainer's base weights)")
    parser.add_argument("--out", type=Path, required=True, help="TRL's output folder (adapters, logs)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (dataset rows)")
    parser.add_argument("--num-generations", type=int, default=2, help="sessions per prompt (the GRPO group)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model pass)")
    parser.add_argument("--agent-env", action="append", default=[], metavar="NAME=VALUE", help="extra environment for the task's agent (e.g. its own output budget)")
    parser.add_argument("--received", type=Path, help="write what TRL's loss received, per session (JSON lines)")
    parser.add_argument("--max-staleness", type=int, default=None, help="mask out sessions sampled more than K versions ago")
    parser.add_argument("--plot", nargs="*", type=Path, metavar="PNG [OTHER_RUN_DIR ...]", help="after the run, draw its per-step figures (and those of other runs' --out folders) into PNG")
    args = parser.parse_args()

    task = task_template(task_file=args.task)
    agent = task.setdefault("agent", {})
    agent["env"] = {**agent.get("env", {}), **dict(item.split("=", 1) for item in args.agent_env)}
    instruction = yaml.safe_load(args.task.read_text())["instruction"]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    rollouts = PolarRollouts(args.server, task, weights=LoraSync(engine=args.engine, adapter_dir=args.out / "adapters"), max_staleness=args.max_staleness)
    config = GRPOConfig(
        output_dir=str(args.out), max_steps=args.steps, learning_rate=args.learning_rate, beta=args.beta,
        per_device_train_batch_size=args.prompts * args.num_generations, num_generations=args.num_generations,
        gradient_accumulation_steps=1, use_vllm=False, use_cpu=True, bf16=False, logging_steps=1, report_to=[],
        save_strategy="no", seed=0,
    )
    Recording.received = args.received
    trainer = Recording(
        model=model, processing_class=tokenizer, reward_funcs=evaluator_reward, args=config,
        train_dataset=Dataset.from_dict({"prompt": [instruction] * (args.prompts * args.steps)}),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        rollout_func=rollouts,
    )
    trainer.train()
    summary = {
        "global_step": trainer.state.global_step,
        "log_history": trainer.state.log_history,
        "syncs": [{"policy_version": r.policy_version, "engine_model": r.engine_model, "seconds": r.seconds} for r in rollouts.weights.reports],
        "sessions": [s.session_id for s in rollouts.last_samples],
        "steps": step_table(trainer.state.log_history, rollouts.history, Recording.mismatch),
        "learning_rate": args.learning_rate, "beta": args.beta,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for row in summary["steps"]:
        print(json.dumps(row, default=str))
    if args.plot:
        png, *others = args.plot
        runs = {f"lr {args.learning_rate:g}": summary["steps"]}
        for other in others:
            theirs = json.loads((other / "summary.json").read_text())
            runs[f"lr {theirs['learning_rate']:g}"] = theirs["steps"]
        plot(runs, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
