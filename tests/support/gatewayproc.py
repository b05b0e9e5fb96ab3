"""Start a real `polar-mitm gateway` process for tests, and talk to it the way harnesses do."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm import routing, session, store


@dataclass
class Gateway:
    port: int
    db: Path
    confdir: Path
    upstream: str
    args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    log: Path | None = None
    cwd: Path | None = None  # run the gateway here, with --db relative to it (as a user typing `--db run.duckdb`)

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_cert))

    def proxy_url(self, session_id: str | None = None, token: str | None = None) -> str:
        if session_id is None:
            return f"http://127.0.0.1:{self.port}"
        if token is None:
            token = session.session_token(session.load_secret(self.confdir), session_id)
        return f"http://{session_id}:{token}@127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> Gateway:
        self.log = self.db.with_suffix(".gateway.log")
        db = os.path.relpath(self.db, self.cwd) if self.cwd is not None else str(self.db)
        # POLAR_MITM_STORE_PROCESS=1: every gateway the tests start runs its store in a process of its own
        extra = ["--store-process"] if os.environ.get("POLAR_MITM_STORE_PROCESS") == "1" and "--store-process" not in self.args else []
        command = [sys.executable, "-m", "polar_mitm.cli", "gateway", "--port", str(self.port), "--upstream", self.upstream, "--db", db, "--confdir", str(self.confdir), "-v", *self.args, *extra]
        self.process = subprocess.Popen(command, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.ca_cert.exists() and _serves_store(self.db, self.process.pid) and listening(self.port) and _announced(self.confdir, self.process.pid):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"gateway did not come up:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=30)

    def start_line(self) -> str:
        """The one line a start prints without -v: where it listens, its store, engine and render mode."""
        assert self.log is not None
        [line] = [line for line in self.log.read_text().splitlines() if line.startswith("polar-mitm gateway: listening on")]
        return line

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        return store.query_dicts(self.db, sql, params)

    def exchanges(self, session_id: str) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM exchanges WHERE session_id = ? ORDER BY seq", [session_id])


def _serves_store(db: Path, pid: int) -> bool:
    """The store is open by this gateway: its control file names it (a file left by a gateway killed before is not)."""
    return (store.live_holder(db) or {}).get("pid") == pid


def _announced(confdir: Path, pid: int) -> bool:
    """The gateway listed itself in its confdir's gateway file (its last start-up step; `polar-mitm run` reads it)."""
    return any(entry.get("pid") == pid for entry in routing.live_gateways(confdir).values())


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# env vars that would point an SDK somewhere else than the provider's default host
_BASE_URL_VARS = ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "GOOGLE_GEMINI_BASE_URL", "GEMINI_BASE_URL", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy")


@contextmanager
def environ(set_: dict[str, str], unset: tuple[str, ...] = ()) -> Iterator[None]:
    """Change os.environ for a block, then put back exactly what was there."""
    saved = {key: os.environ.get(key) for key in (*set_, *unset)}
    try:
        for key in unset:
            os.environ.pop(key, None)
        os.environ.update(set_)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def proxy_env(gateway: Gateway, session_id: str):
    """What a user sets for a harness: HTTPS_PROXY and the mitmproxy CA, no base-URL change."""
    url = gateway.proxy_url(session_id)
    ca = str(gateway.ca_cert)
    return environ({"HTTPS_PROXY": url, "https_proxy": url, "SSL_CERT_FILE": ca, "REQUESTS_CA_BUNDLE": ca}, unset=(*_BASE_URL_VARS, "HTTP_PROXY", "http_proxy"))
