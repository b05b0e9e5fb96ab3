"""The example agents on agent frameworks (examples/agents/), unmodified, through the gateway and the rollout server.

Three small non-coding agents — the OpenAI Agents SDK (facts lookup, Responses API), pydantic-ai (form filling,
Chat Completions) and smolagents (budget planning with a calculator, Chat Completions) — run from their venv
(sandboxes/agents-frameworks/install.sh) on their framework's normal OpenAI client, routed by proxy settings only,
steered by examples/agents/steer.py (a regex on the output only). Each one:
  - through `polar-mitm run -- PYTHON agent.py INSTRUCTION` (a `--render tokens` gateway) on the task's own
    files: its tool really runs (its log holds the call and the result), it exits 0, the store holds exactly
    its two model calls with its `api`, ids equal to the engine's, the session assembles with every sampled
    token once, and its task's evaluator, on what it left, gives 1.0;
  - through `polar-mitm rollout run TASK.yaml` (one sample, chat mode): completed, reward 1.0 from its evaluator,
    the task's trajectories exported to Parquet with the session in them.
Sequences per session in each mode are docs/agents.md's (SEQUENCES). The evaluators' strictness and the presets'
environment are checked without the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from polar_mitm import harnesses, store
from polar_mitm.assembler import assemble
from polar_mitm.harnesses.frameworks import frameworks_python
from polar_mitm.rollout.models import TaskRequest, UploadStep
from polar_mitm.store import JSON_COLUMNS
from polar_mitm.util import free_port, load_function
from tests.support.gatewayproc import Gateway
from tests.support.harness_runs import REPO, STRIPPED, check_assembly
from tests.support.matrix import harness_matrix

EXAMPLES = REPO / "examples" / "agents"
INSTALL = REPO / "sandboxes" / "agents-frameworks" / "install.sh"
HOOK = f"{EXAMPLES / 'steer.py'}:steer"
RUN_TIMEOUT = 240


@dataclass(frozen=True)
class Expect:
    example: str  # its folder under examples/agents/
    final_finish: str  # how its last turn ends: a text ("stop") or its framework's own answer tool ("tool_calls")
    finisher: str | None = None  # that answer tool


AGENTS = {
    "openai-agents-facts": Expect("facts", "stop"),
    "pydantic-ai-form": Expect("form", "tool_calls", "final_result"),
    "smolagents-planner": Expect("planner", "tool_calls", "final_answer"),
}


# sequences per session (docs/agents.md's matrix): `polar-mitm run` on a `--render tokens` gateway, the rollout
# server in chat mode (its default)
SEQUENCES = {"openai-agents-facts": {"tokens": 1, "chat": 2}, "pydantic-ai-form": {"tokens": 1, "chat": 2}, "smolagents-planner": {"tokens": 2, "chat": 2}}


@pytest.fixture(scope="module")
def frameworks_installed() -> None:
    try:
        result = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{INSTALL} did not finish within 30 minutes")
    if result.returncode != 0:
        pytest.skip(f"{INSTALL} failed (exit {result.returncode}); the frameworks cannot be installed here:\n{result.stderr[-2000:]}")


@pytest.fixture(scope="module")
def steered_gateway(engine_url: str, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("frameworks-gw")
    gateway = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine_url, args=["--render", "tokens", "--engine-hook", HOOK]).start()
    yield gateway
    gateway.stop()


def load_task(name: str) -> TaskRequest:
    return TaskRequest.model_validate(yaml.safe_load((EXAMPLES / AGENTS[name].example / "task.yaml").read_text()))


def planned_call(task: TaskRequest) -> dict[str, Any]:
    [line] = [line for line in task.instruction.splitlines() if line.startswith("STEER-CALL: ")]
    return json.loads(line.removeprefix("STEER-CALL: "))


class WorkspaceContext:
    """What a Python evaluator reads (polar_mitm.rollout.evaluation.EvaluationContext's `task` and `read_file`),
    over a `polar-mitm run` workspace instead of a rollout sandbox."""

    def __init__(self, task: TaskRequest, workspace: Path) -> None:
        self.task, self.workspace = task, workspace

    def read_file(self, path: str) -> bytes:
        return (self.workspace / path).read_bytes()


def rows_of(gateway: Gateway, session_id: str) -> list[dict]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_through_polar_mitm_run(frameworks_installed, steered_gateway: Gateway, name: str, session_id: str, tmp_path: Path) -> None:
    task, expect, harness = load_task(name), AGENTS[name], harnesses.get(name)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    for step in task.runtime.prepare:  # the task's own files, as its sandbox gets them
        assert isinstance(step, UploadStep) and step.upload.content is not None
        (workspace / step.upload.target).parent.mkdir(parents=True, exist_ok=True)
        (workspace / step.upload.target).write_text(step.upload.content)
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED} | {"OPENAI_API_KEY": harnesses.PLACEHOLDER_API_KEY}
    command = [
        sys.executable, "-m", "polar_mitm.cli", "run", "--gateway", steered_gateway.proxy_url(), "--confdir", str(steered_gateway.confdir),
        "--session", session_id, "--", str(frameworks_python()), str(EXAMPLES / expect.example / "agent.py"), task.instruction,
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    print(f"\n{name} run: {time.monotonic() - started:.1f}s, exit {result.returncode}")
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert f"session {session_id}" in result.stderr

    # the tool really ran: the agent's own tool logged the call the policy made, with what it returned
    call = planned_call(task)
    logged = [json.loads(line) for line in (workspace / "tool_calls.jsonl").read_text().splitlines()]
    assert [(c["tool"], c["arguments"]) for c in logged] == [(call["name"], call["arguments"])], report

    rows = rows_of(steered_gateway, session_id)
    summary = [(r["seq"], r["api"], r["status"], r["path"], r["stream"], r["finish_reason"], r["user_agent"]) for r in rows]
    assert len(rows) == 2, summary
    assert all(r["status"] == "ok" and r["http_status"] == 200 for r in rows), summary
    assert {r["api"] for r in rows} == {harness.api}, summary
    for row in rows:
        [choice] = row["engine_response"]["choices"]
        assert row["completion_token_ids"] == choice["token_ids"]
        assert row["prompt_token_ids"] == choice["prompt_token_ids"]  # token-in: the engine's own ids
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["engine_request"]["structured_outputs"]["regex"]  # the steering is on the record
        assert row["render_mode"] == "tokens" and row["engine_request"]["prompt"] == row["prompt_token_ids"]
    tool_turn, final_turn = rows
    # the call the policy sampled, as the framework received it (its tool then ran it: the log above)
    assert tool_turn["finish_reason"] == "tool_calls" and call["name"] in json.dumps(tool_turn["response_body"]), summary
    assert final_turn["finish_reason"] == expect.final_finish, summary
    if expect.finisher:
        assert expect.finisher in json.dumps(final_turn["response_body"]), summary
    # the second turn carries the tool's real result back, and extends the first turn's sampled ids
    assert logged[0]["result"].splitlines()[0] in json.dumps(final_turn["request_body"]), summary
    check_assembly(steered_gateway, session_id, rows)
    sequences = assemble(steered_gateway.db, builder="prefix_merging", session=session_id).sequences
    assert len(sequences) == SEQUENCES[name]["tokens"], [s.exchange_ids for s in sequences]  # docs/agents.md's count

    # what it left is what its task's evaluator rewards
    assert task.evaluator is not None and task.evaluator.python is not None
    path, function = task.evaluator.python.split(":")
    evaluator = load_function(f"{EXAMPLES / expect.example / path}:{function}")
    outcome = evaluator(WorkspaceContext(task, workspace))
    assert outcome["reward"] == 1.0, outcome


# default suite: one agent end to end through `rollout run` (each task.yaml is parsed as a TaskRequest and its
# evaluator run by test_evaluators_are_strict, each agent run by test_agent_through_polar_mitm_run);
# all in the full matrix
@pytest.mark.parametrize("name", harness_matrix(list(AGENTS), default=("smolagents-planner",)))
def test_agent_through_the_rollout_server(frameworks_installed, engine_url: str, name: str, tmp_path: Path) -> None:
    """`polar-mitm rollout run examples/agents/<agent>/task.yaml`, one sample: its evaluator's reward, its Parquet."""
    task = yaml.safe_load((EXAMPLES / AGENTS[name].example / "task.yaml").read_text())
    task["num_samples"] = 1
    path, function = task["evaluator"]["python"].split(":")
    task["evaluator"]["python"] = f"{EXAMPLES / AGENTS[name].example / path}:{function}"  # the copy lives elsewhere
    task_file = tmp_path / "task.yaml"
    task_file.write_text(yaml.safe_dump(task))
    db = tmp_path / "store.duckdb"
    command = [sys.executable, "-m", "polar_mitm.cli", "rollout", "run", str(task_file), "--upstream", engine_url, "--db", str(db), "--confdir", str(tmp_path / "confdir"), "--engine-hook", HOOK]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    print(f"\n{name} rollout: {time.monotonic() - started:.1f}s, exit {done.returncode}")
    assert done.returncode == 0, done.stdout + done.stderr
    [session] = store.query_dicts(db, "SELECT session_id, status, reward, harness FROM sessions WHERE task_id = ?", [task["task_id"]])
    assert session["status"] == "completed" and session["reward"] == 1.0 and session["harness"] == name, (session, done.stdout[-2000:], done.stderr[-3000:])
    apis = store.query_dicts(db, "SELECT DISTINCT api FROM exchanges WHERE session_id = ?", [session["session_id"]])
    assert apis == [{"api": harnesses.get(name).api}]
    trajectories = pq.read_table(tmp_path / "store.rollouts" / f"{task['task_id']}.parquet").to_pylist()
    assert {row["session_id"] for row in trajectories} == {session["session_id"]}
    assert all(row["reward"] == 1.0 for row in trajectories)
    assert len(trajectories) == SEQUENCES[name]["chat"], trajectories  # docs/agents.md's count


@pytest.mark.parametrize("name", list(AGENTS))
def test_evaluators_are_strict(name: str, tmp_path: Path) -> None:
    """No reward without the tool's own log, nor for an answer that differs from the task's files by one character."""
    task, expect = load_task(name), AGENTS[name]
    path, function = (task.evaluator.python or "").split(":")
    evaluator = load_function(f"{EXAMPLES / expect.example / path}:{function}")
    call = planned_call(task)
    right = {"facts": ("answer.txt", "Polarine boils at 81.5 degrees Celsius at sea level.\n"),
             "form": ("form.json", json.dumps({"vendor": "Northwind Ropes Ltd", "invoice_number": "NW-20931", "date": "2026-11-04", "total": "EUR 612.40"})),
             "planner": ("answer.txt", "451\n")}[expect.example]
    result = {"facts": right[1].strip(), "form": next((s.upload.content for s in task.runtime.prepare if isinstance(s, UploadStep)), ""), "planner": "451"}[expect.example]
    context = WorkspaceContext(task, tmp_path)
    (tmp_path / right[0]).write_text(right[1])
    assert evaluator(context)["reward"] == 0.0  # the answer alone: no tool ran
    (tmp_path / "tool_calls.jsonl").write_text(json.dumps({"tool": call["name"], "arguments": call["arguments"], "result": result}) + "\n")
    assert evaluator(context)["reward"] == 1.0
    (tmp_path / right[0]).write_text(right[1].replace("1", "7", 1))
    assert evaluator(context)["reward"] == 0.0


def test_framework_presets_keep_the_provider_host_and_their_own_interpreter() -> None:
    """No preset points an agent past the proxy, nor lets the caller's Python packages into the frameworks' venv."""
    base = {"PATH": "/usr/bin", "OPENAI_BASE_URL": "http://elsewhere", "PYTHONPATH": "/repo", "VIRTUAL_ENV": "/repo/.venv"}
    for name, expect in AGENTS.items():
        harness = harnesses.get(name)
        env = harness.environment("/tmp/polar-home", "m", base=base)
        assert not set(env) & {*harnesses.BASE_URL_VARIABLES, "PYTHONPATH", "VIRTUAL_ENV"}, name
        assert env["HOME"] == "/tmp/polar-home" and env["OPENAI_API_KEY"] == harnesses.PLACEHOLDER_API_KEY and env["POLAR_AGENT_MODEL"] == "m"
        if frameworks_python().exists():
            assert harness.command("do it") == [str(frameworks_python()), str(EXAMPLES / expect.example / "agent.py"), "do it"]
