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
from pathlib import Path

import pytest

from polar_mitm import harnesses, routing
from tests.support.harness_runs import HOOK, STRIPPED, check_run, run_harness


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
