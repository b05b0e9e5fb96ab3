"""The OpenAI Responses dialect (Codex's wire API): the official `openai` SDK through HTTPS_PROXY only, the real
gateway and the real engine; bad input. The pure parser/renderer tests are in tests/unit/dialects/."""

from __future__ import annotations

import json
import re
import ssl
from typing import Any

import httpx
import openai
import pytest

from polar_mitm.dialects import reasoning
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.responses_stream import accumulate, outline, sse_events


@pytest.fixture
def gateway(chat_gateway: Gateway) -> Gateway:
    """The shared gateway in chat mode (`--render chat`): this module checks what the Responses dialect hands the
    engine as a chat request. Tokens mode's engine requests are tests/integration/test_tokens_gateway.py's."""
    return chat_gateway


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





# -- an engine without a reasoning parser, through `polar-mitm gateway --split-reasoning`


@pytest.mark.engine
def test_split_reasoning_round_trips_through_encrypted_content(make_gateway: Any, session_id: str, engine_url: str) -> None:
    """The engine answers `<think>...</think>` inline before a tool call; the client gets a reasoning item with
    encrypted_content, streamed as non-streamed, and sending the items back gives the engine what it sampled."""
    # --split-reasoning is for an engine that returns reasoning inline: chat mode's (tokens mode splits it itself)
    gateway = make_gateway("--render", "chat", "--split-reasoning")
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
