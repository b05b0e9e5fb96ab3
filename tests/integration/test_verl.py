"""verl's agent loop on polar-mitm (issue 27): real verl 0.9 in its own venv (`polar-mitm engine build --with-verl`),
`PolarAgentLoop` made the way verl's AgentLoopWorker makes agent loops (hydra's instantiate of the registered
config), run for two samples of the facts agent (OpenAI Agents SDK, Responses API) through the rollout server on a
tokens-mode gateway and the real engine. verl's trainer itself is not run: it needs GPUs (FSDP/Megatron workers and
verl's own inference servers); README says so.

What verl receives is checked against the store: verl's own AgentLoopOutput objects (`as_dict()` works on them),
the evaluator's reward, both model calls in one response with the tool result masked out, and every sampled
token's logprob the engine's as stored.
"""

from __future__ import annotations

import json
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

EXAMPLE = REPO / "examples" / "verl_agent_loop.py"
TASK = REPO / "examples" / "agents" / "facts" / "task.yaml"
HOOK = f"{REPO / 'examples' / 'agents' / 'steer.py'}:steer"


@pytest.fixture(scope="module")
def verl_python() -> str:
    return str(build.build_verl_venv(build.engine_home()))


def test_verl_agent_loop_outputs_are_real_sessions_with_the_stored_tokens(engine_url: str, verl_python: str, tmp_path: Path) -> None:
    assert frameworks_python().exists(), f"the agent frameworks' venv is missing ({frameworks_python()}): scripts/setup.sh installs it"
    server = serve(["--upstream", engine_url, "--db", "verl.duckdb", "--confdir", "verl-conf", "--render", "tokens", "--engine-hook", HOOK], tmp_path, tmp_path / "server.log")
    url, log = server.url, server.log
    try:
        done = subprocess.run(
            [verl_python, str(EXAMPLE), "--server", url, "--task", str(TASK), "--model", str(build.model_dir(build.engine_home(), "qwen3-tiny")), "--samples", "2", "--out", "verl.json"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=build.engine_python_env(),
        )
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}\nserver log:\n{log.read_text()[-3000:]}"
        outputs = json.loads((tmp_path / "verl.json").read_text())
        tasks = httpx.get(url + "/tasks", timeout=30, trust_env=False).json()
    finally:
        server.client.close()
        stop_process_group(server.process, grace=60)

    assert len(outputs) == 2 and len(tasks) == 2  # one one-sample task per verl sample
    sequences = {row["session_id"]: row for task in tasks for row in pq.read_table(task["trajectories"]).to_pylist() if row["trainable"]}
    for output in outputs:
        assert output["type"] == "verl.experimental.agent_loop.agent_loop.AgentLoopOutput"
        assert {"prompts", "responses", "response_mask", "rollout_log_probs"} <= set(output["as_dict_keys"])
        extra = output["extra_fields"]
        assert extra["polar_status"] == "completed" and extra["polar_trainable"] and not extra["polar_truncated"]
        assert output["reward_score"] == 1.0  # the strict evaluator: the lookup ran and the answer is the fact
        assert extra["polar_sequences"] == 1 and extra["polar_policy_versions"] == [0]
        # the session's one sequence, split at its first sampled token: both model calls, the tool result between
        sequence = sequences[extra["polar_session_id"]]
        assert output["prompt_ids"] + output["response_ids"] == sequence["input_ids"]
        mask, logprobs = output["response_mask"], output["response_logprobs"]
        assert len(mask) == len(output["response_ids"]) == len(logprobs) and mask[0] == 1 and 0 in mask
        assert output["num_turns"] == 4
        rows = store.query_dicts(tmp_path / "verl.duckdb", "SELECT status, api, completion_token_ids, completion_logprobs FROM exchanges WHERE session_id = ? ORDER BY seq", [extra["polar_session_id"]])
        assert [(r["status"], r["api"]) for r in rows] == [("ok", "openai_responses")] * 2
        sampled = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
        stored = [lp for r in rows for lp in r["completion_logprobs"]]
        assert len(sampled) == len(stored) and max(abs(a - b) for a, b in zip(sampled, stored, strict=True)) < 1e-6
        assert [t for t, m in zip(output["response_ids"], mask, strict=True) if m] == [t for r in rows for t in r["completion_token_ids"]]
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
