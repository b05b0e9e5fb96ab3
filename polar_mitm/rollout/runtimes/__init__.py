"""Sandboxes: where one session's prepare steps, harness and evaluator run. One module per backend.

    sandbox = await runtimes.create(spec)        # fresh workspace + private HOME (local) or a container (docker)
    await sandbox.upload(upload); await sandbox.exec("make setup", timeout)
    argv, env = await sandbox.prepare_harness(harness, agent, instruction)
    exit_code = await sandbox.run_harness(argv, env, timeout, output_file)
    data = await sandbox.read_file("out.txt")
    await sandbox.destroy()                      # always; kills whatever is left and removes everything

`exec`/`run_harness` raise TimeoutError past their timeout, and kill what they started when cancelled.
Each backend is a `Sandbox` subclass (the ABC below) registered in RUNTIMES under its `runtime.backend` name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from polar_mitm import routing
from polar_mitm.harnesses import Harness
from polar_mitm.registry import Registry
from polar_mitm.rollout.models import Agent, Runtime, Upload

OUTPUT_TAIL = 4000


@dataclass
class GatewayAccess:
    """How a sandbox reaches the node's gateway: the host's view of it."""

    url: str  # http://127.0.0.1:PORT
    confdir: Path  # CA + session secret (the secret never enters a sandbox)
    relay_socket: Path | None = None  # a unix socket forwarding to the gateway, for sandboxes without a network


@dataclass
class SandboxSpec:
    sandbox_id: str  # the session id
    runtime: Runtime
    gateway: GatewayAccess
    owner: str | None = None  # the server whose sandbox it is (durable.sandbox_owner): a restart reaps what it left by it


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


def tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


class Sandbox(abc.ABC):
    home: str  # HOME as the processes inside see it
    workdir: str  # where commands run, as seen inside

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.id = spec.sandbox_id

    def proxy_environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` routed through the gateway as this session (host view: loopback URL, CA bundle in the confdir); with
        `runtime.capture: transparent`, no proxy settings, only the CA (the capture namespace routes it)."""
        if self.spec.runtime.capture == "transparent":
            return routing.capture_environment(self.id, self.spec.gateway.confdir, base=base)
        return routing.proxy_environment(self.id, self.spec.gateway.confdir, self.spec.gateway.url, base=base)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def upload(self, upload: Upload) -> None: ...

    @abc.abstractmethod
    async def exec(self, command: str, timeout: float | None, env: Mapping[str, str] | None = None) -> ExecResult:
        """`bash -c command` in the workdir with the runtime's env (plus `env`)."""

    @abc.abstractmethod
    async def prepare_harness(self, harness: Harness, agent: Agent, instruction: str) -> tuple[list[str], dict[str, str]]:
        """Write the harness's HOME (preset config + agent.home_files); return its argv and full environment."""

    @abc.abstractmethod
    async def run_harness(self, argv: list[str], env: dict[str, str], timeout: float, output: Path) -> int:
        """Run the harness to its end (exit status), stdout+stderr into `output` on the host."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes: ...

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Kill everything still running in the sandbox and remove it. Idempotent."""


def write_home_files(home: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = home / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# backend name -> Sandbox class, imported on first use
RUNTIMES: Registry[type[Sandbox]] = Registry(
    "runtime",
    {"local": "polar_mitm.rollout.runtimes.local:LocalSandbox", "docker": "polar_mitm.rollout.runtimes.docker:DockerSandbox"},
)


async def create(spec: SandboxSpec) -> Sandbox:
    """A started sandbox of `spec.runtime.backend` (a name in RUNTIMES); destroyed again if starting fails."""
    sandbox = RUNTIMES.get(spec.runtime.backend)(spec)
    try:
        await sandbox.start()
    except BaseException:
        await sandbox.destroy()
        raise
    return sandbox
