"""The four real harnesses, unmodified, in tokens mode and in chat mode, in the same run.

The harness runs headless as in tests/integration/test_harnesses.py (same install and instruction), steered by
tests/support/tokens_steering.py:two_calls: a shell call writing the proof file, a second reading it back, then
a final text, each forced by structured outputs and so not canonically tokenized. In tokens mode every turn that
extends an earlier one (an append-only turn) must be bridged, and every lineage must assemble into exactly
one sequence with every sampled token once under mask 1. Chat mode's result on the same session is printed
(`merge:` lines, the README's table).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_mitm.assembler import assemble
from polar_mitm.store import JSON_COLUMNS
from tests.support import harness_steering as steering
from tests.support import tokens_steering
from tests.support.harness_runs import check_assembly, run_harness
from tests.support.matrix import harness_matrix

HOOK = f"{Path(tokens_steering.__file__).resolve()}:two_calls"

def rows_of(gateway, session_id: str) -> list[dict]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


def run_in_both_modes(make_gateway, name: str, session_id: str, tmp_path) -> dict[str, tuple[list[dict], int]]:
    results = {}
    for mode in ("tokens", "chat"):
        gateway = make_gateway("--render", mode, "--engine-hook", HOOK)
        workdir = tmp_path / mode
        workdir.mkdir()
        result = run_harness(gateway, name, session_id, workdir)
        assert result.returncode == 0, f"{mode}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        assert (workdir / "workspace" / steering.PROOF_FILE).read_text() == steering.PROOF_CONTENT
        rows = rows_of(gateway, session_id)
        assert all(r["status"] == "ok" and r["render_mode"] == mode for r in rows), [(r["seq"], r["status"], r["error"]) for r in rows]
        if mode == "tokens":
            check_assembly(gateway, session_id, rows)
        results[mode] = (rows, len(assemble(gateway.db, builder="prefix_merging", session=session_id).sequences))
    return results


def check_tokens_mode(name: str, results: dict[str, tuple[list[dict], int]]) -> None:
    rows, sequences = results["tokens"]
    chat_rows, chat_sequences = results["chat"]
    first_turns = [r for r in rows if r["bridge_reason"] == "first_turn"]
    append_only = [r for r in rows if r["bridge_reason"] != "first_turn"]
    assert len(append_only) >= 2 and all(r["bridged"] for r in append_only), [(r["seq"], r["bridged"], r["bridge_reason"]) for r in rows]
    assert sequences == len(first_turns)  # one sequence per lineage
    assert [r["finish_reason"] for r in rows].count("tool_calls") == 2
    merged_chat = len(chat_rows) - chat_sequences
    print(f"\nmerge: {name} exchanges={len(rows)} lineages={len(first_turns)} append_only={len(append_only)} "
          f"tokens: bridged={sum(bool(r['bridged']) for r in append_only)} sequences={sequences} | "
          f"chat: exchanges={len(chat_rows)} merged={merged_chat} sequences={chat_sequences}")


@pytest.mark.harness
# default suite: Claude Code and Gemini CLI (two dialects; Gemini's side call is a second lineage);
# all four in the full matrix
@pytest.mark.parametrize("name", harness_matrix(["qwen", "codex", "claude", "gemini"], default=("claude", "gemini")))
def test_harness_lineages_are_one_sequence_in_tokens_mode(installed, make_gateway, name: str, session_id: str, tmp_path) -> None:
    check_tokens_mode(name, run_in_both_modes(make_gateway, name, session_id, tmp_path))
