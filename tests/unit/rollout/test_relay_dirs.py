"""A node's relay folder outlives a node that was killed; the next node to start removes it, and only the folders of
nodes that are gone (real processes and real unix sockets)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from polar_mitm.rollout import relay_dirs
from polar_mitm.rollout.relay_dirs import LEGACY_AGE_S, PREFIX, SOCKET, make_relay_dir, reap_relay_dirs


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "note").write_text("left by a node")
    return folder


def _age(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(folder, (then, then))


def test_only_the_folders_of_nodes_that_are_gone_are_removed(tmp_path: Path) -> None:
    dead = _folder(tmp_path, f"{PREFIX}{_gone_pid()}-abc")
    mine = _folder(tmp_path, f"{PREFIX}{os.getpid()}-def")
    old_silent = _folder(tmp_path, f"{PREFIX}ghi")
    with socket.socket(socket.AF_UNIX) as bound:  # bound, never listening: connecting is refused, as after a SIGKILL
        bound.bind(str(old_silent / SOCKET))
    _age(old_silent, LEGACY_AGE_S + 60)  # after the socket: a new entry touches its folder
    old_answering = _folder(tmp_path, f"{PREFIX}jkl")
    young_silent = _folder(tmp_path, f"{PREFIX}mno")
    elsewhere = _folder(tmp_path, f"{PREFIX}{_gone_pid()}-pqr")  # a node in another pid namespace: its pid is none here
    other = _folder(tmp_path, "polar-other-123-x")
    with socket.socket(socket.AF_UNIX) as listening, socket.socket(socket.AF_UNIX) as other_namespace:
        listening.bind(str(old_answering / SOCKET))
        listening.listen()
        _age(old_answering, LEGACY_AGE_S + 60)
        other_namespace.bind(str(elsewhere / SOCKET))
        other_namespace.listen()
        removed = reap_relay_dirs(tmp_path)
    assert sorted(removed) == sorted([dead, old_silent])
    assert not dead.exists() and not old_silent.exists()
    assert all(path.exists() for path in (mine, old_answering, young_silent, other, elsewhere))
    # their nodes stopped answering: the next start removes them
    assert sorted(reap_relay_dirs(tmp_path)) == sorted([old_answering, elsewhere])
    assert all(path.exists() for path in (mine, young_silent, other))


def test_a_relay_folder_is_named_for_its_process_and_readable_by_a_container(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(relay_dirs.tempfile, "tempdir", str(tmp_path))
    folder = make_relay_dir()
    try:
        assert folder.parent == tmp_path and folder.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert folder.stat().st_mode & 0o777 == 0o755
        assert reap_relay_dirs(tmp_path) == [] and folder.exists()  # this process is alive
    finally:
        folder.rmdir()
