"""A closed GRPO loop on one CPU machine: rollouts through the polar-mitm gateway, assembly, a PyTorch policy-
gradient step on a LoRA of SmolLM2-135M-Instruct, weight sync into the running vLLM engine, resume with the next
policy version. Runs in the trainer's environment (Python >= 3.11 with torch, transformers, peft, openai,
matplotlib; here the local engine's venv, which `polar-mitm engine build --model smollm2 --with-trainer`
equips); it reaches polar-mitm only through `polar_mitm.client` (HTTP + Parquet) and the `polar-mitm assemble`
command. From any folder (its files land there; REPO is this checkout), as docs/training.md prints them:

    polar-mitm engine build --model smollm2 --with-trainer
    polar-mitm engine start --model smollm2 --port 8012 --lora-rank 8
    polar-mitm gateway --port 8090 --upstream http://127.0.0.1:8012/v1 --db grpo.duckdb --confdir grpo-conf
    ~/.cache/polar-mitm/engine-venv/bin/python $REPO/examples/grpo_loop.py --gateway http://127.0.0.1:8090 \\
        --confdir grpo-conf --db grpo.duckdb --engine http://127.0.0.1:8012/v1 --out grpo-run --steps 2

(the gateway in a terminal of its own). Before the first rollout the loop serves its untrained LoRA (B = 0: the
trainer's starting weights) as the run's first policy version, so a gateway left serving an earlier run's adapter
does not sample this run's step 0; and it stops (exit 1) when a step's train/inference mismatch passes
--max-mismatch: the engine then did not sample with the trainer's weights.

The task: "What color is X? Answer with one lowercase word and nothing else." Reward (verifiable): 1 if the
expected colour is among the words of the reply, +1 if the reply is exactly that word. The base model names the
colour about half the time, in a sentence; the exact one-word answer is what it has to learn.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "polar_mitm").is_dir():
    sys.path.insert(0, str(CHECKOUT))  # this example's own polar_mitm, without PYTHONPATH (so from any folder)
# The trainer's Python settings are not those of the `polar-mitm assemble` child (another venv, another Python):
# a PYTHONPATH into this environment makes that child import this venv's compiled modules.
for variable in ("PYTHONPATH", "PYTHONHOME"):
    os.environ.pop(variable, None)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from polar_mitm.client import (  # noqa: E402
    GatewayControl,
    assemble,
    load_batch,
    logprob_mismatch,
    session_proxy_url,
    write_rewards_csv,
)
from polar_mitm.errors import PolarError  # noqa: E402
from polar_mitm.grpo import grpo_loss, token_logprobs  # noqa: E402
from polar_mitm.weight_sync import VLLMLoraEngine, sync_lora  # noqa: E402

TASKS = [
    ("the sky on a clear day", "blue"),
    ("fresh grass", "green"),
    ("snow", "white"),
    ("a ripe banana", "yellow"),
    ("a ripe tomato", "red"),
    ("coal", "black"),
]
PROMPT = "What color is {thing}? Answer with one lowercase word and nothing else."
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROBE = [{"role": "user", "content": "Name a color."}]


def reward(text: str, colour: str) -> float:
    words = re.findall(r"[a-z]+", (text or "").lower())
    return float(colour in words) + float(words == [colour])


def rollout(args: argparse.Namespace, step: int, run: str) -> tuple[dict[str, float], dict[str, str], int]:
    """prompts x samples sessions through the gateway (the openai SDK behind the proxy); rewards per session."""
    ca = str(Path(args.confdir) / "mitmproxy-ca-cert.pem")
    jobs = []
    for k in range(args.prompts):
        thing, colour = TASKS[(step * args.prompts + k) % len(TASKS)]
        for i in range(args.samples):
            jobs.append((f"{run}-s{step}-p{k}-{i}", f"{run}-s{step}-p{k}", thing, colour))

    def one(job: tuple[str, str, str, str]) -> tuple[str, float]:
        session_id, _, thing, colour = job
        http_client = httpx.Client(proxy=session_proxy_url(args.gateway, session_id, args.confdir), verify=ca, trust_env=False, timeout=600)
        client = openai.OpenAI(api_key="sk-grpo-loop", http_client=http_client, max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": PROMPT.format(thing=thing)}], max_tokens=args.max_tokens, temperature=args.temperature
        )
        http_client.close()
        return session_id, reward(reply.choices[0].message.content, colour)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        rewards = dict(pool.map(one, jobs))
    return rewards, {session_id: group for session_id, group, _, _ in jobs}, len(jobs)


def probe_logprobs(engine_url: str, model: str) -> list[float]:
    """Greedy logprobs of a fixed prompt under the engine model now served: they move when the weights do."""
    reply = httpx.post(
        engine_url + "/chat/completions",
        json={"model": model, "messages": PROBE, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 0},
        timeout=300,
        trust_env=False,
    ).json()
    return [item["logprob"] for item in reply["choices"][0]["logprobs"]["content"]]


def polar_mitm_command(given: str | None) -> list[str]:
    """How to run `polar-mitm` (for assemble): as given, else this checkout's venv, else the one on PATH."""
    if given:
        return shlex.split(given)
    for candidate in (CHECKOUT / ".venv" / "bin" / "polar-mitm", shutil.which("polar-mitm")):
        if candidate and Path(candidate).exists():
            return [str(candidate)]
    raise SystemExit(f"grpo_loop: no polar-mitm command ({CHECKOUT / '.venv/bin/polar-mitm'} missing, none on PATH); pass --polar-mitm")


def serve_starting_weights(gateway: GatewayControl, engine: VLLMLoraEngine, model: PeftModel, adapter_dir: Path, prefix: str) -> tuple[int, str]:
    """Serve the untrained LoRA (B = 0, so the base weights the trainer starts from) as this run's first policy
    version; returns (version, adapter name). A fresh gateway (no engine model set) keeps its version; one left
    serving another model (an earlier run's adapter) moves on to the next version, whose rows then hold this run's
    weights only. Every request of the run goes through an adapter: on vLLM CPU a base-model request batched with
    LoRA requests is served by whichever adapter sits in the last slot (docs/training.md)."""
    status = gateway.status()
    current, version = status["engine_model"], status["policy_version"] + (status["engine_model"] is not None)
    if current is not None:
        print(f"the gateway serves {current!r} at policy version {status['policy_version']}, not the trainer's starting weights: "
              f"serving this run's untrained adapter as version {version}", flush=True)
    # an earlier run's adapters under this prefix would block this run's names (vLLM refuses a loaded name)
    for name in [name for name in engine.served() if name.startswith(prefix) and name != current]:
        print(f"unloading {name!r}, left in the engine by an earlier run", flush=True)
        engine.unload(name)
    model.save_pretrained(adapter_dir / f"v{version}")
    previous = current if current is not None and current.startswith(prefix) else None
    report = sync_lora([gateway], engine, adapter_dir / f"v{version}", version, name_prefix=prefix, previous=previous)
    return report.policy_version, report.engine_model or f"{prefix}{version}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", required=True, help="the gateway's URL (proxy and /control/*)")
    parser.add_argument("--confdir", required=True, help="the gateway's confdir (CA, session secret)")
    parser.add_argument("--db", required=True, help="the gateway's store")
    parser.add_argument("--engine", required=True, help="the vLLM engine's OpenAI base URL, started with --lora-rank")
    parser.add_argument("--model-dir", default=None, help="the Hugging Face model directory the engine serves (default: $POLAR_MITM_HOME/models/smollm2)")
    parser.add_argument("--out", required=True, help="directory for adapters, Parquet, metrics.jsonl and the plot")
    parser.add_argument("--polar-mitm", default=None, help="how to run the polar-mitm command, for assemble (default: this checkout's .venv/bin/polar-mitm, else PATH's)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=3, help="GRPO groups per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the rollouts")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--adapter-prefix", default="policy-v", help="adapters are served as PREFIX<version>")
    # measured (docs/training.md): 0.02-0.064 per step when the engine samples with the trainer's weights; 0.76 when
    # it sampled with another run's adapter
    parser.add_argument("--max-mismatch", type=float, default=0.1, help="stop when a step's mean |Δ logprob| (trainer vs engine) passes this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a shared 2-core machine 1 is several times faster than 2)")
    args = parser.parse_args(argv)
    command = polar_mitm_command(args.polar_mitm)
    model_dir = Path(args.model_dir or Path(os.environ.get("POLAR_MITM_HOME") or "~/.cache/polar-mitm").expanduser() / "models" / "smollm2")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")  # this run's steps only (an --out used before keeps its adapters)
    run = uuid.uuid4().hex[:6]

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS, lora_dropout=0.0))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    gateway = GatewayControl(args.gateway)
    engine = VLLMLoraEngine(args.engine)
    version, served = serve_starting_weights(gateway, engine, model, out / "adapters", args.adapter_prefix)
    first_version = version
    probe_before = probe_logprobs(args.engine, served)
    metrics = []
    for step in range(args.steps):
        times: dict[str, float] = {}
        mark = time.monotonic()
        rewards, groups, n = rollout(args, step, run)
        times["rollout"] = time.monotonic() - mark

        mark = time.monotonic()
        csv = write_rewards_csv(out / f"rewards-{step}.csv", rewards, groups)
        parquet = assemble(args.db, out / f"step-{step}.parquet", csv, builder="per_request", command=command)
        batch = load_batch(parquet, sessions=rewards)
        times["assemble"] = time.monotonic() - mark
        versions = {v for v in batch.extra["min_policy_version"]} | {v for v in batch.extra["max_policy_version"]}
        if versions != {version}:
            raise SystemExit(f"grpo_loop: step {step}: rows carry policy versions {versions}, expected only {version} (another trainer syncs this gateway?)")

        mark = time.monotonic()
        tensors = batch.to_torch()
        logprobs = token_logprobs(model, tensors["input_ids"], tensors["attention_mask"])
        mismatch = logprob_mismatch(batch, logprobs.detach().numpy())
        if mismatch["mean_abs"] > args.max_mismatch:
            raise SystemExit(
                f"grpo_loop: step {step}: train/inference mismatch mean |Δ logprob| {mismatch['mean_abs']:.3f} (max {mismatch['max_abs']:.2f}) "
                f"passes --max-mismatch {args.max_mismatch}: the engine did not sample version {version} ({served}) with the trainer's weights; stopped before the update"
            )
        loss, stats = grpo_loss(logprobs, tensors["rollout_logprobs"], tensors["advantages"], tensors["loss_mask"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times["train"] = time.monotonic() - mark

        mark = time.monotonic()
        sampled = version
        adapter = out / "adapters" / f"v{version + 1}"
        model.save_pretrained(adapter)
        report = sync_lora([gateway], engine, adapter, version + 1, name_prefix=args.adapter_prefix, previous=served)
        version, served = report.policy_version, report.engine_model or served
        times["sync"] = time.monotonic() - mark

        values = np.array(list(rewards.values()))
        by_group: dict[str, list[float]] = {}
        for session_id, value in rewards.items():
            by_group.setdefault(groups[session_id], []).append(value)
        row = {
            "step": step, "policy_version_sampled": sampled, "samples": n, "reward_mean": float(values.mean()), "reward_std": float(values.std(ddof=1)),
            "exact_rate": float((values == 2).mean()), "groups_with_signal": sum(len(set(v)) > 1 for v in by_group.values()), "sampled_tokens": batch.sampled_tokens, "loss": float(loss.detach()), **stats,
            "mismatch": mismatch, "seconds": {k: round(v, 2) for k, v in times.items()}, "sync_seconds": {k: round(v, 3) for k, v in report.seconds.items()},
        }
        metrics.append(row)
        (out / "metrics.jsonl").open("a").write(json.dumps(row) + "\n")
        print(
            f"step {step:2d} v{sampled}: reward {row['reward_mean']:.2f}±{row['reward_std']:.2f} exact {row['exact_rate']:.2f} "
            f"tokens {row['sampled_tokens']:4d} | mismatch mean|Δ| {mismatch['mean_abs']:.4f} max|Δ| {mismatch['max_abs']:.4f} kl {mismatch['kl']:.2e} | "
            + " ".join(f"{k} {v:.1f}s" for k, v in times.items()),
            flush=True,
        )
    probe_after = probe_logprobs(args.engine, served)
    summary = {"steps": args.steps, "first_version": first_version, "final_version": version, "served": served, "probe_before": probe_before, "probe_after": probe_after,
               "probe_max_abs_change": float(np.max(np.abs(np.array(probe_after[: len(probe_before)]) - np.array(probe_before[: len(probe_after)]))))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(metrics, out / "grpo_loop.png")
    print(json.dumps(summary))
    return 0


def plot(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    mean, std = np.array([m["reward_mean"] for m in metrics]), np.array([m["reward_std"] for m in metrics])
    left.plot(steps, mean, marker="o", label="reward mean (0-2)")
    left.fill_between(steps, mean - std, mean + std, alpha=0.2)
    left.plot(steps, [2 * m["exact_rate"] for m in metrics], marker=".", linestyle="--", label="2 x exact one-word rate")
    left.set_xlabel("step (policy version sampled)")
    left.set_title("reward")
    left.legend(fontsize=8)
    right.plot(steps, [m["mismatch"]["mean_abs"] for m in metrics], marker="o", label="mean |Δ logprob|")
    right.plot(steps, [m["mismatch"]["max_abs"] for m in metrics], marker=".", label="max |Δ logprob|")
    right.set_yscale("log")
    right.set_xlabel("step")
    right.set_title("train/inference mismatch (fp32 trainer vs bf16 vLLM)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (PolarError, httpx.HTTPError, openai.APIError) as error:  # a gateway, engine or assemble failure: one line
        sys.exit(f"grpo_loop: {error}")
