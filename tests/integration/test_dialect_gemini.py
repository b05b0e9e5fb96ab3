"""The Gemini dialect: google-genai through HTTPS_PROXY only, the real gateway and the real engine."""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm import store
from polar_mitm.dialects import dialect_for, gemini, reasoning
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, ToolCall
from tests.support import steer_gemini
from tests.support.gatewayproc import Gateway, proxy_env

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


def sse_events(stream: str) -> list[dict[str, Any]]:
    assert stream.endswith("\r\n\r\n") and "event:" not in stream
    return [json.loads(event.removeprefix("data: ")) for event in stream.split("\r\n\r\n") if event]


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
    gateway = make_gateway("--engine-hook", STEER_HOOK)
    client = sdk_client(gateway, session_id)
    config = types.GenerateContentConfig(tools=[WEATHER_TOOL], max_output_tokens=64, temperature=0)
    question = types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])

    # turn 1: a function call
    response, chunks = both_ways(client, [question], config)
    assert_stream_equals_body(response, chunks)
    assert [(call.name, call.args) for call in response.function_calls] == [("get_weather", steer_gemini.forced_arguments())]
    assert response.text.strip() == steer_gemini.PREAMBLE and len(chunks) == 2  # a text chunk, then the functionCall chunk
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


# -- the parser and renderer, without the network


def fixture_bodies() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, json.loads(path.read_text())) for path in sorted(FIXTURES.glob("*.json"))]


def leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for key, sub in value.items() for leaf in leaves(sub, f"{path}.{key}" if path else key)]
    if isinstance(value, list):
        return [leaf for index, sub in enumerate(value) for leaf in leaves(sub, f"{path}[{index}]")]
    return [(path, value)]


def engine_strings(chat: dict[str, Any]) -> list[str]:
    """Every string the engine request carries, JSON-encoded arguments and tool results opened up."""
    found = []
    for _, value in leaves(chat):
        found.append(str(value))
        if isinstance(value, str) and value.startswith("{"):
            found += [str(inner) for _, inner in leaves(json.loads(value))]
    return found


# values that are mapped structurally rather than copied (roles become chat roles, types are lowercased)
STRUCTURAL = {"user", "model", "function", "OBJECT", "STRING", "INTEGER", "BOOLEAN", "ARRAY", "NUMBER", "AUTO", "ANY", "NONE", "application/json"}


@pytest.mark.parametrize("name,fixture", fixture_bodies(), ids=[name for name, _ in fixture_bodies()])
def test_cli_fixtures_parse_without_loss(name: str, fixture: dict[str, Any]) -> None:
    path, _, query = fixture["path"].partition("?")
    assert dialect_for(fixture["method"], path) is gemini
    parsed = gemini.parse(json.dumps(fixture["body"]).encode(), path, dict([query.split("=")]) if query else {})
    assert parsed.stream == path.endswith(":streamGenerateContent") and parsed.model in path
    carried = engine_strings(parsed.chat)
    lost = [
        (where, value)
        for where, value in leaves(fixture["body"])
        if not any(where == field or where.startswith(field + ".") for field in parsed.ignored)
        and value not in STRUCTURAL
        and not any(str(value) in text for text in carried)
    ]
    assert lost == []


def test_tool_turn_pairs_responses_by_name_and_order() -> None:
    call = lambda name, n: {"functionCall": {"name": name, "args": {"n": n}}}  # noqa: E731
    answer = lambda name, n: {"functionResponse": {"name": name, "response": {"n": n}}}  # noqa: E731
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "go"}]},
            {"role": "model", "parts": [call("a", 1), call("b", 2), call("a", 3)]},
            {"role": "user", "parts": [answer("a", 1), {"functionResponse": {**answer("a", 3)["functionResponse"], "id": "made-up"}}, answer("b", 2), {"text": "and now?"}]},
        ],
        "tools": [{"functionDeclarations": [{"name": "a", "parameters": {"type": "OBJECT", "properties": {"n": {"type": "INTEGER", "nullable": True}}}}, {"name": "b"}]}, {"googleSearch": {}}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["a"]}},
    }
    parsed = gemini.parse(json.dumps(body).encode(), f"/v1beta/models/{MODEL}:generateContent")
    messages = parsed.chat["messages"]
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert len(set(ids)) == 3
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in messages[2:]] == [
        ("tool", ids[0], '{"n": 1}'), ("tool", ids[2], '{"n": 3}'), ("tool", ids[1], '{"n": 2}'), ("user", None, "and now?"),
    ]
    # the same history next turn gives the same ids: the engine prompt stays a prefix
    assert [c["id"] for c in gemini.parse(json.dumps(body).encode(), f"/v1beta/models/{MODEL}:generateContent").chat["messages"][1]["tool_calls"]] == ids
    assert parsed.chat["tools"][0]["function"]["parameters"] == {"type": "object", "properties": {"n": {"type": ["integer", "null"]}}}
    assert parsed.chat["tools"][1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert parsed.chat["tool_choice"] == {"type": "function", "function": {"name": "a"}}
    # an id that names no call is paired by name, and recorded as not used
    assert parsed.ignored == ["contents[2].parts[1].functionResponse.id", "tools[1].googleSearch"]


def signature(text: str) -> str:
    """The thoughtSignature carrying `text`: our seal, base64-encoded as Google's bytes fields are."""
    return base64.b64encode(reasoning.seal(text).encode()).decode()


def make_completion(content: str | None, reasoning_text: str | None, calls: list[ToolCall]) -> Completion:
    return Completion(
        id="chatcmpl-test", created=0, content=content, reasoning=reasoning_text, tool_calls=calls, finish_reason="tool_calls" if calls else "stop",
        prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5], completion_logprobs=[-0.5, -0.25, 0.0],
        logprobs_content=[{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.25}, {"token": "c", "logprob": 0.0}], prompt_tokens=2, completion_tokens=3,
    )


@pytest.mark.parametrize("keep_thought_parts", [True, False])
def test_reasoning_round_trips_through_thought_signature(keep_thought_parts: bool) -> None:
    request = {"contents": [{"role": "user", "parts": [{"text": "go"}]}], "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}
    path = f"/v1beta/models/{MODEL}:streamGenerateContent"
    parsed = gemini.parse(json.dumps(request).encode(), path, {"alt": "sse"})
    completion = make_completion("Calling.", "The user wants x; call f.", [ToolCall(id="c1", name="f", arguments='{"x": 1}')])
    body = gemini.render_body(parsed, completion)
    parts = body["candidates"][0]["content"]["parts"]
    assert parts[0] == {"text": "The user wants x; call f.", "thought": True, "thoughtSignature": signature("The user wants x; call f.")}
    assert parts[1:] == [{"text": "Calling."}, {"functionCall": {"name": "f", "args": {"x": 1}}, "thoughtSignature": signature("The user wants x; call f.")}]
    assert body["candidates"][0]["finishReason"] == "STOP"
    assert [part for event in sse_events(gemini.render_stream(parsed, completion).decode()) for part in event["candidates"][0]["content"]["parts"]] == parts

    # Gemini CLI keeps signatures but drops thought parts from its history: either way the reasoning comes back
    history = parts if keep_thought_parts else [part for part in parts if not part.get("thought")]
    request["contents"] += [{"role": "model", "parts": history}, {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"ok": True}}}]}]
    assistant = gemini.parse(json.dumps(request).encode(), path, {"alt": "sse"}).chat["messages"][1]
    assert assistant["reasoning_content"] == "The user wants x; call f."
    assert assistant["content"] == "Calling."


def test_render_without_thoughts_requested_and_with_logprobs() -> None:
    request = {"contents": [{"parts": [{"text": "go"}]}], "generationConfig": {"responseLogprobs": True, "logprobs": 2}}
    parsed = gemini.parse(json.dumps(request).encode(), f"/v1/models/{MODEL}:generateContent")
    assert parsed.chat["top_logprobs"] == 2
    body = gemini.render_body(parsed, make_completion("abc", "hidden", []))
    candidate = body["candidates"][0]
    assert candidate["content"]["parts"] == [{"text": "abc", "thoughtSignature": signature("hidden")}]
    assert candidate["logprobsResult"]["chosenCandidates"][1] == {"token": "b", "logProbability": -0.25}
    assert body["usageMetadata"] == {"promptTokenCount": 2, "candidatesTokenCount": 3, "totalTokenCount": 5}
    assert (body["modelVersion"], body["responseId"]) == (MODEL, "chatcmpl-test")


@pytest.mark.parametrize(
    "path,body,expected",
    [
        ("/v1beta/models/m:streamGenerateContent", {"contents": [{"parts": [{"text": "x"}]}]}, "alt=sse"),
        ("/v1beta/models/m:generateContent", {"contents": [{"role": "model", "parts": [{"functionResponse": {"name": "f", "response": {}}}]}]}, "model turn"),
        ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"fileData": {"fileUri": "gs://x", "mimeType": "text/plain"}}]}]}, "fileData"),
        ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"videoMetadata": {}}]}]}, "no supported data"),
        ("/v1beta/models/m:generateContent", {"contents": [{"role": "model", "parts": [{"text": "x", "functionCall": {"name": "f"}}]}]}, "exactly one kind"),
        ("/v1beta/models/m:generateContent", {"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "role"),
        ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"responseMimeType": "text/plain", "responseSchema": {"type": "STRING"}}}, "responseMimeType"),
        ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["nope"]}}}, "undeclared"),
    ],
)
def test_parse_rejects(path: str, body: dict[str, Any], expected: str) -> None:
    with pytest.raises(DialectError) as failure:
        gemini.parse(json.dumps(body).encode(), path, {})
    assert failure.value.status == 400 and expected in failure.value.message
    assert gemini.error_body(failure.value) == {"error": {"code": 400, "message": failure.value.message, "status": "INVALID_ARGUMENT"}}


def test_snake_case_inline_text_and_count_tokens() -> None:
    body = {
        "system_instruction": {"parts": [{"text": "sys"}]},
        "contents": [{"role": "user", "parts": [{"text": "see"}, {"inline_data": {"mime_type": "text/plain", "data": base64.b64encode(b"file body").decode()}}]}],
        "generation_config": {"max_output_tokens": 5, "stop_sequences": ["END"], "response_mime_type": "text/x.enum", "response_schema": {"type": "STRING", "enum": ["yes", "no"]}, "thinking_config": {"thinking_budget": 0}},
    }
    parsed = gemini.parse(json.dumps(body).encode(), "/v1beta/models/m:generateContent")
    assert parsed.chat["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "text", "text": "file body"}]}]
    assert (parsed.chat["max_tokens"], parsed.chat["stop"], parsed.chat["structured_outputs"]) == (5, ["END"], {"choice": ["yes", "no"]})
    assert "request.system_instruction -> systemInstruction" in parsed.normalizations
    # a zero thinking budget turns the template's thinking off; nothing is left unmapped
    assert parsed.chat["chat_template_kwargs"] == {"enable_thinking": False} and parsed.ignored == []
    counted = gemini.parse(json.dumps({"generateContentRequest": {"model": "models/m", "contents": body["contents"]}}).encode(), "/v1beta/models/m:countTokens")
    assert counted.action == "count_tokens" and counted.ignored == ["generateContentRequest.model"]
    assert gemini.render_count_tokens(counted, 7) == {"totalTokens": 7}


def test_recognizes_paths() -> None:
    assert gemini.recognizes("POST", "/v1beta/models/gemini-2.5-flash:generateContent")
    assert gemini.recognizes("POST", "/v1/models/gemini-2.5-flash:streamGenerateContent")
    assert gemini.recognizes("POST", "/v1beta/models/gemini-2.5-flash:countTokens")
    assert not gemini.recognizes("GET", "/v1beta/models/gemini-2.5-flash:generateContent")
    assert not gemini.recognizes("POST", "/v1beta/models/gemini-2.5-flash:embedContent")
    assert not gemini.recognizes("POST", "/v1/chat/completions")


def test_error_statuses() -> None:
    statuses = {code: gemini.error_body(DialectError(code, "x", "m"))["error"]["status"] for code in (400, 404, 500, 502, 503, 504)}
    assert statuses == {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 500: "INTERNAL", 502: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


# -- generated request bodies: only DialectError may escape

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
names = st.sampled_from(["f", "g"])
signatures = st.none() | st.text(max_size=8) | st.text(max_size=8).map(reasoning.seal) | st.text(max_size=8).map(signature)
# mostly well-formed pieces, so that generated requests reach deep into the parser, with a random value here and there
text_parts = st.fixed_dictionaries({"text": st.text(max_size=8)}, optional={"thought": st.booleans(), "thoughtSignature": signatures})
call_parts = st.fixed_dictionaries({"functionCall": st.fixed_dictionaries({"name": names}, optional={"args": st.dictionaries(st.text(max_size=4), json_values, max_size=2) | json_values, "id": st.text(max_size=4)})}, optional={"thoughtSignature": signatures})
response_parts = st.fixed_dictionaries({"functionResponse": st.fixed_dictionaries({"name": names}, optional={"response": st.dictionaries(st.text(max_size=4), json_values, max_size=2) | json_values, "id": st.text(max_size=4), "parts": st.lists(text_parts, max_size=2) | json_values})})
inline_parts = st.fixed_dictionaries({"inlineData": st.fixed_dictionaries({"mimeType": st.sampled_from(["image/png", "text/plain", "audio/wav", "application/json"]), "data": st.sampled_from(["aGk=", "not base64!", "/w=="])})})
any_part = text_parts | call_parts | response_parts | inline_parts | st.dictionaries(st.text(max_size=6), json_values, max_size=2)
user_turns = st.fixed_dictionaries({"role": st.sampled_from(["user", "function"]), "parts": st.lists(text_parts | response_parts | inline_parts, min_size=1, max_size=3)})
model_turns = st.fixed_dictionaries({"role": st.just("model"), "parts": st.lists(text_parts | call_parts, min_size=1, max_size=3)})
odd_turns = st.fixed_dictionaries({"role": st.sampled_from(["user", "model", "x"]), "parts": st.lists(any_part, max_size=2) | json_values})
contents = st.lists(user_turns | model_turns | odd_turns, min_size=1, max_size=6)
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["STRING", "INTEGER", "string", "TYPE_UNSPECIFIED", "NULL"])}, optional={"nullable": st.booleans(), "minLength": st.sampled_from(["1", 2, "x"])}),
    lambda inner: st.fixed_dictionaries({"type": st.sampled_from(["OBJECT", "object", "ARRAY"])}, optional={"properties": st.dictionaries(st.sampled_from(["a", "type", "items"]), inner, max_size=2), "items": inner, "anyOf": st.lists(inner, max_size=2)}),
    max_leaves=6,
)
declarations = st.fixed_dictionaries({"name": names}, optional={"description": st.text(max_size=4), "parameters": schemas | json_values, "parametersJsonSchema": schemas, "behavior": json_values})
tools = st.lists(st.fixed_dictionaries({}, optional={"functionDeclarations": st.lists(declarations, max_size=2) | json_values, "googleSearch": st.just({})}), max_size=2)
tool_configs = st.fixed_dictionaries({"functionCallingConfig": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["AUTO", "ANY", "NONE", "VALIDATED", "BOGUS"]), "allowedFunctionNames": st.lists(names, max_size=2) | json_values})})
generation_configs = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2) | json_values, "topK": st.integers(1, 50) | st.floats() | json_values, "maxOutputTokens": st.integers(1, 100) | json_values,
        "stopSequences": st.lists(st.text(max_size=3), max_size=2) | json_values, "candidateCount": st.integers(0, 3), "responseMimeType": st.sampled_from(["text/plain", "application/json", "text/x.enum", "image/png"]),
        "responseSchema": schemas | st.just({"type": "STRING", "enum": ["a", "b"]}) | json_values, "responseJsonSchema": schemas, "responseLogprobs": st.booleans(), "logprobs": st.integers(0, 5),
        "responseModalities": st.lists(st.sampled_from(["TEXT", "IMAGE"]), max_size=2), "thinkingConfig": st.fixed_dictionaries({}, optional={"includeThoughts": json_values, "thinkingBudget": st.integers()}) | json_values,
    },
)
requests = st.fixed_dictionaries(
    {"contents": contents},
    optional={"systemInstruction": st.text(max_size=5) | st.fixed_dictionaries({"parts": st.lists(text_parts | any_part, max_size=2)}) | json_values, "tools": tools | json_values, "toolConfig": tool_configs | json_values, "generationConfig": generation_configs | json_values, "safetySettings": json_values},
)
bodies = st.one_of(requests, requests, requests, requests.map(lambda r: {"generateContentRequest": r}), st.dictionaries(st.text(max_size=8), json_values, max_size=4), json_values).map(lambda b: json.dumps(b).encode()) | st.binary(max_size=40)
paths = st.sampled_from([f"/v1beta/models/m:{method}" for method in ("generateContent", "streamGenerateContent", "countTokens")])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, path=paths, alt=st.sampled_from([{}, {"alt": "sse"}]))
def test_generated_bodies_raise_only_dialect_errors(body: bytes, path: str, alt: dict[str, str]) -> None:
    try:
        parsed = gemini.parse(body, path, alt)
    except DialectError as error:
        assert 400 <= error.status < 500
        assert gemini.error_body(error)["error"]["message"]
        return
    assert isinstance(parsed, ParsedRequest)
    json.dumps(parsed.chat)
    completion = make_completion("x", "r", [])
    gemini.render_stream(parsed, completion)


# -- an engine without a reasoning parser, through `polar-mitm gateway --split-reasoning`


def test_split_reasoning_round_trips_through_thought_signature(make_gateway: Any, session_id: str, engine_url: str) -> None:
    """The engine answers `<think>...</think>` inline before a tool call; google-genai gets a thought part with its
    thoughtSignature, streamed as non-streamed, and sending its Content back gives the engine what it sampled."""
    gateway = make_gateway("--split-reasoning", "--engine-hook", f"{Path(steer_gemini.__file__)}:steer_thinking")
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
    assert len(chunks) == 2  # the thought chunk, then the functionCall chunk

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
