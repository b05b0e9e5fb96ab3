"""The docker runtime: each session in its own container, through the docker SDK against a real Docker engine.

The container reaches only the gateway. With `network: gateway` (the default) it has no network at all
(`--network none`): its HTTPS_PROXY is a relay on its own loopback (polar_mitm/rollout/relay.py, run by the
image's python3 as the container's main process) that forwards to a unix socket bind-mounted from the node,
which ends at the gateway. `network: host` shares the machine's network (the proxy settings still route the
harness). The gateway's CA bundle is mounted read-only (the session secret is not); the host's pinned
Node + harness install is mounted read-only at the same path, so the harness presets' argv and PATH hold
inside. CPU and memory limits are the container's. Images: sandboxes/docker/ (no registry needed).

An engine that goes away mid-session (dockerd stopped or restarted: without live-restore its containers stop with
it) fails the session with ContainerLost, saying so rather than showing the dying container's exit status; its
removal waits up to REMOVE_WAIT for the engine to answer again, and one still not removed goes at the next start.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from polar_mitm import harnesses, routing
from polar_mitm.errors import DockerUnavailable
from polar_mitm.harnesses import Harness
from polar_mitm.rollout import relay
from polar_mitm.rollout.models import Agent, Upload
from polar_mitm.rollout.runtimes import (
    ExecResult,
    Sandbox,
    SandboxSpec,
    write_home_files,
)

DEFAULT_WORKDIR = "/workspace"
HOME = "/home/agent"
CONTAINER_CA = "/etc/polar-mitm/ca-bundle.pem"
CONTAINER_RELAY_DIR = "/run/polar-mitm"
RELAY_PORT = 3128
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LABEL = "polar-mitm.session"
OWNER_LABEL = "polar-mitm.owner"  # the server whose sandbox it is (SandboxSpec.owner): a restart removes what it left
HARNESS_LOG = "/tmp/polar-harness.log"
READY_TIMEOUT = 30.0
# how long removing a sandbox waits for an engine that stopped answering (dockerd restarting) to answer again
REMOVE_WAIT = 30.0

_client: Any = None
_client_lock = threading.Lock()
_unremoved: set[str] = set()  # containers whose removal found no engine: removed once it answers again (_sweep)


class ContainerLost(RuntimeError):
    """The session's container, or the Docker engine holding it, went away while the session ran."""


async def _settled(work) -> None:
    """Finish `work` even when the caller is being cancelled (the cancel is re-raised by the caller's own path)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise




def client() -> Any:
    """One docker SDK client per process, from DOCKER_HOST (sandboxes/docker/dockerd.sh prints it)."""
    global _client
    with _client_lock:
        if _client is None:
            import docker

            try:
                _client = docker.from_env(version="auto", timeout=120)
                _client.ping()
            except Exception as error:  # noqa: BLE001 - every way of not reaching the engine reads the same to a user
                _client = None
                raise DockerUnavailable(f"no Docker engine reachable (DOCKER_HOST; start one with sandboxes/docker/dockerd.sh): {error}") from error
        return _client


def check_image(image: str) -> None:
    import docker
    import requests

    try:
        client().images.get(image)
    except docker.errors.ImageNotFound:
        raise DockerUnavailable(f"image {image!r} is not in the Docker engine; build it with sandboxes/docker/build-image.sh (no registry is used)") from None
    except requests.exceptions.ConnectionError as error:
        raise DockerUnavailable(f"the Docker engine does not answer now (is dockerd restarting?): {error}") from None


def _engine_away(error: BaseException) -> bool:
    """Whether `error` says the engine is not there (stopped, restarting), as opposed to refusing the request."""
    import docker
    import requests

    return isinstance(error, requests.exceptions.ConnectionError) or (
        isinstance(error, docker.errors.APIError) and not isinstance(error, docker.errors.NotFound) and error.is_server_error()
    )


def _remove_container(container_id: str) -> None:
    """Remove a container, waiting up to REMOVE_WAIT for an engine that went away; one it never reached is kept
    in `_unremoved` for the next sweep, and the error raised."""
    import docker

    deadline = time.monotonic() + REMOVE_WAIT
    while True:
        try:
            client().api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except Exception as error:
            if not _engine_away(error):
                raise
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            with _client_lock:
                _unremoved.add(container_id)
            raise DockerUnavailable(f"container {container_id[:12]} is not removed: the Docker engine did not answer for {REMOVE_WAIT:g}s ({error}); it is removed when the next sandbox starts") from None
        with _client_lock:
            _unremoved.discard(container_id)
        return


def _sweep() -> None:
    """Remove what an absent engine kept earlier removals from removing (best effort: it waits for no engine)."""
    import docker

    with _client_lock:
        left = list(_unremoved)
    for container_id in left:
        try:
            client().api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except Exception:  # noqa: BLE001 - still unreachable: kept for the next sweep
            continue
        with _client_lock:
            _unremoved.discard(container_id)


def remove_owned(owner: str) -> int:
    """Remove every container labelled with `owner` (what a killed server left running); how many."""
    containers = client().containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner}"})
    for container in containers:
        container.remove(force=True)
    return len(containers)


class DockerSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec):
        super().__init__(spec)
        self.container: Any = None
        self.workdir = spec.runtime.workdir or DEFAULT_WORKDIR
        self.home = HOME
        self.path = PATH

    # -- lifecycle
    async def start(self) -> None:
        # a cancel must not leave a container made after destroy() looked: finish creating, then give up
        await _settled(asyncio.to_thread(self._start))

    def _start(self) -> None:
        from docker.types import Mount

        _sweep()
        runtime = self.spec.runtime
        mounts = [Mount(CONTAINER_CA, str(routing.ca_bundle(self.spec.gateway.confdir)), type="bind", read_only=True)]
        if runtime.mount_harnesses:
            prefix = harnesses.install_prefix()
            mounts.append(Mount(str(prefix), str(prefix), type="bind", read_only=True))
            node_dir = harnesses.node_bin_dir()
            if node_dir is not None and not node_dir.is_relative_to(prefix):
                mounts.append(Mount("/usr/local/bin/node", str(node_dir / "node"), type="bind", read_only=True))
        if runtime.network == "gateway":
            socket = self.spec.gateway.relay_socket
            if socket is None:
                raise DockerUnavailable("the node has no relay socket for network 'gateway'")
            mounts.append(Mount(CONTAINER_RELAY_DIR, str(socket.parent), type="bind", read_only=False))
            command = ["python3", "-c", Path(relay.__file__).read_text(), "tcp-to-unix", f"{CONTAINER_RELAY_DIR}/{socket.name}", str(RELAY_PORT)]
            network = "none"
        else:
            command = ["sleep", "infinity"]
            network = "host"
        import docker

        try:
            self.container = client().containers.run(
                runtime.image, command, detach=True, init=True, network_mode=network, mounts=mounts,
                labels={LABEL: self.id, **({OWNER_LABEL: self.spec.owner} if self.spec.owner else {})}, environment={"LANG": "C.UTF-8", **runtime.env},
                nano_cpus=int(runtime.cpus * 1e9) if runtime.cpus else None, mem_limit=runtime.memory,
                hostname="sandbox",
            )
        except docker.errors.ImageNotFound:
            raise DockerUnavailable(f"image {runtime.image!r} is not in the Docker engine; build it with sandboxes/docker/build-image.sh") from None
        # the image's own PATH (its toolchains, or harnesses baked in) stays the base of every exec
        image_env = dict(entry.split("=", 1) for entry in self.container.attrs["Config"].get("Env") or [] if "=" in entry)
        self.path = image_env.get("PATH", PATH)
        if runtime.network == "gateway":
            self._wait_for_relay()
        self._exec_blocking(["mkdir", "-p", self.workdir, self.home], {}, "/")

    def _wait_for_relay(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            self.container.reload()
            logs = self.container.logs().decode("utf-8", "replace")
            if relay.READY in logs:
                return
            if self.container.status == "exited":
                raise DockerUnavailable(f"the gateway relay in image {self.spec.runtime.image!r} exited (it needs python3, or use network 'host'): {logs[-1500:]}")
            time.sleep(0.1)
        raise DockerUnavailable(f"the gateway relay did not start within {READY_TIMEOUT:.0f}s")

    async def destroy(self) -> None:
        if self.container is not None:
            await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        _remove_container(self.container.id)

    # -- files
    def _inside(self, path: str) -> str:
        return str(PurePosixPath(self.workdir) / path)

    async def upload(self, upload: Upload) -> None:
        target = PurePosixPath(self._inside(upload.target))
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            if upload.content is not None:
                data = upload.content.encode()
                info = tarfile.TarInfo(target.name)
                info.size, info.mode, info.mtime = len(data), upload.mode if upload.mode is not None else 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
            else:
                source = Path(upload.source or "").expanduser()
                if not source.exists():
                    raise FileNotFoundError(f"upload source {str(source)!r} does not exist on the rollout server's machine")
                tar.add(str(source), arcname=target.name)
        await self._put(str(target.parent), buffer.getvalue())

    async def _put(self, directory: str, data: bytes) -> None:
        await asyncio.to_thread(self._exec_blocking, ["mkdir", "-p", directory], {}, "/")
        if not await asyncio.to_thread(self.container.put_archive, directory, data):
            raise RuntimeError(f"could not copy into {directory} of the container")

    async def read_file(self, path: str) -> bytes:
        return await self._read(self._inside(path))

    async def _read(self, absolute: str) -> bytes:
        def read() -> bytes:
            stream, _ = self.container.get_archive(absolute)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.next()
                handle = tar.extractfile(member) if member is not None else None
                if handle is None:
                    raise IsADirectoryError(absolute)
                return handle.read()

        return await asyncio.to_thread(read)

    # -- processes
    def _exec_blocking(self, argv: list[str], env: Mapping[str, str], workdir: str) -> ExecResult:
        """Run `argv` in the container to its end. ContainerLost if the container or its engine went away meanwhile
        (a dockerd stop ends the exec's stream and, without live-restore, stops every container): that, not the
        exit status a dying container leaves, is what the session's error must say."""
        import docker

        api = client().api
        try:
            exec_id = api.exec_create(self.container.id, argv, environment=dict(env), workdir=workdir, stdout=True, stderr=True)["Id"]
            stdout, stderr = api.exec_start(exec_id, demux=True)
            inspected = api.exec_inspect(exec_id)
        except Exception as error:
            if _engine_away(error):
                raise ContainerLost(f"the Docker engine went away while the session ran (dockerd stopped or restarted; without live-restore its containers stop with it): container {self.container.id[:12]} is lost ({type(error).__name__})") from None
            if isinstance(error, docker.errors.NotFound):  # the container removed, or a restarted engine that lost the exec
                raise ContainerLost(f"container {self.container.id[:12]} or its process is gone from the Docker engine (it restarted, or the container was removed): {error}") from None
            raise
        code = inspected.get("ExitCode")
        if code != 0 or inspected.get("Running"):  # a dying container's exit status, or a stream cut while it runs
            if (gone := self._gone()) is not None:
                raise ContainerLost(f"container {self.container.id[:12]} {gone} while the session ran: the Docker engine stopped or restarted, or something stopped the container")
        return ExecResult(code if code is not None else -1, (stdout or b"").decode("utf-8", "replace"), (stderr or b"").decode("utf-8", "replace"))

    def _gone(self) -> str | None:
        """Why the container can run nothing more, in words; None while it runs."""
        import docker

        try:
            state = client().api.inspect_container(self.container.id)["State"]
        except docker.errors.NotFound:
            return "was removed"
        except Exception as error:  # noqa: BLE001 - any way of not reaching the engine reads the same here
            return f"is out of reach ({type(error).__name__}: {error})" if _engine_away(error) else None
        if state.get("Running") and not state.get("Restarting"):
            return None
        return f"stopped ({'killed for memory' if state.get('OOMKilled') else 'exit status ' + str(state.get('ExitCode'))} at {state.get('FinishedAt')})"

    async def _exec(self, argv: list[str], env: Mapping[str, str], timeout: float | None) -> ExecResult:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._exec_blocking, argv, env, self.workdir), timeout)
        except BaseException:  # TimeoutError or CancelledError: the exec cannot be killed alone; the container goes
            await asyncio.to_thread(self._kill)
            raise

    def _kill(self) -> None:
        import docker
        import requests

        try:
            self.container.kill()
        except (docker.errors.APIError, requests.exceptions.ConnectionError):  # already stopped or gone, or no engine
            pass

    async def exec(self, command: str, timeout: float | None, env: Mapping[str, str] | None = None) -> ExecResult:
        return await self._exec(["bash", "-c", command], {"HOME": self.home, **self.spec.runtime.env, **(env or {})}, timeout)

    async def prepare_harness(self, harness: Harness, agent: Agent, instruction: str) -> tuple[list[str], dict[str, str]]:
        with tempfile.TemporaryDirectory(prefix="polar-home-") as staging:
            harness.prepare_home(staging, agent.model)
            write_home_files(Path(staging), agent.home_files)
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                for entry in Path(staging).iterdir():
                    tar.add(str(entry), arcname=entry.name)
        await self._put(self.home, buffer.getvalue())
        routed = self.proxy_environment({"PATH": self.path, "LANG": "C.UTF-8", **self.spec.runtime.env})
        routed.update({name: CONTAINER_CA for name in routing.CA_VARIABLES})
        if self.spec.runtime.network == "gateway":
            # same credentials, the container's own loopback relay instead of the gateway's port
            credentials = routed["HTTPS_PROXY"].split("@", 1)[0]
            routed.update({name: f"{credentials}@127.0.0.1:{RELAY_PORT}" for name in routing.PROXY_VARIABLES})
        env = harness.environment(self.home, agent.model, base=routed)
        env.update(agent.env)
        if self.spec.runtime.mount_harnesses:
            argv = harness.command(instruction, agent.model)
        else:  # the image's own install, found on its PATH
            argv = [harness.binary, *harness.arguments(instruction, agent.model or harness.default_model)]
        return argv, env

    async def run_harness(self, argv: list[str], env: dict[str, str], timeout: float, output: Path) -> int:
        # its output goes to a file in the container, copied out afterwards (a killed container still has it):
        # simpler and sturdier than the SDK's exec output stream
        redirected = ["sh", "-c", f'exec "$@" > {HARNESS_LOG} 2>&1', "harness", *argv]
        try:
            return (await self._exec(redirected, env, timeout)).exit_code
        finally:
            await _settled(self._copy_log(output))

    async def _copy_log(self, output: Path) -> None:
        output.parent.mkdir(parents=True, exist_ok=True)
        try:
            output.write_bytes(await self._read(HARNESS_LOG))
        except Exception as error:  # noqa: BLE001 - a missing log must not hide the run's own outcome
            output.write_text(f"(no harness output: {type(error).__name__}: {error})\n")
