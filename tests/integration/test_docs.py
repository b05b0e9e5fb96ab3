"""The commands of README's "Use it" and docs/debugging.md's SQL, run as written, in a fresh directory with a
fresh HOME (so the default confdir `~/.mitmproxy` is this test's own).

Two changes only, both said here: the gateway's port (8080 may be taken on a shared machine) and, because the
local engine serves a random-weight test model, the gateway gets the README's steering hook
(`--engine-hook examples/steer_tiny_model.py:steer`) so Qwen Code gets a well-formed reply.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.local_engine.build import engine_home
from polar_mitm.util import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
README_ENGINE = "http://127.0.0.1:8011/v1"


def code_block(document: Path, after: str) -> list[str]:
    """The command lines of the first ``` block after the line `after`, comments dropped."""
    text = document.read_text()
    block = re.search(r"```\n(.*?)```", text[text.index(after):], re.DOTALL)
    assert block, f"no code block after {after!r} in {document}"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def as_run_here(line: str, port: int) -> list[str]:
    argv = shlex.split(line.replace("8080", str(port)))
    assert argv[0] == "polar-mitm", line
    return [str(BIN / "polar-mitm"), *argv[1:]]


def test_the_readme_use_it_commands_run_as_written(tmp_path: Path, engine_url: str) -> None:
    if engine_url != README_ENGINE:
        pytest.skip(f"the README's commands name the local engine at {README_ENGINE}")
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("POLAR_MITM_GATEWAY", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")}
    # the engine and the harness binaries stay where setup put them (HOME moves, their home does not)
    env.update(HOME=str(home), PYTHONPATH=str(REPO), POLAR_MITM_HOME=str(engine_home()))
    port = free_port()
    engine, gateway_line, run_line, sql_line, assemble_line = code_block(REPO / "README.md", "## Use it")
    assert "--harness qwen" in run_line and run_line.endswith('-- qwen --yolo "fix the tests"')

    def run(line: str, timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run(as_run_here(line, port), cwd=work, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result

    assert README_ENGINE in run(engine).stdout  # reuses the live engine
    gateway = subprocess.Popen(
        [*as_run_here(gateway_line, port), "--engine-hook", str(REPO / "examples" / "steer_tiny_model.py") + ":steer"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        started = gateway.stdout.readline()
        assert f"listening on http://127.0.0.1:{port}, store {work / 'rollouts.duckdb'}, engine vllm {README_ENGINE} serving 'qwen3-tiny'" in started, gateway.stderr.read() if gateway.poll() is not None else started
        ran = run(run_line, timeout=300)
        assert "polar-mitm run: session s1 via gateway" in ran.stderr
        rows = run(sql_line).stdout
        assert "s1" in rows and "openai_chat" in rows
        assembled = run(assemble_line)
        assert "wrote" in assembled.stdout and str(work / "train.parquet") in assembled.stdout  # absolute: readable from anywhere
        assert "loaded into table trajectories" in assembled.stdout and "through the writer of the gateway" in assembled.stdout
        # docs/debugging.md's SQL, against the live store: the views over trajectories work while the gateway runs
        for line in code_block(REPO / "docs" / "debugging.md", "## SQL"):
            run(line)
        by_class = run('polar-mitm sql --db rollouts.duckdb --json "SELECT count(*) AS n FROM trajectories WHERE session_id = \'s1\'"').stdout
        assert '"n": 0' not in by_class
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(timeout=30)
