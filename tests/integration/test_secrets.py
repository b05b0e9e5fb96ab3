"""Provider API keys never reach anything polar-mitm keeps: the store (its journals and segments), its snapshot's
Parquet files (what a Ray head reads), the gateway's log, an assembled Parquet export, or mitmproxy's saved flows.

A real gateway (mitmdump with the addon script, as users run it, its flow saving on and its log at the most detail)
in front of the real engine gets calls on all four APIs, each carrying a key in a spelling its provider takes
(`Authorization: Bearer`, `x-api-key`, `api-key`, `x-goog-api-key`, `?key=`), and keys in bodies: the header's key
pasted into a message, a body field named `api_key`, a key no header names pasted into a message. Then every
artifact is searched for each key, byte for byte and decoded (DuckDB and Parquet compress their strings).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pyarrow.parquet as pq
import pytest
from mitmproxy import io as flow_io

from polar_mitm import harnesses, session, store
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway

pytestmark = pytest.mark.engine
MITMDUMP = Path(sys.executable).with_name("mitmdump")
ADDON = Path(__file__).resolve().parents[2] / "addons" / "polar.py"


def key(prefix: str, length: int) -> str:
    """A fresh key in a provider's shape: mixed case and digits, as real ones are."""
    alphabet = string.ascii_letters + string.digits
    return prefix + "Ab1" + "".join(secrets.choice(alphabet) for _ in range(length - 3))


KEYS = {
    "openai_bearer": key("sk-proj-", 48),
    "anthropic_x_api_key": key("sk-ant-api03-", 90),
    "gemini_query_key": key("AIza", 35),
    "gemini_x_goog_api_key": key("AIza", 35),
    "azure_api_key": secrets.token_hex(16),  # Azure's shape: 32 hex digits, nothing like a key but for its header
    "body_api_key_field": "bodykey-" + secrets.token_hex(12),  # only in a body field named api_key
    "pasted_unnamed": key("sk-", 48),  # only pasted into a message: no header or field names it
}


def calls(keys: dict[str, str]) -> list[tuple[str, str, dict[str, str], dict]]:
    """(host, path, headers, body) of each call: every API, streamed and not, every key spelling."""
    openai_key, anthropic_key = keys["openai_bearer"], keys["anthropic_x_api_key"]
    bearer = {"authorization": f"Bearer {openai_key}"}
    gemini_text = {"contents": [{"role": "user", "parts": [{"text": f"my key is {keys['gemini_query_key']} and {keys['gemini_x_goog_api_key']}"}]}], "generationConfig": {"maxOutputTokens": 2}}
    return [
        ("api.openai.com", "/v1/chat/completions", bearer,
         {"model": "gpt-4o", "max_tokens": 2, "api_key": keys["body_api_key_field"], "messages": [{"role": "user", "content": f"use {openai_key} and {keys['pasted_unnamed']}"}]}),
        ("api.openai.com", "/v1/chat/completions", {**bearer, "api-key": keys["azure_api_key"]},
         {"model": "gpt-4o", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": f"azure {keys['azure_api_key']}"}]}),
        ("api.openai.com", "/v1/responses", bearer,
         {"model": "gpt-4o", "max_output_tokens": 16, "input": f"the key {openai_key}", "metadata": {"api_key": keys["body_api_key_field"]}}),
        ("api.openai.com", "/v1/responses", bearer,
         {"model": "gpt-4o", "max_output_tokens": 16, "stream": True, "input": [{"role": "user", "content": f"pasted {keys['pasted_unnamed']}"}]}),
        ("api.anthropic.com", "/v1/messages", {"x-api-key": anthropic_key, "anthropic-version": "2023-06-01"},
         {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": f"my key: {anthropic_key}"}]}),
        ("api.anthropic.com", "/v1/messages", {"x-api-key": anthropic_key, "authorization": f"Bearer {anthropic_key}", "anthropic-version": "2023-06-01"},
         {"model": "claude-sonnet-4-5", "max_tokens": 2, "stream": True, "system": f"key {anthropic_key}", "messages": [{"role": "user", "content": "hi"}]}),
        ("generativelanguage.googleapis.com", f"/v1beta/models/gemini-2.5-pro:generateContent?key={keys['gemini_query_key']}", {}, gemini_text),
        ("generativelanguage.googleapis.com", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", {"x-goog-api-key": keys["gemini_x_goog_api_key"]}, gemini_text),
        # not a model call, answered by the gateway itself (a harness listing models with its key)
        ("api.openai.com", "/v1/models", bearer, {}),
    ]


def start_mitmdump(base: Path, engine_url: str) -> tuple[subprocess.Popen, Gateway, Path, Path]:
    port, db, confdir = free_port(), base / "store.duckdb", base / "confdir"
    flows, log = base / "flows.mitm", base / "gateway.log"
    command = [
        str(MITMDUMP), "--listen-host", "127.0.0.1", "-p", str(port), "--flow-detail", "4", "--set", f"confdir={confdir}",
        "--set", f"save_stream_file={flows}", "-s", str(ADDON), "--set", f"polar_upstream={engine_url}", "--set", f"polar_db={db}",
    ]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    gateway = Gateway(port=port, db=db, confdir=confdir, upstream=engine_url)
    deadline = time.monotonic() + 60
    while not (gateway.ca_cert.exists() and (store.live_holder(db) or {}).get("pid") == process.pid):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    return process, gateway, flows, log


def decoded_texts(path: Path) -> list[str]:
    """What a file holds, decoded the way its reader sees it (DuckDB and Parquet compress strings; flows are
    tnetstrings), so a key is found however it is stored."""
    if path.suffix == ".parquet":
        return [json.dumps(pq.read_table(path).to_pylist(), default=str)]
    if path.suffix == ".mitm":
        with path.open("rb") as handle:
            return [json.dumps(flow.get_state(), default=repr) for flow in flow_io.FlowReader(handle).stream()]
    if path.suffix == ".duckdb":
        with duckdb.connect(str(path), read_only=True) as con:
            tables = con.execute("SELECT schema_name, table_name FROM duckdb_tables()").fetchall()
            return [json.dumps(con.execute(f'SELECT * FROM "{schema}"."{table}"').fetchall(), default=str) for schema, table in tables]
    return []


def leaks(base: Path, keys: dict[str, str]) -> dict[str, list[str]]:
    """key name -> the files under `base` holding it (raw bytes, or decoded)."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in base.rglob("*") if p.is_file() and "confdir" not in p.parts):
        raw = path.read_bytes()
        texts = decoded_texts(path)
        for name, value in keys.items():
            if value.encode() in raw or any(value in text for text in texts):
                found.setdefault(name, []).append(str(path.relative_to(base)))
    return found


def test_no_key_in_the_store_log_export_or_saved_flows(engine_url: str, tmp_path: Path) -> None:
    process, gateway, flows, log = start_mitmdump(tmp_path, engine_url)
    answered, in_replies = [], {}
    try:
        with httpx.Client(proxy=gateway.proxy_url("secrets"), verify=gateway.ssl_context(), trust_env=False, timeout=120) as client:
            for host, path, headers, body in calls(KEYS):
                method = "POST" if body else "GET"
                reply = client.request(method, f"https://{host}{path}", headers={"content-type": "application/json", **headers}, content=json.dumps(body).encode() if body else None)
                answered.append((path.split("?")[0], reply.status_code))
                # nothing the harness gets back names a key either (the Responses API echoes `metadata`, say)
                for name, value in KEYS.items():
                    if value in reply.text:
                        in_replies.setdefault(name, []).append(f"reply to {path.split('?')[0]}")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    assert [status for _, status in answered] == [200] * 8 + [404], answered
    rows = store.query_dicts(gateway.db, "SELECT api, status, request_body, engine_request FROM exchanges ORDER BY seq")
    assert [row["status"] for row in rows] == ["ok"] * 8, rows

    export = tmp_path / "export" / "trajectories.parquet"
    assembled = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "assemble", "--db", str(gateway.db), "--out", str(export)], capture_output=True, text=True, timeout=120)
    assert assembled.returncode == 0 and export.exists(), assembled.stderr
    assert flows.stat().st_size > 0 and log.stat().st_size > 0  # the flows were saved, the log written
    # the store as a head reads it: its segments' Parquet exports, the journal tail, sessions and marks
    with store.ClosedStore(gateway.db) as closed:
        snapshot = closed.snapshot("node")
    assert [path for path in snapshot.exchanges if ".segments" in path], snapshot  # at least one segment export

    # the session's proxy credential (it lets its holder write rows into the session) is kept nowhere either
    credential = session.session_token(session.load_secret(gateway.confdir), "secrets")
    found = leaks(tmp_path, {**KEYS, "session_proxy_token": credential})
    for name, where in in_replies.items():
        found.setdefault(name, []).extend(where)
    assert not found, f"keys found in stored artifacts: {found}"
    # the engine got the pasted keys redacted: the prompt (and so its tokens) holds none; in tokens mode (the default
    # here) the prompt went as token ids, read back with the engine's own detokenize
    sent = json.loads(rows[0]["engine_request"])
    prompt = sent["messages"] if "messages" in sent else httpx.post(f"{engine_url.removesuffix('/v1')}/detokenize", json={"model": sent["model"], "tokens": sent["prompt"]}, timeout=60).json()["prompt"]
    assert "[REDACTED]" in json.dumps(prompt) and "[REDACTED]" in rows[0]["request_body"]


def test_agent_config_files_hold_only_the_placeholder_key_inside_the_sandbox_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agents' config files are written into the sandbox's private HOME (a temporary directory, removed with the
    sandbox; never under the node's output or store, which keep only the harness log, rows and Parquet), and hold the
    placeholder key, never one from the server's environment."""
    real = {name: key("sk-proj-", 48) for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "LLM_API_KEY", "OPENROUTER_API_KEY", "MISTRAL_API_KEY")}
    for name, value in real.items():
        monkeypatch.setenv(name, value)
    with_key: list[str] = []
    for name in harnesses.NAMES:
        home = tmp_path / "homes" / name
        harnesses.get(name).prepare_home(home)
        files = [p for p in home.rglob("*") if p.is_file()]
        assert all(p.resolve().is_relative_to(home.resolve()) for p in files), f"{name} wrote outside its home"
        for path in files:
            text = path.read_bytes()
            assert not any(value.encode() in text for value in real.values()), f"{name}: {path} holds a key from the environment"
            if harnesses.PLACEHOLDER_API_KEY.encode() in text:
                with_key.append(name)
    assert with_key, "no preset writes a config file holding its key: this test checks nothing"
