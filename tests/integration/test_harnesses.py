"""The real harnesses, unmodified, through the gateway: one multi-turn tool-using run each.

Each test runs the pinned harness binary headless in a temp workspace with a private HOME, through
`polar-mitm run --harness X` (proxy settings only, no base-URL change), against a gateway whose engine
hook (tests/support/harness_steering.py) constrains the real engine: turn 1 a shell tool call writing a proof file,
turn 2 a short final text. The tool must really run, the harness exit 0, and the store hold exactly the
harness's model exchanges, in order, under the session id given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from polar_mitm import harnesses, routing
from polar_mitm.assembler import assemble
from polar_mitm.store import JSON_COLUMNS
from tests.support import harness_steering as steering
from tests.support.processes import stop_process_group

REPO = Path(__file__).resolve().parents[2]
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


def run_harness(gateway, name: str, session_id: str, tmp_path: Path, subcommand_options: tuple[str, ...] = (), stop_when: Callable[[], bool] | None = None) -> subprocess.CompletedProcess:
    """`subcommand_options` go right after the harness's subcommand (Codex's `exec -c key=value`). With `stop_when`
    (checked every second), the run and the harness under it are stopped (SIGTERM) once it holds."""
    harness = harnesses.get(name)
    try:
        argv = harness.command(INSTRUCTION, harness.default_model)
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))
    argv[2:2] = subcommand_options
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    workspace.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
    command = [
        sys.executable, "-m", "polar_mitm.cli", "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir),
        "--session", session_id, "--harness", name, "--home", str(home),
        *(["--model", harness.default_model] if harness.default_model else []), "--", *argv,
    ]
    started = time.monotonic()
    if stop_when is None:
        result = subprocess.run(command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    else:
        result = _run_until(command, workspace, env, stop_when, tmp_path)
    print(f"\n{name} run: {time.monotonic() - started:.1f}s, exit {result.returncode}")
    return result


def _run_until(command: list[str], cwd: Path, env: dict[str, str], stop_when: Callable[[], bool], tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `command` (its output to files: nothing blocks on a full pipe) until it exits or `stop_when()` holds; then
    stop its process group, the harness with it. Raises TimeoutExpired as subprocess.run does after RUN_TIMEOUT."""
    out, err = tmp_path / "run.stdout", tmp_path / "run.stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while process.poll() is None and not stop_when():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(command, RUN_TIMEOUT)
            time.sleep(1)
    finally:
        if process.poll() is None:
            stop_process_group(process, grace=30)
    return subprocess.CompletedProcess(command, process.returncode, out.read_text(), err.read_text())


def check_run(
    gateway, name: str, session_id: str, tmp_path: Path, result: subprocess.CompletedProcess, side_calls: int = 0,
    others: tuple[str, ...] = (), aborted: int = 0,
) -> list[dict]:
    """What every harness run must show; returns its served rows (side calls first, then the two agent turns).

    `others`: the session ids of other runs sharing this gateway. `aborted`: how many engine attempts a
    pause(abort) cut short; each is a row of its own (status 'aborted', no tokens), left out of the returned rows."""
    harness = harnesses.get(name)
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert f"session {session_id}" in result.stderr
    proof = tmp_path / "workspace" / steering.PROOF_FILE
    assert proof.exists(), f"the shell tool never ran\n{report}"
    assert proof.read_text() == steering.PROOF_CONTENT

    # every exchange of this private gateway is this session's: nothing under another id, no non-model calls
    assert sorted(r["session_id"] for r in gateway.rows("SELECT DISTINCT session_id FROM exchanges")) == sorted([session_id, *others])
    every = [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]
    summary = [(r["seq"], r["api"], r["status"], r["path"], r["stream"], r["finish_reason"]) for r in every]
    assert [r["seq"] for r in every] == list(range(1, len(every) + 1)), summary
    cut = [r for r in every if r["status"] == "aborted"]
    assert len(cut) == aborted, summary
    assert all(not r["completion_token_ids"] and "aborted by pause(mode=abort)" in r["error"] for r in cut), summary
    rows = [r for r in every if r["status"] != "aborted"]
    assert len(rows) == side_calls + 2, summary
    assert all(r["status"] == "ok" and r["http_status"] == 200 for r in rows), summary
    assert {r["api"] for r in rows} == {harness.api}
    assert {r["harness"] for r in rows} == {name}  # told apart by its own user agent
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
    assert tool_turn["stream"] is True and final_turn["stream"] is True
    # the second turn carries the call back with its result, and re-sends the first prompt unchanged
    assert final_turn["finish_reason"] == "stop"
    assert final_turn["engine_response"]["choices"][0]["message"]["content"] == steering.FINAL_TEXT
    assert any(m["role"] == "tool" for m in final_turn["engine_request"]["messages"])
    first, second = tool_turn["prompt_token_ids"], final_turn["prompt_token_ids"]
    assert second[: len(first)] == first, "per-turn prompt noise: turn 2 does not extend turn 1's prompt"
    check_assembly(gateway, session_id, rows)
    return rows


def check_assembly(gateway, session_id: str, rows: list[dict]) -> None:
    """The harness's real session assembles with every sampled token in exactly one sequence, under its mask."""
    by_id = {row["exchange_id"]: row for row in rows}
    sequences = assemble(gateway.db, builder="prefix_merging", session=session_id).sequences
    assert sorted(e for s in sequences for e in s.exchange_ids) == sorted(by_id)
    for sequence in sequences:
        sampled = [token for token, mask in zip(sequence.input_ids, sequence.loss_mask, strict=True) if mask]
        assert sampled == [token for e in sequence.exchange_ids for token in by_id[e]["completion_token_ids"]]
        assert [lp for lp, mask in zip(sequence.rollout_logprobs, sequence.loss_mask, strict=True) if mask] == [lp for e in sequence.exchange_ids for lp in by_id[e]["completion_logprobs"]]
        assert sequence.input_ids[: sequence.prompt_len] == by_id[sequence.exchange_ids[0]]["prompt_token_ids"]


@pytest.fixture
def steered_gateway(make_gateway):
    return make_gateway("--engine-hook", HOOK)


@pytest.mark.harness
def test_qwen_code(installed, steered_gateway, session_id, tmp_path):
    result = run_harness(steered_gateway, "qwen", session_id, tmp_path)
    rows = check_run(steered_gateway, "qwen", session_id, tmp_path, result)
    # its default provider, DashScope, reached only through the proxy
    assert {(r["host"], r["path"], r["model_requested"]) for r in rows} == {("dashscope.aliyuncs.com", "/compatible-mode/v1/chat/completions", "qwen3-coder-plus")}


@pytest.mark.harness
def test_codex(installed, steered_gateway, session_id, tmp_path):
    result = run_harness(steered_gateway, "codex", session_id, tmp_path)
    rows = check_run(steered_gateway, "codex", session_id, tmp_path, result)
    assert {(r["host"], r["path"], r["model_requested"]) for r in rows} == {("api.openai.com", "/v1/responses", "qwen3-coder-plus")}
    # the Responses item ids thread the turns: the call the gateway rendered comes back as its output
    call_id = rows[0]["response_body"]["output"][-1]["call_id"]
    outputs = [item for item in json.loads(rows[1]["request_body"])["input"] if item.get("type") == "function_call_output"]
    assert [item["call_id"] for item in outputs] == [call_id]


@pytest.mark.harness
def test_claude_code(installed, steered_gateway, session_id, tmp_path):
    result = run_harness(steered_gateway, "claude", session_id, tmp_path)
    rows = check_run(steered_gateway, "claude", session_id, tmp_path, result)
    assert {(r["host"], r["path"]) for r in rows} == {("api.anthropic.com", "/v1/messages?beta=true")}
    # the preset's CLAUDE_CODE_ATTRIBUTION_HEADER=0 keeps the per-turn `cch=` nonce out of the system prompt
    assert not any("cch=" in r["request_body"] for r in rows)
    tool_use = next(block for block in rows[0]["response_body"]["content"] if block["type"] == "tool_use")
    results = [block for message in json.loads(rows[1]["request_body"])["messages"] if isinstance(message["content"], list) for block in message["content"] if block.get("type") == "tool_result"]
    assert [block["tool_use_id"] for block in results] == [tool_use["id"]]


@pytest.mark.harness
def test_gemini_cli(installed, steered_gateway, session_id, tmp_path):
    result = run_harness(steered_gateway, "gemini", session_id, tmp_path)
    router, tool_turn, final_turn = check_run(steered_gateway, "gemini", session_id, tmp_path, result, side_calls=1)
    # its default model "auto" asks a router model first, without streaming and without tools
    assert router["path"].endswith(":generateContent") and router["stream"] is False
    assert not router["engine_request"].get("tools")
    assert json.loads(router["response_body"]["candidates"][0]["content"]["parts"][0]["text"])["complexity_score"] == 10
    routed = tool_turn["model_requested"]
    assert tool_turn["path"] == final_turn["path"] == f"/v1beta/models/{routed}:streamGenerateContent?alt=sse"
    assert {r["host"] for r in (router, tool_turn, final_turn)} == {"generativelanguage.googleapis.com"}


# `polar-mitm run` itself, with a plain Python program and the official SDK (no harness binary needed)
CHILD = """
import json, os, sys, openai
client = openai.OpenAI()  # no base URL: api.openai.com, through HTTPS_PROXY, trusting SSL_CERT_FILE
client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
keys = ["HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "POLAR_MITM_SESSION", *sys.argv[1:]]
print(json.dumps({"env": {k: os.environ.get(k) for k in keys}}))
sys.exit(7)
"""


@pytest.mark.engine
def test_run_routes_any_command_through_the_gateway(gateway, session_id, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED} | {"OPENAI_API_KEY": "sk-test", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    command = [sys.executable, "-m", "polar_mitm.cli", "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--session", session_id, "--", sys.executable, "-c", CHILD, *routing.CA_VARIABLES]
    result = subprocess.run(command, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 7, result.stderr  # the command's own exit code
    assert f"polar-mitm run: session {session_id}" in result.stderr
    seen = json.loads(result.stdout)["env"]
    assert seen["HTTPS_PROXY"] == seen["HTTP_PROXY"] == gateway.proxy_url(session_id)
    assert seen["NO_PROXY"] == "localhost,127.0.0.1,::1" and seen["POLAR_MITM_SESSION"] == session_id
    bundles = {seen[k] for k in routing.CA_VARIABLES}
    assert len(bundles) == 1 and bundles != {"/etc/ssl/certs/ca-certificates.crt"}  # the machine's own setting is overridden
    bundle = Path(bundles.pop()).read_text()
    assert bundle.startswith(gateway.ca_cert.read_text().rstrip()) and bundle.count("BEGIN CERTIFICATE") > 10  # + the system CAs
    [row] = gateway.exchanges(session_id)
    assert (row["api"], row["host"], row["status"]) == ("openai_chat", "api.openai.com", "ok")


def test_run_without_a_gateway_says_so(tmp_path):
    result = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "run", "--confdir", str(tmp_path), "--gateway", "http://127.0.0.1:9", "--", "true"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no gateway listening at http://127.0.0.1:9" in result.stderr


def test_harness_presets_keep_the_provider_host():
    """Nothing in a preset points a harness past the proxy: base-URL variables are removed, none added."""
    for name in harnesses.NAMES:
        harness = harnesses.get(name)
        env = harness.environment("/tmp/polar-home", "some-model", base={"PATH": "/usr/bin", "OPENAI_BASE_URL": "http://elsewhere", "ANTHROPIC_BASE_URL": "http://elsewhere"})
        assert not set(env) & set(harnesses.BASE_URL_VARIABLES), name
        assert env["HOME"] == "/tmp/polar-home" and env["PATH"].endswith("/usr/bin")
