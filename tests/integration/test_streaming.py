"""Streamed replies survive a slow engine: first byte at once, provider keepalives, errors inside the stream.

Each official SDK (openai Chat + Responses, anthropic, google-genai) calls its provider's host through the real
gateway, whose engine is a stand-in that takes SLOW seconds (tests/upstream_standins.py; no real engine can be made
that slow on demand). The SDK must see its first event at once, keep reading through the keepalives, and assemble
exactly the message a gateway without keepalives (--keepalive-interval 0) gives for the same reply; an
engine failure after FAIL_AFTER seconds must surface in the SDK as its own in-stream error.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from polar_mitm.store import JSON_COLUMNS
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.matrix import full_matrix
from tests.support.upstream_standins import SLOW_ARGUMENTS, SLOW_TEXT, SlowStandinEngine

SLOW = 30.0  # seconds the stand-in engine takes (the 30 s)
FAIL_AFTER = 10.0  # seconds before the failing stand-in answers HTTP 500
KEEPALIVE = 1.0  # the gateways' --keepalive-interval
FIRST_BYTE = 1.0  # the goal: first byte within a second

OPENAI_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a value up.", "parameters": {"type": "object", "properties": {"value": {"type": "string"}}}}}
RESPONSES_TOOL = {"type": "function", "name": "lookup", "description": "Look a value up.", "parameters": {"type": "object", "properties": {"value": {"type": "string"}}}}
ANTHROPIC_TOOL = {"name": "lookup", "description": "Look a value up.", "input_schema": {"type": "object", "properties": {"value": {"type": "string"}}}}
GEMINI_TOOL = genai_types.Tool(function_declarations=[genai_types.FunctionDeclaration(name="lookup", description="Look a value up.", parameters=genai_types.Schema(type=genai_types.Type.OBJECT, properties={"value": genai_types.Schema(type=genai_types.Type.STRING)}))])
PROMPT = "Look up the value."
MODEL_ANTHROPIC = "claude-opus-4-8"


@dataclass
class Call:
    """One streamed SDK call: when its first byte and first event came, what it assembled or raised."""

    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    first_event: float | None = None
    elapsed: float = 0.0
    final: Any = None
    error: BaseException | None = None
    events: list[str] = field(default_factory=list)
    rows_at_first_content: list[dict[str, Any]] | None = None
    failure: Any = None  # the error a response.failed event carried (Responses)

    def headers_in(self, response: Any) -> None:
        """An httpx response hook, given to the SDK's own HTTP client: the response's headers are in."""
        if self.first_byte is None:
            self.first_byte = time.monotonic() - self.started

    def note(self, kind: str) -> None:
        if self.first_event is None:
            self.first_event = time.monotonic() - self.started
        self.events.append(kind)


# -- the four SDKs, each: build a client bound to (gateway, session), run one streamed call into a Call

def run_chat(client: openai.OpenAI, call: Call, on_content: Callable[[], None]) -> None:
    with client.chat.completions.stream(model="gpt-4o", messages=[{"role": "user", "content": PROMPT}], tools=[OPENAI_TOOL], stream_options={"include_usage": True}) as stream:
        for event in stream:
            call.note(event.type)
            if event.type == "content.delta" and event.delta:  # the opening chunk's content is ""
                on_content()
        call.final = stream.get_final_completion()


def run_responses(client: openai.OpenAI, call: Call, on_content: Callable[[], None]) -> None:
    with client.responses.stream(model="gpt-4o", input=PROMPT, tools=[RESPONSES_TOOL]) as stream:
        for event in stream:
            call.note(event.type)
            if event.type == "response.output_item.added":
                on_content()
            if event.type == "response.failed":
                call.failure = event.response.error
        call.final = stream.get_final_response()


def run_anthropic(client: anthropic.Anthropic, call: Call, on_content: Callable[[], None]) -> None:
    with client.messages.stream(model=MODEL_ANTHROPIC, max_tokens=256, messages=[{"role": "user", "content": PROMPT}], tools=[ANTHROPIC_TOOL]) as stream:
        for event in stream:
            call.note(event.type)
            if event.type == "content_block_start":
                on_content()
        call.final = stream.get_final_message()


def run_gemini(client: genai.Client, call: Call, on_content: Callable[[], None]) -> None:
    chunks = []
    config = genai_types.GenerateContentConfig(tools=[GEMINI_TOOL])
    for chunk in client.models.generate_content_stream(model="gemini-2.5-flash", contents=PROMPT, config=config):
        call.note("chunk")
        if chunk.candidates and chunk.candidates[0].content.parts and any(part.text or part.function_call for part in chunk.candidates[0].content.parts):
            on_content()
        chunks.append(chunk)
    # google-genai has no stream assembler: what a client (Gemini CLI among them) builds from the chunks
    call.final = {
        "text": "".join(chunk.text or "" for chunk in chunks),
        "function_calls": [fc.model_dump(mode="json") for chunk in chunks for fc in chunk.function_calls or []],
        "finish_reasons": [str(chunk.candidates[0].finish_reason) for chunk in chunks if chunk.candidates and chunk.candidates[0].finish_reason],
        "usage": chunks[-1].usage_metadata.model_dump(mode="json"),
        "model_version": {chunk.model_version for chunk in chunks},
        "non_empty_parts": [part.model_dump(mode="json", exclude_none=True) for chunk in chunks for part in chunk.candidates[0].content.parts if part.text or part.function_call],
    }


SDKS = {"openai_chat": run_chat, "openai_responses": run_responses, "anthropic_messages": run_anthropic, "gemini": run_gemini}


def make_client(sdk: str, gateway: Gateway, session_id: str, call: Call) -> Any:
    hooks = {"response": [call.headers_in]}
    with proxy_env(gateway, session_id):  # HTTPS_PROXY and the CA, read at construction; no base URL
        if sdk in ("openai_chat", "openai_responses"):
            return openai.OpenAI(api_key="sk-polar-test", max_retries=0, http_client=openai.DefaultHttpxClient(event_hooks=hooks))
        if sdk == "anthropic_messages":
            return anthropic.Anthropic(api_key="sk-ant-polar-test", max_retries=0, http_client=anthropic.DefaultHttpxClient(event_hooks=hooks))
        return genai.Client(api_key="polar-test", http_options=genai_types.HttpOptions(client_args={"event_hooks": hooks}, retry_options=genai_types.HttpRetryOptions(attempts=1)))


def run(sdk: str, gateway: Gateway, session_id: str, client: Any, call: Call) -> Call:
    def on_content() -> None:
        # the reply's first real event: its row must be in the store already
        if call.rows_at_first_content is None:
            call.rows_at_first_content = gateway.exchanges(session_id)

    call.started = time.monotonic()
    try:
        SDKS[sdk](client, call, on_content)
    except Exception as error:  # noqa: BLE001 - the failure test looks at it
        call.error = call.error or error
    call.elapsed = time.monotonic() - call.started
    return call


def run_all(gateway: Gateway, prefix: str) -> dict[str, tuple[str, Call]]:
    """All four SDKs at once (each against its own session), so the slow engine's wait is paid once. The clients are
    made one after another first: each reads the proxy settings from the environment when it is made."""
    sessions = {sdk: f"{prefix}-{sdk}-{int(time.time() * 1000) % 10**8}" for sdk in SDKS}
    calls = {sdk: Call() for sdk in SDKS}
    clients = {sdk: make_client(sdk, gateway, sessions[sdk], calls[sdk]) for sdk in SDKS}
    with ThreadPoolExecutor(len(SDKS)) as pool:
        futures = {sdk: pool.submit(run, sdk, gateway, sessions[sdk], clients[sdk], calls[sdk]) for sdk in SDKS}
        return {sdk: (sessions[sdk], future.result()) for sdk, future in futures.items()}


def rows_of(gateway: Gateway, session_id: str) -> list[dict[str, Any]]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


def normalized(sdk: str, final: Any) -> Any:
    """The assembled message with the reply's id and timestamps taken out (they name one exchange, not its content)."""
    if sdk == "gemini":
        return {**final, "model_version": sorted(final["model_version"])}
    data = final.model_dump(mode="json")
    reply_id = {"openai_chat": data["id"].removeprefix("chatcmpl-"), "openai_responses": data["id"].removeprefix("resp_"), "anthropic_messages": data["id"].removeprefix("msg_")}[sdk]
    text = json.dumps(data).replace(reply_id, "REPLY_ID")
    return _drop_keys(json.loads(text), {"created", "created_at", "completed_at"})


def _drop_keys(value: Any, keys: set[str]) -> Any:
    if isinstance(value, dict):
        return {k: _drop_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_drop_keys(v, keys) for v in value]
    return value


KEEPALIVE_PATTERNS = {
    "openai_chat": r'"delta":\{\},"logprobs":null,"finish_reason":null',
    "openai_responses": r"event: response\.in_progress",
    "anthropic_messages": r"event: ping",
    "gemini": r'"parts":\[\{"text":""\}\]',
}


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """slow: a 30 s engine, keepalives every second; reference: the same replies at once, no keepalives;
    failing: HTTP 500 after 10 s, keepalives every second."""
    from polar_mitm.util import free_port

    engines = {"slow": SlowStandinEngine(delay=SLOW), "reference": SlowStandinEngine(delay=0), "failing": SlowStandinEngine(delay=FAIL_AFTER, fail=True)}
    started: dict[str, Gateway] = {}
    try:
        for name, engine in engines.items():
            base = tmp_path_factory.mktemp(f"stream-{name}")
            interval = "0" if name == "reference" else str(KEEPALIVE)
            started[name] = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine.url, args=["--keepalive-interval", interval]).start()
        yield started
    finally:
        for gateway in started.values():
            gateway.stop()
        for engine in engines.values():
            engine.close()


def test_sdks_get_first_byte_at_once_and_the_same_message(gateways: dict[str, Gateway]) -> None:
    reference = run_all(gateways["reference"], "reference")
    slow = run_all(gateways["slow"], "slow")
    for sdk in SDKS:
        (ref_session, ref), (session_id, call) = reference[sdk], slow[sdk]
        assert ref.error is None and call.error is None, (sdk, ref.error, call.error)
        # headers at once; the first event at once where the grammar has an opening event (Gemini's has none)
        assert call.first_byte is not None and call.first_byte < FIRST_BYTE, (sdk, call.first_byte)
        if sdk != "gemini":
            assert call.first_event is not None and call.first_event < FIRST_BYTE, (sdk, call.first_event, call.events[:3])
        assert call.elapsed >= SLOW, (sdk, call.elapsed)  # it really waited for the engine
        assert normalized(sdk, call.final) == normalized(sdk, ref.final), sdk

        [row] = rows_of(gateways["slow"], session_id)  # exactly one row for the exchange
        assert (row["status"], row["http_status"], row["stream"]) == ("ok", 200, True), sdk
        # the row was committed before the reply's first real event reached the client
        assert call.rows_at_first_content is not None and [r["exchange_id"] for r in call.rows_at_first_content] == [row["exchange_id"]], sdk
        # the keepalives are on the record, as sent: the stream has that many more of the keepalive event
        [ref_row] = rows_of(gateways["reference"], ref_session)
        keepalives = len(re.findall(KEEPALIVE_PATTERNS[sdk], row["response_stream"])) - len(re.findall(KEEPALIVE_PATTERNS[sdk], ref_row["response_stream"]))
        assert keepalives >= SLOW / KEEPALIVE - 3, (sdk, keepalives)
        assert row["completion_token_ids"] == ref_row["completion_token_ids"]

    # what each SDK assembled: the stand-in's text and its call of the offered tool
    chat = slow["openai_chat"][1].final.choices[0].message
    assert chat.content == SLOW_TEXT and chat.tool_calls[0].function.arguments == SLOW_ARGUMENTS
    responses = slow["openai_responses"][1].final
    assert responses.output_text == SLOW_TEXT and [item.type for item in responses.output] == ["message", "function_call"]
    message = slow["anthropic_messages"][1].final
    assert [block.type for block in message.content] == ["text", "tool_use"] and message.usage.input_tokens == 9
    gemini = slow["gemini"][1].final
    assert gemini["text"] == SLOW_TEXT and gemini["function_calls"][0]["args"] == json.loads(SLOW_ARGUMENTS)


# what each SDK raises for an engine failure delivered inside the stream
EXPECTED_ERRORS = {
    "openai_chat": openai.APIError,  # a data line with an `error` object: APIError (no HTTP status to classify by)
    "openai_responses": RuntimeError,  # response.failed is a typed event; get_final_response() raises after it
    "anthropic_messages": anthropic.APIStatusError,  # `event: error`: the status class of the 200 it came with
    "gemini": genai_errors.ServerError,  # an `error` chunk with code 502: the 5xx class
}


def test_engine_failure_inside_the_stream_raises_in_each_sdk(gateways: dict[str, Gateway]) -> None:
    failing = run_all(gateways["failing"], "failing")
    for sdk, (session_id, call) in failing.items():
        assert call.first_byte is not None and call.first_byte < FIRST_BYTE, (sdk, call.first_byte)
        assert call.elapsed >= FAIL_AFTER, (sdk, call.elapsed)
        assert type(call.error) is EXPECTED_ERRORS[sdk], (sdk, type(call.error), call.error)
        if sdk != "openai_responses":
            assert "HTTP 500" in str(call.error), (sdk, str(call.error))
        [row] = rows_of(gateways["failing"], session_id)  # the failure is a row, with its status
        assert (row["status"], row["http_status"]) == ("engine_error", 200), sdk
        assert "HTTP 500" in row["error"]
        assert row["response_stream"].count("stand-in engine failure") == 1  # the error event, recorded as sent
    responses = failing["openai_responses"][1]
    assert responses.events[-1] == "response.failed" and responses.failure.code == "server_error" and "HTTP 500" in responses.failure.message
    assert "response.completed" in str(responses.error)
    assert failing["anthropic_messages"][1].error.body["error"]["type"] == "api_error"


@full_matrix  # waits out Gemini CLI's own 60 s; the deadline itself: tests/unit/gateway/test_unstreamed_deadline.py
def test_a_non_streamed_call_is_answered_before_its_harness_gives_up(make_gateway, session_id: str) -> None:
    """A non-streamed call cannot be kept alive. Gemini CLI's router call is one, and its HTTP client waits 60 s for
    headers: the gateway gives the engine until 5 s before that and answers a Google-shaped 504, recorded as
    engine_timeout, instead of a reply nobody would read (the default --engine-timeout is 600 s)."""
    import httpx

    from polar_mitm import harnesses
    from tests.support.upstream_standins import StandinUpstream

    limit = harnesses.get("gemini").unstreamed_timeout
    standin = StandinUpstream("hang", delay=limit + 10)
    try:
        gateway = make_gateway(upstream=standin.url)
        body = {"contents": [{"role": "user", "parts": [{"text": "Route this."}]}]}
        with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=limit + 30) as client:
            started = time.monotonic()
            response = client.post("https://generativelanguage.googleapis.com/v1beta/models/gemini-3.5-flash-lite:generateContent", json=body, headers={"user-agent": "GeminiCLI/0.61.0/gemini-3.5-flash-lite (linux; x64)", "x-goog-api-key": "k"})
            elapsed = time.monotonic() - started
    finally:
        standin.close()
    assert response.status_code == 504 and response.json()["error"]["status"] == "DEADLINE_EXCEEDED", response.text
    assert limit - 10 < elapsed < limit, elapsed
    [row] = gateway.exchanges(session_id)
    assert (row["harness"], row["stream"], row["status"], row["http_status"]) == ("gemini", False, "engine_timeout", 504)


def test_a_retry_after_an_in_stream_error_is_a_retry_not_a_fork(make_gateway, session_id: str) -> None:
    """What Claude Code does after an `event: error`: the same request again, its retry counter up. The failed
    exchange is a row with its status; the trajectory has the retry's tokens once, in one sequence."""
    from polar_mitm.assembler import assemble

    engine = SlowStandinEngine(delay=2, failures=1)
    try:
        gateway = make_gateway("--keepalive-interval", "0.5", upstream=engine.url)
        with proxy_env(gateway, session_id):
            client = anthropic.Anthropic(api_key="sk-ant-polar-test", max_retries=0)
        request = {"model": MODEL_ANTHROPIC, "max_tokens": 64, "messages": [{"role": "user", "content": PROMPT}]}
        with pytest.raises(anthropic.APIStatusError) as failed:
            with client.messages.stream(**request) as stream:
                stream.get_final_message()
        assert failed.value.body["error"]["type"] == "api_error"
        with client.messages.stream(**request, extra_headers={"x-stainless-retry-count": "1"}) as stream:
            message = stream.get_final_message()
        assert message.content[0].text == SLOW_TEXT
        rows = rows_of(gateway, session_id)
        assert [(r["seq"], r["status"], r["retry_count"]) for r in rows] == [(1, "engine_error", 0), (2, "ok", 1)]
        assert failed.value.request_id == "req_" + rows[0]["exchange_id"].replace("-", "")  # from the request-id header
        [sequence] = assemble(gateway.db, builder="prefix_merging", session=session_id).sequences
        assert sequence.exchange_ids == [rows[1]["exchange_id"]]
    finally:
        engine.close()
