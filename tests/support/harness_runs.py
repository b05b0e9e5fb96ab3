"""Running a real harness through `polar-mitm run` against a test gateway, and what every such run must show.

Shared by the harness tests (tests/integration/test_harnesses.py and the keepalive, stream-error, pause and
tokens-mode variants): the run itself (`run_harness`), the checks on its store rows (`check_run`) and on its
assembled trajectory (`check_assembly`). The `installed` fixture is in tests/integration/conftest.py.
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

from polar_mitm import harnesses
from polar_mitm.assembler import assemble
from polar_mitm.render import parsers
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
    others: tuple[str, ...] = (), aborted: int = 0, shell_arguments: dict | None = None, append_only: bool = True,
) -> list[dict]:
    """What every harness run must show; returns its served rows (side calls first, then the two agent turns).

    `others`: the session ids of other runs sharing this gateway. `aborted`: how many engine attempts a
    pause(abort) cut short; each is a row of its own (status 'aborted', no tokens), left out of the returned rows.
    `shell_arguments`: the tool call's arguments where they are not {harness.shell_argument: the proof command}
    (Cline's `run_commands` takes a list of commands). `append_only=False`: the harness itself rewrites its prompt
    between turns (OpenClaw moves a runtime-context message to the end of each request), so turn 2 need not
    extend turn 1."""
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
        # where the engine echoes the prompt: beside the choices in chat mode, in the choice token-in (tokens mode)
        echoed = engine["prompt_token_ids"] if row["render_mode"] == "chat" else engine["choices"][0]["prompt_token_ids"]
        assert row["prompt_token_ids"] == echoed
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["engine_request"]["structured_outputs"]["regex"]  # the steering is on the record

    tool_turn, final_turn = rows[side_calls:]
    assert tool_turn["finish_reason"] == "tool_calls"
    calls, _ = sampled(tool_turn)
    [(name, arguments)] = calls
    assert name == harness.shell_tool
    assert json.loads(arguments) == (shell_arguments or {harness.shell_argument: steering.proof_command()})
    assert tool_turn["stream"] is True and final_turn["stream"] is True
    # the second turn carries the call back with its result, and re-sends the first prompt unchanged
    assert final_turn["finish_reason"] == "stop"
    assert sampled(final_turn) == ([], steering.FINAL_TEXT)
    if final_turn["render_mode"] == "chat":
        assert any(m["role"] == "tool" for m in final_turn["engine_request"]["messages"])
    elif append_only:  # tokens mode: the harness sent turn 1, our answer, then new messages (the tool result)
        assert (final_turn["bridged"], final_turn["bridge_reason"]) == (True, None), final_turn["bridge_reason"]
    first, second = tool_turn["prompt_token_ids"], final_turn["prompt_token_ids"]
    assert second[: len(first)] == first or not append_only, "per-turn prompt noise: turn 2 does not extend turn 1's prompt"
    check_assembly(gateway, session_id, rows)
    return rows


def sampled(row: dict) -> tuple[list[tuple[str, str]], str | None]:
    """The tool calls (name, arguments JSON) and text of the engine's reply: its message in chat mode (the engine
    parsed the sampled text); in tokens mode the sampled text as the gateway parses it (Hermes, this model's
    template), with no parse failure recorded."""
    choice = row["engine_response"]["choices"][0]
    if row["render_mode"] == "chat":
        message = choice["message"]
        return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []], message.get("content")
    assert row["output_parse_error"] is None, row["output_parse_error"]
    parsed = parsers.parse_output(choice["text"], "hermes")
    return [(c.name, c.arguments) for c in parsed.tool_calls], parsed.content


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
