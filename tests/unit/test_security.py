"""Security parts without a gateway: which listen addresses need a token (api_auth), the rollout server's bearer
token on every route (the real app over its stand-in node, on loopback, with the real clients and CLI), and which
strings of a request count as its API keys and are scrubbed before the engine sees it (redact)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import hypothesis
import pytest
from hypothesis import strategies as st

from polar_mitm import api_auth, redact
from polar_mitm.client import RolloutClient
from polar_mitm.errors import ServerRefused
from polar_mitm.rollout.server import LocalBackend, create_app
from tests.support.rollout_standins import LoopbackServers, StandinNode

OPENAI_KEY = "sk-proj-Ab1cD2eF3gH4iJ5kL6mN7oP8qR9sT0uV"
GOOGLE_KEY = "AIzaSyAb1cD2eF3gH4iJ5kL6mN7oP8qR9sT0uVw"  # 39 characters, as Google's are


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("::", False), ("192.168.1.5", False), ("gateway.example", False),
])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert api_auth.is_loopback(host) is loopback
    refusal = api_auth.refusal_to_listen(host, None, "the server", "--api-token")
    assert (refusal is None) is loopback
    assert api_auth.refusal_to_listen(host, "t0ken", "the server", "--api-token") is None
    if refusal:
        assert "\n" not in refusal and "--api-token" in refusal


def test_bearer_matches_only_the_exact_token() -> None:
    assert api_auth.bearer_matches("Bearer s3cret", "s3cret")
    for given in (None, "", "s3cret", "Bearer s3cre", "Bearer s3cret2", "bearer s3cret", "Basic s3cret"):
        assert not api_auth.bearer_matches(given, "s3cret"), given


def test_the_keys_of_a_request() -> None:
    body = json.dumps({"api_key": "field-key-123456789", "nested": [{"apiKey": "camel-key-123456789"}], "messages": [
        {"role": "user", "content": f"pasted {OPENAI_KEY} and {GOOGLE_KEY}; also sk-learn-compatible-estimators, sk-test"},
    ]}).encode()
    found = redact.secret_values([("Authorization", "Bearer header-key-0123456789"), ("x-goog-api-key", "goog")], [("key", "query-key-0123456789")], body)
    assert set(found) == {
        "Bearer header-key-0123456789", "header-key-0123456789", "goog", "query-key-0123456789",
        "field-key-123456789", "camel-key-123456789", OPENAI_KEY, GOOGLE_KEY,
    }



# the key shape as first written, one lookbehind pattern (~2 ms per 50 KB body): redact.py's faster scan must find
# exactly what it found
REFERENCE_KEY_SHAPE = re.compile(r"(?<![A-Za-z0-9_-])(?:sk-[A-Za-z0-9_-]{20,}|AIza[0-9A-Za-z_-]{35})(?![A-Za-z0-9_-])")


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(["sk-", "AIza", OPENAI_KEY, GOOGLE_KEY, GOOGLE_KEY + "x", "task", "-", "_", " ", "\n", '"', "Ab1", "z9Q", "é"]), max_size=12))
def test_key_shaped_strings_are_those_the_reference_pattern_finds(parts: list[str]) -> None:
    text = "".join(parts)
    expected = [m for m in REFERENCE_KEY_SHAPE.findall(text) if redact._looks_like_key(m)]
    assert sorted(redact.secret_values([], [], text.encode())) == sorted(s for s in expected if len(s) >= 4)


@pytest.mark.parametrize("name", ["X-API-KEY", "Client_Secret", "access-token", "_api_key_", "xGoogApiKey"])
def test_key_named_fields_are_found_in_any_spelling(name: str) -> None:
    body = json.dumps({"a": [{"b": {name: "spelled-key-123456789"}}], "text": "no key here"}).encode()
    assert redact.secret_values([], [], body) == ["spelled-key-123456789"]
    # a field's name in a prompt's text, not as a key of the body, is not a field
    assert redact.secret_values([], [], json.dumps({"text": f'{name}: "not-a-field-123456789"'}).encode()) == []

# how a field's name was first told apart (lowercase, squash "-" and "_", look for each quoted name): the one-pass
# pattern must say the same of every body
def _reference_names_a_field(body: bytes) -> bool:
    squashed = body.decode("utf-8", "replace").lower().replace("-", "").replace("_", "")
    return any(f'"{name}"' in squashed for name in redact.SECRET_BODY_FIELDS)


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(['"', "api", "Api", "KEY", "key", "-", "_", "x", "X-", "goog", "secret", "Client", "auth", "Token",
                                            "authorization", "ACCESS", ":", " ", "é", "漢", "{", "}"]), max_size=14))
def test_a_field_named_like_a_key_is_told_apart_as_the_reference_does(parts: list[str]) -> None:
    body = "".join(parts).encode()
    assert bool(redact._FIELD_NAME.search(body)) is _reference_names_a_field(body)


def test_keys_in_a_body_past_latin_1_are_scrubbed_from_its_bytes() -> None:
    body = json.dumps({"Api-Key": "field-key-123456789", "messages": [{"role": "user", "content": f"漢字 é {OPENAI_KEY} short"}]}, ensure_ascii=False).encode()
    found = redact.secret_values([("proxy-authorization", "Basic c2hvcnQ=")], [], body)
    assert set(found) == {"Basic c2hvcnQ=", "c2hvcnQ=", "field-key-123456789", OPENAI_KEY}
    engine = json.loads(redact.scrub_body(body, [*found, "short"]))
    assert engine["Api-Key"] == "[REDACTED]" and engine["messages"][0]["content"] == "漢字 é [REDACTED] short"
    stored = json.loads(redact.scrub_body(body, [*found, "short"], min_length=1))
    assert stored["messages"][0]["content"] == "漢字 é [REDACTED] [REDACTED]"


def test_scrub_body_keeps_short_placeholders_and_json() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": f"write a test with key {OPENAI_KEY}"}]}).encode()
    scrubbed = redact.scrub_body(body, ["test", OPENAI_KEY])
    # a placeholder as short as "test" is a word a prompt may hold: the engine still sees it; a real key it never does
    assert json.loads(scrubbed)["messages"][0]["content"] == "write a test with key [REDACTED]"
    assert redact.scrub_body(body, ["test"]) is body


@pytest.fixture
def token_server():
    servers = LoopbackServers(create_app(LocalBackend(StandinNode("http://127.0.0.1:9")), api_token="t0ken-of-the-server"))
    yield servers.urls[0]
    servers.close()


def test_the_rollout_server_with_a_token_refuses_every_route_without_it(token_server: str) -> None:
    import httpx

    with httpx.Client(base_url=token_server, trust_env=False) as http:
        for path in ("/health", "/tasks", "/tasks/x", "/control/status", "/ui/", "/docs", "/openapi.json", "/nodes", "/sql?q=SELECT%201"):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "t0ken-of-the-server"}):
                answer = http.get(path, headers=headers)
                assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", (path, headers, answer.text)
                assert "t0ken" not in answer.text
        assert http.post("/tasks", json={"instruction": "x", "agent": {"harness": "qwen"}}).status_code == 401
        assert http.get("/health", headers={"authorization": "Bearer t0ken-of-the-server"}).status_code == 200
    with RolloutClient(token_server) as client, pytest.raises(ServerRefused) as refused:
        client.health()
    assert refused.value.status == 401
    with RolloutClient(token_server, token="t0ken-of-the-server") as client:
        accepted = client.submit({"instruction": "x", "agent": {"harness": "qwen"}, "num_samples": 2})
        assert client.wait(accepted["task_id"], timeout=30, poll_seconds=0.1)["status"] == "completed"


def test_the_rollout_cli_sends_the_token(token_server: str) -> None:
    def cli(*args: str, token: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != api_auth.ROLLOUT_TOKEN_ENV}
        if token is not None:
            env[api_auth.ROLLOUT_TOKEN_ENV] = token
        return subprocess.run([sys.executable, "-m", "polar_mitm.cli", "rollout", *args, "--server", token_server], capture_output=True, text=True, timeout=60, env=env)

    refused = cli("list", token=None)
    assert refused.returncode != 0 and "401" in refused.stderr, refused
    listed = cli("list", "--json", token="t0ken-of-the-server")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed


def test_a_model_calls_row_body_and_flow_keep_no_key() -> None:
    from mitmproxy import http
    from mitmproxy.test import tflow

    from polar_mitm.gateway import flows

    body = json.dumps({"contents": [{"parts": [{"text": f"key {OPENAI_KEY}"}]}], "api_key": "field-key-123456789"}).encode()
    flow = tflow.tflow()
    path = "/v1beta/models/g:streamGenerateContent"
    flow.request = http.Request.make("POST", f"https://generativelanguage.googleapis.com{path}?key={GOOGLE_KEY}&alt=sse", body, {"x-goog-api-key": GOOGLE_KEY, "authorization": f"Bearer {OPENAI_KEY}"})
    row, to_parse = flows.request_row(flow, "gemini", path, "s", 0, None)
    kept = json.dumps(flow.get_state(), default=repr) + json.dumps(row, default=str) + to_parse.decode()
    for secret in (OPENAI_KEY, GOOGLE_KEY, "field-key-123456789"):
        assert secret not in kept, secret
    assert flow.request.query["alt"] == "sse" and json.loads(to_parse)["contents"][0]["parts"][0]["text"] == "key [REDACTED]"


def test_a_harness_s_output_keeps_no_key_it_printed() -> None:
    from polar_mitm.redact import REDACTED, env_secrets, scrub_output

    env = {"OPENAI_API_KEY": "hunter2-not-key-shaped", "GITHUB_TOKEN": "ghp_x", "PATH": "/usr/bin", "SHORT_KEY": "abc"}
    assert env_secrets(env) == ["hunter2-not-key-shaped", "ghp_x"]  # by name; 3 characters are no secret
    printed = "env: OPENAI_API_KEY=hunter2-not-key-shaped\nusing sk-ant-api03-AbCdEfGhIjKlMnOp0123456789 for claude\nPATH=/usr/bin\n"
    scrubbed = scrub_output(printed, env_secrets(env))
    assert "hunter2" not in scrubbed and "AbCdEfGh" not in scrubbed and scrubbed.count(REDACTED) == 2
    assert "PATH=/usr/bin" in scrubbed and scrub_output("") == ""
