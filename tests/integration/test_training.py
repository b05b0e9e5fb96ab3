"""Training against polar-mitm with a real model: weight sync into the running vLLM engine (runtime LoRA), the
trainer's fp32 recomputation of every stored rollout logprob, and examples/grpo_loop.py closing three steps.

Engine: SmolLM2-135M-Instruct served by vLLM 0.32 CPU with --enable-lora (fixture `lora_engine`); trainer: the
engine venv's torch + transformers + peft, run as a subprocess that imports only polar_mitm.client/grpo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from polar_mitm.client import GatewayControl, load_batch
from polar_mitm.local_engine import build
from polar_mitm.weight_sync import VLLMLoraEngine, sync_lora
from tests.support.gatewayproc import Gateway

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = build.model_dir(build.engine_home(), "smollm2")
# measured (docs/training.md): bf16 engine vs fp32 recomputation of the same weights, SmolLM2 on CPU. Per step or
# run the mean |Δ| was 0.02-0.064 (over 22-207 tokens); the largest single-token |Δ| 0.63 (a low-probability token).
MEAN_TOLERANCE = 0.1
MAX_TOLERANCE = 1.0


def trainer(python: str, *args: str, timeout: float = 900) -> dict:
    env = {**build.engine_python_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, str(ROOT / "tests" / "support" / "trainer_side.py"), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sdk(gateway: Gateway, session_id: str) -> openai.OpenAI:
    http_client = httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=600)
    return openai.OpenAI(api_key="sk-test", http_client=http_client, max_retries=0)


PROBE = [{"role": "user", "content": "Name a color."}]


def probe(gateway: Gateway, session_id: str) -> list[float]:
    reply = sdk(gateway, session_id).chat.completions.create(model="smollm2", messages=PROBE, max_tokens=8, temperature=0, logprobs=True, top_logprobs=0)
    return [item.logprob for item in reply.choices[0].logprobs.content]


def test_weight_sync_changes_engine_logprobs_and_row_versions(lora_engine: str, trainer_python: str, make_gateway, session_id: str, tmp_path: Path) -> None:
    gateway = make_gateway(upstream=lora_engine)
    control, engine = GatewayControl(gateway.proxy_url()), VLLMLoraEngine(lora_engine)
    before = probe(gateway, session_id + "-v0")
    adapter = trainer(trainer_python, "adapter", str(tmp_path / "adapter"), "--model-dir", str(MODEL_DIR))["adapter"]
    prefix = f"sync-{session_id[-8:]}-v"  # the engine is shared: a name of this test's own
    name = prefix + "1"
    report = sync_lora([control], engine, adapter, 1, name_prefix=prefix)
    try:
        assert report.engine_model == name and name in engine.served()
        assert set(report.seconds) == {"pause", "load", "resume", "total"}
        status = control.status()
        assert status["policy_version"] == 1 and status["engine_model"] == name and status["state"] == "serving", status
        after = probe(gateway, session_id + "-v1")
        rows = {r["session_id"]: r for r in gateway.rows("SELECT session_id, policy_version, model_engine, completion_logprobs FROM exchanges WHERE session_id LIKE ?", [session_id + "-%"])}
        assert rows[session_id + "-v0"]["policy_version"] == 0 and rows[session_id + "-v0"]["model_engine"] == "smollm2"
        assert rows[session_id + "-v1"]["policy_version"] == 1 and rows[session_id + "-v1"]["model_engine"] == name
        common = min(len(before), len(after))
        assert max(abs(a - b) for a, b in zip(before[:common], after[:common], strict=True)) > 0.05, (before, after)
        print(f"sync seconds {report.seconds}; probe logprobs before {before} after {after}")
    finally:
        engine.unload(name)
    assert name not in engine.served()


def test_recomputed_logprobs_match_the_stored_ones_and_a_shifted_mask_does_not(lora_engine: str, trainer_python: str, make_gateway, session_id: str, tmp_path: Path) -> None:
    """An unsteered run (no structured outputs): multi-turn SDK sessions, assembled by prefix_merging."""
    gateway = make_gateway(upstream=lora_engine)
    for n in range(3):
        client, messages = sdk(gateway, f"{session_id}-{n}"), [{"role": "user", "content": f"Tell me one fact about the number {n + 2}."}]
        for _ in range(2):
            reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=1.0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "And another one?"}]
    parquet = tmp_path / "run.parquet"
    done = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "assemble", "--db", str(gateway.db), "--builder", "prefix_merging", "--out", str(parquet)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    batch = load_batch(parquet)
    assert len(batch) >= 3 and batch.sampled_tokens > 0
    # every exchange is in: second turns that extend the first are merged into it, others (re-tokenized text) start anew
    assert sum(batch.extra["n_exchanges"]) == 6, batch.extra["n_exchanges"]
    aligned = trainer(trainer_python, "recompute", str(parquet), "--model-dir", str(MODEL_DIR))
    print("aligned:", aligned)
    assert aligned["tokens"] == batch.sampled_tokens
    assert aligned["mean_abs"] < MEAN_TOLERANCE and aligned["max_abs"] < MAX_TOLERANCE, aligned
    shifted = trainer(trainer_python, "recompute", str(parquet), "--model-dir", str(MODEL_DIR), "--shift", "1")
    print("shifted:", shifted)
    assert shifted["mean_abs"] > 10 * MEAN_TOLERANCE and shifted["max_abs"] > 5 * MAX_TOLERANCE, shifted


def test_grpo_loop_closes_three_steps(lora_engine: str, trainer_python: str, make_gateway, session_id: str, tmp_path: Path) -> None:
    gateway = make_gateway(upstream=lora_engine)
    prefix = f"loop-{session_id[-8:]}-v"  # the engine is shared: adapter names of this test's own
    out = tmp_path / "run"
    env = {**build.engine_python_env(), "PYTHONPATH": str(ROOT)}
    command = [
        trainer_python, str(ROOT / "examples" / "grpo_loop.py"), "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--db", str(gateway.db),
        "--engine", lora_engine, "--model-dir", str(MODEL_DIR), "--out", str(out), "--polar-mitm", f"{sys.executable} -m polar_mitm.cli",
        "--steps", "3", "--prompts", "2", "--samples", "2", "--max-tokens", "14", "--adapter-prefix", prefix,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    finally:
        engine = VLLMLoraEngine(lora_engine)
        for name in [n for n in engine.served() if n.startswith(prefix)]:
            engine.unload(name)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version_sampled"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["samples"] == 4 and m["sampled_tokens"] > 0 and 0 <= m["reward_mean"] <= 2
        assert m["mismatch"]["tokens"] == m["sampled_tokens"] and m["mismatch"]["mean_abs"] < MEAN_TOLERANCE, m
    status = GatewayControl(gateway.proxy_url()).status()
    assert status["policy_version"] == 3 and status["engine_model"] == prefix + "3" and status["state"] == "serving", status
    rows = gateway.rows("SELECT policy_version, model_engine, count(*) AS n FROM exchanges WHERE status = 'ok' GROUP BY ALL ORDER BY policy_version")
    assert [(r["policy_version"], r["model_engine"], r["n"]) for r in rows] == [(0, "smollm2", 4), (1, prefix + "1", 4), (2, prefix + "2", 4)], rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_version"] == 3 and (out / "grpo_loop.png").stat().st_size > 10_000
    # the engine's weights moved exactly when some group had a reward spread (else every advantage, so the step, is 0)
    if any(m["groups_with_signal"] for m in metrics):
        assert summary["probe_max_abs_change"] > 0, summary
    else:
        assert summary["probe_max_abs_change"] == 0, summary
