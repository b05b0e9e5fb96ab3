"""Gateway core, OpenAI Chat Completions, against the real vLLM engine through real mitmproxy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import httpx
import openai
import pytest

from polar_mitm import store
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway, listening, proxy_env
from tests.support.rows import fill_the_disk_under
from tests.support.upstream_standins import StandinUpstream


@pytest.fixture
def gateway(chat_gateway: Gateway) -> Gateway:
    """The shared gateway in chat mode (`--render chat`): this module checks the Chat Completions request as the engine
    got it (its messages, tools and sampling). Tokens mode's engine requests are
    tests/integration/test_tokens_gateway.py's."""
    return chat_gateway


pytestmark = pytest.mark.engine

SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
FORCED_CALL = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "echo hi > out.txt"}}\n</tool_call>'


def regex_for(text: str) -> str:
    import re

    return re.escape(text)


def accumulate_stream(chunks) -> dict:
    """What an SDK user gets by concatenating a chat stream."""
    content, finish, usage = "", None, None
    calls: dict[int, dict] = {}
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish, "usage": usage}


def message_of(completion) -> dict:
    message = completion.choices[0].message
    return {
        "content": message.content,
        "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []],
        "finish_reason": completion.choices[0].finish_reason,
        "usage": completion.usage.model_dump(),
    }


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]]}


def assert_tokens_match_engine(row: dict) -> None:
    engine = json.loads(row["engine_response"])
    choice = engine["choices"][0]
    assert row["prompt_token_ids"] == engine["prompt_token_ids"]
    assert row["completion_token_ids"] == choice["token_ids"]
    assert row["completion_logprobs"] == [item["logprob"] for item in choice["logprobs"]["content"]]
    assert len(row["completion_token_ids"]) > 0


def test_stream_equals_nonstream_text(gateway: Gateway, session_id: str) -> None:
    request = dict(model="gpt-4o-mini", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0)
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test-secret-key-123456")
        plain = client.chat.completions.create(**request)
        streamed = accumulate_stream(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert plain.model == "gpt-4o-mini"  # the client's name is echoed, not the engine's
    assert streamed == message_of(plain)
    rows = gateway.exchanges(session_id)
    assert [(r["seq"], r["api"], r["stream"], r["status"]) for r in rows] == [(1, "openai_chat", False, "ok"), (2, "openai_chat", True, "ok")]
    for row in rows:
        engine_request = json.loads(row["engine_request"])
        assert engine_request["stream"] is False and "stream_options" not in engine_request
        assert engine_request["logprobs"] is True and engine_request["top_logprobs"] == 0 and engine_request["return_token_ids"] is True
        assert engine_request["model"] == "qwen3-tiny"
        assert row["model_requested"] == "gpt-4o-mini" and row["model_engine"] == "qwen3-tiny"
        assert_tokens_match_engine(row)
        assert json.loads(row["response_body"])["choices"][0]["message"]["content"] == plain.choices[0].message.content
    assert rows[1]["response_stream"].rstrip().endswith("data: [DONE]")
    # the API key never reaches the store
    dump = json.dumps(gateway.rows("SELECT * FROM exchanges WHERE session_id = ?", [session_id]), default=str)
    assert "sk-test-secret-key-123456" not in dump and "[REDACTED]" in dump


def test_stream_equals_nonstream_tool_call_and_tool_result_turn(gateway: Gateway, session_id: str) -> None:
    messages = [{"role": "user", "content": "Create out.txt saying hi."}]
    forced = {"structured_outputs": {"regex": regex_for(FORCED_CALL)}}
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test")
        plain = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[SHELL_TOOL], tool_choice="auto", max_tokens=64, temperature=0, extra_body=forced)
        streamed = accumulate_stream(client.chat.completions.create(model="gpt-4o", messages=messages, tools=[SHELL_TOOL], tool_choice="auto", max_tokens=64, temperature=0, extra_body=forced, stream=True, stream_options={"include_usage": True}))
        call = plain.choices[0].message.tool_calls[0]
        assert plain.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("shell", {"cmd": "echo hi > out.txt"})
        assert without_ids(streamed) == without_ids(message_of(plain))
        assert streamed["tool_calls"][0]["id"]
        # turn 2: the tool result goes back, the engine answers with text
        history = messages + [plain.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "done"}]
        final = client.chat.completions.create(model="gpt-4o", messages=history, tools=[SHELL_TOOL], max_tokens=8, temperature=0, extra_body={"structured_outputs": {"regex": "File written\\."}})
    assert final.choices[0].message.content == "File written."
    rows = gateway.exchanges(session_id)
    assert [r["stream"] for r in rows] == [False, True, False]
    for row in rows:
        assert_tokens_match_engine(row)
        assert "structured_outputs" in json.loads(row["engine_request"])
    # the tool result reached the engine's prompt
    sent = json.loads(rows[2]["engine_request"])["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": call.id, "content": "done"}


def test_row_is_committed_before_the_reply(gateway: Gateway, session_id: str) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False) as client:
        with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-x"}) as response:
            exchange_id = response.headers["x-polar-exchange-id"]
            # the provider's request id: the openai SDK puts it on errors, Qwen Code retries a stream error naming one
            assert response.headers["x-request-id"] == "req_" + exchange_id.replace("-", "")
            # headers and the opening chunk come at once (streamed replies start before the engine answers); once
            # any event after the opening is in, the row must already be durable
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            opening = json.loads(next(events).removeprefix("data: "))
            assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            rest = [next(events)]
            rows = gateway.rows("SELECT status, completion_token_ids FROM exchanges WHERE exchange_id = ?", [exchange_id])
            assert rows and rows[0]["status"] == "ok" and rows[0]["completion_token_ids"]
            rest += list(events)
    assert rest[-1] == "data: [DONE]"


def _post(gateway: Gateway, session_id: str, body: bytes | dict, path: str = "/v1/chat/completions", host: str = "api.openai.com") -> httpx.Response:
    with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=60) as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return client.post(f"https://{host}{path}", content=content, headers={"content-type": "application/json", "authorization": "Bearer sk-x"})


def assert_openai_error(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and "type" in error


def test_bad_input_gets_openai_errors_and_is_recorded(gateway: Gateway, session_id: str) -> None:
    assert_openai_error(_post(gateway, session_id, b"{not json"), 400, "not valid JSON")
    assert_openai_error(_post(gateway, session_id, {"model": "gpt-4o", "messages": "hello"}), 400, "'messages' must be an array")
    assert_openai_error(_post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}), 400, "'max_tokens' must be an integer")
    assert_openai_error(_post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "n": 3}), 400, "n=3")
    assert_openai_error(_post(gateway, session_id, {"messages": [{"role": "user", "content": "x"}]}), 400, "'model'")
    rows = gateway.exchanges(session_id)
    assert [r["status"] for r in rows] == ["bad_request"] * 5
    assert all(r["error"] and r["http_status"] == 400 and r["request_body"] for r in rows)
    # and the gateway keeps serving
    ok = _post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_unknown_model_is_404_in_openai_shape(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--model-map", "gpt-*")
    response = _post(gateway, session_id, {"model": "llama-nonexistent", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(response, 404, "llama-nonexistent")
    assert response.json()["error"]["code"] == "model_not_found"
    assert _post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status_code == 200
    assert [r["status"] for r in gateway.exchanges(session_id)] == ["bad_request", "ok"]


@pytest.mark.parametrize("failure", ["down", "500", "timeout"])
def test_engine_failures_are_surfaced_and_recorded(make_gateway, session_id: str, failure: str) -> None:
    standin = None
    if failure == "down":
        gateway = make_gateway(upstream=f"http://127.0.0.1:{free_port()}/v1")
        expected = (503, "engine_unreachable", "unreachable")
    elif failure == "500":
        standin = StandinUpstream("500")
        gateway = make_gateway(upstream=standin.url)
        expected = (502, "engine_error", "HTTP 500")
    else:
        standin = StandinUpstream("hang", delay=5)
        gateway = make_gateway("--engine-timeout", "1", upstream=standin.url)
        expected = (504, "engine_timeout", "did not answer")
    try:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        # a failure within the gateway's first 0.3 s (an unreachable engine, an HTTP 500 at once) is still the HTTP
        # error; one after the headers went out (the engine timing out after 1 s) is told inside the stream
        in_stream = failure == "timeout"
        for stream in (False, True):  # and the gateway keeps serving after a failure
            response = _post(gateway, session_id, {**body, "stream": stream})
            if stream and in_stream:
                # the error inside the stream, in OpenAI's grammar: a data line with an `error` object, no [DONE]
                assert response.status_code == 200, response.text
                *_, last = [line for line in response.text.splitlines() if line.startswith("data: ")]
                error = json.loads(last.removeprefix("data: "))["error"]
                assert error["code"] == expected[1] and expected[2] in error["message"] and error["type"] == "server_error"
            else:
                assert_openai_error(response, expected[0], expected[2])
        rows = gateway.exchanges(session_id)
        assert [r["status"] for r in rows] == [expected[1]] * 2
        assert [r["http_status"] for r in rows] == [expected[0], 200 if in_stream else expected[0]]
        assert all(expected[2] in r["error"] for r in rows)
    finally:
        if standin:
            standin.close()


def test_non_model_traffic_is_answered_locally(gateway: Gateway, session_id: str) -> None:
    with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False) as client:
        response = client.get("https://api.anthropic.com/api/claude_code/settings")
        telemetry = client.post("https://play.googleapis.com/log?format=json", content=b"[]")
    assert response.status_code == 404 and "not forwarded" in response.json()["error"]["message"]
    assert telemetry.status_code == 404
    assert gateway.exchanges(session_id) == []


def test_require_auth(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--require-auth")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for proxy in (gateway.proxy_url(None), gateway.proxy_url(session_id, token="wrong")):
        with httpx.Client(proxy=proxy, verify=gateway.ssl_context(), trust_env=False) as client:
            with pytest.raises(httpx.ProxyError, match="407"):
                client.post("https://api.openai.com/v1/chat/completions", json=body)
    assert _post(gateway, session_id, body).status_code == 200
    assert [r["session_id"] for r in gateway.exchanges(session_id)] == [session_id]


def test_sigkill_loses_no_committed_exchange(make_gateway, session_id: str) -> None:
    gateway = make_gateway()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ids = [_post(gateway, session_id, body).headers["x-polar-exchange-id"] for _ in range(3)]
    gateway.stop(signal.SIGKILL)
    restarted = Gateway(port=free_port(), db=gateway.db, confdir=gateway.confdir, upstream=gateway.upstream).start()
    try:
        rows = restarted.exchanges(session_id)
        assert [r["exchange_id"] for r in rows] == ids and all(r["completion_token_ids"] for r in rows)
        _post(restarted, session_id, body)
        assert [r["seq"] for r in restarted.exchanges(session_id)] == [1, 2, 3, 4]
    finally:
        restarted.stop()


def test_a_gateway_restarting_while_a_reader_has_the_store_open_waits_for_it(make_gateway, session_id: str) -> None:
    """After a crash the control file names a dead gateway, so a reader (polar-mitm sql, store.query) opens the file
    itself; a gateway started meanwhile waits for that reader instead of exiting on DuckDB's lock."""
    gateway = make_gateway()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    _post(gateway, session_id, body)
    gateway.stop(signal.SIGKILL)
    port = free_port()
    reader = duckdb.connect(str(gateway.db), read_only=True)
    held: list[float] = []

    def close_reader() -> None:  # 2 s after the new gateway listens, i.e. while it opens the store
        deadline = time.monotonic() + 120
        while not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)
        held.append(time.monotonic())
        reader.close()

    closing = threading.Thread(target=close_reader)
    closing.start()
    restarted = Gateway(port=port, db=gateway.db, confdir=gateway.confdir, upstream=gateway.upstream).start()
    try:
        assert held, "the gateway was ready before the reader let go of the store"
        _post(restarted, session_id, body)
        assert [r["seq"] for r in restarted.exchanges(session_id)] == [1, 2]
        assert "cannot open the store" not in restarted.log.read_text()
    finally:
        closing.join()
        restarted.stop()


def test_sql_cli_while_gateway_runs(gateway: Gateway, session_id: str) -> None:
    _post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    query = f"SELECT session_id, len(completion_token_ids) AS n FROM exchanges WHERE session_id = '{session_id}'"
    result = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "sql", "--db", str(gateway.db), "--json", query], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"session_id": session_id, "n": 2}
    refused = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "sql", "--db", str(gateway.db), "DELETE FROM exchanges"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "read-only" in refused.stderr


@pytest.mark.parametrize("render", ["chat", "tokens"])
def test_mitmdump_with_the_addon_script(tmp_path, engine_url: str, session_id: str, render: str) -> None:
    port = free_port()
    db, confdir = tmp_path / "dump.duckdb", tmp_path / "conf"
    mitmdump = os.path.join(os.path.dirname(sys.executable), "mitmdump")
    addon = os.path.join(os.path.dirname(__file__), "..", "..", "addons", "polar.py")
    process = subprocess.Popen(
        [mitmdump, "-q", "--listen-host", "127.0.0.1", "-p", str(port), "--set", f"confdir={confdir}", "-s", addon, "--set", f"polar_upstream={engine_url}", "--set", f"polar_db={db}", "--set", f"polar_render={render}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        gateway = Gateway(port=port, db=db, confdir=confdir, upstream=engine_url)
        deadline = time.monotonic() + 60
        while not (gateway.ca_cert.exists() and store.control_file(db).exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        response = _post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert response.status_code == 200
        assert [(r["api"], r["render_mode"]) for r in gateway.exchanges(session_id)] == [("openai_chat", render)]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def test_sglang_engine_token_ids(make_gateway, session_id: str) -> None:
    # SGLang cannot run here: a named stand-in answers in its documented reply shape
    standin = StandinUpstream("sglang")
    try:
        gateway = make_gateway("--engine", "sglang", upstream=standin.url)
        response = _post(gateway, session_id, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stop": ["STOP"], "stream": True})
        assert response.status_code == 200 and "Hi there" in response.text
        row = gateway.exchanges(session_id)[0]
        assert json.loads(row["engine_request"])["return_prompt_token_ids"] is True
        assert row["prompt_token_ids"] == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
        assert row["completion_token_ids"] == [13048, 1052, 45537]
        assert row["completion_logprobs"] == [-0.25, -0.5, -0.125]
        # SGLang's matched_stop is the stop string a dialect reports (here Anthropic's stop_sequence)
        anthropic_body = {"model": "claude-x", "max_tokens": 8, "stop_sequences": ["STOP"], "messages": [{"role": "user", "content": "hi"}]}
        stopped = _post(gateway, session_id, anthropic_body, path="/v1/messages", host="api.anthropic.com").json()
        assert (stopped["stop_reason"], stopped["stop_sequence"], stopped["content"]) == ("stop_sequence", "STOP", [{"type": "text", "text": "Hi there"}])
    finally:
        standin.close()


def test_split_reasoning_round_trip(make_gateway, session_id: str) -> None:
    """An engine without a reasoning parser returns <think> inline; --split-reasoning maps it to reasoning_content."""
    # --split-reasoning is for an engine that returns reasoning inline: chat mode's (tokens mode splits it itself)
    gateway = make_gateway("--render", "chat", "--split-reasoning")
    forced = "<think>\nThe user greets me.\n</think>\n\nHello!"
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": regex_for(forced)}}
    reply = _post(gateway, session_id, body).json()["choices"][0]["message"]
    assert reply["content"] == "Hello!" and reply["reasoning_content"] == "The user greets me."
    streamed = _post(gateway, session_id, {**body, "stream": True}).text
    assert '"reasoning_content":"The user greets me."' in streamed and '"content":"Hello!"' in streamed
    # the next turn sends the reasoning back: the engine's template renders it again, as sampled
    follow = {"model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", **reply}, {"role": "user", "content": "bye"}]}
    assert _post(gateway, session_id, follow).status_code == 200
    plain, streamed_row, follow_row = gateway.exchanges(session_id)
    assert plain["completion_token_ids"] == streamed_row["completion_token_ids"]
    # token ids are the engine's whole sample, reasoning included: splitting is presentation only
    assert plain["completion_token_ids"][0] == 151667  # <think>
    assert json.loads(follow_row["engine_request"])["messages"][1]["reasoning_content"] == "The user greets me."


def test_a_failed_commit_is_answered_500_never_200(tmp_path, engine_url: str) -> None:
    """The reply is made only after its row's commit; if DuckDB refuses the row, the harness gets a 500 in the
    provider's shape instead of the model's answer. Run in-process: the failure is provoked by pointing the store's
    commit log at /dev/full (every write fails as on a full disk), which no other process could do to a running
    gateway's store."""
    from mitmproxy import http
    from mitmproxy.addons import proxyserver
    from mitmproxy.test import taddons, tflow

    from polar_mitm.gateway.addon import PolarAddon

    async def exchange(addon: PolarAddon) -> http.Response:
        flow = tflow.tflow()
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        flow.request = http.Request.make("POST", "https://api.openai.com/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        addon.requestheaders(flow)
        await addon.request(flow)
        assert flow.response is not None
        return flow.response

    async def main() -> None:
        addon = PolarAddon()
        with taddons.context(proxyserver.Proxyserver(), addon) as tctx:
            tctx.configure(addon, polar_upstream=engine_url, polar_db=str(tmp_path / "store.duckdb"), confdir=str(tmp_path / "confdir"))
            await addon.running()  # the store opens once the gateway runs
            try:
                ok = await exchange(addon)
                assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
                assert addon.store.query("SELECT status FROM exchanges WHERE exchange_id = ?", [ok.headers["x-polar-exchange-id"]])[1] == [("ok",)]
                fill_the_disk_under(addon.store)
                failed = await exchange(addon)
                assert failed.status_code == 500
                error = failed.json()["error"]
                assert error["type"] == "server_error" and "could not record the exchange" in error["message"]
                assert failed.headers["x-polar-exchange-id"] != ok.headers["x-polar-exchange-id"]
            finally:
                await addon.done()

    asyncio.run(main())


def test_gateway_master_keeps_mitmproxys_safety_checks_and_leaves_out_flow_rewriting(tmp_path) -> None:
    """The gateway runs mitmproxy with only the addons it needs (each loaded addon is asked about every flow); the
    ones that keep it safe stay: Block refuses clients from public addresses, TlsConfig makes the certificates."""
    from polar_mitm.gateway import server
    from polar_mitm.gateway.config import GatewayConfig

    async def main() -> None:
        master = server.make_master(GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp_path / "store.duckdb", confdir=str(tmp_path / "confdir")))
        try:
            names = {type(addon).__name__ for addon in master.addons.chain}
            assert {"Block", "TlsConfig", "Proxyserver", "NextLayer", "StartupCheck", "PolarAddon"} <= names  # StartupCheck: mitmproxy's ErrorCheck, in one line
            assert not names & {"MapRemote", "MapLocal", "ModifyBody", "ModifyHeaders", "StickyCookie", "AntiCache", "ServerPlayback", "Dumper"}
            assert master.options.block_global is True
            assert master.options.connection_strategy == "lazy" and master.options.stream_large_bodies is None
        finally:
            assert master.addons.get("polaraddon").store is None  # opened in running()

    asyncio.run(main())


def test_gateway_process_runs_without_mitmproxys_debug_checks(gateway: Gateway, session_id: str) -> None:
    """`polar-mitm gateway` starts itself again under `python -O` (same pid): mitmproxy's per-flow self-checks
    live under `if __debug__`; serving is unchanged."""
    command_line = Path(f"/proc/{gateway.process.pid}/cmdline").read_bytes().split(b"\0")
    assert command_line[1:5] == [b"-O", b"-m", b"polar_mitm.cli", b"gateway"]
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(gateway, session_id, body).status_code == 200
