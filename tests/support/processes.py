"""Child processes the tests start in a session of their own (`start_new_session=True`)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process's whole group, SIGKILL after `grace` seconds if it has not exited by then."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
