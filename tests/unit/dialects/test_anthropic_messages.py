"""Anthropic Messages dialect on its own (no engine, no gateway): Claude Code's recorded requests parse without loss,
prefill and tool_choice translate, thinking blocks stream through the SDK, and generated bodies raise only
DialectError. The live side is tests/integration/test_dialect_anthropic.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.dialects import anthropic_messages, reasoning
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, ToolCall
from tests.support.anthropic_stream import assert_anthropic_grammar

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "anthropic"
MODEL = "claude-opus-4-8"
BASH_TOOL = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
# -- the parser on its own


@pytest.mark.parametrize("name", sorted(path.name for path in FIXTURES.glob("claude_code_*.json")))
def test_claude_code_fixtures_parse_without_loss(name: str) -> None:
    fixture = json.loads((FIXTURES / name).read_text())
    body = fixture["body"]
    parsed = anthropic_messages.parse(json.dumps(body).encode(), fixture["path"].split("?")[0], {"beta": "true"})
    chat, ignored = parsed.chat, set(parsed.ignored)
    assert parsed.stream is True and parsed.action == "generate" and parsed.model == body["model"]
    # every top-level field is translated or recorded as ignored
    mapped = {"model", "messages", "system", "stream", "tools", "thinking", "max_tokens"}
    assert set(body) - mapped <= ignored and set(body) - mapped
    assert chat["max_tokens"] == body["max_tokens"]
    assert chat["chat_template_kwargs"] == {"enable_thinking": body["thinking"]["type"] != "disabled"}
    assert parsed.render["thinking_display"] == body["thinking"].get("display")
    # every text reaches the engine, the per-turn cch= billing line included
    engine_text = json.dumps(chat, ensure_ascii=False)
    for text in _texts(body):
        assert json.dumps(text, ensure_ascii=False) in engine_text
    assert "cch=" in json.dumps(chat["messages"][0]) or "cch=" not in json.dumps(body["system"][0])
    # every tool reaches the engine with its exact schema
    assert [(t["function"]["name"], t["function"]["parameters"], t["function"].get("defer_loading")) for t in chat["tools"]] == [
        (t["name"], t["input_schema"], t.get("defer_loading")) for t in body["tools"]
    ]
    # fields with no engine meaning are recorded with their path
    for path, _value in _walk(body):
        if path.endswith(".cache_control") or re.fullmatch(r"messages\[\d+\]\.output_config", path):
            assert path in ignored, path
    if body["thinking"].get("budget_tokens"):
        assert "thinking.budget_tokens" in ignored
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block["type"] == "tool_use":
                calls = [c for m in chat["messages"] for c in m.get("tool_calls", [])]
                assert {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}} in calls
            if block["type"] == "tool_result":
                assert {"role": "tool", "tool_call_id": block["tool_use_id"], "content": block["content"]} in chat["messages"]


def _texts(body: dict[str, Any]) -> list[str]:
    texts = [body["system"]] if isinstance(body["system"], str) else [block["text"] for block in body["system"]]
    for message in body["messages"]:
        if isinstance(message["content"], str):
            texts.append(message["content"])
        else:
            texts += [block["text"] for block in message["content"] if block["type"] == "text"]
    return texts


def _walk(value: Any, path: str = "") -> list[tuple[str, Any]]:
    found = [(path, value)] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _walk(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _walk(item, f"{path}[{index}]")
    return found


def test_prefill_and_tool_choice_translate() -> None:
    body = {
        "model": MODEL,
        "max_tokens": 10,
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "tools": [BASH_TOOL, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Answer: (A) or (B)?"}, {"role": "assistant", "content": "The answer is ("}],
        "context_management": {"edits": []},
    }
    parsed = anthropic_messages.parse(json.dumps(body).encode(), "/v1/messages")
    chat = parsed.chat
    assert (chat["stop"], chat["temperature"], chat["top_k"], chat["tool_choice"], chat["parallel_tool_calls"]) == (["END"], 0.5, 5, "required", False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is ("}
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["Bash"]
    assert {"context_management", "tools[1] (web_search_20250305)"} <= set(parsed.ignored)
    assert 'tool_choice any -> "required"' in parsed.normalizations


def test_thinking_blocks_stream_through_the_sdk() -> None:
    """The local engine runs without a reasoning parser, so a completion with reasoning is built here: its body and
    its stream, read by the SDK's own event accumulator, are the same message, and its thinking block restores the
    reasoning when sent back."""
    from anthropic._streaming import SSEDecoder
    from anthropic.lib.streaming._messages import accumulate_event

    completion = Completion(
        id="chatcmpl-9f2c", created=0, content="Let me look.", reasoning="The user wants the files listed.",
        tool_calls=[ToolCall(id="chatcmpl-tool-77ab", name="Bash", arguments='{"command": "ls"}')], finish_reason="tool_calls",
        prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], completion_logprobs=[-0.1, -0.2], logprobs_content=None, prompt_tokens=3, completion_tokens=2,
    )
    for display in ("summarized", "omitted"):
        request = {"model": MODEL, "max_tokens": 64, "stream": True, "thinking": {"type": "adaptive", "display": display}, "messages": [{"role": "user", "content": "ls"}]}
        parsed = anthropic_messages.parse(json.dumps(request).encode(), "/v1/messages")
        body = anthropic_messages.render_body(parsed, completion)
        thinking, text, tool_use = body["content"]
        assert thinking == {"type": "thinking", "thinking": "" if display == "omitted" else completion.reasoning, "signature": reasoning.seal(completion.reasoning)}
        assert text == {"type": "text", "text": "Let me look."} and tool_use == {"type": "tool_use", "id": "toolu_77ab", "name": "Bash", "input": {"command": "ls"}}
        assert (body["id"], body["stop_reason"]) == ("msg_9f2c", "tool_use")
        stream = anthropic_messages.render_stream(parsed, completion)
        deltas = [data["delta"]["type"] for name, data in assert_anthropic_grammar(stream.decode()) if name == "content_block_delta"]
        assert deltas == (["signature_delta"] if display == "omitted" else ["thinking_delta", "signature_delta"]) + ["text_delta", "input_json_delta"]
        snapshot, buffers = None, {}
        for event in SSEDecoder().iter_bytes(iter([stream])):
            if event.event != "ping":
                snapshot = accumulate_event(event=event.json(), current_snapshot=snapshot, json_bufs=buffers)
        assert snapshot.model_dump() == anthropic.types.Message.model_validate(body).model_dump()
        # next turn: the client sends the content back; the engine gets the reasoning, also when its text was omitted
        follow_up = {**request, "messages": request["messages"] + [{"role": "assistant", "content": body["content"]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_77ab", "content": "a.txt"}]}]}
        assistant = anthropic_messages.parse(json.dumps(follow_up).encode(), "/v1/messages").chat["messages"][1]
        assert assistant["reasoning_content"] == completion.reasoning and assistant["content"] == "Let me look."


# -- hypothesis: whatever the body, parse() answers a ParsedRequest or a DialectError (a provider-shaped 4xx)

_scalars = st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
_ids = st.sampled_from(["toolu_a", "toolu_b"])
_text = st.text(max_size=8)
_source = st.sampled_from([{"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}, {"type": "url", "url": "https://example.com/a.png"}, {"type": "file", "file_id": "f"}])
_result_part = st.sampled_from([{"type": "text", "text": "out"}, {"type": "tool_reference", "tool_name": "Read"}, {"type": "image", "source": {"type": "url", "url": "u"}}, {"type": "search_result"}])
_block = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}, _text),
    st.builds(lambda source: {"type": "image", "source": source}, _source),
    st.builds(lambda id_, name, args: {"type": "tool_use", "id": id_, "name": name, "input": args}, _ids, st.sampled_from(["Bash", "Read"]), st.dictionaries(_text, _scalars, max_size=2)),
    st.builds(lambda id_, content, error: {"type": "tool_result", "tool_use_id": id_, "content": content, "is_error": error}, _ids, _text | st.lists(_result_part, max_size=2), st.booleans()),
    st.builds(lambda text, signature: {"type": "thinking", "thinking": text, "signature": signature}, _text, st.sampled_from([reasoning.seal("r"), "EqQBCkgIAxABGAIiQ", "polar1.!!", ""])),
    st.just({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}),
    st.sampled_from([{"type": "document", "source": {"type": "text", "data": "d"}}, {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Bash"}}, {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}}, {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {"name": "New", "input_schema": {"type": "object"}}}}]),
)
_message = st.builds(lambda role, content: {"role": role, "content": content}, st.sampled_from(["user", "assistant", "system"]), _text | st.lists(_block, max_size=4))
_tool_turn = st.builds(
    lambda thinking, id_, result: [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": thinking + [{"type": "tool_use", "id": id_, "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id_, "content": result}]},
    ],
    st.sampled_from([[], [{"type": "thinking", "thinking": "", "signature": reasoning.seal("why")}], [{"type": "redacted_thinking", "data": "x"}]]),
    _ids,
    _text | st.lists(_result_part, max_size=2),
)
_tool = st.builds(
    lambda name, kind, deferred: {"name": name, "input_schema": {"type": "object"}, **kind, **deferred},
    st.sampled_from(["Bash", "Read"]),
    st.sampled_from([{}, {"type": "custom"}, {"type": "bash_20250124"}]),
    st.sampled_from([{}, {"defer_loading": True}]),
)
_request = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 100), "messages": st.lists(_message, min_size=1, max_size=5) | st.builds(list.__add__, _tool_turn, st.lists(_message, max_size=2))},
    optional={
        "system": _text | st.lists(st.builds(lambda text: {"type": "text", "text": text}, _text), max_size=2),
        "tools": st.lists(_tool, max_size=3),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "Bash"}, {"type": "none"}]),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive", "display": "omitted"}, {"type": "disabled"}]),
        "stream": st.booleans(),
        "stop_sequences": st.lists(_text, max_size=2),
        "temperature": st.floats(0, 1),
        "top_k": st.integers(1, 50),
        "structured_outputs": st.just({"regex": "a"}),
        "chat_template_kwargs": st.just({"enable_thinking": False}),
        "seed": st.integers(0, 9),
        "context_management": _json,
    },
)


def _mutated(request: dict[str, Any], index: int, junk: Any) -> dict[str, Any]:
    """The request with one value, anywhere in it, replaced by arbitrary JSON."""
    slots: list[tuple[Any, Any]] = []

    def collect(value: Any) -> None:
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            slots.append((value, key))
            collect(item)

    collect(request)
    container, key = slots[index % len(slots)]
    container[key] = junk
    return request


# well-formed requests reach the parser's depths; one mutated value anywhere, or any bytes at all, probe its checks
_bodies = st.one_of(
    _request,
    st.builds(_mutated, _request, st.integers(0, 10_000), _json),
    _json,
).map(lambda value: json.dumps(value).encode()) | st.binary(max_size=40)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_parse_raises_only_dialect_errors(body: bytes, path: str) -> None:
    try:
        parsed = anthropic_messages.parse(body, path, {"beta": "true"})
    except DialectError as error:
        assert 400 <= error.status < 500 and error.message
        shaped = anthropic_messages.error_body(error)
        assert shaped == {"type": "error", "error": {"type": "invalid_request_error", "message": error.message}}
        return
    assert isinstance(parsed, ParsedRequest) and isinstance(parsed.chat["messages"], list)
    assert parsed.action == ("count_tokens" if path.endswith("count_tokens") else "generate")
    json.dumps(parsed.chat)  # the engine request is plain JSON


def test_deeply_nested_json_is_a_bad_request() -> None:
    with pytest.raises(DialectError) as raised:
        anthropic_messages.parse(b'{"model": "m", "max_tokens": 1, "messages": ' + b"[" * 100_000, "/v1/messages")
    assert raised.value.status == 400


