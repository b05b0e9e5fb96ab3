"""The local runtime: each session in a fresh temp directory (workspace + private HOME + TMPDIR), as subprocesses.

No isolation beyond that: the harness reaches the gateway through its proxy settings, but nothing stops a
process from opening other connections (use the docker runtime for that). With `runtime.capture: transparent` the
harness runs in a capture namespace of its own instead (polar_mitm/capture.py): no proxy settings, and nothing but
the gateway's transparent listener reachable. Every process started here
carries POLAR_MITM_SANDBOX=<id> in its environment; `destroy` kills each process that still has it (also
ones that left the process group, e.g. a tool's detached child), then removes the directory.

A sandbox does not outlive its server. Each process it starts gets a parent-death signal (SIGKILL when the server
dies, prctl PR_SET_PDEATHSIG) and leads a process group of its own, watched by a guard (a `sh` in a session of its
own, reading a pipe only the server holds open): the server's death closes the pipe and the guard kills the whole
group (the harness's children too: the signal reaches only the process itself). With a `spec.owner`, every
process also carries POLAR_MITM_SANDBOX_OWNER=<owner>: a restarted server kills any left (`kill_owned`), e.g. one
that left its group, before it fails the sessions they belonged to, and removes their directories, which name their
owner in OWNER_FILE (`remove_owned`).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from polar_mitm import routing
from polar_mitm.capture import CaptureNamespace, open_namespace
from polar_mitm.harnesses import Harness
from polar_mitm.rollout.models import Agent, Upload
from polar_mitm.rollout.runtimes import ExecResult, Sandbox, SandboxSpec, write_home_files

MARKER = "POLAR_MITM_SANDBOX"
OWNER_MARKER = "POLAR_MITM_SANDBOX_OWNER"
OWNER_FILE = ".polar-owner"  # in a sandbox's directory, beside (not in) its workspace, HOME and TMPDIR
PREFIX = "polar-sandbox-"
PR_SET_PDEATHSIG = 1
# looked up here, not in the forked child (which must not import or allocate much before exec); Linux only
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
# kills the watched group once the pipe on its stdin closes: the server ended it, or the server died
GUARD = 'read _ignored; kill -s KILL -- "-$1" 2>/dev/null'


class LocalSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec):
        super().__init__(spec)
        self.root: Path | None = None
        self.namespace: CaptureNamespace | None = None
        self.guards: dict[int, tuple[asyncio.subprocess.Process, int]] = {}  # process id -> its guard

    async def start(self) -> None:
        if self.spec.runtime.capture == "transparent":
            listener = routing.transparent_listener(self.spec.gateway.confdir, self.spec.gateway.url)
            self.namespace = await asyncio.to_thread(open_namespace, self.spec.gateway.confdir, self.id, listener)
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.id[:60]}-"))
        if self.spec.owner:
            (self.root / OWNER_FILE).write_text(self.spec.owner)
        workspace = self.root / "workspace"
        self.workdir = str(workspace / (self.spec.runtime.workdir or ""))
        self.home = str(self.root / "home")
        for path in (self.workdir, self.home, self.root / "tmp"):
            Path(path).mkdir(parents=True, exist_ok=True)

    def _base_env(self) -> dict[str, str]:
        assert self.root is not None
        return {
            "PATH": os.environ.get("PATH", os.defpath),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": self.home,
            "TMPDIR": str(self.root / "tmp"),
            MARKER: self.id,
            **({OWNER_MARKER: self.spec.owner} if self.spec.owner else {}),
            **self.spec.runtime.env,
        }

    async def upload(self, upload: Upload) -> None:
        target = Path(self.workdir) / upload.target
        if upload.content is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(upload.content)
            target.chmod(upload.mode if upload.mode is not None else 0o644)
            return
        source = Path(upload.source or "").expanduser()
        if source.is_dir():
            await asyncio.to_thread(shutil.copytree, source, target, symlinks=True, dirs_exist_ok=True)
        elif source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(shutil.copy2, source, target)
        else:
            raise FileNotFoundError(f"upload source {str(source)!r} does not exist on the rollout server's machine")

    async def exec(self, command: str, timeout: float | None, env: Mapping[str, str] | None = None) -> ExecResult:
        process = await self._spawn(["bash", "-c", command], {**self._base_env(), **(env or {})}, asyncio.subprocess.PIPE)
        stdout, stderr = await self._wait(process, timeout, communicate=True)
        return ExecResult(process.returncode if process.returncode is not None else -1, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"))

    async def prepare_harness(self, harness: Harness, agent: Agent, instruction: str) -> tuple[list[str], dict[str, str]]:
        harness.prepare_home(self.home, agent.model)
        write_home_files(Path(self.home), agent.home_files)
        env = harness.environment(self.home, agent.model, base=self.proxy_environment(self._base_env()))
        env.update(agent.env)
        return harness.command(instruction, agent.model), env

    async def run_harness(self, argv: list[str], env: dict[str, str], timeout: float, output: Path) -> int:
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("wb") as sink:
            process = await self._spawn(self.namespace.command(argv) if self.namespace else argv, env, sink)
            await self._wait(process, timeout, communicate=False)
        return process.returncode if process.returncode is not None else -1

    async def read_file(self, path: str) -> bytes:
        return (Path(self.workdir) / path).read_bytes()

    async def destroy(self) -> None:
        await asyncio.to_thread(kill_marked, self.id)
        if self.namespace is not None:
            await asyncio.to_thread(self.namespace.close)
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)

    # -- processes
    async def _spawn(self, argv: list[str], env: dict[str, str], stdout) -> asyncio.subprocess.Process:
        # its own process group, so a timeout or cancel kills the whole tree it started; dies with this process
        parent = os.getpid()
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=self.workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=stdout,
            stderr=asyncio.subprocess.PIPE if stdout is asyncio.subprocess.PIPE else asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: _die_with(parent),
        )
        try:
            self.guards[process.pid] = await _guard(process.pid)
        except BaseException:
            _kill_group(process.pid)
            await process.wait()
            raise
        return process

    async def _wait(self, process: asyncio.subprocess.Process, timeout: float | None, communicate: bool) -> tuple[bytes, bytes]:
        try:
            async with asyncio.timeout(timeout):
                if communicate:
                    return await process.communicate()
                await process.wait()
                return b"", b""
        except BaseException:  # TimeoutError or CancelledError: nothing it started may outlive it
            _kill_group(process.pid)
            await process.wait()
            raise
        finally:
            await _release(self.guards.pop(process.pid))


def _die_with(parent: int) -> None:
    """In the forked child, before exec: SIGKILL when the server dies (also if it died since the fork)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


async def _guard(pgid: int) -> tuple[asyncio.subprocess.Process, int]:
    """A guard for process group `pgid` (module docstring) and the pipe end that keeps it waiting."""
    read_end, write_end = os.pipe()  # both close-on-exec here: only the guard's stdin is a copy
    try:
        guard = await asyncio.create_subprocess_exec(
            "sh", "-c", GUARD, "polar-sandbox-guard", str(pgid), stdin=read_end, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return guard, write_end


async def _release(guarded: tuple[asyncio.subprocess.Process, int]) -> None:
    """The group's process ended here: its guard is stopped (its group is this server's to kill now)."""
    guard, write_end = guarded
    try:
        guard.kill()
    except ProcessLookupError:
        pass
    os.close(write_end)
    await guard.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def marked_processes(sandbox_id: str, variable: str = MARKER) -> list[int]:
    """Processes whose environment carries this sandbox's marker (or `variable`=sandbox_id) (Linux /proc)."""
    needle = f"{variable}={sandbox_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            variables = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if needle in variables:
            found.append(int(entry.name))
    return found


def kill_owned(owner: str) -> None:
    """SIGKILL every process of every sandbox `owner` (a server's state) started, as kill_marked does one's."""
    kill_marked(owner, variable=OWNER_MARKER)


def remove_owned(owner: str) -> int:
    """Remove the directories of `owner`'s sandboxes (what a killed server left; its processes killed first,
    `kill_owned`); how many."""
    removed = 0
    for root in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if root.is_dir() and not root.is_symlink() and (root / OWNER_FILE).read_text() == owner:
                shutil.rmtree(root)
                removed += 1
        except OSError:  # not a sandbox of ours (no owner file), or not ours to read
            continue
    return removed


def kill_marked(sandbox_id: str, settle: float = 0.2, limit: float = 10.0, variable: str = MARKER) -> None:
    """SIGKILL every process carrying the sandbox's marker, until scans over `settle` seconds find none.

    One empty scan is not enough: a process in the middle of exec shows an empty environment for a moment
    (measured here: 139 of 2.3 million reads while processes exec'd Python), and a dying tree may still fork.
    """
    deadline = time.monotonic() + limit
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        pids = marked_processes(sandbox_id, variable)
        if pids:
            quiet_since = None
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle:
            return
        time.sleep(0.05)
