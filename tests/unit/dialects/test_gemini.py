"""The Gemini dialect on its own (no engine, no gateway): Gemini CLI's recorded requests parse without loss, tool turns
pair by name and order, reasoning round-trips through thoughtSignature, paths and error statuses, and generated
bodies raise only DialectError. The live side is tests/integration/test_dialect_gemini.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.dialects import dialect_for, gemini, reasoning
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, ToolCall
from tests.support.gemini_stream import sse_events

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gemini"
MODEL = "gemini-2.5-flash"
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
        ("/v1beta/models/m:generateContent", {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f"}, "text": "x"}]}]}, "holds text and functionCall; a part holds exactly one kind"),
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


