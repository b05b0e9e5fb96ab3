"""What every part of the benchmark shares: paths, the run plans, the processes it starts and watches (a `Service`
with its process tree's RSS and CPU time), the request bodies, and the percentile every table uses."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ENGINE_URL = os.environ.get("POLAR_MITM_ENGINE_URL", "http://127.0.0.1:8011/v1").rstrip("/")
STUB_MODEL = "qwen3-tiny-stub"
CONFIGS = ("direct", "gateway", "mitmproxy", "litellm")
PROXIES = ("gateway", "mitmproxy", "litellm", "baseline")
# what the stub's fixed reply contains; a reply without it is counted as an error
REPLY_MARKER = b"run_shell_command"


@dataclass
class Plan:
    rounds: int
    requests: dict[int, int]  # concurrency -> requests per configuration per round
    batch_cap_s: float  # ...or fewer, when a configuration takes longer than this for them
    throughput_rounds: int
    throughput_seconds: float
    rss_seconds: float
    ingest_seconds: float
    engine_pairs: int


QUICK = Plan(rounds=3, requests={1: 8, 8: 24, 32: 64}, batch_cap_s=2.5, throughput_rounds=2, throughput_seconds=2.5, rss_seconds=2.0, ingest_seconds=6.0, engine_pairs=2)
FULL = Plan(rounds=8, requests={1: 50, 8: 48, 32: 128}, batch_cap_s=20.0, throughput_rounds=3, throughput_seconds=6.0, rss_seconds=5.0, ingest_seconds=20.0, engine_pairs=4)


# -- processes ---------------------------------------------------------------------------------------------


def flags_and_env(tokens: list[str]) -> tuple[list[str], dict[str, str]]:
    """A --set variant's FLAGS: command-line flags, and VAR=VALUE tokens as its environment (PYTHONPATH=DIR runs
    another source tree's polar_mitm; LD_PRELOAD=... another allocator)."""
    is_env = re.compile(r"[A-Z][A-Z0-9_]*=").match
    return [token for token in tokens if not is_env(token)], dict(token.split("=", 1) for token in tokens if is_env(token))


def raise_fd_limit() -> int:
    """Raise the file-descriptor limit to its hard limit (services started later inherit it); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Service:
    name: str
    port: int
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    process: subprocess.Popen | None = None

    def start(self) -> Service:
        env = {**os.environ, **self.env}
        for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(key, None)
        self.process = subprocess.Popen(self.command, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.cwd)
        return self

    def wait(self, timeout: float, ready: Any = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            if listening(self.port) and (ready is None or ready()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not come up in {timeout:g}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def rss_mb(self) -> float:
        """Resident memory of the service and its children."""
        return sum(_rss_kb(pid) for pid in process_tree(self.process.pid)) / 1024 if self.process else 0.0

    def cpu_s(self) -> float:
        """CPU time (user + system, all threads) used so far by the service and its children."""
        return sum(_cpu_s(pid) for pid in process_tree(self.process.pid)) if self.process else 0.0

    def own_cpu_s(self) -> float:
        """CPU time used so far by the service's own process, without its children."""
        return _cpu_s(self.process.pid) if self.process else 0.0


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def load_requests() -> list[dict[str, Any]]:
    specs = []
    for path in sorted((BENCH / "requests").glob("*.json"), key=lambda p: -p.stat().st_size):
        spec = json.loads(path.read_text())
        spec["file"] = path.name
        specs.append(spec)
    return specs


def check_alive(services: dict[str, Service]) -> None:
    """Raise with its log's tail if a service died during a run (its figures would be of a dead process)."""
    for service in services.values():
        if service.process and service.process.poll() is not None:
            raise RuntimeError(f"{service.name} died during the run:\n{service.log.read_text()[-2000:]}")


def stop_all(services: dict[str, Service]) -> None:
    """Stop every service, the last started first."""
    for service in reversed(list(services.values())):
        service.stop()
