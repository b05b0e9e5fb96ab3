"""`polar-mitm rollout serve` that cannot start (issue 31), run as the real console script: one line on stderr,
exit status 2, no "serving on", no traceback, nothing left behind (the Ray head's store file included).

Ray must not find a cluster of its own: RAY_ADDRESS is removed and the address given is a loopback port where
nothing listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

CONSOLE_SCRIPT = Path(sys.executable).with_name("polar-mitm")


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        port = api.getsockname()[1]
    command = [str(CONSOLE_SCRIPT), "rollout", "serve", "--port", str(port), "--upstream", "http://127.0.0.1:9/v1", "--db", str(tmp_path / "polar.duckdb"), "--confdir", str(tmp_path / "confdir"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False)


def test_serve_ray_without_a_cluster_is_one_line_and_exit_2_leaving_no_head_store(tmp_path: Path) -> None:
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))  # bound, never listening: nothing answers there
        address = f"127.0.0.1:{nothing.getsockname()[1]}"
        done = serve(tmp_path, "--ray", address)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout + done.stderr
    assert lines == [lines[0]] and lines[0].startswith(f"polar-mitm rollout: no Ray cluster at {address}"), lines
    assert "ray start --head" in lines[0] and "Traceback" not in done.stderr and "serving on" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no polar.head.duckdb, nothing else


def test_serve_whose_gateway_cannot_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = serve(tmp_path, "--gateway-port", str(taken.getsockname()[1]))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("polar-mitm gateway:")]
    assert len(lines) == 1 and lines[0].startswith("polar-mitm rollout: the gateway did not start") and "address already in use" in lines[0].lower(), done.stderr
    assert "Traceback" not in done.stderr and "serving on" not in done.stderr
