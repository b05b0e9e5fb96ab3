"""The npm coding agents beyond the first four, unmodified, through the gateway: a real tool call that really runs.

Each agent runs headless from the pinned install (sandboxes/harnesses/install.sh) through `polar-mitm run --harness
NAME` (proxy settings only, no base-URL change) in a temp workspace with a private HOME, steered by
tests/support/agent_steering.py (a regex on the output only: the agent's own output budget and sampling, so every
run here is one without an output cap or sampling change by a hook). The tool must really run, the agent exit 0,
and the store hold exactly its model calls at its provider's own URL, with its `api` and `harness` (told apart by
its user agent), ids equal to the engine's, assembling with every sampled token in exactly one sequence.

The default suite runs one tool turn per agent in chat mode (tests/support/harness_runs.py:check_run, the bar of
the four original harnesses). POLAR_MITM_FULL_MATRIX=1 adds, per agent, a run of two tool calls (write, read back)
in `--render tokens` and in chat mode: in tokens mode every turn extending an earlier one must be bridged and
every lineage assemble into one sequence; each run's counts must be docs/agents.md's (`merge:` lines print them).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_mitm import harnesses
from polar_mitm.assembler import assemble
from polar_mitm.store import JSON_COLUMNS
from tests.support import agent_steering as steering
from tests.support.harness_runs import INSTRUCTION, REPO, RUN_TIMEOUT, STRIPPED, check_assembly, check_run, run_harness
from tests.support.harness_steering import FINAL_TEXT, PROOF_CONTENT, PROOF_FILE, proof_command
from tests.support.matrix import full_matrix
from tests.support.tokens_steering import CHECK_COMMAND

HOOKS = {name: f"{Path(steering.__file__).resolve()}:{name}" for name in ("steer", "two_calls")}
MATRIX = REPO / "docs" / "agents.md"
PINNED = json.loads((REPO / "sandboxes" / "harnesses" / "package.json").read_text())["dependencies"]


@dataclass(frozen=True)
class Expect:
    """Where one agent's model calls go (the provider's own host and path) and under which requested model;
    `append_only`: each turn's prompt extends the one before (OpenClaw moves a runtime-context message to the end
    of every request, so each of its turns starts a lineage of its own)."""

    host: str
    path: str
    model: str
    append_only: bool = True


AGENTS = {
    "opencode": Expect("dashscope-intl.aliyuncs.com", "/compatible-mode/v1/chat/completions", "qwen3-coder-plus"),
    "pi": Expect("api.openai.com", "/v1/responses", "gpt-4.1"),
    "cline": Expect("api.anthropic.com", "/v1/messages", "claude-sonnet-4-5"),
    "kilo": Expect("generativelanguage.googleapis.com", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", "gemini-2.5-flash"),
    "continue-cli": Expect("api.openai.com", "/v1/chat/completions", "gpt-4.1"),
    "openclaw": Expect("api.openai.com", "/v1/chat/completions", "gpt-4.1", append_only=False),
}


def shell_arguments(name: str, command: str) -> dict:
    """The arguments of the agent's shell call running `command`, as the steering forces them."""
    return steering.AGENT_SHELL_TOOLS[harnesses.get(name).shell_tool](command)


def rows_of(gateway, session_id: str) -> list[dict]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


def check_provider(name: str, rows: list[dict]) -> None:
    expect = AGENTS[name]
    assert {(r["host"], r["path"], r["model_requested"]) for r in rows} == {(expect.host, expect.path, expect.model)}


@pytest.mark.harness
@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_tool_turn(installed, make_gateway, name: str, session_id: str, tmp_path) -> None:
    gateway = make_gateway("--engine-hook", HOOKS["steer"])
    started = time.monotonic()
    result = run_harness(gateway, name, session_id, tmp_path)
    rows = check_run(gateway, name, session_id, tmp_path, result, shell_arguments=shell_arguments(name, proof_command()), append_only=AGENTS[name].append_only)
    check_provider(name, rows)
    sequences = len(assemble(gateway.db, builder="prefix_merging", session=session_id).sequences)
    print(f"\nagent: {name} mode={rows[0]['render_mode']} hook=steer exchanges={len(rows)} sequences={sequences} {time.monotonic() - started:.1f}s")


def check_two_calls(gateway, name: str, session_id: str, workdir: Path, result: subprocess.CompletedProcess, mode: str) -> list[dict]:
    """check_run's bar for a run of two tool calls and a final text, in either render mode."""
    harness = harnesses.get(name)
    report = f"{mode}: exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert (workdir / "workspace" / PROOF_FILE).read_text() == PROOF_CONTENT, report
    assert [r["session_id"] for r in gateway.rows("SELECT DISTINCT session_id FROM exchanges")] == [session_id]
    rows = rows_of(gateway, session_id)
    summary = [(r["seq"], r["status"], r["finish_reason"], r["harness"], r["bridged"], r["bridge_reason"], r["error"]) for r in rows]
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1)), summary
    assert all(r["status"] == "ok" and r["http_status"] == 200 and r["render_mode"] == mode and r["stream"] for r in rows), summary
    assert {r["api"] for r in rows} == {harness.api} and {r["harness"] for r in rows} == {name}, summary
    check_provider(name, rows)
    for row in rows:
        engine = row["engine_response"]
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        # chat mode: the ids the engine rendered and echoed; tokens mode: the engine got exactly these ids (token-in)
        assert row["prompt_token_ids"] == (engine["prompt_token_ids"] if mode == "chat" else row["engine_request"]["prompt"])
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
    assert [r["finish_reason"] for r in rows] == ["tool_calls", "tool_calls", "stop"], summary
    for row, following, command in zip(rows[:2], rows[1:], (proof_command(), CHECK_COMMAND), strict=True):
        if mode == "chat":  # the engine parsed the call; tokens mode's engine call is token-in, the gateway parses
            [call] = row["engine_response"]["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == harness.shell_tool
            assert json.loads(call["function"]["arguments"]) == shell_arguments(name, command)
        # the agent got the call and sent it back, in its own API's shape, with its result
        assert json.dumps(command)[1:-1] in following["request_body"], summary
    if mode == "chat":
        assert rows[-1]["engine_response"]["choices"][0]["message"]["content"] == FINAL_TEXT
    check_assembly(gateway, session_id, rows)
    return rows


def run_two_calls(make_gateway, name: str, session_id: str, workdir: Path, mode: str) -> tuple[list[dict], int]:
    gateway = make_gateway("--render", mode, "--engine-hook", HOOKS["two_calls"])
    workdir.mkdir()
    started = time.monotonic()
    result = run_harness(gateway, name, session_id, workdir)
    rows = check_two_calls(gateway, name, session_id, workdir, result, mode)
    sequences = len(assemble(gateway.db, builder="prefix_merging", session=session_id).sequences)
    print(f"\nagent: {name} mode={mode} hook=two_calls exchanges={len(rows)} sequences={sequences} {time.monotonic() - started:.1f}s")
    return rows, sequences


@full_matrix
@pytest.mark.harness
@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_two_calls_in_both_modes(installed, make_gateway, name: str, session_id: str, tmp_path) -> None:
    rows, sequences = run_two_calls(make_gateway, name, session_id, tmp_path / "tokens", "tokens")
    chat_rows, chat_sequences = run_two_calls(make_gateway, name, session_id, tmp_path / "chat", "chat")
    first_turns = [r for r in rows if not r["bridged"]]  # each starts a lineage
    append_only = [r for r in rows if r["bridged"]]
    bridging = [(r["seq"], r["bridged"], r["bridge_reason"]) for r in rows]
    if AGENTS[name].append_only:  # every turn extends the one before, and is bridged
        assert bridging == [(1, False, "first_turn"), (2, True, None), (3, True, None)], bridging
    else:  # each turn's history differs from the one the engine sampled on: a lineage of its own
        assert bridging == [(1, False, "first_turn"), (2, False, "edited_history"), (3, False, "edited_history")], bridging
    assert sequences == len(first_turns)  # one sequence per lineage
    print(f"\nmerge: {name} exchanges={len(rows)} lineages={len(first_turns)} append_only={len(append_only)} "
          f"tokens: bridged={sum(bool(r['bridged']) for r in append_only)} sequences={sequences} | "
          f"chat: exchanges={len(chat_rows)} merged={len(chat_rows) - chat_sequences} sequences={chat_sequences}")
    row = matrix_rows()[name]
    assert (row["chat sequences"], row["tokens sequences"]) == (str(chat_sequences), str(sequences)), row


def matrix_rows() -> dict[str, dict[str, str]]:
    """docs/agents.md's agent table (its first), by preset name (its `--harness` column)."""
    text = MATRIX.read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("|"))
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), text[start:]))
    header = [cell.strip().strip("`") for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[2:]]
    return {row["--harness"].strip("`"): row for row in rows if row["--harness"].strip("`")}


API_NAMES = {"openai_chat": "Chat Completions", "openai_responses": "Responses", "anthropic_messages": "Anthropic Messages", "gemini": "Gemini generateContent"}


def test_the_matrix_names_each_npm_agent_as_its_preset_pins_it() -> None:
    """docs/agents.md's row of each npm agent: its pinned package and version, wire API, provider URL, streaming."""
    rows = matrix_rows()
    for name, expect in AGENTS.items():
        harness, row = harnesses.get(name), rows[name]
        package, _, version = harness.package.rpartition("@")
        assert (row["package"], row["version"]) == (f"`{package}`", version), name
        assert row["wire API"] == API_NAMES[harness.api], name
        assert row["calls"] == f"`{expect.host}{expect.path}`", name
        assert row["streamed"] == "yes" and row["tool turn"] == "yes", name
        assert PINNED[package] == version, name  # the preset's pin is install.sh's
    assert re.search(r"POLAR_MITM_FULL_MATRIX=1", MATRIX.read_text())


def test_npm_agent_presets_keep_the_provider_host() -> None:
    """No preset points an agent past the proxy: base-URL variables are removed, none added, none in its config."""
    base = {"PATH": "/usr/bin", "OPENAI_BASE_URL": "http://elsewhere", "ANTHROPIC_BASE_URL": "http://elsewhere"}
    for name in AGENTS:
        harness = harnesses.get(name)
        env = harness.environment("/tmp/polar-home", harness.default_model, base=base)
        assert not set(env) & set(harnesses.BASE_URL_VARIABLES), name
        assert not [key for key in env if key.endswith(("_BASE_URL", "_API_BASE"))], name
        assert env["HOME"] == "/tmp/polar-home" and env["PATH"].endswith("/usr/bin"), name


@pytest.mark.harness
def test_custom_harness_runs_an_agent_without_its_preset(installed, make_gateway, session_id, tmp_path) -> None:
    """`--harness custom`: Pi with only what the caller gives it (its flags, its key, PI_OFFLINE) and the shared part:
    a private temporary HOME (the caller's stays untouched), base-URL variables dropped, the pinned install on PATH."""
    gateway = make_gateway("--engine-hook", HOOKS["steer"])
    workspace, caller_home = tmp_path / "workspace", tmp_path / "caller-home"
    workspace.mkdir()
    caller_home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED} | {
        "HOME": str(caller_home), "OPENAI_API_KEY": "sk-caller", "PI_OFFLINE": "1", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "POLAR_MITM_HOME": str(harnesses.install_prefix().parent),  # the install stays where it is, HOME moved
    }
    command = [
        sys.executable, "-m", "polar_mitm.cli", "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir),
        "--session", session_id, "--harness", "custom", "--", "pi", "-p", "--model", "openai/gpt-4.1", INSTRUCTION,
    ]
    result = subprocess.run(command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert (workspace / PROOF_FILE).read_text() == PROOF_CONTENT
    assert not any(caller_home.iterdir())  # Pi kept its session files in the private HOME, removed afterwards
    rows = rows_of(gateway, session_id)
    assert [(r["api"], r["harness"], r["status"], r["finish_reason"]) for r in rows] == [
        ("openai_responses", "pi", "ok", "tool_calls"), ("openai_responses", "pi", "ok", "stop"),
    ]
    check_provider("pi", rows)
    check_assembly(gateway, session_id, rows)
