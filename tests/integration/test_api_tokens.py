"""Who may drive polar-mitm's servers and write into a session, with real processes.

- Beyond loopback, `polar-mitm gateway` and `polar-mitm rollout serve` (and mitmdump with the addon) refuse to start
  without a bearer token, in one line; with one, every call to /control/*, /ui and the rollout API needs it. They
  bind 0.0.0.0 here, and are only ever reached at 127.0.0.1 (the tests send nothing to another address).
- A session's proxy credentials write into that session only, whatever the request names (require_auth, as every
  rollout node's gateway runs: rollout/node.py NODE_OPTIONS); missing or wrong ones get a 407 in the provider's
  error shape, and no row: a refused request names no session to record it under.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from polar_mitm import api_auth, session
from polar_mitm.client import GatewayControl, RolloutClient
from polar_mitm.errors import ServerRefused
from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.rollout.node import GatewayNode, NodeConfig
from polar_mitm.util import free_port
from tests.support.processes import stop_process_group

pytestmark = pytest.mark.engine
TOKEN = "t0ken-" + "x" * 26
CHAT = {"model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (api_auth.ROLLOUT_TOKEN_ENV, api_auth.GATEWAY_TOKEN_ENV)}
    return {**env, **extra}


def test_servers_refuse_to_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    mitmdump = Path(sys.executable).with_name("mitmdump")
    addon = Path(__file__).resolve().parents[2] / "addons" / "polar.py"
    commands = {
        "rollout serve": [sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9/v1", "--db", "r.duckdb"],
        "gateway": [sys.executable, "-m", "polar_mitm.cli", "gateway", "--host", "0.0.0.0", "--port", str(free_port()), "--upstream", "http://127.0.0.1:9/v1", "--db", "g.duckdb"],
    }
    for name, command in commands.items():
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean_env(), cwd=tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "beyond loopback" in lines[0] and "--" in lines[0], (name, done)
    # mitmdump listens on every interface unless told otherwise: the addon stops it before its store is opened
    dump = subprocess.run([str(mitmdump), "-p", str(free_port()), "--set", f"confdir={tmp_path / 'conf'}", "-s", str(addon), "--set", "polar_upstream=http://127.0.0.1:9/v1", "--set", "polar_db=d.duckdb"],
                          capture_output=True, text=True, timeout=60, env=clean_env(), cwd=tmp_path)
    assert dump.returncode == 1 and "beyond loopback, without a bearer token" in dump.stdout + dump.stderr, dump
    assert not list(tmp_path.glob("*.duckdb")), "nothing is opened before the refusal"


def test_a_gateway_beyond_loopback_takes_its_token_from_the_environment(make_gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(api_auth.GATEWAY_TOKEN_ENV, TOKEN)  # the gateway process inherits it
    gateway = make_gateway("--host", "0.0.0.0")
    url = gateway.proxy_url()  # 127.0.0.1: the test reaches the 0.0.0.0 listener on loopback only
    with httpx.Client(trust_env=False) as raw:
        for path in ("/control/status", "/ui/"):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                refused = raw.get(url + path, headers=headers)
                assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized", (path, refused.text)
        # past the token, the dashboard is still served on loopback only (polar_mitm/ui/gateway.py)
        assert raw.get(url + "/ui/", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 403
    with pytest.raises(ServerRefused) as refused:
        GatewayControl(url).status()
    assert refused.value.status == 401
    control = GatewayControl(url, token=TOKEN)
    assert control.pause()["state"] == "paused" and control.resume(policy_version=1)["policy_version"] == 1
    cli = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "control", "status", "--gateway", url], capture_output=True, text=True, timeout=60, env=clean_env(POLAR_MITM_CONTROL_TOKEN=TOKEN))
    assert cli.returncode == 0 and json.loads(cli.stdout)["policy_version"] == 1, cli
    # model calls go on as before
    with httpx.Client(proxy=gateway.proxy_url("tokens"), verify=gateway.ssl_context(), trust_env=False, timeout=60) as client:
        assert client.post("https://api.openai.com/v1/chat/completions", json=CHAT).status_code == 200
    assert TOKEN not in gateway.log.read_text()


def test_rollout_serve_beyond_loopback_needs_its_token(engine_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--host", "0.0.0.0", "--port", str(port), "--upstream", engine_url,
               "--db", str(tmp_path / "store.duckdb"), "--confdir", str(tmp_path / "confdir"), "-v"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=clean_env(POLAR_MITM_API_TOKEN=TOKEN))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 401:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        with httpx.Client(base_url=url, trust_env=False) as raw:
            for path in ("/tasks", "/ui/", "/control/status", "/docs"):
                assert raw.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401, path
        with RolloutClient(url, token=TOKEN) as client:
            assert client.health()["status"] == "ok"
            assert list(client.control("status")["nodes"].values())[0]["state"] == "serving"
        listed = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "rollout", "list", "--json", "--server", url, "--api-token", TOKEN], capture_output=True, text=True, timeout=60, env=clean_env())
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed
    finally:
        stop_process_group(process, grace=30)
    assert TOKEN not in log.read_text()
    assert "bearer token required" in log.read_text()


def test_a_rollout_nodes_gateway_always_requires_session_credentials(tmp_path: Path) -> None:
    config = NodeConfig(gateway=GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp_path / "n.duckdb", confdir=str(tmp_path / "conf"), require_auth=False, host="0.0.0.0"))
    gateway = GatewayNode(config).gateway.config
    assert (gateway.require_auth, gateway.host) == (True, "127.0.0.1")


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_a_sessions_credentials_write_into_that_session_only(make_gateway) -> None:
    gateway = make_gateway("--require-auth")
    secret = session.load_secret(gateway.confdir)
    token_a, token_b = session.session_token(secret, "sandbox-a"), session.session_token(secret, "sandbox-b")

    def call(proxy: str, **request: object) -> httpx.Response:
        with httpx.Client(proxy=proxy, verify=gateway.ssl_context(), trust_env=False, timeout=60) as client:
            return client.post("https://api.openai.com/v1/chat/completions", **request)

    # A's credentials, and a request that names B every way a client could: each lands in A
    named_b = {**CHAT, "user": "sandbox-b", "metadata": {"session_id": "sandbox-b"}}
    headers = {"x-polar-session-id": "sandbox-b", "x-session-id": "sandbox-b", "proxy-authorization": _basic("sandbox-b", token_b)}
    answer = call(gateway.proxy_url("sandbox-a"), json=named_b, headers=headers)
    assert answer.status_code == 200 and answer.headers["x-polar-session-id"] == "sandbox-a", answer.text

    # another session's id with A's token, no credentials, a wrong token: refused before any exchange
    for proxy in (f"http://sandbox-b:{token_a}@127.0.0.1:{gateway.port}", gateway.proxy_url(), f"http://sandbox-a:{'0' * 32}@127.0.0.1:{gateway.port}"):
        with pytest.raises(httpx.ProxyError, match="407"):
            call(proxy, json=CHAT)
    # the same over plain HTTP (no CONNECT): the 407 comes with a body in the provider's error shape
    with httpx.Client(proxy=gateway.proxy_url(), trust_env=False, timeout=60) as plain:
        for credentials in (None, _basic("sandbox-b", token_a)):
            refused = plain.post("http://api.openai.com/v1/chat/completions", json=CHAT, headers={"proxy-authorization": credentials} if credentials else {})
            assert refused.status_code == 407, refused.text
            assert refused.json()["error"]["type"] == "proxy_authentication_required" and refused.json()["error"]["message"]

    rows = gateway.rows("SELECT session_id, status FROM exchanges")
    assert rows == [{"session_id": "sandbox-a", "status": "ok"}], rows
