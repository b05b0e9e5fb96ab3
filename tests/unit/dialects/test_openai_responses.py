"""The OpenAI Responses dialect (Codex's wire API) on its own (no engine, no gateway): Codex's recorded requests parse
without loss, render -> parse round trips, the reasoning carrier and the event grammar, and generated bodies raise
only DialectError. The live side is tests/integration/test_dialect_openai_responses.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.dialects import dialect_for, openai_responses, reasoning
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, ToolCall
from tests.support.responses_stream import accumulate, outline, sse_events

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "responses"
MODEL = "gpt-5.5"
SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
# -- what a client accumulates


# -- Codex's recorded requests, without the engine


def string_leaves(value: Any, path: str = "") -> list[tuple[str, str, str]]:
    """(path, key, text) for every string in a JSON value."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in string_leaves(item, f"{path}.{key}" if path else key)]
    if isinstance(value, list):
        return [leaf for index, item in enumerate(value) for leaf in string_leaves(item, f"{path}[{index}]")]
    return [(path, path.rsplit(".", 1)[-1], value)] if isinstance(value, str) else []


def covered(path: str, ignored: list[str]) -> bool:
    wildcard = re.sub(r"^input\[\d+\]", "input[*]", path)
    wildcard = re.sub(r"(input\[\*\]\.(content|output))\[\d+\]", r"\1[*]", wildcard)
    return any(p == entry or p.startswith(entry + ".") or p.startswith(entry + "[") for entry in ignored for p in (path, wildcard))


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_codex_requests_parse_without_loss(fixture: str) -> None:
    """Every string Codex sent reaches the engine request, or its field is recorded as ignored or normalized."""
    recorded = json.loads((FIXTURES / fixture).read_text())
    assert dialect_for("POST", recorded["path"]) is openai_responses
    parsed = openai_responses.parse(json.dumps(recorded["body"]).encode(), recorded["path"])
    engine_text = json.dumps(parsed.chat, ensure_ascii=False)
    engine_strings = [text for _, _, text in string_leaves(parsed.chat)] + [engine_text]
    notes = "\n".join(parsed.normalizations)
    lost = [
        (path, text[:60])
        for path, key, text in string_leaves(recorded["body"])
        if key not in ("type", "role") and path != "model"  # discriminators mean the mapping itself; the model is checked below
        and not any(text in candidate for candidate in engine_strings)
        and not covered(path, parsed.ignored)
        and repr(text) not in notes
    ]
    assert lost == []
    assert parsed.stream is True and parsed.model == recorded["body"]["model"]
    tool_names = [tool["function"]["name"] for tool in parsed.chat.get("tools", [])]
    assert len(tool_names) == len(set(tool_names)) > 0
    for key in recorded["body"]:
        assert key in openai_responses.CONSUMED or key in parsed.ignored


def test_responses_lite_tools_and_configuration_update() -> None:
    recorded = json.loads((FIXTURES / "codex_responses_lite.json").read_text())
    parsed = openai_responses.parse(json.dumps(recorded["body"]).encode(), recorded["path"])
    kinds = parsed.render["tool_kinds"]
    assert kinds["exec"] == {"kind": "custom", "name": "exec", "namespace": "functions"}
    assert kinds["clock__sleep"] == {"kind": "function", "name": "sleep", "namespace": "clock"}
    assert parsed.chat["reasoning_effort"] == "low" and parsed.chat["parallel_tool_calls"] is False
    assert [m["role"] for m in parsed.chat["messages"]] == ["system"] * 4 + ["user"] * 2
    assert "input[7]: configuration_update reasoning.effort 'low' -> reasoning_effort" in parsed.normalizations


def test_web_search_and_foreign_reasoning_are_recorded_not_dropped() -> None:
    body = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABforeign-provider-blob"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}},
            {"role": "user", "content": "again"},
        ],
        "tools": [{"type": "web_search", "external_web_access": False}],
    }
    parsed = openai_responses.parse(json.dumps(body).encode())
    assert parsed.chat["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert {"input[1].encrypted_content", "input[3]", "tools[0]", "input[*].content[*].annotations"} <= set(parsed.ignored)
    assert "tools" not in parsed.chat


# -- render -> parse, the reasoning carrier and the event grammar, without the engine


def completion(**overrides: Any) -> Completion:
    fields: dict[str, Any] = dict(
        id="chatcmpl-abc123", created=1795950000, content=None, reasoning=None, tool_calls=[], finish_reason="stop",
        prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], completion_logprobs=[-0.5, -0.25],
        logprobs_content=[{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}, {"token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": []}],
        prompt_tokens=3, completion_tokens=2,
    )
    return Completion(**{**fields, **overrides})


def test_rendered_reasoning_round_trips_to_the_next_turn() -> None:
    """An engine that returns reasoning separately (a vLLM reasoning parser) gets it back next turn via
    encrypted_content."""
    body = {"model": MODEL, "input": "List the files.", "tools": [SHELL_TOOL], "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}, "stream": True}
    parsed = openai_responses.parse(json.dumps(body).encode())
    answer = completion(reasoning="Plan: run ls.", tool_calls=[ToolCall(id="call_9", name="shell", arguments='{"cmd": "ls"}')], finish_reason="tool_calls")
    rendered = openai_responses.render_body(parsed, answer)
    thought, call = rendered["output"]
    assert thought["type"] == "reasoning" and reasoning.unseal(thought["encrypted_content"]) == "Plan: run ls."
    assert thought["summary"] == [{"type": "summary_text", "text": "Plan: run ls."}] and thought["content"] == [{"type": "reasoning_text", "text": "Plan: run ls."}]
    assert (call["type"], call["call_id"], call["name"]) == ("function_call", "call_9", "shell")
    events = sse_events(openai_responses.render_stream(parsed, answer))
    assert accumulate(events) == outline(rendered)
    assert events[-1]["response"] == rendered
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_text.delta") < kinds.index("response.reasoning_summary_part.done") < kinds.index("response.function_call_arguments.delta")
    following = {**body, "input": [{"role": "user", "content": "List the files."}, *rendered["output"], {"type": "function_call_output", "call_id": "call_9", "output": "README.md"}]}
    messages = openai_responses.parse(json.dumps(following).encode()).chat["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "reasoning_content": "Plan: run ls.", "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]}
    # without include, no encrypted_content is handed out
    plain = openai_responses.parse(json.dumps({"model": MODEL, "input": "x"}).encode())
    assert "encrypted_content" not in openai_responses.render_body(plain, answer)["output"][0]


def test_max_output_tokens_ends_the_stream_as_incomplete() -> None:
    parsed = openai_responses.parse(json.dumps({"model": MODEL, "input": "x", "max_output_tokens": 2, "include": ["message.output_text.logprobs"]}).encode())
    answer = completion(content="ab", finish_reason="length")
    rendered = openai_responses.render_body(parsed, answer)
    assert (rendered["status"], rendered["incomplete_details"], rendered["output"][0]["status"]) == ("incomplete", {"reason": "max_output_tokens"}, "incomplete")
    assert [p["token"] for p in rendered["output"][0]["content"][0]["logprobs"]] == ["a", "b"]
    events = sse_events(openai_responses.render_stream(parsed, answer))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == rendered


# -- generated bodies


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
ITEM_TYPES = ["message", "reasoning", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "local_shell_call", "tool_search_call", "tool_search_output", "additional_tools", "configuration_update", "web_search_call", "item_reference", "bogus"]
FIELDS = ["role", "content", "call_id", "name", "arguments", "output", "input", "encrypted_content", "summary", "action", "tools", "namespace", "reasoning", "image_url"]
TOOL_TYPES = ["function", "custom", "namespace", "local_shell", "tool_search", "web_search", "mystery"]
NAMES = st.sampled_from(["f", "g", "exec", "functions", "ns"])


def mangled(kinds: list[str], value: st.SearchStrategy) -> st.SearchStrategy:
    """An object of one of these types with any of the known fields, holding anything."""
    return st.fixed_dictionaries({"type": st.sampled_from(kinds)}, optional={key: value for key in FIELDS})


PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "input_file"])}, optional={"text": st.text(max_size=6) | JSON, "refusal": st.text(max_size=6), "image_url": st.just("data:image/png;base64,AAAA") | JSON})
CONTENT = st.text(max_size=8) | st.lists(PART, max_size=3)
WELL_FORMED_TOOL = st.one_of(
    st.builds(lambda name, ns: {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}, **({"namespace": ns} if ns else {})}, NAMES, st.none()),
    st.builds(lambda name: {"type": "custom", "name": name, "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}, NAMES),
    st.builds(lambda name, inner: {"type": "namespace", "name": name, "description": "d", "tools": inner}, NAMES, st.lists(st.builds(lambda n: {"type": "function", "name": n}, NAMES), max_size=2)),
    st.sampled_from([{"type": "local_shell"}, {"type": "tool_search", "execution": "client", "parameters": {"type": "object"}}, {"type": "web_search"}, {"type": "function", "name": "d", "defer_loading": True}]),
)
TOOLS = st.lists(WELL_FORMED_TOOL | mangled(TOOL_TYPES, JSON), max_size=3)
CALL_IDS = st.sampled_from(["call_1", "call_2"])
WELL_FORMED_ITEM = st.one_of(
    st.builds(lambda role, content: {"role": role, "content": content}, st.sampled_from(["user", "assistant", "system", "developer"]), CONTENT),
    st.builds(lambda call_id, name, ns: {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}", **({"namespace": ns} if ns else {})}, CALL_IDS, NAMES, st.none() | NAMES),
    st.builds(lambda call_id, name: {"type": "custom_tool_call", "call_id": call_id, "name": name, "input": "x"}, CALL_IDS, NAMES),
    st.builds(lambda call_id: {"type": "local_shell_call", "call_id": call_id, "status": "completed", "action": {"type": "exec", "command": ["ls"]}}, CALL_IDS),
    st.builds(lambda call_id: {"type": "tool_search_call", "call_id": call_id, "execution": "client", "arguments": {"query": "q"}}, CALL_IDS),
    st.builds(lambda kind, call_id, output: {"type": kind, "call_id": call_id, "output": output}, st.sampled_from(["function_call_output", "custom_tool_call_output", "local_shell_call_output"]), CALL_IDS, CONTENT),
    st.builds(lambda call_id, tools: {"type": "tool_search_output", "call_id": call_id, "status": "completed", "execution": "client", "tools": tools}, CALL_IDS, TOOLS),
    st.builds(lambda text, summary: {"type": "reasoning", "summary": summary, "encrypted_content": text}, st.builds(reasoning.seal, st.text(max_size=8)) | st.text(max_size=8), st.lists(st.builds(lambda t: {"type": "summary_text", "text": t}, st.text(max_size=4)), max_size=1)),
    st.builds(lambda tools: {"type": "additional_tools", "role": "developer", "tools": tools}, TOOLS),
    st.sampled_from([{"type": "configuration_update", "reasoning": {"effort": "low"}}, {"type": "web_search_call", "status": "completed"}, {"type": "item_reference", "id": "msg_1"}]),
)
FIELD_VALUES = JSON | st.sampled_from(["user", "assistant", "developer", "call_1", "f", "{}", "polar1.e30"]) | st.lists(PART, max_size=2)
ITEMS = st.lists(WELL_FORMED_ITEM | mangled(ITEM_TYPES, FIELD_VALUES), max_size=6)
TOOL_CHOICE = st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "allowed_tools", "web_search"])}, optional={"name": NAMES, "mode": st.sampled_from(["auto", "required"]), "tools": st.lists(st.builds(lambda n: {"type": "function", "name": n}, NAMES), max_size=2)})
BODIES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "input": st.text(max_size=8) | ITEMS},
    optional={
        "instructions": st.text(max_size=8),
        "tools": TOOLS,
        "tool_choice": TOOL_CHOICE,
        "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high"]), "summary": st.sampled_from(["auto", "detailed"]), "context": JSON}),
        "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}, optional={"schema": st.just({"type": "object"}) | JSON, "name": st.text(max_size=4)}), "verbosity": st.just("low")}),
        "include": st.lists(st.sampled_from([*openai_responses.INCLUDES, "file_search_call.results"]), max_size=2),
        "max_output_tokens": st.integers(1, 64),
        "stream": st.booleans(),
        "store": st.booleans(),
    },
)
# every field of a near-valid body, one at a time, replaced by anything
MANGLED_BODIES = st.builds(lambda body, key, value: {**body, key: value}, BODIES, st.sampled_from(["model", "input", "instructions", "tools", "tool_choice", "reasoning", "text", "include", "max_output_tokens", "stream", "previous_response_id", "temperature"]), JSON)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES | MANGLED_BODIES | JSON | st.binary(max_size=32))
def test_generated_bodies_only_raise_dialect_errors(body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        parsed = openai_responses.parse(raw, "/v1/responses")
    except DialectError as error:
        assert 400 <= error.status < 500 and error.message
        assert openai_responses.error_body(error)["error"]["message"] == error.message
        return
    assert isinstance(parsed, ParsedRequest) and parsed.chat["messages"]
    json.dumps(parsed.chat)  # what goes to the engine is JSON
    calls = [ToolCall(id="call_x", name=tool["function"]["name"], arguments='{"input": "x", "command": ["ls"], "query": "q"}') for tool in parsed.chat.get("tools", [])[:2]]
    answer = completion(content="ok", tool_calls=calls, finish_reason="tool_calls" if calls else "stop")
    rendered = json.loads(json.dumps(openai_responses.render_body(parsed, answer)))
    events = sse_events(openai_responses.render_stream(parsed, answer))
    assert accumulate(events) == outline(rendered) and events[-1]["response"] == rendered


