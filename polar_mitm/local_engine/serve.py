"""Run a real vLLM server on this machine as the upstream for tests and the demo.

    with LocalEngine() as base_url:      # http://127.0.0.1:8011/v1
        ...

An engine outlives the process that started it (the CLI's `engine start` returns at once), so each one is
recorded in `<home>/engine-<port>.json`; `start()` reuses a live engine serving the same model there, and
`stop()` ends whichever engine the record names.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from polar_mitm.errors import LocalEngineError
from polar_mitm.local_engine import build

HOST = "127.0.0.1"
DEFAULT_PORT = 8011


EngineError = LocalEngineError  # the name this module's callers import


@dataclass
class EngineRecord:
    pid: int
    url: str
    model: str
    log: str


@dataclass
class StoppedEngine:
    """What `LocalEngine.stop()` ended: the group leader's pid, its URL and model, and the group's size and resident
    memory just before the stop (RSS summed over its processes; shared pages count once per process)."""

    pid: int
    url: str
    model: str
    processes: int
    resident_bytes: int

    def describe(self) -> str:
        return (
            f"stopped {self.model} at {self.url} (pid {self.pid}; {self.processes} process{'es' if self.processes != 1 else ''}, "
            f"{self.resident_bytes / 2**30:.1f} GiB resident before the stop)"
        )


class LocalEngine:
    def __init__(
        self, model: str = build.DEFAULT_MODEL, port: int = DEFAULT_PORT, home: str | os.PathLike | None = None,
        max_model_len: int | None = None, lora_rank: int = 0, max_loras: int = 2,
    ):
        if model not in build.MAX_MODEL_LEN:
            raise EngineError(f"unknown model {model!r}; choose one of {', '.join(build.MAX_MODEL_LEN)}")
        if max_model_len is not None and not 0 < max_model_len <= build.MAX_MODEL_LEN[model]:
            raise EngineError(f"--max-model-len must be between 1 and {build.MAX_MODEL_LEN[model]} for {model}")
        self.model = model
        # the context the engine is served with; a smaller one than the model's is what GPU deployments often run
        self.max_model_len = max_model_len or build.MAX_MODEL_LEN[model]
        self.port = port
        # > 0: serve LoRA adapters loaded at runtime (POST /v1/load_lora_adapter): how a trainer syncs weights here
        self.lora_rank = lora_rank
        self.max_loras = max_loras
        self.home = build.engine_home(home)
        self.base_url = f"http://{HOST}:{port}/v1"
        self.log_file = self.home / "logs" / f"engine-{port}.log"
        self.record_file = self.home / f"engine-{port}.json"
        # True only when this object spawned the engine: context-manager exit then stops it.
        self.started_here = False
        self._process: subprocess.Popen | None = None

    def build(self) -> Path:
        """Build the venv and this model if needed; returns the model directory."""
        return build.build_model(self.home, self.model)

    def start(self, timeout: float = 600.0) -> str:
        """Start (or reuse) the engine and return its OpenAI base URL once it answers."""
        model_path = self.build()
        deadline = time.monotonic() + timeout
        with build.file_lock(self.home / f"engine-{self.port}.lock"):
            record = self._live_record()
            if record is not None:
                if record.model != self.model:
                    raise EngineError(
                        f"port {self.port} already serves {record.model!r} (pid {record.pid}); "
                        f"run `polar-mitm engine stop --port {self.port}` first"
                    )
                self._wait_until_ready(record.pid, deadline)
                return self.base_url
            if _port_in_use(self.port):
                raise EngineError(f"port {self.port} on {HOST} is taken by something that is not our engine")
            self._spawn(model_path)
            try:
                self._wait_until_ready(self._process.pid, deadline)
                self._warm_up()
            except BaseException:
                self.stop()
                raise
        return self.base_url

    def command(self, model_path: Path) -> list[str]:
        return [
            str(build.venv_dir(self.home) / "bin" / "vllm"), "serve", str(model_path),
            "--host", HOST,
            "--port", str(self.port),
            "--served-model-name", self.model,
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",  # start-up ~25 s instead of ~100 s of torch.compile
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            "--enable-scale-out",  # /inference/v1/generate and /v1/chat/completions/render
            *(["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--max-loras", str(self.max_loras)] if self.lora_rank else []),
        ]

    def _spawn(self, model_path: Path) -> None:
        command = self.command(model_path)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            # Own session: stop() can kill vLLM's API server and engine-core processes as one group.
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self._environment(), cwd=self.home, start_new_session=True,
            )
        self.started_here = True
        record = EngineRecord(pid=self._process.pid, url=self.base_url, model=self.model, log=str(self.log_file))
        self.record_file.write_text(json.dumps(asdict(record), indent=2) + "\n")

    def _environment(self) -> dict[str, str]:
        env = build.engine_python_env()
        scratch = self.home / "scratch"
        for sub in ("vllm", "inductor", "tmp"):
            (scratch / sub).mkdir(parents=True, exist_ok=True)
        env.update(
            PATH=f"{build.venv_dir(self.home) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; tiny models need little, and RAM is shared
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(scratch / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
            TMPDIR=str(scratch / "tmp"),
        )
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def _wait_until_ready(self, pid: int, deadline: float) -> None:
        while True:
            if not self._alive(pid):
                raise EngineError(f"the engine exited during start-up; log {self.log_file}:\n{self._log_tail()}")
            try:
                if _get(f"{self.base_url}/models").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"the engine did not answer within the timeout; log {self.log_file}:\n{self._log_tail()}")
            time.sleep(0.5)

    def _warm_up(self) -> None:
        # The first request after start-up is slow (1-9 s); pay that here, not in a caller's timed test.
        request = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        httpx.post(f"{self.base_url}/chat/completions", json=request, timeout=120, trust_env=False).raise_for_status()

    def stop(self, timeout: float = 30.0) -> StoppedEngine | None:
        """Stop the engine recorded for this port (whoever started it) and wait until it is gone.

        Returns what was stopped, or None when no engine was alive there (a stale record is removed either way)."""
        record = self._read_record()
        pid = self._process.pid if self._process else record.pid if record else None
        stopped = None
        if pid is not None and self._alive(pid):
            processes = _group_members(pid)
            stopped = StoppedEngine(
                pid=pid, url=record.url if record else self.base_url, model=record.model if record else self.model,
                processes=len(processes), resident_bytes=sum(_resident_bytes(member) for member in processes),
            )
            # The engine leads its own process group (setsid): signal vLLM's API server and its
            # engine-core workers together, and wait for all of them, not just the leader.
            _signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self._group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            _signal_group(pid, signal.SIGKILL)
            while self._group_alive(pid):
                time.sleep(0.1)
        self.record_file.unlink(missing_ok=True)
        self._process = None
        self.started_here = False
        return stopped

    def running(self) -> bool:
        """Whether an engine for this port is alive and answering."""
        record = self._live_record()
        if record is None:
            return False
        try:
            return _get(f"{self.base_url}/models").status_code == 200
        except httpx.TransportError:
            return False

    def status(self) -> EngineRecord | None:
        return self._live_record()

    def left_running(self) -> str | None:
        """The line a command that used this engine prints on exit when the engine stays up for the next run (kept
        on purpose: it starts in ~25 s and holds GBs): what it is, what it holds, and how to end it. None when no
        engine is alive on this port."""
        record = self._live_record()
        if record is None:
            return None
        processes = _group_members(record.pid)
        resident = sum(_resident_bytes(member) for member in processes) / 2**30
        stop = "polar-mitm engine stop" + ("" if self.port == DEFAULT_PORT else f" --port {self.port}")
        return (
            f"the local engine is still running for the next run: {record.model} at {record.url} (pid {record.pid}; "
            f"{len(processes)} process{'es' if len(processes) != 1 else ''}, {resident:.1f} GiB resident); `{stop}` ends it"
        )

    def wait(self) -> int:
        """Block until an engine started here exits (for `engine start --foreground`)."""
        if self._process is None:
            raise EngineError("wait() needs an engine started by this process")
        return self._process.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        if self.started_here:
            self.stop()

    def _read_record(self) -> EngineRecord | None:
        try:
            return EngineRecord(**json.loads(self.record_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def _live_record(self) -> EngineRecord | None:
        record = self._read_record()
        if record is not None and self._alive(record.pid):
            return record
        return None

    def _alive(self, pid: int) -> bool:
        if self._process is not None and self._process.pid == pid:
            return self._process.poll() is None  # also reaps our own child
        return _is_vllm_process(pid)

    def _group_alive(self, pgid: int) -> bool:
        if self._process is not None:
            self._process.poll()  # reap our own child, or its zombie keeps the group alive
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "".join(self.log_file.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except FileNotFoundError:
            return ""


def _get(url: str) -> httpx.Response:
    # trust_env=False: a proxy configured for the gateway under test must not sit between us and vLLM.
    return httpx.get(url, timeout=2, trust_env=False)


def _is_vllm_process(pid: int) -> bool:
    """Alive and still vLLM: a recorded pid may have been reused by an unrelated process since."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        # "pid (comm) S ...": the state letter follows the last ')', since comm may contain spaces.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return b"vllm" in cmdline and state != "Z"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid` (the engine's API server and its engine-core workers)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _resident_bytes(pid: int) -> int:
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((HOST, port)) == 0
