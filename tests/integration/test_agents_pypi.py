"""The PyPI coding agents, unmodified, through the gateway: a real action that really runs, in both render modes.

Each agent runs headless from its pinned venv (sandboxes/agents-py/install.sh) through `polar-mitm run --harness
NAME` (proxy settings only, no base-URL change) in a temp workspace with a private HOME, steered by
tests/support/agent_steering_py.py (a regex on the output only: the agent's own output budget and sampling). The
action must really run (the proof file exists with its content), the agent exit 0, and the store hold exactly its
model calls, with its `api` and `harness`, token ids equal to the engine's, assembling with every sampled token in
exactly one sequence.

The default suite runs one action per agent in chat mode. POLAR_MITM_FULL_MATRIX=1 adds, per agent, a run of two
actions (write, read back) in chat mode and in `--render tokens`, where every turn extending an earlier one must
be bridged and every lineage assemble into one sequence; `merge:` lines give docs/agents.md's counts.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_mitm import dialects, harnesses, session
from polar_mitm.assembler import assemble
from polar_mitm.store import JSON_COLUMNS
from tests.support import agent_steering_py as steering
from tests.support.harness_runs import REPO, check_assembly, run_harness
from tests.support.harness_steering import PROOF_CONTENT, PROOF_FILE, proof_command
from tests.support.matrix import full_matrix
from tests.support.tokens_steering import CHECK_COMMAND

INSTALL = REPO / "sandboxes" / "agents-py" / "install.sh"
HOOKS = {name: f"{Path(steering.__file__).resolve()}:{name}" for name in ("steer", "two_calls")}


@dataclass(frozen=True)
class Expect:
    """What one agent's run looks like: `url` where its model calls go (the provider's own host and path); `stream`
    its agent turns' streaming; `tool_calls` whether it acts by tool calls (aider's actions are edits in its reply
    text); `ending` the turn its loop takes as the end: a plain text ("text"), or a tool call (name, arguments):
    mini's COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT, gptme's `complete`; `side_calls` its calls outside the agent loop
    (requests without its tools)."""

    url: str
    stream: bool
    tool_calls: bool = True
    ending: str | tuple[str, dict] = "text"
    side_calls: int = 0
    proof: str = PROOF_CONTENT  # the proof file's content (a whole-file edit ends in a newline)


AGENTS = {
    "mini-swe-agent": Expect("api.openai.com/v1/chat/completions", stream=False, ending=("bash", {"command": steering.MINI_SUBMIT})),
    "aider": Expect("api.openai.com/v1/chat/completions", stream=True, tool_calls=False, proof=PROOF_CONTENT + "\n"),
    "openhands": Expect("api.openai.com/v1/chat/completions", stream=False),
    "hermes": Expect("openrouter.ai/api/v1/chat/completions", stream=True),
    "gptme": Expect("api.openai.com/v1/responses", stream=True, ending=("complete", {}), side_calls=1),  # a title, not streamed
    "vibe": Expect("api.mistral.ai/v1/chat/completions", stream=True),
    "kimi": Expect("api.moonshot.ai/v1/chat/completions", stream=True),
}
MATRIX = REPO / "docs" / "agents.md"
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed")
API_NAMES = {"openai_chat": "Chat Completions", "openai_responses": "Responses", "anthropic_messages": "Anthropic Messages", "gemini": "Gemini generateContent"}


def matrix_rows() -> dict[str, dict[str, str]]:
    """docs/agents.md's agent table, by preset name (its `--harness` column)."""
    lines = [line for line in MATRIX.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip().strip("`") for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[2:]]
    return {row["--harness"].strip("`"): row for row in rows if row["--harness"].strip("`")}


@pytest.fixture
def agent_installed(request: pytest.FixtureRequest) -> str:
    """Install the test's agent (idempotent: seconds when it is there; minutes from PyPI on a fresh machine)."""
    name = request.node.callspec.params["name"]
    try:
        result = subprocess.run([str(INSTALL), name], capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{INSTALL.name} {name} did not finish within 30 minutes")
    if result.returncode != 0:
        pytest.skip(f"{INSTALL.name} {name} failed (exit {result.returncode}); the agent cannot be installed here:\n{result.stderr[-2000:]}")
    return name


def rows_of(gateway, session_id: str) -> list[dict]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


def check_agent_run(gateway, name: str, session_id: str, workdir: Path, result: subprocess.CompletedProcess, commands: tuple[str, ...], mode: str) -> list[dict]:
    """The bar of tests/support/harness_runs.py:check_run, for an agent's own way of acting and finishing."""
    harness, expect = harnesses.get(name), AGENTS[name]
    report = f"{mode}: exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert f"session {session_id}" in result.stderr
    proof = workdir / "workspace" / PROOF_FILE
    assert proof.exists(), f"the action never ran\n{report}"
    assert proof.read_text() == expect.proof

    # every exchange of this private gateway is this session's, each a model call served in full
    assert [r["session_id"] for r in gateway.rows("SELECT DISTINCT session_id FROM exchanges")] == [session_id]
    rows = rows_of(gateway, session_id)
    summary = [(r["seq"], r["status"], r["path"], r["stream"], r["finish_reason"], r["harness"]) for r in rows]
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1)), summary
    assert all(r["status"] == "ok" and r["http_status"] == 200 and r["render_mode"] == mode for r in rows), summary
    assert {r["api"] for r in rows} == {harness.api}, summary
    assert {r["harness"] for r in rows} == {name}, summary  # told apart by the user agent its preset sets
    assert {r["host"] + r["path"] for r in rows} == {expect.url}, summary  # the provider's own URL
    for row in rows:
        engine = row["engine_response"]  # chat mode: a chat completion; tokens mode: a token-in completion
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert row["prompt_token_ids"] == engine.get("prompt_token_ids", engine["choices"][0].get("prompt_token_ids"))
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["engine_request"]["structured_outputs"]["regex"]  # the steering is on the record

    # what the agent sent and got, read back in its own API (the same in both render modes)
    sent = {r["seq"]: dialects.get(r["api"]).parse(r["request_body"].encode(), r["path"]).chat for r in rows}
    replies = {r["seq"]: dialects.get(r["api"]).parse_reply(r["response_body"]) for r in rows}
    if mode == "chat":  # the hook changed no output budget or sampling: the engine got the agent's own
        for row in rows:
            own = {k: sent[row["seq"]].get(k) for k in SAMPLING}
            got = {k: row["engine_request"].get(k) for k in SAMPLING}
            # but for the gateway's own fit: a budget at or above the engine's context is left out, and noted
            fitted = {k for k in ("max_tokens", "max_completion_tokens") if own[k] is not None and got[k] is None}
            assert all(any(note.startswith(f"{k} {own[k]} -> ") for note in row["normalizations"] or []) for k in fitted), row["normalizations"]
            assert {k: v for k, v in got.items() if k not in fitted} == {k: v for k, v in own.items() if k not in fitted}, (row["seq"], own, got)
    if not expect.tool_calls:  # one reply per message, its edit applied by the agent
        assert len(rows) == 1 and rows[0]["finish_reason"] == "stop" and rows[0]["stream"] is expect.stream, summary
        assert replies[1].content == steering.AIDER_EDIT
        return rows
    turns = [r for r in rows if harness.shell_tool in [(t.get("function") or {}).get("name") for t in sent[r["seq"]].get("tools") or []]]
    assert len(rows) - len(turns) == expect.side_calls, summary
    assert {r["stream"] for r in turns} == {expect.stream}, summary
    calls = [(harness.shell_tool, {harness.shell_argument: command}) for command in commands]
    assert len(turns) == len(calls) + 1, summary
    if expect.ending != "text":
        calls.append(expect.ending)
    for turn, (tool, arguments) in zip(turns, calls, strict=False):
        assert turn["finish_reason"] == "tool_calls", summary
        [call] = replies[turn["seq"]].tool_calls
        assert (call["name"], json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]) == (tool, arguments)
    if expect.ending == "text":
        assert turns[-1]["finish_reason"] == "stop", summary
        assert replies[turns[-1]["seq"]].content == steering.FINAL_TEXT
    # each later turn carries the results back
    for done, turn in enumerate(turns[1:], start=1):
        assert sum(m["role"] == "tool" for m in sent[turn["seq"]]["messages"]) == done, summary
    return rows


def run_agent(make_gateway, name: str, session_id: str, workdir: Path, mode: str, hook: str, commands: tuple[str, ...]) -> tuple[list[dict], int]:
    """One steered run of `name` on a fresh gateway in render `mode`: its rows, and the sequences they assemble to."""
    gateway = make_gateway("--render", mode, "--engine-hook", HOOKS[hook])
    workdir.mkdir()
    started = time.monotonic()
    result = run_harness(gateway, name, session_id, workdir)
    rows = check_agent_run(gateway, name, session_id, workdir, result, commands, mode)
    check_assembly(gateway, session_id, rows)
    sequences = len(assemble(gateway.db, builder="prefix_merging", session=session_id).sequences)
    print(f"\nagent: {name} mode={mode} hook={hook} exchanges={len(rows)} sequences={sequences} {time.monotonic() - started:.1f}s")
    return rows, sequences


@pytest.mark.harness
@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_one_action(agent_installed, make_gateway, name: str, session_id: str, tmp_path) -> None:
    run_agent(make_gateway, name, session_id, tmp_path / "chat", "chat", "steer", (proof_command(),))


@full_matrix
@pytest.mark.harness
@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_two_actions_in_both_modes(agent_installed, make_gateway, name: str, session_id: str, tmp_path) -> None:
    commands = (proof_command(), CHECK_COMMAND)
    rows, sequences = run_agent(make_gateway, name, session_id, tmp_path / "tokens", "tokens", "two_calls", commands)
    chat_rows, chat_sequences = run_agent(make_gateway, name, session_id, tmp_path / "chat", "chat", "two_calls", commands)
    # a lineage starts at a conversation no exchange answered before: a first turn, or (aider) one opening with
    # the agent's own example turns
    first_turns = [r for r in rows if r["bridge_reason"] in ("first_turn", "no_lineage")]
    append_only = [r for r in rows if r not in first_turns]
    assert all(r["bridged"] for r in append_only), [(r["seq"], r["bridged"], r["bridge_reason"]) for r in rows]
    assert sequences == len(first_turns)  # one sequence per lineage
    if AGENTS[name].tool_calls:
        assert len(append_only) >= 2 and {r["bridge_reason"] for r in first_turns} == {"first_turn"}
    print(f"\nmerge: {name} exchanges={len(rows)} lineages={len(first_turns)} append_only={len(append_only)} "
          f"tokens: bridged={sum(bool(r['bridged']) for r in append_only)} sequences={sequences} | "
          f"chat: exchanges={len(chat_rows)} merged={len(chat_rows) - chat_sequences} sequences={chat_sequences}")
    row = matrix_rows()[name]
    assert (row["chat sequences"], row["tokens sequences"]) == (str(chat_sequences), str(sequences)), row


def test_the_matrix_names_each_pypi_agent_as_its_preset_pins_it() -> None:
    """docs/agents.md's row of each PyPI agent: its pinned package and version (as locked), wire API, URL, streaming."""
    rows = matrix_rows()
    for name, expect in AGENTS.items():
        harness, row = harnesses.get(name), rows[name]
        package, _, version = harness.package.partition("==")
        assert (row["package"], row["version"]) == (f"`{package}`", version), name
        assert f"{package}=={version}" in (INSTALL.parent / "requirements" / f"{name}.txt").read_text().splitlines(), name
        assert row["wire API"] == API_NAMES[harness.api], name
        assert row["calls"] == f"`{expect.url}`", name
        assert row["streamed"] == ("yes" if expect.stream else "no"), name
        assert row["tool turn"] == ("yes" if expect.tool_calls else "edit"), name


def test_python_agent_presets_keep_the_provider_host_and_their_own_interpreter():
    """No preset points an agent past the proxy, and none lets the caller's Python packages into the agent's venv."""
    base = {"PATH": "/usr/bin", "OPENAI_BASE_URL": "http://elsewhere", "PYTHONPATH": "/repo", "VIRTUAL_ENV": "/repo/.venv"}
    for name in AGENTS:
        env = harnesses.get(name).environment("/tmp/polar-home", None, base=base)
        assert not set(env) & {*harnesses.BASE_URL_VARIABLES, "PYTHONPATH", "VIRTUAL_ENV"}, name
        assert env["HOME"] == "/tmp/polar-home" and env["PATH"].endswith("/usr/bin")
        assert env["PATH"].split(":")[0].endswith("/harnesses/py/bin"), name


def test_the_gateway_tells_the_pypi_agents_apart_by_what_their_presets_set() -> None:
    seen = {
        "mini-swe-agent": {"user-agent": "mini-swe-agent/2.4.6"},
        "aider": {"user-agent": "aider/0.86.2"},
        "openhands": {"user-agent": "openhands-sdk/1.58.2"},
        "hermes": {"user-agent": "hermes-agent/0.19.0", "x-title": "Hermes Agent"},
        "gptme": {"user-agent": "gptme/0.35.1"},
        "vibe": {"user-agent": "mistral-client-python/2.6.0", "x-title": "mistral-vibe"},
        "kimi": {"user-agent": "KimiCLI/1.51.0"},
    }
    assert {name: session.harness_from_headers(headers) for name, headers in seen.items()} == {name: name for name in seen}
    # their clients' own user agents name no harness; nor does another app's title
    for headers in ({"user-agent": "OpenAI/Python 2.24.0"}, {"user-agent": "mistral-client-python/2.6.0"}, {"user-agent": "OpenAI/Python 2.54.0", "x-title": "gptme-webui"}):
        assert session.harness_from_headers(headers) is None, headers
