"""The notebooks in notebooks/, executed top to bottom with nbclient against a store built by a small real run
through the gateway and the real engine (the `debug_store` fixture, tests/support/debug_run.py).

Each notebook asserts on what it displays (the SQL views and the assembler must agree with what is shown);
these tests run them and check the displayed outputs for what this run is known to contain."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import debug_run
from tests.support.gatewayproc import environ

pytestmark = pytest.mark.engine

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, env: dict[str, str]) -> list[dict]:
    """Run the notebook in a fresh kernel (which inherits `env`); returns the outputs of its code cells, in order."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    with environ(env):
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def texts(outputs: list[dict], kind: str) -> list[str]:
    found = []
    for output in outputs:
        if output.get("output_type") == "stream" and kind == "stream":
            found.append(output["text"])
        elif kind in output.get("data", {}):
            found.append(output["data"][kind])
    return found


def test_inspect_session_notebook(debug_store) -> None:
    outputs = execute("1_inspect_session.ipynb", {"POLAR_MITM_DB": str(debug_store.db), "POLAR_MITM_SESSION": debug_run.EDITED})
    printed = "".join(texts(outputs, "stream"))
    assert f"session {debug_run.EDITED} · seq 1 → seq 2" in printed
    assert f"- {debug_run.EDIT_BEFORE}" in printed and f"+ {debug_run.EDIT_AFTER}" in printed
    assert "break class: rewritten" in printed
    markup = "".join(texts(outputs, "text/html"))
    # the token view: both sequences of the broken session, sampled tokens coloured apart from context
    assert markup.count('class="polar-seq"') == 2
    assert f"{debug_run.EDITED}:prefix_merging:1" in markup and f"{debug_run.EDITED}:prefix_merging:2" in markup
    assert 'class="tok sampled"' in markup and 'class="tok context"' in markup
    assert "rewritten" in markup  # the breaks table


def test_inspect_session_notebook_picks_a_broken_session(debug_store) -> None:
    outputs = execute("1_inspect_session.ipynb", {"POLAR_MITM_DB": str(debug_store.db)})
    chosen = "".join(texts(outputs, "text/markdown"))
    assert f"**Session `{debug_run.CUT}`**" in chosen  # the first session (by id) with a recorded break
    assert "break class: truncated" in "".join(texts(outputs, "stream"))


def test_explore_rollout_notebook(debug_store) -> None:
    outputs = execute("2_explore_rollout.ipynb", {"POLAR_MITM_DB": str(debug_store.db)})
    assert len(texts(outputs, "image/png")) == 4  # rewards, sequence lengths, compression ratio, break classes
    tables = "".join(texts(outputs, "text/html"))
    for task, harness in debug_run.REWARDS:
        assert f"<td>{task}</td>\n      <td>{harness}</td>" in tables
    assert "<td>prefix_merging</td>" in tables and "<td>per_request</td>" in tables
    assert "<td>qwen</td>\n      <td>rewritten</td>" in tables and "<td>qwen</td>\n      <td>truncated</td>" in tables


def test_compare_harnesses_notebook(debug_store) -> None:
    outputs = execute("3_compare_harnesses.ipynb", {"POLAR_MITM_DB": str(debug_store.db), "POLAR_MITM_TASK": "list-files", "POLAR_MITM_HARNESSES": "codex,claude"})
    shown = "".join(texts(outputs, "text/markdown"))
    assert "Task **list-files**: `codex` vs `claude`" in shown
    assert "only `codex`: exec_command, update_goal, write_stdin" in shown and "only `claude`: Bash, Read, Write" in shown
    tables = "".join(texts(outputs, "text/html")).replace("&nbsp;", " ")
    assert "exec_command(cmd: string, justification?: string" in tables and "Bash(command: string, timeout?: number" in tables
    assert "You are a coding agent running in the Codex CLI" in tables and "You are a Claude agent" in tables  # the system-prompt diff
    assert len(texts(outputs, "image/png")) == 1
