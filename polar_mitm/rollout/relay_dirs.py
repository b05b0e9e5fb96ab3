"""The folders that hold a node's relay socket (polar_mitm.rollout.relay), and the ones dead nodes left behind.

A node makes `polar-node-<pid>-<random>` in the temp folder and removes it when it stops. A node that was killed
(SIGKILL of `rollout serve`, a Ray actor killed with its worker) cannot, so each node starting on the machine first
removes the folders whose process is gone and on whose socket nothing answers. Folders named before the pid was
part of the name (`polar-node-<random>`) are removed once nothing answers on their socket and they are older than
LEGACY_AGE_S (a node of an older version that is just starting has not bound its socket yet).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

log = logging.getLogger("polar_mitm.rollout")

PREFIX = "polar-node-"
SOCKET = "gateway.sock"
LEGACY_AGE_S = 600.0
_WITH_PID = re.compile(re.escape(PREFIX) + r"(\d+)-")


def make_relay_dir() -> Path:
    """A new relay folder of this process (readable by a container's user, which connects to its socket)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    folder.chmod(0o755)
    return folder


def reap_relay_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the relay folders whose node is gone; returns them. Never raises: a folder that cannot be removed
    (another user's) is left."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if folder.is_dir() and not folder.is_symlink() and _is_stale(folder):
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError:
            continue
    if removed:
        log.info(f"polar node: removed {len(removed)} relay folder(s) of nodes that are gone: {', '.join(path.name for path in removed)}")
    return removed


def _is_stale(folder: Path) -> bool:
    if match := _WITH_PID.match(folder.name):
        # and nothing answers on its socket: a node in another pid namespace (a container sharing /tmp) has a pid
        # that is no process here
        return not _alive(int(match.group(1))) and not _answers(folder / SOCKET)
    return time.time() - folder.stat().st_mtime > LEGACY_AGE_S and not _answers(folder / SOCKET)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
