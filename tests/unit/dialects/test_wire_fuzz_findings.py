"""What fuzzing over the wire (tests/integration/test_fuzz_wire.py, bench/fuzz.py) found in the dialects, one test
each: every one was an HTTP 500 for a body a client sent (or for a reply the engine made), where the provider's own
4xx, or a reply, belongs."""

from __future__ import annotations

import json

import pytest

from polar_mitm.dialects import anthropic_messages, gemini, openai_chat, openai_responses
from polar_mitm.dialects.common import load_json_object
from polar_mitm.exchange import Completion, DialectError, StreamState, ToolCall


@pytest.mark.parametrize("role", [[], {}, ["user"], {"a": 1}])
def test_a_chat_message_role_that_is_not_a_string_is_a_400(role: object) -> None:
    # was TypeError: unhashable type: 'list' (the role was looked up in a set): HTTP 500
    body = json.dumps({"model": "m", "messages": [{"role": role, "content": "hi"}]}).encode()
    with pytest.raises(DialectError) as raised:
        openai_chat.parse(body)
    assert raised.value.status == 400 and raised.value.param == "messages[0].role"


@pytest.mark.parametrize("escaped", ["\\ud800", "\\udfff", "a\\ud83dz", "\\udb2e\\udc4b\\udfff"])
def test_a_lone_surrogate_in_a_string_becomes_a_replacement_character(escaped: str) -> None:
    # JSON.stringify of a string cut inside an emoji sends "\ud83d"; orjson refuses it, json took it as a lone
    # surrogate that nothing downstream can encode: the engine call raised UnicodeEncodeError, HTTP 500
    body = f'{{"model": "m\\ud800", "messages": [{{"role": "user", "content": "{escaped}", "k\\udfff": ["{escaped}"]}}]}}'.encode()
    data = load_json_object(body)
    message = data["messages"][0]
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # what the engine is sent: encodes now
    assert data["model"] == "m\ufffd" and "\ufffd" in message["content"] and "k\ufffd" in message
    assert "\U0001f600" == load_json_object(b'{"s": "\\ud83d\\ude00"}')["s"]  # a valid pair stays one character


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_and_are_a_400(constant: str) -> None:
    # json accepts them; the engine got `"temperature": NaN` as it was sent
    with pytest.raises(DialectError) as raised:
        load_json_object(f'{{"model": "m", "temperature": {constant}, "messages": []}}'.encode())
    assert raised.value.status == 400 and constant in raised.value.message


def test_a_body_nested_deeper_than_json_parses_is_a_400() -> None:
    with pytest.raises(DialectError) as raised:
        load_json_object(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert raised.value.status == 400 and "deeply" in raised.value.message


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", "null", '"text"', "{"])
def test_a_gemini_call_whose_arguments_are_not_an_object_is_rendered_not_a_500(arguments: str) -> None:
    # was ValueError (and JSONDecodeError for text): a sample the engine made, answered HTTP 500
    parsed = gemini.parse(b'{"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}', "/v1beta/models/gemini-2.5-flash:streamGenerateContent", {"alt": "sse"})
    completion = Completion("chatcmpl-1", 1, None, None, [ToolCall("call_1", "run_shell_command", arguments)], "tool_calls", [1], [2], [-0.5], None, 1, 1)
    body = gemini.render_body(parsed, completion)
    (part,) = body["candidates"][0]["content"]["parts"]
    assert part["functionCall"] == {"name": "run_shell_command", "args": {"_arguments": arguments}}  # as Anthropic keeps it
    assert b"_arguments" in gemini.stream_body(parsed, StreamState("chatcmpl-1", 1), completion)


@pytest.mark.parametrize("dialect", [openai_chat, openai_responses, anthropic_messages, gemini])
def test_every_dialect_refuses_lone_surrogates_in_raw_utf8_with_a_400(dialect: object) -> None:
    # the same surrogate sent raw (not escaped) is invalid UTF-8: refused as not JSON, never a 500
    path = "/v1beta/models/m:generateContent" if dialect is gemini else ""
    with pytest.raises(DialectError) as raised:
        dialect.parse('{"model": "m", "x": "\ud800"}'.encode("utf-8", "surrogatepass"), path)  # type: ignore[attr-defined]
    assert raised.value.status == 400
