"""`polar-mitm run` interrupted mid-run: the real console script, the real Qwen Code under it, a real gateway, engine.

Qwen Code is a launcher that re-executes itself (`node --expose-gc cli.js`) and waits for that child; a signal that
ends only the launcher, or a HOME removed as soon as the launcher exits, leaves the child running and writing into a
HOME that is gone ("Session recording stopped after a write failure"). Each case interrupts a run while its first
engine call is in flight (the unsteered tiny model generates for minutes) and then checks what a user would see:
the command exits, no `polar-qwen-home-*` folder is left in its (private) temp directory, and no process of the run
is left.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from polar_mitm import harnesses
from polar_mitm.client import GatewayControl
from tests.support.processes import stop_process_group

CONSOLE_SCRIPT = Path(sys.executable).parent / "polar-mitm"
# what a user's shell would not have: nothing may point past the proxy
STRIPPED = {*harnesses.BASE_URL_VARIABLES, "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"}
# the run's bound: 10 s for the harness's group to end after the signal, then SIGKILL, then cleanup
EXIT_WITHIN = 30


def processes_with(variable: str) -> list[str]:
    """`pid command` of every live process whose environment holds `variable` exactly (Linux /proc)."""
    needle = variable.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(f"{entry.name} {command[:160]}")
    return found


def wait_for_in_flight(control: GatewayControl, run: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while control.status()["in_flight"] < 1:
        assert run.poll() is None, f"the run ended (exit {run.returncode}) before its first engine call"
        assert time.monotonic() < deadline, f"no engine call in flight after {timeout}s"
        time.sleep(0.5)
    time.sleep(2)  # the harness streams, writes its records, holds its child


@pytest.mark.parametrize("interrupt", ["ctrl-c in a terminal", "SIGINT to the process group", "SIGTERM to the command"])
def test_an_interrupted_run_leaves_no_home_and_no_process(interrupt: str, make_gateway, session_id: str, tmp_path: Path) -> None:
    try:
        argv = harnesses.get("qwen").command("Fix the failing tests in this folder.")
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))
    gateway = make_gateway()
    control = GatewayControl(gateway.proxy_url())
    private_tmp, workspace = tmp_path / "tmp", tmp_path / "workspace"
    private_tmp.mkdir()
    workspace.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED} | {"TMPDIR": str(private_tmp)}
    command = [str(CONSOLE_SCRIPT), "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--session", session_id, "--harness", "qwen", "--", *argv]
    output = tmp_path / "run.out"
    terminal = interrupt.startswith("ctrl-c")
    if terminal:
        # Ctrl-C is the line discipline's SIGINT to the terminal's foreground process group, whatever that is then
        run, master, reader = in_a_terminal(command, env, workspace, output)
    else:
        with output.open("w") as sink:
            run = subprocess.Popen(command, cwd=workspace, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_in_flight(control, run)
        assert [p.name for p in private_tmp.iterdir() if p.name.startswith("polar-qwen-home-")], "the run made no temporary HOME"
        assert processes_with(f"TMPDIR={private_tmp}"), "no process of the run found"
        if terminal:
            os.write(master, b"\x03")
        elif interrupt.startswith("SIGINT"):
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = run.wait(timeout=EXIT_WITHIN)
        took = time.monotonic() - started
    finally:
        if run.poll() is None:
            stop_process_group(run, grace=5)
        if terminal:
            reader.join(timeout=5)
            os.close(master)
    text = output.read_text(errors="replace")
    print(f"{interrupt}: exit {code} after {took:.1f}s\n{text[-2000:]}")
    left_processes = processes_with(f"TMPDIR={private_tmp}")
    left_homes = sorted(str(p) for p in private_tmp.glob("polar-qwen-home-*"))
    for line in left_processes:  # the test leaves nothing behind either
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert code != 0, f"an interrupted run reported success\n{text[-2000:]}"
    assert not left_processes, f"processes of the run outlived it: {left_processes}"
    assert not left_homes, f"temporary HOME left behind: {left_homes} holding {[str(p.relative_to(private_tmp)) for h in left_homes for p in Path(h).rglob('*') if p.is_file()][:20]}"
    assert "Traceback" not in text, text[-3000:]
    assert "write failure" not in text, text[-3000:]


def _copy_terminal(master: int, path: Path) -> None:
    """Everything the terminal shows, to `path` (read until the last writer closes it)."""
    with path.open("wb") as sink:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: no writer left
                return
            if not chunk:
                return
            sink.write(chunk)
            sink.flush()


def in_a_terminal(command: list[str], env: dict[str, str], cwd: Path, output: Path) -> tuple[subprocess.Popen, int, threading.Thread]:
    """Start `command` as the leader of a new session whose controlling terminal is a fresh pty; returns the process,
    the pty's master end and the thread copying what the terminal shows into `output`."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    reader = threading.Thread(target=_copy_terminal, args=(master, output), daemon=True)
    reader.start()
    return process, master, reader


def test_a_command_run_from_a_terminal_reads_it_and_its_exit_code_is_returned(make_gateway, tmp_path: Path) -> None:
    """The command's process group is the terminal's foreground group while it runs (what it types reaches it)."""
    gateway = make_gateway()
    script = 'read line; echo "got $line"; exit 3'
    command = [str(CONSOLE_SCRIPT), "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--", "sh", "-c", script]
    run, master, reader = in_a_terminal(command, dict(os.environ), tmp_path, tmp_path / "run.out")
    try:
        os.write(master, b"hello\n")
        code = run.wait(timeout=60)
    finally:
        if run.poll() is None:
            stop_process_group(run, grace=5)
        reader.join(timeout=5)
        os.close(master)
    text = (tmp_path / "run.out").read_text(errors="replace")
    assert code == 3 and "got hello" in text, (code, text)


def test_processes_the_command_leaves_running_are_killed_after_the_grace(make_gateway, tmp_path: Path) -> None:
    gateway = make_gateway()
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ) | {"TMPDIR": str(private_tmp)}
    # a background process that outlives the command and ignores SIGTERM
    command = [str(CONSOLE_SCRIPT), "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--", "sh", "-c", "trap '' TERM; sleep 120 & exit 0"]
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, start_new_session=True)
    took = time.monotonic() - started
    left = processes_with(f"TMPDIR={private_tmp}")
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert done.returncode == 0, done.stderr
    assert not left, left
    assert 9 < took < 30, took
    assert "still ran 10s after it ended; killed them" in done.stderr, done.stderr
