"""Tokens mode's engine-free parts: the tool-call and reasoning parsers, the token-in request."""

from __future__ import annotations

import json
from array import array

import orjson
import pytest

from polar_mitm.engines import make_engine
from polar_mitm.engines.base import WireJSON
from polar_mitm.errors import EngineError
from polar_mitm.exchange import Notes
from polar_mitm.render import parsers, token_engine

TOOLS = [{"type": "function", "function": {"name": "run_shell_command", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}}}]


# -- parsers
def test_hermes_tool_calls_reasoning_and_content() -> None:
    text = '<think>\nlook first\n</think>\n\nLet me check.\n<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "pwd"}}\n</tool_call>'
    out = parsers.parse_output(text, "hermes")
    assert (out.reasoning, out.content, out.problem) == ("look first", "Let me check.", None)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("run_shell_command", {"command": "ls"}), ("run_shell_command", {"command": "pwd"})]
    assert len({c.id for c in out.tool_calls}) == 2


def test_qwen3_coder_tool_calls_are_typed_by_the_schema() -> None:
    text = "<tool_call>\n<function=run_shell_command>\n<parameter=command>\necho 'a\nb'\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
    out = parsers.parse_output(text, "qwen3_coder", TOOLS)
    [call] = out.tool_calls
    assert (call.name, json.loads(call.arguments), out.content, out.problem) == ("run_shell_command", {"command": "echo 'a\nb'", "timeout": 30}, None, None)


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"\n</tool_call>', "not JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "string 'name'"),
        ('<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call> and then some prose', "text after the tool calls"),
        ('<tool_call>\n{"name": "x", "arguments": {}}', "not closed"),
    ],
)
def test_a_tool_call_that_does_not_parse_is_text_with_a_reason(text: str, why: str) -> None:
    out = parsers.parse_output(text, "hermes")
    assert out.tool_calls == [] and out.content == text and why in out.problem


def test_reasoning_opened_by_the_prompt_and_cut_off() -> None:
    assert parsers.split_reasoning("still thinking", think_opened=True) == ("still thinking", "")
    assert parsers.split_reasoning("plan\n</think>\n\nanswer", think_opened=True) == ("plan", "answer")
    assert parsers.parse_output("plain answer", "hermes") == parsers.ParsedOutput(content="plain answer", reasoning=None)


# -- the token-in request
def test_token_in_requests_carry_the_sampling_of_the_hooked_chat_request() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 5000, "structured_outputs": {"regex": "a+"}, "seed": 7, "min_tokens": 1}
    notes = Notes()
    assert token_engine.max_new_tokens(chat, 1000, 4096, notes) == 3096  # the harness's limit cut to the room left
    assert notes.normalizations == ["max_tokens 5000 -> 3096: the engine's context is 4096 tokens and the prompt 1000"]
    assert token_engine.max_new_tokens({}, 1000, 4096) == 3096
    with pytest.raises(EngineError) as over:
        token_engine.max_new_tokens(chat, 4096, 4096)
    assert (over.value.status_class, over.value.prompt_tokens, over.value.max_context) == ("context_length_exceeded", 4096, 4096)
    vllm = token_engine.build_request(make_engine("vllm", "http://127.0.0.1:9/v1"), chat, "m", [1, 2, 3], 100)
    assert vllm == {"temperature": 0, "seed": 7, "min_tokens": 1, "structured_outputs": {"regex": "a+"}, "model": "m", "prompt": [1, 2, 3], "max_tokens": 100, "logprobs": 0, "return_token_ids": True, "stream": False}
    sglang = token_engine.build_request(make_engine("sglang", "http://127.0.0.1:9/v1"), chat, "m", [1, 2, 3], 100)
    assert sglang == {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "sampling_seed": 7, "min_new_tokens": 1, "regex": "a+", "max_new_tokens": 100, "skip_special_tokens": False}, "return_logprob": True}
    schema = token_engine.build_request(make_engine("vllm", "http://127.0.0.1:9/v1"), {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "m", [1], 8)
    assert schema["structured_outputs"] == {"json": {"type": "object"}}


def test_a_token_in_request_is_sent_and_stored_as_its_text_and_holds_its_ids_compactly_meanwhile() -> None:
    """While the engine works (seconds, for every session in flight) the request holds its prompt as 4-byte ids and
    its encoded bytes: the bytes are what the HTTP client sends, the text what the store records, and both are the
    list the renderer made, exactly."""
    ids = [151644, 872, 198, *range(100_000, 104_000), 2**32 - 1]
    for kind, key in (("vllm", "prompt"), ("sglang", "input_ids")):
        engine = make_engine(kind, "http://127.0.0.1:9/v1")
        held = array("I", ids)
        sent = token_engine.encode_request(engine, {"temperature": 0.5}, "m", held, 16)
        assert sent[key] is held and held.tolist() == ids  # the caller's 4-byte ids, not a copy, not a list
        built = token_engine.build_request(engine, {"temperature": 0.5}, "m", ids, 16)
        assert json.loads(sent.data) == json.loads(sent.text) == built and sent.data == sent.text.encode()
        assert sent.strict
    beyond = token_engine.encode_request(make_engine("vllm", "http://127.0.0.1:9/v1"), {"seed": 2**70}, "m", array("I", [1, 2]), 8)
    assert json.loads(beyond.text)["prompt"] == [1, 2] and json.loads(beyond.text)["seed"] == 2**70
    assert beyond.data == beyond.text.encode() and not beyond.strict


def test_wire_json_keeps_a_reply_s_text_as_received_and_a_request_s_bytes_as_encoded() -> None:
    reply = WireJSON({"a": 1}, '{"a":   1}')
    assert reply.text == '{"a":   1}' and reply.data == b'{"a":   1}' and reply.text is reply.text  # the store finds slices of it by identity
    request = WireJSON({"text": "é 😀", "n": [1, 2]})
    assert request.data == orjson.dumps({"text": "é 😀", "n": [1, 2]}) and request.text == request.data.decode()
