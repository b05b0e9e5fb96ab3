"""TRL's own GRPOTrainer drives the rollout server (issue 27): real `trl` 1.16 in the trainer's environment (the
engine venv, Python 3.11), a LoRA on SmolLM2-135M-Instruct, two optimizer steps, every completion a real agent's
model call (the OpenAI Agents SDK facts agent of examples/agents/, Responses API, routed by proxy settings only)
through the rollout server's gateway to the real vLLM engine, unsteered. The agent asks for at most 128 tokens a
call itself (its own `max_tokens`, POLAR_AGENT_MAX_TOKENS): SmolLM2 otherwise rambles up to its context limit, minutes
a call on a loaded 2-core machine; the uncapped run of this agent is test_agent_frameworks'. Each call that reaches
128 tokens fails its Agents SDK run (masked out for TRL); with 2 sessions a prompt, all four of a step's sessions did so
once in a full suite (a step with nothing to train on), so each prompt gets 4.

`examples/trl_grpo.py` runs as a user runs it, from a fresh folder: TRL's `rollout_func` is
polar_mitm.integrations.trl.PolarRollouts, which pushes the trainer's adapter into the running engine before each
step's rollouts. The test then checks what TRL's loss received against the store: each session's logprobs equal
the engine's stored ones token for token, its rows carry the policy version of the step that sampled them and the
engine model the sync loaded, and TRL logged both steps.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from polar_mitm import store
from polar_mitm.harnesses.frameworks import frameworks_python
from polar_mitm.local_engine import build
from tests.support.processes import stop_process_group
from tests.support.rollout_runs import REPO, serve

pytestmark = [pytest.mark.engine, pytest.mark.harness]

EXAMPLE = REPO / "examples" / "trl_grpo.py"
TASK = REPO / "examples" / "agents" / "facts" / "task.yaml"


@pytest.fixture
def rollout_server(lora_engine: str, tmp_path: Path):
    if not frameworks_python().exists():
        pytest.fail(f"the agent frameworks' venv is missing ({frameworks_python()}): scripts/setup.sh installs it")
    server = serve(["--upstream", lora_engine, "--db", "trl.duckdb", "--confdir", "trl-conf", "--run-limit", "4"], tmp_path, tmp_path / "server.log")
    yield server.url, tmp_path / "trl.duckdb", server.log
    server.client.close()
    stop_process_group(server.process, grace=60)


def test_trl_grpo_trainer_trains_two_steps_on_real_agent_sessions_with_the_stored_logprobs(lora_engine: str, trainer_python: str, rollout_server, tmp_path: Path) -> None:
    url, db, log = rollout_server
    work = tmp_path / "trainer"
    work.mkdir()
    command = [
        trainer_python, str(EXAMPLE), "--server", url, "--engine", lora_engine, "--task", str(TASK),
        "--out", "run", "--steps", "2", "--prompts", "2", "--num-generations", "4", "--received", "received.jsonl",
        "--agent-env", "POLAR_AGENT_MAX_TOKENS=128",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=work, env=build.engine_python_env())
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}\nserver log:\n{log.read_text()[-3000:]}"
    summary = json.loads((work / "run" / "summary.json").read_text())

    # two optimizer steps, each logged by TRL with a finite loss; the engine got the adapter before each step's rollouts
    assert summary["global_step"] == 2
    steps = [entry for entry in summary["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2] and all(math.isfinite(entry["loss"]) for entry in steps), steps
    # a fresh server's gateway serves version 0: the run's steps are versions 1 and 2, each its own adapter
    served = {step: (s["policy_version"], s["engine_model"]) for step, s in enumerate(summary["syncs"])}
    assert [v for v, _ in served.values()] == [1, 2] and len({m for _, m in served.values()}) == 2 and all(m.startswith("trl-") for _, m in served.values()), summary["syncs"]
    assert [row["policy_versions"] for row in summary["steps"]] == [[1], [2]], summary["steps"]
    # the recomputation check: the trainer's fp32 logprob of every sampled token, before its step, against the bf16
    # engine's stored one (measured 0.03-0.07 mean |Δ|); the same with the mask one token off is far from it
    for row in summary["steps"]:
        assert row["mismatch_mean"] < 0.25 and row["shifted_mismatch_mean"] > 4 * row["mismatch_mean"], row

    received = [json.loads(line) for line in (work / "received.jsonl").read_text().splitlines()]
    assert [r["step"] for r in received] == [0] * 8 + [1] * 8  # 2 prompts x 4 sessions per step
    assert len({r["session_id"] for r in received}) == 16

    # what TRL received is the sequence the integration chose from each task's Parquet (its last one) ...
    tasks = httpx.get(url + "/tasks", timeout=30, trust_env=False).json()
    chosen: dict[str, dict] = {}
    for task in tasks:
        for row in pq.read_table(task["trajectories"]).to_pylist():
            if row["trainable"]:
                chosen[row["session_id"]] = row  # file order: a session's last trainable sequence wins, as in samples_of
    sessions = {s["session_id"]: s for task in tasks for s in task["sessions"]}
    trained = [entry for entry in received if entry["logprobs"]]
    # a session that failed (the Agents SDK fails a run whose reply hit its own budget) reached TRL masked out,
    # with no reward: nothing of it was trained on
    for entry in received:
        if not entry["logprobs"]:
            assert entry["session_id"] not in chosen and entry["reward"] is None and sessions[entry["session_id"]]["status"] != "completed", entry
    assert {entry["step"] for entry in trained} == {0, 1}, received  # each step trained on real sessions
    for entry in trained:
        sequence = chosen[entry["session_id"]]
        # ... and its logprobs are the engine's, as the store holds them, exchange by exchange
        rows = store.query_dicts(db, "SELECT exchange_id, api, status, policy_version, model_engine, completion_logprobs FROM exchanges WHERE session_id = ? ORDER BY seq", [entry["session_id"]])
        by_id = {row["exchange_id"]: row for row in rows}
        stored = [lp for exchange_id in sequence["exchange_ids"] for lp in by_id[exchange_id]["completion_logprobs"]]
        assert len(stored) == len(entry["logprobs"]) > 0
        assert max(abs(a - b) for a, b in zip(stored, entry["logprobs"], strict=True)) < 1e-5
        # a real agent's calls, stamped with the policy that sampled them
        assert {(row["api"], row["status"]) for row in rows} == {("openai_responses", "ok")}, rows
        assert store.query_dicts(db, "SELECT harness FROM sessions WHERE session_id = ?", [entry["session_id"]]) == [{"harness": "openai-agents-facts"}]
        assert {(row["policy_version"], row["model_engine"]) for row in rows} == {served[entry["step"]]}

