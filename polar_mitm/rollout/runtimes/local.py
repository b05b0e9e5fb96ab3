"""The local runtime: each session in a fresh temp directory (workspace + private HOME + TMPDIR), as subprocesses.

No isolation beyond that: the harness reaches the gateway through its proxy settings, but nothing stops a
process from opening other connections (use the docker runtime for that). With `runtime.capture: transparent` the
harness runs in a capture namespace of its own instead (polar_mitm/capture.py): no proxy settings, and nothing but
the gateway's transparent listener reachable. Every process started here
carries POLAR_MITM_SANDBOX=<id> in its environment; `destroy` kills each process that still has it (also
ones that left the process group, e.g. a tool's detached child), then removes the directory.
"""

from __future__ import annotations

import asyncio
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


class LocalSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec):
        super().__init__(spec)
        self.root: Path | None = None
        self.namespace: CaptureNamespace | None = None

    async def start(self) -> None:
        if self.spec.runtime.capture == "transparent":
            listener = routing.transparent_listener(self.spec.gateway.confdir, self.spec.gateway.url)
            self.namespace = await asyncio.to_thread(open_namespace, self.spec.gateway.confdir, self.id, listener)
        self.root = Path(tempfile.mkdtemp(prefix=f"polar-sandbox-{self.id[:60]}-"))
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
        # its own process group, so a timeout or cancel kills the whole tree it started
        return await asyncio.create_subprocess_exec(
            *argv, cwd=self.workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=stdout,
            stderr=asyncio.subprocess.PIPE if stdout is asyncio.subprocess.PIPE else asyncio.subprocess.STDOUT, start_new_session=True,
        )

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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def marked_processes(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's marker (Linux /proc)."""
    needle = f"{MARKER}={sandbox_id}".encode()
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


def kill_marked(sandbox_id: str, settle: float = 0.2, limit: float = 10.0) -> None:
    """SIGKILL every process carrying the sandbox's marker, until scans over `settle` seconds find none.

    One empty scan is not enough: a process in the middle of exec shows an empty environment for a moment
    (measured here: 139 of 2.3 million reads while processes exec'd Python), and a dying tree may still fork.
    """
    deadline = time.monotonic() + limit
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        pids = marked_processes(sandbox_id)
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
