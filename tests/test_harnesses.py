"""The real harnesses, unmodified, through the gateway: one multi-turn tool-using run each.

Each test runs the pinned harness binary headless in a temp workspace with a private HOME, through
`polar-mitm run --harness X` (proxy settings only, no base-URL change), against a gateway whose engine
hook (tests/harness_steering.py) constrains the real engine: turn 1 a shell tool call writing a proof file,
turn 2 a short final text. The tool must really run, the harness exit 0, and the store hold exactly the
harness's model exchanges, in order, under the session id given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm import harnesses
from polar_mitm.store import JSON_COLUMNS
from tests import harness_steering as steering

pytestmark = pytest.mark.harness

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "sandboxes" / "harnesses" / "install.sh"
HOOK = f"{Path(steering.__file__).resolve()}:steer"
INSTRUCTION = f"Create the file {steering.PROOF_FILE} containing {steering.PROOF_CONTENT}, using the shell."
RUN_TIMEOUT = 480
# what a user's shell would not have when following the README: nothing may point past the proxy
STRIPPED = {*harnesses.BASE_URL_VARIABLES, "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"}


@pytest.fixture(scope="module")
def installed() -> float:
    """Run the install recipe (idempotent; fetches Node 22 and the pinned harnesses from the npm registry)."""
    started = time.monotonic()
    try:
        result = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{INSTALL.name} did not finish within 20 minutes")
    if result.returncode != 0:
        pytest.skip(f"{INSTALL.name} failed (exit {result.returncode}); the harnesses cannot be installed here:\n{result.stderr[-2000:]}")
    elapsed = time.monotonic() - started
    print(f"\nharness install: {elapsed:.1f}s")
    return elapsed


def run_harness(gateway, name: str, session_id: str, tmp_path: Path, stream: bool | None = None) -> subprocess.CompletedProcess:
    harness = harnesses.get(name)
    try:
        argv = harness.command(INSTRUCTION, harness.default_model, stream=stream)
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    workspace.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
    command = [
        sys.executable, "-m", "polar_mitm.cli", "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir),
        "--session", session_id, "--harness", name, "--home", str(home),
        *(["--model", harness.default_model] if harness.default_model else []), "--", *argv,
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=workspace, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    print(f"\n{name} run (stream={stream}): {time.monotonic() - started:.1f}s, exit {result.returncode}")
    return result


def check_run(gateway, name: str, session_id: str, tmp_path: Path, result: subprocess.CompletedProcess, side_calls: int = 0, stream: bool | None = True) -> list[dict]:
    """The assertions every harness shares; returns the rows of its two agent turns."""
    harness = harnesses.get(name)
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert f"session {session_id}" in result.stderr
    proof = tmp_path / "workspace" / steering.PROOF_FILE
    assert proof.exists(), f"the shell tool never ran\n{report}"
    assert proof.read_text() == steering.PROOF_CONTENT

    # every exchange of this private gateway is this session's: nothing under another id, no non-model calls
    assert [r["session_id"] for r in gateway.rows("SELECT DISTINCT session_id FROM exchanges")] == [session_id]
    rows = [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))
    summary = [(r["seq"], r["api"], r["status"], r["path"], r["finish_reason"]) for r in rows]
    assert len(rows) == side_calls + 2, summary
    assert all(r["status"] == "ok" and r["http_status"] == 200 for r in rows), summary
    assert {r["api"] for r in rows} == {harness.api}
    assert {r["harness"] for r in rows} == {name}
    for row in rows:
        engine = row["engine_response"]
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert row["prompt_token_ids"] == engine["prompt_token_ids"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["engine_request"]["structured_outputs"]["regex"]  # the steering is on the record

    tool_turn, final_turn = rows[side_calls:]
    assert tool_turn["finish_reason"] == "tool_calls"
    [call] = tool_turn["engine_response"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == harness.shell_tool
    assert json.loads(call["function"]["arguments"]) == {harness.shell_argument: steering.proof_command()}
    if stream is not None:
        assert tool_turn["stream"] is stream and final_turn["stream"] is stream
    # the second turn carries the first one's call back with its result, as the harness threads it
    assert final_turn["finish_reason"] == "stop"
    assert final_turn["engine_response"]["choices"][0]["message"]["content"] == steering.FINAL_TEXT
    assert any(m["role"] == "tool" for m in final_turn["engine_request"]["messages"])
    first, second = tool_turn["prompt_token_ids"], final_turn["prompt_token_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    print(f"{name}: prompt {len(first)} -> {len(second)} tokens, shared prefix {shared}")
    return [tool_turn, final_turn]


@pytest.fixture
def steered_gateway(make_gateway):
    return make_gateway("--engine-hook", HOOK)


def test_qwen_code(installed, steered_gateway, session_id, tmp_path):
    result = run_harness(steered_gateway, "qwen", session_id, tmp_path)
    tool_turn, _ = check_run(steered_gateway, "qwen", session_id, tmp_path, result)
    assert tool_turn["host"] == "dashscope.aliyuncs.com"  # its default provider, reached only through the proxy
    assert tool_turn["model_requested"] == "qwen3-coder-plus"
