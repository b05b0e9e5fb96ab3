"""The Gemini dialect: google-genai through HTTPS_PROXY only, the real gateway and the real engine."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from polar_mitm import store
from polar_mitm.dialects import reasoning
from tests.support import steer_gemini
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.gemini_stream import is_keepalive, sse_events


@pytest.fixture
def gateway(chat_gateway: Gateway) -> Gateway:
    """The shared gateway in chat mode (`--render chat`): this module checks what the Gemini dialect hands the engine
    as a chat request. Tokens mode's engine requests are tests/integration/test_tokens_gateway.py's."""
    return chat_gateway


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gemini"
STEER_HOOK = f"{Path(steer_gemini.__file__)}:steer"
MODEL = "gemini-2.5-flash"
API_ROOT = "https://generativelanguage.googleapis.com/v1beta/models"

WEATHER_TOOL = types.Tool(
    function_declarations=[
        types.FunctionDeclaration(
            name="get_weather",
            description="The current weather in a city.",
            parameters=types.Schema(type=types.Type.OBJECT, properties={"city": types.Schema(type=types.Type.STRING)}, required=["city"]),
        )
    ]
)


def sdk_client(gateway: Gateway, session_id: str) -> genai.Client:
    # built inside proxy_env: the SDK reads HTTPS_PROXY and SSL_CERT_FILE when its HTTP client is made
    with proxy_env(gateway, session_id):
        return genai.Client(api_key="test")


def both_ways(client: genai.Client, contents: Any, config: types.GenerateContentConfig) -> tuple[types.GenerateContentResponse, list[types.GenerateContentResponse]]:
    return client.models.generate_content(model=MODEL, contents=contents, config=config), list(client.models.generate_content_stream(model=MODEL, contents=contents, config=config))


def assert_stream_equals_body(response: types.GenerateContentResponse, chunks: list[types.GenerateContentResponse]) -> None:
    """What a streaming client accumulates is exactly the non-streamed answer."""
    chunks = [chunk for chunk in chunks if not is_keepalive(chunk.model_dump(mode="json", by_alias=True, exclude_none=True))]
    assert len(chunks) >= 1
    streamed_parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
    assert streamed_parts == response.candidates[0].content.parts
    assert {chunk.candidates[0].content.role for chunk in chunks} == {"model"}
    finish = [chunk.candidates[0].finish_reason for chunk in chunks if chunk.candidates[0].finish_reason]
    assert finish == [response.candidates[0].finish_reason]
    assert chunks[-1].usage_metadata == response.usage_metadata
    assert {chunk.model_version for chunk in chunks} == {response.model_version} == {MODEL}


def assert_rows_match_engine(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        assert row["api"] == "gemini" and row["status"] == "ok" and row["http_status"] == 200
        engine = row["engine_response"]
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert row["prompt_token_ids"] == engine["prompt_token_ids"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["engine_request"]["stream"] is False and row["engine_request"]["logprobs"] is True


def exchanges(gateway: Gateway, session_id: str) -> list[dict[str, Any]]:
    """The session's rows, JSON columns decoded."""
    rows = gateway.exchanges(session_id)
    for row in rows:
        for column in store.JSON_COLUMNS & row.keys():
            if isinstance(row[column], str):
                row[column] = json.loads(row[column])
    return rows


# -- google-genai against the real engine


def test_text_stream_accumulates_the_non_streamed_answer(gateway: Gateway, session_id: str) -> None:
    client = sdk_client(gateway, session_id)
    config = types.GenerateContentConfig(system_instruction="Be brief.", temperature=0, max_output_tokens=8)
    response, chunks = both_ways(client, "Say hi", config)
    assert_stream_equals_body(response, chunks)
    assert response.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    counted = client.models.count_tokens(model=MODEL, contents="Say hi")

    rows = exchanges(gateway, session_id)
    assert [(row["stream"], row["action"]) for row in rows] == [(False, "generate"), (True, "generate"), (False, "count_tokens")]
    assert_rows_match_engine(rows[:2])
    body_row, stream_row, count_row = rows
    # greedy: both calls sampled the same tokens, and the client saw the engine's text
    assert body_row["completion_token_ids"] == stream_row["completion_token_ids"]
    assert response.text == body_row["engine_response"]["choices"][0]["message"]["content"]
    usage = response.usage_metadata
    assert (usage.prompt_token_count, usage.candidates_token_count) == (body_row["prompt_tokens"], body_row["completion_tokens"]) == (body_row["prompt_tokens"], 8)
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
    assert body_row["engine_request"]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert (body_row["engine_request"]["temperature"], body_row["engine_request"]["max_tokens"]) == (0, 8)
    assert stream_row["path"].endswith(":streamGenerateContent?alt=sse")
    assert [event["candidates"][0]["content"]["parts"] for event in sse_events(stream_row["response_stream"])] == [[{"text": response.text}]]
    # countTokens is the engine tokenizer's count of the same prompt
    assert counted.total_tokens == count_row["engine_response"]["count"]
    assert count_row["response_body"] == {"totalTokens": counted.total_tokens}


def test_function_call_then_result_two_turns(make_gateway: Any, session_id: str) -> None:
    gateway = make_gateway("--render", "chat", "--engine-hook", STEER_HOOK)  # chat mode, as the module's `gateway`
    client = sdk_client(gateway, session_id)
    config = types.GenerateContentConfig(tools=[WEATHER_TOOL], max_output_tokens=64, temperature=0)
    question = types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])

    # turn 1: a function call
    response, chunks = both_ways(client, [question], config)
    assert_stream_equals_body(response, chunks)
    assert [(call.name, call.args) for call in response.function_calls] == [("get_weather", steer_gemini.forced_arguments())]
    content = [chunk for chunk in chunks if not is_keepalive(chunk.model_dump(mode="json", by_alias=True, exclude_none=True))]
    assert response.text.strip() == steer_gemini.PREAMBLE and len(content) == 2  # a text chunk, then the functionCall chunk
    assert response.candidates[0].finish_reason == types.FinishReason.STOP

    # turn 2: the result goes back, paired with the call although Gemini calls carry no ids
    result = types.Content(role="user", parts=[types.Part.from_function_response(name="get_weather", response={"temperature_c": 21})])
    response2, chunks2 = both_ways(client, [question, response.candidates[0].content, result], config)
    assert_stream_equals_body(response2, chunks2)
    assert response2.text == steer_gemini.ANSWER_AFTER_TOOL
    assert response2.candidates[0].finish_reason == types.FinishReason.STOP

    rows = exchanges(gateway, session_id)
    assert [row["stream"] for row in rows] == [False, True, False, True]
    assert_rows_match_engine(rows)
    assert rows[0]["engine_response"]["choices"][0]["finish_reason"] == "tool_calls"
    assert rows[0]["completion_token_ids"] == rows[1]["completion_token_ids"]
    assert rows[2]["completion_token_ids"] == rows[3]["completion_token_ids"]
    assert rows[0]["engine_request"]["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    ]
    assistant, tool = rows[2]["engine_request"]["messages"][-2:]
    assert assistant["content"] == response.text
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": json.dumps(steer_gemini.forced_arguments())}
    assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": '{"temperature_c": 21}'}
    events = sse_events(rows[1]["response_stream"])
    assert events[-1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in events[-1]


def test_recorded_cli_requests_are_served(gateway: Gateway, session_id: str) -> None:
    """Gemini CLI's own requests (8 tools, JSON-schema routing call) are accepted by the engine as translated."""
    with proxy_env(gateway, session_id):
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(gateway.ca_cert)), timeout=120)
    for name in ("cli_0.61_route_generateContent.json", "cli_0.61_turn_streamGenerateContent.json", "cli_0.61_tool_result_streamGenerateContent.json"):
        fixture = json.loads((FIXTURES / name).read_text())
        body = fixture["body"]
        body["generationConfig"]["maxOutputTokens"] = 4  # the recorded calls set no limit
        reply = http.post("https://generativelanguage.googleapis.com" + fixture["path"], json=body, headers={"x-goog-api-key": "test"})
        assert reply.status_code == 200, reply.text
        if "alt=sse" in fixture["path"]:
            assert reply.headers["content-type"] == "text/event-stream"
            assert sse_events(reply.text)[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
        else:
            assert reply.json()["candidates"][0]["finishReason"] == "MAX_TOKENS"
    rows = exchanges(gateway, session_id)
    assert_rows_match_engine(rows)
    assert [row["model_requested"] for row in rows] == ["gemini-3.5-flash-lite", "gemini-3.1-pro-preview", "gemini-3.8-flash"]
    assert rows[0]["engine_request"]["response_format"]["json_schema"]["schema"]["properties"]["complexity_score"]["type"] == "integer"
    assert len(rows[1]["engine_request"]["tools"]) == 8
    # the CLI numbers its calls itself and echoes the id in the functionResponse
    assistant, tool = rows[2]["engine_request"]["messages"][-2:]
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"] == "list_directory_1795957213998_0"
    assert [row["ignored_fields"] for row in rows] == [["generationConfig.thinkingConfig.thinkingLevel"]] * 2 + [
        ["contents[1].parts[1].thoughtSignature", "generationConfig.thinkingConfig.thinkingLevel"]  # the CLI's synthetic signature
    ]
    assert all(row["engine_request"]["chat_template_kwargs"] == {"enable_thinking": True} for row in rows)


def test_bad_requests_get_google_errors_and_are_recorded(gateway: Gateway, session_id: str) -> None:
    client = sdk_client(gateway, session_id)
    with proxy_env(gateway, session_id):
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(gateway.ca_cert)), timeout=60)
    url = f"{API_ROOT}/{MODEL}:generateContent"

    malformed = http.post(url, content=b'{"contents": [', headers={"content-type": "application/json", "x-goog-api-key": "test"})
    missing = http.post(url, json={"generationConfig": {"temperature": 0}}, headers={"x-goog-api-key": "test"})
    for reply in (malformed, missing):
        assert reply.status_code == 400
        assert set(reply.json()) == {"error"} and set(reply.json()["error"]) == {"code", "message", "status"}
        assert reply.json()["error"]["code"] == 400 and reply.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert "not valid JSON" in malformed.json()["error"]["message"]
    assert "contents" in missing.json()["error"]["message"]

    sdk_failures = {
        "no earlier functionCall": [types.Content(role="user", parts=[types.Part.from_function_response(name="never_called", response={"x": 1})])],
        "audio/wav": [types.Content(role="user", parts=[types.Part.from_bytes(data=b"RIFF0000WAVE", mime_type="audio/wav")])],
    }
    for expected, contents in sdk_failures.items():
        with pytest.raises(errors.ClientError) as failure:
            client.models.generate_content(model=MODEL, contents=contents)
        assert failure.value.code == 400 and failure.value.status == "INVALID_ARGUMENT" and expected in failure.value.message
    with pytest.raises(errors.ClientError, match="candidateCount=2"):
        client.models.generate_content(model=MODEL, contents="hi", config=types.GenerateContentConfig(candidate_count=2))

    # still serving
    assert client.models.generate_content(model=MODEL, contents="hi", config=types.GenerateContentConfig(max_output_tokens=2)).candidates[0].finish_reason

    rows = exchanges(gateway, session_id)
    assert [(row["api"], row["status"], row["http_status"]) for row in rows] == [("gemini", "bad_request", 400)] * 5 + [("gemini", "ok", 200)]
    assert rows[0]["request_body"] == '{"contents": ['
    assert all(row["error"] and row["response_body"]["error"]["status"] == "INVALID_ARGUMENT" for row in rows[:5])
    assert all(row["engine_request"] is None for row in rows[:5])


# -- an engine without a reasoning parser, through `polar-mitm gateway --split-reasoning`


def test_split_reasoning_round_trips_through_thought_signature(make_gateway: Any, session_id: str, engine_url: str) -> None:
    """The engine answers `<think>...</think>` inline before a tool call; google-genai gets a thought part with its
    thoughtSignature, streamed as non-streamed, and sending its Content back gives the engine what it sampled."""
    # --split-reasoning is for an engine that returns reasoning inline: chat mode's (tokens mode splits it itself)
    gateway = make_gateway("--render", "chat", "--split-reasoning", "--engine-hook", f"{Path(steer_gemini.__file__)}:steer_thinking")
    client = sdk_client(gateway, session_id)
    config = types.GenerateContentConfig(
        tools=[WEATHER_TOOL],
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode=types.FunctionCallingConfigMode.AUTO)),
        thinking_config=types.ThinkingConfig(include_thoughts=True),
        max_output_tokens=96,
        temperature=0,
    )
    question = types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])
    response, chunks = both_ways(client, [question], config)
    assert_stream_equals_body(response, chunks)
    thought, call = response.candidates[0].content.parts
    assert (thought.thought, thought.text) == (True, steer_gemini.THOUGHT)
    # the signature is bytes to the SDK; Google places it on the first functionCall part too
    assert reasoning.unseal(thought.thought_signature.decode()) == steer_gemini.THOUGHT and call.thought_signature == thought.thought_signature
    assert (call.function_call.name, call.function_call.args) == ("get_weather", steer_gemini.forced_arguments())
    content = [chunk for chunk in chunks if not is_keepalive(chunk.model_dump(mode="json", by_alias=True, exclude_none=True))]
    assert len(content) == 2  # the thought chunk, then the functionCall chunk

    # turn 2: the SDK's own Content goes back (it re-encodes the signature's bytes URL-safe), with the result
    result = types.Content(role="user", parts=[types.Part.from_function_response(name="get_weather", response={"temperature_c": 21})])
    answer = client.models.generate_content(model=MODEL, contents=[question, response.candidates[0].content, result], config=config)
    assert answer.text == steer_gemini.ANSWER_AFTER_TOOL

    rows = exchanges(gateway, session_id)
    assert [row["stream"] for row in rows] == [False, True, False]
    assert_rows_match_engine(rows)
    # splitting is presentation only: the row keeps the engine's whole sample, `<think>` (151667) first
    assert rows[0]["completion_token_ids"][0] == 151667
    assistant = rows[2]["engine_request"]["messages"][1]
    assert assistant == {"role": "assistant", "content": None, "reasoning_content": steer_gemini.THOUGHT, "tool_calls": [{"id": "call_1_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(steer_gemini.forced_arguments())}}]}
    assert "contents[1]: reasoning restored from thoughtSignature" in rows[2]["normalizations"]
    assert rows[2]["engine_request"]["chat_template_kwargs"] == {"enable_thinking": True}
    # the engine's next prompt holds the assistant turn exactly as the engine sampled it (turn 1, streamed)
    detokenize = lambda ids: httpx.post(engine_url.removesuffix("/v1") + "/detokenize", json={"model": "qwen3-tiny", "tokens": ids}, trust_env=False, timeout=30).json()["prompt"]  # noqa: E731
    sampled_turn = detokenize(rows[1]["completion_token_ids"])
    assert sampled_turn.startswith(steer_gemini.THINKING_TOOL_CALL) and sampled_turn.endswith("<|im_end|>")
    assert f"<|im_start|>assistant\n{sampled_turn}" in detokenize(rows[2]["prompt_token_ids"])
