"""Starting what is measured: the stand-in upstream (bench/stub_upstream.py), `polar-mitm gateway`, `mitmdump`,
LiteLLM's proxy (in a cached venv of its own), optionally a baseline source tree's gateway; the `Target` for each."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench.client import Target
from bench.common import BENCH, ENGINE_URL, ROOT, STUB_MODEL, Service, free_port

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "polar-mitm"
LITELLM_VENV = CACHE / "bench-litellm"
LITELLM_SPEC = "litellm[proxy]==1.108.7"
# LiteLLM refuses to start without a master key; a fresh one per run, checked on every request as in production
LITELLM_KEY = "sk-bench-" + os.urandom(16).hex()


def ensure_litellm() -> Path:
    """LiteLLM lives in its own venv (cached), so the project's venv stays clean."""
    litellm = LITELLM_VENV / "bin" / "litellm"
    marker = LITELLM_VENV / "bench-spec.txt"
    if litellm.exists() and marker.exists() and marker.read_text().strip() == LITELLM_SPEC:
        return litellm
    print(f"installing {LITELLM_SPEC} into {LITELLM_VENV} (once; cached)...", flush=True)
    shutil.rmtree(LITELLM_VENV, ignore_errors=True)
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base_python, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_SPEC], check=True)
    marker.write_text(LITELLM_SPEC + "\n")
    return litellm


def engine_reachable() -> bool:
    try:
        with urllib.request.urlopen(ENGINE_URL + "/models", timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def start_services(services: dict[str, Service], tmp: Path, stub_delay_ms: float, with_litellm: bool, baseline: Path | None = None) -> None:
    """Start every service into `services` as it goes, so the caller stops them all even if one fails to come up."""
    python = sys.executable
    confdir = tmp / "confdir"
    stub_port, gateway_port, mitm_port, litellm_port = (free_port() for _ in range(4))
    stub_base = f"http://127.0.0.1:{stub_port}/v1"
    services.update({
        "stub": Service("stub", stub_port, [python, str(BENCH / "stub_upstream.py"), "--port", str(stub_port), "--delay-ms", str(stub_delay_ms)], tmp / "stub.log"),
        "gateway": Service(
            "gateway", gateway_port,
            [python, "-m", "polar_mitm.cli", "gateway", "--port", str(gateway_port), "--upstream", stub_base, "--db", str(tmp / "gateway.duckdb"),
             "--confdir", str(confdir), "--engine-model", STUB_MODEL, "--require-auth"],
            tmp / "gateway.log",
        ),
    })
    mitmdump = Path(python).parent / "mitmdump"
    services["mitmproxy"] = Service(
        "mitmproxy", mitm_port,
        [str(mitmdump) if mitmdump.exists() else "mitmdump", "--mode", f"reverse:http://127.0.0.1:{stub_port}@{mitm_port}", "--set", f"confdir={confdir}", "-q"],
        tmp / "mitmdump.log",
    )
    if with_litellm:
        services["litellm"] = Service(
            "litellm", litellm_port,
            [str(ensure_litellm()), "--config", str(BENCH / "litellm_config.yaml"), "--host", "127.0.0.1", "--port", str(litellm_port), "--num_workers", "1"],
            tmp / "litellm.log",
            env={"BENCH_UPSTREAM_BASE": stub_base, "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"},
        )
    services["stub"].start().wait(30)
    services["gateway"].start().wait(60, ready=lambda: (confdir / "mitmproxy-ca-cert.pem").exists() and (tmp / "gateway.duckdb.control.json").exists())
    if baseline is not None:
        # another polar_mitm source tree (e.g. `git archive` of an older commit), same venv: `-m` imports it from
        # its cwd
        port = free_port()
        command = [python, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", stub_base, "--db", str(tmp / "baseline.duckdb"),
                   "--confdir", str(confdir), "--engine-model", STUB_MODEL, "--require-auth"]
        services["baseline"] = Service("baseline", port, command, tmp / "baseline.log", cwd=baseline).start()
        services["baseline"].wait(60, ready=lambda: (tmp / "baseline.duckdb.control.json").exists())
    for name in ("mitmproxy", "litellm"):
        if name in services:
            services[name].start()
    services["mitmproxy"].wait(60)
    if "litellm" in services:
        services["litellm"].wait(180, ready=lambda: _http_ok(litellm_port, "/health/liveliness"))


def stub_requests(port: int) -> int:
    """How many completions the stand-in upstream answered (each configuration really reached it)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as response:
        return int(json.loads(response.read())["requests"])


def _http_ok(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def make_targets(services: dict[str, Service], tmp: Path) -> dict[str, Target]:
    sys.path.insert(0, str(ROOT))
    from polar_mitm import session

    ca = tmp / "confdir" / "mitmproxy-ca-cert.pem"
    context = ssl.create_default_context(cafile=str(ca))
    secret = session.load_secret(tmp / "confdir")

    def credentials(index: int) -> tuple[str, str]:
        user = f"bench-{index}"
        return user, session.session_token(secret, user)

    targets = {
        "direct": Target("direct", services["stub"].port, "plain"),
        "gateway": Target("gateway", services["gateway"].port, "connect", context, provider_paths=True, credentials=credentials),
        "mitmproxy": Target("mitmproxy", services["mitmproxy"].port, "tls", context),
    }
    if "litellm" in services:
        targets["litellm"] = Target("litellm", services["litellm"].port, "plain", api_key=LITELLM_KEY)
    if "baseline" in services:
        targets["baseline"] = Target("baseline", services["baseline"].port, "connect", context, provider_paths=True, credentials=credentials)
    if "engine-gateway" in services:
        engine_port = int(ENGINE_URL.split(":")[-1].split("/")[0])
        targets["engine-direct"] = Target("engine-direct", engine_port, "plain", model="qwen3-tiny", max_tokens=8)
        targets["engine-gateway"] = Target("engine-gateway", services["engine-gateway"].port, "connect", context, provider_paths=True, max_tokens=8, credentials=credentials)
    return targets
