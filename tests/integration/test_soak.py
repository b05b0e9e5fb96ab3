"""The reliability soak's quick run (bench/soak.py --quick), started as a user starts it: its own process, from its
own working directory, writing its results there. Its invariants, read back from the JSON it writes: nothing an
answered client holds is missing from the store, nothing stored twice, no fault answered or stored as a success, no
abandoned call stored trainable, the gateway serving again after its SIGKILL, and the rollout server reporting every
task and session after its own SIGKILL, its sandboxes gone with it.

Needs the model directory the local engine is built from (tokens mode's tokenizer) and Qwen Code (the rollout
phase's sessions); not the engine itself: the soak brings its own stand-in engine (bench/soak_engine.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm import harnesses
from polar_mitm.local_engine import build

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.harness]


def test_quick_soak_loses_nothing_and_answers_no_fault_as_success(tmp_path: Path) -> None:
    if not (build.model_dir(build.engine_home(), build.DEFAULT_MODEL) / "tokenizer.json").exists():
        pytest.skip("no local model directory (scripts/setup.sh builds it): tokens mode has no tokenizer")
    try:
        harnesses.get("qwen").executable()
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--quick", "--out", "soak.json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    print(run.stdout[-6000:])
    assert (tmp_path / "soak.json").exists(), f"exit {run.returncode}, no results:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.md").read_text().startswith("Soak (quick")
    phases, invariants = results["phases"], results["invariants"]
    assert set(phases) == {"chat", "tokens"} and results["rollout"] is not None
    for name, phase in phases.items():
        # the load and the faults were really there: every API, streamed and not, each fault kind injected
        assert set(phase["by_api"]) == {"openai_chat", "openai_responses", "anthropic_messages", "gemini"}, name
        assert 0 < phase["streamed"] < phase["requests"], name
        assert {"engine_5xx", "reset", "garbage", "truncated", "hangup_stream", "hangup", "malformed", "no_auth", "wrong_auth"} <= set(phase["faults_planned"]), (name, phase["faults_planned"])
        assert phase["answered_ok"] > 0 and phase["rows"] > 0, name
    assert phases["chat"]["gateway_restarts_s"], "the chat phase SIGKILLs and restarts its gateway"
    failed = {name: check["value"] for name, check in invariants.items() if not check["holds"]}
    assert not failed, f"invariants failed: {failed}\n{run.stdout[-4000:]}"
    assert run.returncode == 0, run.stderr[-3000:]
    print(f"quick soak: {took:.0f} s")
