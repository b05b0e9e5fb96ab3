"""Capture without proxy settings (polar_mitm/capture.py): a client that ignores HTTPS_PROXY, Node's own fetch(), runs
through `polar-mitm run --capture transparent` (the console script, from its own folder with relative paths) against a
real gateway listening in mitmproxy's transparent mode, and through the rollout server with `runtime.capture:
transparent`. Its calls are served by the real engine and recorded under the session, with nothing but the gateway's
CA trusted. The same client in a namespace without the gateway's route fails locally: the namespace's only way out is
the gateway, so no packet of a failed capture leaves the machine. Needs root, iproute2 and iptables (skipped without).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm import capture
from polar_mitm.harnesses import node_bin_dir
from polar_mitm.util import free_port

POLAR_MITM = str(Path(sys.executable).with_name("polar-mitm"))
REPO = Path(__file__).resolve().parents[2]

# what an agent that builds its own HTTP client does: fetch() ignores HTTPS_PROXY (Node without NODE_USE_ENV_PROXY)
# and trusts NODE_EXTRA_CA_CERTS; one JSON call and one streamed call, to the provider's own host
CLIENT = """
const call = (stream) => fetch("https://api.openai.com/v1/chat/completions", {
  method: "POST", headers: {"content-type": "application/json", authorization: "Bearer sk-test"},
  body: JSON.stringify({model: "gpt-4o-mini", messages: [{role: "user", content: "Say hi"}], max_tokens: 6, stream}),
});
const plain = await call(false);
const reply = await plain.json();
const streamed = await (await call(true)).text();
console.log(JSON.stringify({status: plain.status, content: reply.choices[0].message.content, done: streamed.trim().endsWith("data: [DONE]")}));
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"), reason="transparent capture needs root, iproute2 and iptables")


def node() -> str:
    found = node_bin_dir()
    if found is None:
        pytest.skip("no node >= 22 (scripts/setup.sh installs one)")
    return str(found / "node")


def leftovers(confdir: Path) -> list[str]:
    """Whatever a capture namespace leaves once closed: its namespace, rules, registrations."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    rules = "".join(subprocess.run(["iptables", "-w", "-t", t, "-S", c], capture_output=True, text=True).stdout for t, c in capture.RULE_CHAINS)
    registered = [p.name for p in (confdir / capture.CAPTURE_DIR).glob("*.json")]
    return [line for line in (namespaces + rules).splitlines() if "polar-cap-" in line] + registered


@pytest.fixture(scope="module", autouse=True)
def namespaces_can_be_made(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A machine that refuses namespaces or iptables' nat table (no CAP_NET_ADMIN) skips, saying why."""
    try:
        capture.open_namespace(tmp_path_factory.mktemp("probe"), "probe", listener=("127.0.0.1", 9)).close()
    except capture.CaptureError as error:
        pytest.skip(str(error))


@pytest.fixture
def transparent_gateway(make_gateway):
    return make_gateway("--transparent-port", str(free_port()))


def test_a_client_that_ignores_the_proxy_is_captured_and_recorded(transparent_gateway, session_id: str, tmp_path: Path) -> None:
    gw = transparent_gateway
    (tmp_path / "client.mjs").write_text(CLIENT)
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    done = subprocess.run(
        [POLAR_MITM, "run", "--capture", "transparent", "--confdir", os.path.relpath(gw.confdir, tmp_path), "--gateway", gw.proxy_url(),
         "--session", session_id, "--", node(), "client.mjs"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "captured transparently in network namespace polar-cap-" in done.stderr, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["status"] == 200 and said["done"], said
    rows = gw.exchanges(session_id)
    assert [(r["api"], r["stream"], r["status"]) for r in rows] == [("openai_chat", False, "ok"), ("openai_chat", True, "ok")], rows
    assert json.loads(rows[0]["response_body"])["choices"][0]["message"]["content"] == said["content"]
    for row in rows:  # the engine's own token ids, and the harness's request as it sent it
        engine = json.loads(row["engine_response"])
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert json.loads(row["engine_request"])["max_tokens"] == 6
    assert leftovers(gw.confdir) == []


def test_the_same_client_without_the_gateway_route_fails_locally(transparent_gateway, session_id: str, tmp_path: Path) -> None:
    """A namespace made the same way, but with no route to the gateway: the call is refused inside the machine."""
    gw = transparent_gateway
    (tmp_path / "client.mjs").write_text(CLIENT)
    namespace = capture.open_namespace(gw.confdir, session_id, listener=None)
    try:
        from polar_mitm.routing import capture_environment

        env = capture_environment(session_id, gw.confdir)
        done = subprocess.run(namespace.command([node(), "client.mjs"]), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    finally:
        namespace.close()
    assert done.returncode != 0 and "ECONNREFUSED" in done.stderr and capture.UNROUTED in done.stderr, done.stderr
    assert gw.exchanges(session_id) == []
    assert leftovers(gw.confdir) == []


def test_a_gateway_without_a_transparent_listener_is_refused_with_the_reason(make_gateway, tmp_path: Path) -> None:
    gw = make_gateway()
    done = subprocess.run(
        [POLAR_MITM, "run", "--capture", "transparent", "--confdir", str(gw.confdir), "--gateway", gw.proxy_url(), "--", "true"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "no transparent listener: start it with --transparent-port" in done.stderr, done.stderr
    assert leftovers(gw.confdir) == []


def test_the_rollout_server_local_runtime_captures_its_harness_transparently(transparent_gateway, session_id: str) -> None:
    """`runtime.capture: transparent` on the local backend: the harness process runs in the sandbox's namespace with
    no proxy settings; destroying the sandbox removes the namespace."""
    import asyncio

    from polar_mitm.rollout import runtimes
    from polar_mitm.rollout.models import Runtime

    gw = transparent_gateway
    spec = runtimes.SandboxSpec(session_id, Runtime(backend="local", capture="transparent"), runtimes.GatewayAccess(url=gw.proxy_url(), confdir=gw.confdir))

    async def run() -> tuple[int, str, dict[str, str]]:
        sandbox = await runtimes.create(spec)
        try:
            (Path(sandbox.workdir) / "client.mjs").write_text(CLIENT)
            env = sandbox.proxy_environment({"PATH": os.environ["PATH"], "HOME": sandbox.home})
            output = Path(sandbox.home) / "harness.log"
            code = await sandbox.run_harness([node(), "client.mjs"], env, 120, output)
            return code, output.read_text(), env
        finally:
            await sandbox.destroy()

    code, output, env = asyncio.run(run())
    assert code == 0, output
    assert not any(key.upper().endswith("_PROXY") for key in env) and env["NODE_EXTRA_CA_CERTS"], env
    assert json.loads(output.strip().splitlines()[-1])["status"] == 200, output
    assert [r["status"] for r in gw.exchanges(session_id)] == ["ok", "ok"]
    assert leftovers(gw.confdir) == []

