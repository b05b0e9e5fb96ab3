"""`polar-mitm engine stop` says what it stopped: the engine's model, URL and pid, its processes and their memory.

The console script is run as a user runs it, against a home and port of this test's own (never the shared engine on
8011). What it stops is a stand-in: a process group whose leader's command line names vLLM, as the recorded engine's
does (the stop checks that, so a reused pid is never signalled), with one child as vLLM's engine-core worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from polar_mitm.util import free_port

POLAR_MITM = str(Path(sys.executable).parent / "polar-mitm")
# the leader starts a worker in its group, then says so and waits (argv[1] is only there to name vLLM)
STAND_IN = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('up', flush=True); time.sleep(600)"
# started as `engine start` starts the engine: in a session of its own, by a process that exits at once, so the test
# is not its parent (a parent that does not reap it would keep its group alive as a zombie)
LAUNCH = f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {STAND_IN!r}, 'vllm-stand-in'], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, start_new_session=True); print(p.stdout.readline().strip(), p.pid, flush=True)"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_engine_stop_names_what_it_stopped_and_says_when_nothing_ran(tmp_path: Path) -> None:
    port = free_port()
    launched = subprocess.run([sys.executable, "-c", LAUNCH], capture_output=True, text=True, timeout=60)
    up, pid = launched.stdout.split()
    engine_pid = int(pid)
    try:
        assert up == "up", launched.stderr
        record = tmp_path / f"engine-{port}.json"
        record.write_text(json.dumps({"pid": engine_pid, "url": f"http://127.0.0.1:{port}/v1", "model": "qwen3-tiny", "log": str(tmp_path / "engine.log")}))

        stop = [POLAR_MITM, "engine", "stop", "--port", str(port), "--home", str(tmp_path)]
        done = subprocess.run(stop, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        line = done.stdout.strip()
        assert line.startswith(f"polar-mitm engine: stopped qwen3-tiny at http://127.0.0.1:{port}/v1 (pid {engine_pid}; 2 processes, "), line
        assert line.endswith(" GiB resident before the stop)"), line
        deadline = time.monotonic() + 10
        while group_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(engine_pid), "the worker outlived the stop"
        assert not record.exists()

        again = subprocess.run(stop, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stdout.strip() == f"polar-mitm engine: no engine on port {port}; nothing to stop", again.stdout + again.stderr
    finally:
        if group_alive(engine_pid):
            os.killpg(engine_pid, 9)
