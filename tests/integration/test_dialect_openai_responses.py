"""The OpenAI Responses dialect (Codex's wire API): the official `openai` SDK through HTTPS_PROXY only, the real
gateway and the real engine; Codex's recorded requests; bad input; generated bodies."""

from __future__ import annotations

import json
import re
import ssl
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.dialects import dialect_for, openai_responses, reasoning
from polar_mitm.exchange import Completion, DialectError, ParsedRequest, ToolCall
from tests.support.gatewayproc import Gateway, proxy_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "responses"
MODEL = "gpt-5.5"
SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}}
AGENTS_NAMESPACE = {
    "type": "namespace",
    "name": "collaboration",
    "description": "Tools for managing sub-agents.",
    "tools": [{"type": "function", "name": "list_agents", "description": "List live agents.", "strict": False, "parameters": {"type": "object", "properties": {"path_prefix": {"type": "string"}}}}],
}


def forced(text: str) -> dict[str, Any]:
    """vLLM structured outputs: the engine samples exactly this text (a vLLM extension the dialect passes on)."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# -- what a client accumulates


def sse_events(stream: bytes | str) -> list[dict[str, Any]]:
    """Split the raw SSE bytes; every event has an `event:` line naming its type, and JSON data."""
    text = stream.decode() if isinstance(stream, bytes) else stream
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and "\n" not in data
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == head.removeprefix("event: ")
        events.append(event)
    return events


def accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rebuild the output from deltas alone, checking the grammar on the way: sequence numbers, item ids,
    output and content indexes, each `.done` agreeing with its deltas. Returns the items' essentials."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
    response_id = events[0]["response"]["id"]
    assert all(e["response"]["id"] == response_id for e in (events[0], events[1], events[-1]))
    items: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    for event in events[2:-1]:
        kind, index = event["type"], event["output_index"]
        if kind == "response.output_item.added":
            assert index == len(items) and index not in items
            items[index] = {"id": event["item"]["id"], "type": event["item"]["type"], "name": event["item"].get("name"), "namespace": event["item"].get("namespace"), "text": "", "parts": []}
            continue
        item = items[index]
        assert index not in done
        if kind == "response.output_item.done":
            assert event["item"]["id"] == item["id"]
            done[index] = event["item"]
            continue
        assert event["item_id"] == item["id"]
        if kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            slot = event.get("content_index", event.get("summary_index"))
            item["parts"].append(kind)
            assert slot == sum(1 for part in item["parts"] if part == kind) - 1 and event["part"]["text"] == ""
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta", "response.custom_tool_call_input.delta", "response.reasoning_text.delta"):
            item["text"] += event["delta"]
        elif kind == "response.output_text.done" or kind == "response.reasoning_text.done":
            assert event["text"] == item["text"]
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == item["text"]
        elif kind == "response.custom_tool_call_input.done":
            assert event["input"] == item["text"]
        else:
            assert kind in ("response.content_part.done", "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"), kind
    assert sorted(done) == sorted(items)
    assert [done[i] for i in sorted(done)] == events[-1]["response"]["output"]
    return [{k: v for k, v in items[i].items() if k not in ("id", "parts")} for i in sorted(items)]


def outline(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The same essentials, read from a non-streamed Response."""
    summary = []
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            text = item["arguments"]
        elif item["type"] == "custom_tool_call":
            text = item["input"]
        elif item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
        else:
            text = ""
        summary.append({"type": item["type"], "name": item.get("name"), "namespace": item.get("namespace"), "text": text})
    return summary


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """Two engine calls differ in ids and clock only (`parsed*` is what responses.stream() adds itself)."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id", "parsed_arguments")} for item in response["output"]]
    for item in out["output"]:
        if item["type"] == "message":
            item["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in item["content"]]
    return out


def three_ways(client: openai.OpenAI, **request: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The non-streamed Response, the raw events of create(stream=True), and responses.stream()'s final Response."""
    plain = client.responses.create(**request).to_dict()
    events = [event.to_dict() for event in client.responses.create(**request, stream=True)]
    with client.responses.stream(**request) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response().to_dict()
    assert text == "".join(item["text"] for item in outline(plain) if item["type"] == "message")
    return plain, events, final


def assert_streams_match(plain: dict[str, Any], events: list[dict[str, Any]], final: dict[str, Any]) -> None:
    assert accumulate(events) == outline(plain)
    assert without_ids(events[-1]["response"]) == without_ids(plain)
    assert without_ids(final) == without_ids(plain)


def assert_rows(rows: list[dict[str, Any]], streams: list[bool]) -> None:
    """Each stored row: this API, the stream flag, and the engine's own token ids and logprobs."""
    assert [(r["api"], r["stream"], r["status"], r["http_status"]) for r in rows] == [("openai_responses", s, "ok", 200) for s in streams]
    for row in rows:
        engine = as_json(row["engine_response"])
        assert row["prompt_token_ids"] == engine["prompt_token_ids"]
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert row["completion_logprobs"] == [item["logprob"] for item in engine["choices"][0]["logprobs"]["content"]]
        assert len(row["completion_token_ids"]) > 0
        sent = as_json(row["engine_request"])
        assert sent["stream"] is False and sent["logprobs"] is True and "structured_outputs" in sent
        assert "structured_outputs: engine extension, passed through to the engine" in as_json(row["normalizations"])
        if row["stream"]:
            stored = sse_events(row["response_stream"])
            assert stored[-1]["response"] == as_json(row["response_body"])


# -- the official SDK against the real engine


@pytest.mark.engine
def test_text_streams_accumulate_the_non_streamed_answer(gateway: Gateway, session_id: str) -> None:
    request = dict(model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=16, temperature=0, extra_body=forced("Hello from the engine."))
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test-responses-key-0001")
        plain, events, final = three_ways(client, **request)
        counted = client.responses.input_tokens.count(model=MODEL, instructions="Be brief.", input="Say hello.")
    assert outline(plain) == [{"type": "message", "name": None, "namespace": None, "text": "Hello from the engine."}]
    assert plain["model"] == MODEL and plain["status"] == "completed" and plain["id"].startswith("resp_")
    assert_streams_match(plain, events, final)
    rows = gateway.exchanges(session_id)
    assert_rows(rows[:3], [False, True, True])
    assert plain["usage"]["input_tokens"] == len(rows[0]["prompt_token_ids"]) and plain["usage"]["output_tokens"] == len(rows[0]["completion_token_ids"])
    sent = as_json(rows[0]["engine_request"])
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    assert sent["max_tokens"] == 16 and sent["model"] == "qwen3-tiny"
    # /v1/responses/input_tokens is the engine tokenizer's count of the same prompt
    assert (rows[3]["api"], rows[3]["action"], rows[3]["status"]) == ("openai_responses", "count_tokens", "ok")
    assert counted.input_tokens == plain["usage"]["input_tokens"]
    assert "sk-test-responses-key-0001" not in json.dumps(rows, default=str)


@pytest.mark.engine
def test_tool_call_and_tool_result_turn_stream_like_the_non_streamed_answer(gateway: Gateway, session_id: str) -> None:
    user = {"role": "user", "content": "Create out.txt saying hi."}
    call = {"type": "function", "name": "shell", "arguments": {"cmd": "echo hi > out.txt"}}
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test")
        turn1 = dict(model=MODEL, input=[user], tools=[SHELL_TOOL], tool_choice="auto", max_output_tokens=64, temperature=0, extra_body=forced(tool_call_text("shell", call["arguments"])))
        plain, events, final = three_ways(client, **turn1)
        [function_call] = plain["output"]
        assert (function_call["type"], function_call["name"], json.loads(function_call["arguments"])) == ("function_call", "shell", call["arguments"])
        assert function_call["call_id"] and function_call["status"] == "completed"
        assert_streams_match(plain, events, final)
        # turn 2: the call and its output go back; the engine answers in text
        history = [user, *plain["output"], {"type": "function_call_output", "call_id": function_call["call_id"], "output": "done"}]
        turn2 = dict(model=MODEL, input=history, tools=[SHELL_TOOL], max_output_tokens=8, temperature=0, extra_body=forced("File written."))
        plain2, events2, final2 = three_ways(client, **turn2)
    assert outline(plain2) == [{"type": "message", "name": None, "namespace": None, "text": "File written."}]
    assert_streams_match(plain2, events2, final2)
    rows = gateway.exchanges(session_id)
    assert_rows(rows, [False, True, True] * 2)
    sent = as_json(rows[0]["engine_request"])
    assert sent["tools"] == [{"type": "function", "function": {k: v for k, v in SHELL_TOOL.items() if k != "type"}}] and sent["tool_choice"] == "auto"
    assert as_json(rows[0]["engine_response"])["choices"][0]["finish_reason"] == "tool_calls"
    messages = as_json(rows[3]["engine_request"])["messages"]
    assert messages[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": function_call["call_id"], "type": "function", "function": {"name": "shell", "arguments": function_call["arguments"]}}]},
        {"role": "tool", "tool_call_id": function_call["call_id"], "content": "done"},
    ]
    # the output item ids the client echoed back are recorded as ignored, not silently dropped
    assert "input[*].id" in as_json(rows[3]["ignored_fields"])


@pytest.mark.engine
def test_codex_tool_shapes_render_back_as_declared(gateway: Gateway, session_id: str) -> None:
    """A freeform (custom) tool call comes back as custom_tool_call; a namespaced tool, delivered the responses-lite
    way in an additional_tools input item, comes back as a function_call with its namespace."""
    patch = "*** Begin Patch\n*** Add File: hi.txt\n+hi\n*** End Patch\n"
    lite_tools = {"type": "additional_tools", "role": "developer", "tools": [AGENTS_NAMESPACE]}
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test")
        custom = dict(model=MODEL, input="Add hi.txt.", tools=[PATCH_TOOL], max_output_tokens=96, temperature=0, extra_body=forced(tool_call_text("apply_patch", {"input": patch})))
        plain, events, final = three_ways(client, **custom)
        namespaced = client.responses.create(model=MODEL, input=[lite_tools, {"role": "user", "content": "Who is running?"}], max_output_tokens=48, temperature=0, extra_body=forced(tool_call_text("collaboration__list_agents", {})))
    assert [(i["type"], i["name"], i["input"]) for i in plain["output"]] == [("custom_tool_call", "apply_patch", patch)]
    assert_streams_match(plain, events, final)
    assert [(i.type, i.name, i.namespace, i.arguments) for i in namespaced.output] == [("function_call", "list_agents", "collaboration", "{}")]
    rows = gateway.exchanges(session_id)
    assert_rows(rows, [False, True, True, False])
    stored_events = [e["type"] for e in sse_events(rows[1]["response_stream"])]
    assert "response.custom_tool_call_input.delta" in stored_events and "response.custom_tool_call_input.done" in stored_events
    [patch_tool] = as_json(rows[0]["engine_request"])["tools"]
    assert patch_tool["function"]["name"] == "apply_patch" and patch_tool["function"]["parameters"]["required"] == ["input"]
    assert [t["function"]["name"] for t in as_json(rows[3]["engine_request"])["tools"]] == ["collaboration__list_agents"]
    assert "input[0].tools[0].description" in as_json(rows[3]["ignored_fields"])


@pytest.mark.engine
def test_reasoning_item_restores_the_engine_reasoning(gateway: Gateway, session_id: str, engine_url: str) -> None:
    """A reasoning item whose encrypted_content the gateway sealed gives the engine its original reasoning back."""
    thought = "I should list the files first."
    history = [
        {"role": "user", "content": "List the files."},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": thought}], "encrypted_content": reasoning.seal(thought)},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
    ]
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test")
        response = client.responses.create(model=MODEL, input=history, tools=[SHELL_TOOL], include=["reasoning.encrypted_content"], reasoning={"summary": "auto"}, max_output_tokens=8, temperature=0, extra_body=forced("One file."))
    assert response.output_text == "One file."
    [row] = gateway.exchanges(session_id)
    assert_rows([row], [False])
    assistant = as_json(row["engine_request"])["messages"][1]
    assert assistant["reasoning_content"] == thought and assistant["tool_calls"][0]["id"] == "call_1"
    prompt = httpx.post(engine_url.removesuffix("/v1") + "/detokenize", json={"model": "qwen3-tiny", "tokens": row["prompt_token_ids"]}, trust_env=False, timeout=30).json()["prompt"]
    assert f"<think>\n{thought}\n</think>" in prompt


# -- bad input


def post(gateway: Gateway, session_id: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    context = ssl.create_default_context(cafile=str(gateway.ca_cert))
    with httpx.Client(proxy=gateway.proxy_url(session_id), verify=context, trust_env=False, timeout=60) as client:
        return client.post("https://api.openai.com/v1/responses", content=content, headers={"content-type": "application/json", "authorization": "Bearer sk-x"})


@pytest.mark.engine
def test_bad_input_gets_openai_errors_is_recorded_and_the_gateway_keeps_serving(gateway: Gateway, session_id: str) -> None:
    user = {"role": "user", "content": "x"}
    cases = [
        (b'{"model": "gpt-5.5", "input": ', "not valid JSON", None),
        ({"model": MODEL}, "missing required parameter 'input'", "input"),
        ({"input": "hi"}, "missing required parameter 'model'", "model"),
        ({"model": MODEL, "input": [user, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "No tool call found for function call output with call_id call_nope", "input"),
        ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "'input_file'", "input[0].content[0].type"),
        ({"model": MODEL, "input": "hi", "previous_response_id": "resp_1"}, "keeps no response state", "previous_response_id"),
    ]
    for body, message, param in cases:
        response = post(gateway, session_id, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    ok = post(gateway, session_id, {"model": MODEL, "input": "x", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["object"] == "response"
    rows = gateway.exchanges(session_id)
    assert [(r["api"], r["status"], r["http_status"]) for r in rows] == [("openai_responses", "bad_request", 400)] * len(cases) + [("openai_responses", "ok", 200)]
    assert all(r["error"] and r["request_body"] and as_json(r["response_body"])["error"]["message"] == r["error"] for r in rows[:-1])
    # the SDK surfaces the same error as its own exception type
    with proxy_env(gateway, session_id), pytest.raises(openai.BadRequestError, match="No tool call found"):
        openai.OpenAI(api_key="sk-test").responses.create(model=MODEL, input=[user, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])


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


# -- an engine without a reasoning parser, through `polar-mitm gateway --split-reasoning`


@pytest.mark.engine
def test_split_reasoning_round_trips_through_encrypted_content(make_gateway: Any, session_id: str, engine_url: str) -> None:
    """The engine answers `<think>...</think>` inline before a tool call; the client gets a reasoning item with
    encrypted_content, streamed as non-streamed, and sending the items back gives the engine what it sampled."""
    gateway = make_gateway("--split-reasoning")
    thought = "The user wants the files listed, so I run ls."
    arguments = {"cmd": "ls"}
    user = {"role": "user", "content": "List the files."}
    request = dict(model=MODEL, tools=[SHELL_TOOL], tool_choice="auto", include=["reasoning.encrypted_content"], reasoning={"summary": "auto"}, temperature=0)
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-test")
        sampled = f"<think>\n{thought}\n</think>\n\n" + tool_call_text("shell", arguments)
        plain, events, final = three_ways(client, **request, input=[user], max_output_tokens=96, extra_body=forced(sampled))
        item, call = plain["output"]
        assert (item["type"], item["content"], item["summary"]) == ("reasoning", [{"type": "reasoning_text", "text": thought}], [{"type": "summary_text", "text": thought}])
        assert reasoning.unseal(item["encrypted_content"]) == thought
        assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "shell", arguments)
        assert_streams_match(plain, events, final)
        kinds = [event["type"] for event in events]
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_summary_text.delta") < kinds.index("response.function_call_arguments.delta")
        # turn 2, the way Codex builds its history: the stream's finished output items, then the tool's output
        streamed_items = [event["item"] for event in events if event["type"] == "response.output_item.done"]
        history = [user, *streamed_items, {"type": "function_call_output", "call_id": streamed_items[1]["call_id"], "output": "README.md"}]
        answer = client.responses.create(**request, input=history, max_output_tokens=8, extra_body=forced("One file."))
    assert answer.output_text == "One file."
    rows = gateway.exchanges(session_id)
    assert_rows(rows, [False, True, True, False])
    # splitting is presentation only: the row keeps the engine's whole sample, `<think>` (151667) first
    assert rows[0]["completion_token_ids"][0] == 151667 and as_json(rows[0]["engine_response"])["choices"][0]["message"]["content"].startswith("<think>")
    streamed_call = streamed_items[1]
    assistant = as_json(rows[3]["engine_request"])["messages"][1]
    assert assistant == {"role": "assistant", "content": None, "reasoning_content": thought, "tool_calls": [{"id": streamed_call["call_id"], "type": "function", "function": {"name": "shell", "arguments": streamed_call["arguments"]}}]}
    # the engine's next prompt holds the assistant turn exactly as the engine sampled it (turn 1, streamed)
    sampled_turn = detokenize(engine_url, rows[1]["completion_token_ids"])
    assert sampled_turn.startswith(sampled) and sampled_turn.endswith("<|im_end|>")
    assert f"<|im_start|>assistant\n{sampled_turn}" in detokenize(engine_url, rows[3]["prompt_token_ids"])


def detokenize(engine_url: str, token_ids: list[int]) -> str:
    reply = httpx.post(engine_url.removesuffix("/v1") + "/detokenize", json={"model": "qwen3-tiny", "tokens": token_ids}, trust_env=False, timeout=30)
    return reply.json()["prompt"]
