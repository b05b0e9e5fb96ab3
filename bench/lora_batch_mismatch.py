"""Does a request's logprob on vLLM CPU depend on what else is in its batch? Base and LoRA requests, alone or
batched together, against the trainer's fp32 recomputation under the same weights.

Run in a trainer environment (torch, transformers, peft; the local engine's venv after
`polar_mitm.local_engine.build.ensure_trainer_packages`) against an engine serving runtime LoRA adapters
(`polar-mitm engine start --model smollm2 --port 8013 --lora-rank 8`), with an adapter folder (e.g.
`tests/support/trainer_side.py adapter DIR --model-dir MODEL`):

    PYTHONPATH=. python bench/lora_batch_mismatch.py --engine http://127.0.0.1:8013/v1 --model-dir MODEL --adapter DIR

Every request has logprobs and a fixed seed per prompt (`--temperature`, default 0; `--no-seed`), sent straight to
the engine. Conditions, each `--repeats` times: `alone` (one request at a time), `base_batch` (the base requests at
once), `lora_batch` (the LoRA requests at once), `mixed` (base and LoRA requests at once),
`mixed_with_adapter_churn` (the mixed batch while another client loads, uses and unloads adapters, as a training
loop's weight sync does; `--no-churn` leaves it out). `--base-adapter DIR` serves the base requests through that
adapter (one with B = 0 is the base model) instead. Prints one JSON object: per condition and kind (base, lora)
the mean/max |Δ| against the fp32 recomputation under its own weights and under the other kind's, against the same
request sent alone (engine vs engine, over the tokens both sampled alike), and how many samples changed.
Findings: docs/training.md ("Mixed base/LoRA batches").
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from polar_mitm.weight_sync import VLLMLoraEngine

PROMPTS = [
    "Name a color.",
    "What is two plus three?",
    "Write one sentence about the sea.",
    "List three fruits.",
    "Say hello in French.",
    "Why is the sky blue? One sentence.",
]
ADAPTER_NAME = "batch-mismatch-lora"


SAMPLING = {"temperature": 0.0}
SEEDED = [True]


def complete(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, barrier: threading.Barrier | None) -> dict:
    # a fixed seed per prompt: with --temperature > 0 the same request samples the same tokens in every condition
    # (as long as its logits do not move), so the conditions stay comparable token by token
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "logprobs": True, "return_token_ids": True, **SAMPLING}
    if SEEDED[0]:
        body["seed"] = PROMPTS.index(prompt)
    if barrier is not None:
        barrier.wait()
    reply = http.post(url + "/chat/completions", json=body)
    reply.raise_for_status()
    data = reply.json()
    choice = data["choices"][0]
    return {"prompt_ids": data["prompt_token_ids"], "ids": choice["token_ids"], "logprobs": [item["logprob"] for item in choice["logprobs"]["content"]]}


def run(http: httpx.Client, url: str, jobs: list[tuple[str, int]], models: dict[str, str], max_tokens: int, together: bool) -> dict[tuple[str, int], dict]:
    """jobs: (kind, prompt index). together: all sent at the same moment (one batch), else one after another."""
    if not together:
        return {job: complete(http, url, models[job[0]], PROMPTS[job[1]], max_tokens, None) for job in jobs}
    barrier = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(complete, http, url, models[job[0]], PROMPTS[job[1]], max_tokens, barrier) for job in jobs}
        return {job: future.result() for job, future in futures.items()}


def churn(engine: VLLMLoraEngine, http: httpx.Client, url: str, adapter: str, stop: threading.Event) -> int:
    """What a training loop's weight sync does next to a running batch: load an adapter under a new name, sample
    with it once, unload it; again until `stop`. Returns how many rounds ran."""
    rounds = 0
    while not stop.is_set():
        name = f"{ADAPTER_NAME}-churn-{rounds}"
        engine.load(name, adapter)
        complete(http, url, name, PROMPTS[0], 4, None)
        engine.unload(name)
        rounds += 1
    return rounds


def fp32_logprobs(model, prompt_ids: list[int], ids: list[int]) -> np.ndarray:
    sequence = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = model(input_ids=sequence).logits.float()[0]
    scored = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1).gather(-1, sequence[0, len(prompt_ids) :, None]).squeeze(-1)
    return scored.numpy()


def summary(deltas: list[np.ndarray]) -> dict:
    flat = np.abs(np.concatenate(deltas)) if deltas else np.zeros(0)
    return {"tokens": int(flat.size), "mean_abs": round(float(flat.mean()), 4) if flat.size else None, "max_abs": round(float(flat.max()), 4) if flat.size else None}


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True, help="the engine's OpenAI base URL (.../v1)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--adapter", required=True, help="a PEFT adapter folder")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-seed", action="store_true", help="send no per-request seed")
    parser.add_argument("--no-churn", action="store_true", help="leave out mixed_with_adapter_churn")
    parser.add_argument("--base-adapter", help="serve the base requests through this adapter (e.g. one with B = 0) instead of the base model")
    args = parser.parse_args()
    SAMPLING["temperature"] = args.temperature
    SEEDED[0] = not args.no_seed

    engine = VLLMLoraEngine(args.engine)
    base_name = engine.served()[0]
    engine.load(ADAPTER_NAME, args.adapter)
    models = {"base": base_name, "lora": ADAPTER_NAME}
    if args.base_adapter:
        engine.load(ADAPTER_NAME + "-base", args.base_adapter)
        models["base"] = ADAPTER_NAME + "-base"
    base_jobs = [("base", i) for i in range(len(PROMPTS))]
    lora_jobs = [("lora", i) for i in range(len(PROMPTS))]
    conditions = {"alone": (base_jobs + lora_jobs, False), "base_batch": (base_jobs, True), "lora_batch": (lora_jobs, True), "mixed": (base_jobs + lora_jobs, True)}
    results: dict[str, list[dict]] = {name: [] for name in [*conditions, "mixed_with_adapter_churn"]}
    churn_rounds = 0
    try:
        with httpx.Client(timeout=600, trust_env=False) as http:
            for _ in range(args.repeats):
                for name, (jobs, together) in conditions.items():
                    results[name].append(run(http, args.engine, jobs, models, args.max_tokens, together))
                if args.no_churn:
                    continue
                stop = threading.Event()
                with ThreadPoolExecutor(1) as side:
                    churned = side.submit(churn, engine, httpx.Client(timeout=600, trust_env=False), args.engine, args.adapter, stop)
                    try:
                        results["mixed_with_adapter_churn"].append(run(http, args.engine, base_jobs + lora_jobs, models, args.max_tokens, True))
                    finally:
                        stop.set()
                    churn_rounds += churned.result()
    finally:
        engine.unload(ADAPTER_NAME)
        if args.base_adapter:
            engine.unload(ADAPTER_NAME + "-base")
        engine.close()

    trainers = {"base": AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()}
    trainers["lora"] = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32), args.adapter).eval()
    reference = results["alone"][0]
    report: dict = {"prompts": len(PROMPTS), "max_tokens": args.max_tokens, "repeats": args.repeats, "temperature": args.temperature, "seeded": SEEDED[0], "base_served_as": models["base"], "churn_rounds": churn_rounds, "conditions": {}}
    for name, runs in results.items():
        for kind in ("base", "lora"):
            other = "lora" if kind == "base" else "base"
            vs_fp32, vs_other, vs_alone, changed = [], [], [], 0
            for outcome in runs:
                for (job_kind, index), sample in outcome.items():
                    if job_kind != kind:
                        continue
                    vs_fp32.append(fp32_logprobs(trainers[kind], sample["prompt_ids"], sample["ids"]) - np.array(sample["logprobs"]))
                    vs_other.append(fp32_logprobs(trainers[other], sample["prompt_ids"], sample["ids"]) - np.array(sample["logprobs"]))
                    alone = reference[(kind, index)]
                    same = next((n for n, (a, b) in enumerate(zip(alone["ids"], sample["ids"], strict=False)) if a != b), min(len(alone["ids"]), len(sample["ids"])))
                    changed += same < max(len(alone["ids"]), len(sample["ids"]))
                    vs_alone.append(np.array(sample["logprobs"][:same]) - np.array(alone["logprobs"][:same]))
            if vs_fp32:
                report["conditions"].setdefault(name, {})[kind] = {"vs_fp32": summary(vs_fp32), "vs_fp32_other_weights": summary(vs_other), "vs_alone": summary(vs_alone), "greedy_samples_changed": changed, "samples": len(vs_fp32)}
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
