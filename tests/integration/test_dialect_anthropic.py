"""Anthropic Messages dialect: the official `anthropic` SDK through HTTPS_PROXY only, the real vLLM engine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from polar_mitm.dialects import reasoning
from tests.support.anthropic_stream import assert_anthropic_grammar, sse_events
from tests.support.gatewayproc import Gateway, proxy_env


@pytest.fixture
def gateway(chat_gateway: Gateway) -> Gateway:
    """The shared gateway in chat mode (`--render chat`): this module checks what the Anthropic dialect hands the
    engine as a chat request. Tokens mode's engine requests are tests/integration/test_tokens_gateway.py's."""
    return chat_gateway


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "anthropic"
MODEL = "claude-opus-4-8"
BASH_TOOL = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
FORCED_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def forced(text: str) -> dict[str, Any]:
    """vLLM structured outputs forcing exactly `text` (the random test model would emit newlines); greedy, so that
    repeated calls also pick the same tokens for it."""
    return {"structured_outputs": {"regex": re.escape(text)}, "temperature": 0}


def sdk_client() -> anthropic.Anthropic:
    # built inside proxy_env: httpx reads HTTPS_PROXY and SSL_CERT_FILE at construction; no base URL
    return anthropic.Anthropic(api_key="sk-ant-polar-test-key", max_retries=0)


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Three calls are three engine samples: message and tool_use ids differ, the rest must not."""
    content = [{k: v for k, v in block.items() if not (block["type"] == "tool_use" and k == "id")} for block in message["content"]]
    return {**{k: v for k, v in message.items() if k != "id"}, "content": content}


def accumulate(events) -> dict[str, Any]:
    """What a `messages.create(stream=True)` user builds from the raw events (independent of the SDK's helper)."""
    message: dict[str, Any] | None = None
    partial_json: dict[int, str] = {}
    for event in events:
        if event.type == "message_start":
            message = event.message.model_dump()
        elif event.type == "content_block_start":
            message["content"].append(event.content_block.model_dump())
        elif event.type == "content_block_delta":
            block, delta = message["content"][event.index], event.delta
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = delta.signature
            elif delta.type == "input_json_delta":
                partial_json[event.index] = partial_json.get(event.index, "") + delta.partial_json
        elif event.type == "content_block_stop":
            if event.index in partial_json:
                message["content"][event.index]["input"] = json.loads(partial_json[event.index])
        elif event.type == "message_delta":
            message["stop_reason"] = event.delta.stop_reason
            message["stop_sequence"] = event.delta.stop_sequence
            message["usage"].update({k: v for k, v in event.usage.model_dump().items() if v is not None})
    return message


def three_ways(client: anthropic.Anthropic, **request: Any) -> tuple[dict, dict, dict]:
    """The same request non-streamed, with create(stream=True), and with messages.stream()."""
    plain = client.messages.create(**request).model_dump()
    with client.messages.create(stream=True, **request) as events:
        streamed = accumulate(events)
    with client.messages.stream(**request) as stream:
        helper = stream.get_final_message().model_dump()
    return plain, streamed, helper


def assert_rows(gateway: Gateway, session_id: str, count: int) -> list[dict[str, Any]]:
    rows = gateway.exchanges(session_id)
    assert len(rows) == count
    for row in rows:
        assert row["api"] == "anthropic_messages" and row["status"] == "ok" and row["http_status"] == 200
        engine = json.loads(row["engine_response"])
        assert row["completion_token_ids"] == engine["choices"][0]["token_ids"]
        assert row["prompt_token_ids"] == engine["prompt_token_ids"]
        if row["stream"]:
            assert_anthropic_grammar(row["response_stream"])
    return rows


def assert_streams_match_rows(rows: list[dict[str, Any]], plain: dict, streamed: dict, helper: dict) -> None:
    """Each streamed answer equals the non-streamed rendering of its own completion, ids included."""
    assert [row["stream"] for row in rows] == [False, True, True]
    assert streamed == anthropic.types.Message.model_validate(json.loads(rows[1]["response_body"])).model_dump()
    assert helper == anthropic.types.Message.model_validate(json.loads(rows[2]["response_body"])).model_dump()
    assert without_ids(plain) == without_ids(streamed) == without_ids(helper)


# -- against the real engine, through the real gateway


@pytest.mark.engine
def test_text_streams_equal_the_message(gateway: Gateway, session_id: str) -> None:
    request = dict(
        model=MODEL,
        max_tokens=32,
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Say hello"}],
        metadata={"user_id": "polar-test"},
        extra_body=forced("Hello from polar"),
    )
    with proxy_env(gateway, session_id):
        plain, streamed, helper = three_ways(sdk_client(), **request)
    assert plain["content"] == [{"type": "text", "text": "Hello from polar", "citations": None}]
    assert plain["stop_reason"] == "end_turn" and plain["model"] == MODEL and plain["id"].startswith("msg_")
    rows = assert_rows(gateway, session_id, 3)
    assert_streams_match_rows(rows, plain, streamed, helper)
    assert plain["usage"]["input_tokens"] == rows[0]["prompt_tokens"] == len(rows[0]["prompt_token_ids"])
    assert plain["usage"]["output_tokens"] == rows[0]["completion_tokens"] == len(rows[0]["completion_token_ids"])
    engine_request = json.loads(rows[0]["engine_request"])
    assert engine_request["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": "Say hello"},
    ]
    assert engine_request["max_tokens"] == 32 and "structured_outputs" in engine_request
    assert {"metadata", "system[0].cache_control"} <= set(rows[0]["ignored_fields"])
    assert "structured_outputs: engine extension passed through" in rows[0]["normalizations"]


@pytest.mark.engine
def test_tool_use_and_tool_result_turns(gateway: Gateway, session_id: str) -> None:
    first = dict(model=MODEL, max_tokens=64, tools=[BASH_TOOL], messages=[{"role": "user", "content": "List the files"}], extra_body=forced(FORCED_CALL))
    with proxy_env(gateway, session_id):
        client = sdk_client()
        plain, streamed, helper = three_ways(client, **first)
        call = plain["content"][-1]
        assert call["type"] == "tool_use" and call["name"] == "Bash" and call["input"] == {"command": "ls -la"}
        assert call["id"].startswith("toolu_") and plain["stop_reason"] == "tool_use"
        rows = assert_rows(gateway, session_id, 3)
        assert_streams_match_rows(rows, plain, streamed, helper)

        # turn 2: Claude Code sends the assistant turn back with the tool's output
        history = [
            {"role": "user", "content": "List the files"},
            {"role": "assistant", "content": plain["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": [{"type": "text", "text": "README.md"}], "is_error": False}]},
        ]
        second = dict(model=MODEL, max_tokens=32, tools=[BASH_TOOL], messages=history, extra_body=forced("There is one file."))
        plain2, streamed2, helper2 = three_ways(client, **second)
    assert plain2["content"] == [{"type": "text", "text": "There is one file.", "citations": None}] and plain2["stop_reason"] == "end_turn"
    rows = assert_rows(gateway, session_id, 6)
    assert_streams_match_rows(rows[3:], plain2, streamed2, helper2)
    sent = json.loads(rows[3]["engine_request"])
    assert sent["tools"] == [{"type": "function", "function": {"name": "Bash", "description": BASH_TOOL["description"], "parameters": BASH_TOOL["input_schema"]}}]
    assistant, tool = sent["messages"][1], sent["messages"][2]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [(call["id"], "Bash", {"command": "ls -la"})]
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": [{"type": "text", "text": "README.md"}]}
    # the engine rendered the tool result into the prompt it sampled from
    assert rows[3]["prompt_tokens"] > rows[0]["prompt_tokens"]


@pytest.mark.engine
def test_thinking_signature_restores_reasoning(gateway: Gateway, session_id: str) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    forced_output = "<think>\nThe user wants a greeting.\n</think>\n\nHello"
    with proxy_env(gateway, session_id):
        client = sdk_client()
        first = client.messages.create(model=MODEL, max_tokens=48, thinking=thinking, messages=[{"role": "user", "content": "Greet me"}], extra_body=forced(forced_output))
        row = gateway.exchanges(session_id)[0]
        engine_reasoning = json.loads(row["engine_response"])["choices"][0]["message"].get("reasoning")
        blocks = [block.model_dump() for block in first.content]
        if engine_reasoning:
            # the engine parsed its reasoning out: a thinking block, text omitted as asked, reasoning in the signature
            assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == ""
            assert reasoning.unseal(blocks[0]["signature"]) == engine_reasoning
        else:
            # an engine without a reasoning parser returns it inline: the client sees exactly what it sampled
            assert blocks == [{"type": "text", "text": forced_output, "citations": None}]
            engine_reasoning = "The user wants a greeting.\n"
            blocks = [{"type": "thinking", "thinking": "", "signature": reasoning.seal(engine_reasoning)}, {"type": "text", "text": "Hello"}]
        answer = [block["text"] for block in blocks if block["type"] == "text"]
        # next turn: the client sends the blocks back (thinking text omitted) and a tool result after a tool call
        history = [
            {"role": "user", "content": "Greet me"},
            {"role": "assistant", "content": blocks + [{"type": "tool_use", "id": "toolu_polar1", "name": "Bash", "input": {"command": "date"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_polar1", "content": "Sun Nov 29", "is_error": True}]},
        ]
        second = client.messages.create(model=MODEL, max_tokens=16, thinking=thinking, tools=[BASH_TOOL], messages=history, extra_body=forced("Done"))
    assert second.stop_reason == "end_turn"
    row = gateway.exchanges(session_id)[1]
    assistant = json.loads(row["engine_request"])["messages"][1]
    assert assistant["reasoning_content"] == engine_reasoning and [assistant["content"]] == answer
    assert json.loads(row["engine_request"])["chat_template_kwargs"] == {"enable_thinking": True}
    assert "messages[1].content[0]: reasoning restored from the thinking signature" in row["normalizations"]
    assert {"thinking.budget_tokens", "messages[2].content[0].is_error"} <= set(row["ignored_fields"])
    # the reasoning sits after the last user query, so the chat template renders it into the prompt
    tokenizer_text = httpx.post(f"{gateway.upstream.removesuffix('/v1')}/detokenize", json={"model": row["model_engine"], "tokens": row["prompt_token_ids"]}).json()["prompt"]
    assert "<think>\n" + engine_reasoning.strip("\n") + "\n</think>" in tokenizer_text


@pytest.mark.engine
def test_stop_sequence_and_prefill(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = sdk_client()
        request = dict(model=MODEL, max_tokens=16, stop_sequences=["STOP"], messages=[{"role": "user", "content": "Talk"}], extra_body=forced("Hello STOP there"))
        stopped = client.messages.create(**request).model_dump()
        with client.messages.create(stream=True, **request) as events:
            streamed = accumulate(events)
        # a final assistant turn is continued, not answered
        prefill = [{"role": "user", "content": "(A) or (B)?"}, {"role": "assistant", "content": "The answer is ("}]
        continued = client.messages.create(model=MODEL, max_tokens=4, messages=prefill, extra_body=forced("B)"))
    assert (stopped["content"][0]["text"], stopped["stop_reason"], stopped["stop_sequence"]) == ("Hello ", "stop_sequence", "STOP")
    assert without_ids(streamed) == without_ids(stopped)
    assert continued.content[0].text == "B)"
    row = assert_rows(gateway, session_id, 3)[2]
    prompt = httpx.post(f"{gateway.upstream.removesuffix('/v1')}/detokenize", json={"model": row["model_engine"], "tokens": row["prompt_token_ids"]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe answer is (")


@pytest.mark.engine
def test_count_tokens_is_the_engine_tokenizers_count(gateway: Gateway, session_id: str) -> None:
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    with proxy_env(gateway, session_id):
        client = sdk_client()
        # thinking disabled changes the prompt (Qwen3 renders an empty think block): the count must see it too
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages, tools=[BASH_TOOL], thinking={"type": "disabled"})
        generated = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=messages, tools=[BASH_TOOL], thinking={"type": "disabled"}, extra_body=forced("ok"))
    # the chat request written by hand, tokenized by vLLM's own /tokenize
    expected = httpx.post(
        f"{gateway.upstream.removesuffix('/v1')}/tokenize",
        json={
            "model": "qwen3-tiny",
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How many tokens is this?"}],
            "tools": [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command", "parameters": BASH_TOOL["input_schema"]}}],
            "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()["count"]
    assert counted.input_tokens == expected == generated.usage.input_tokens
    count_row, generate_row = gateway.exchanges(session_id)
    assert count_row["api"] == "anthropic_messages" and count_row["action"] == "count_tokens" and count_row["status"] == "ok"
    assert json.loads(count_row["response_body"]) == {"input_tokens": expected}
    assert json.loads(count_row["engine_response"]) == {"count": expected}
    # the row records the exact /tokenize body the engine counted
    tokenized = json.loads(count_row["engine_request"])
    assert tokenized == {"model": "qwen3-tiny", "messages": json.loads(generate_row["engine_request"])["messages"], "add_generation_prompt": True, "tools": json.loads(generate_row["engine_request"])["tools"], "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"{gateway.upstream.removesuffix('/v1')}/tokenize", json=tokenized).json()["count"] == expected
    assert generate_row["prompt_tokens"] == expected


@pytest.mark.engine
def test_claude_code_request_through_the_gateway(gateway: Gateway, session_id: str) -> None:
    """A recorded Claude Code tool turn, as sent (only max_tokens lowered and the output forced)."""
    fixture = json.loads((FIXTURES / "claude_code_2.1.332_tool_turn.json").read_text())
    body = {**fixture["body"], "max_tokens": 8, **forced("Done.")}
    with proxy_env(gateway, session_id):
        with httpx.Client() as client:
            response = client.post(f"https://api.anthropic.com{fixture['path']}", json=body, headers={**fixture["headers"], "x-api-key": "sk-ant-polar-test-key"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = assert_anthropic_grammar(response.text)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Done."}
    (row,) = assert_rows(gateway, session_id, 1)
    assert row["path"] == "/v1/messages?beta=true" and row["harness"] == "claude"
    # message_start goes out before the engine has counted the prompt: the count comes with message_delta
    assert events[0][1]["message"]["usage"]["input_tokens"] == 0 and events[-2][1]["usage"]["input_tokens"] == row["prompt_tokens"]
    sent = json.loads(row["engine_request"])
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "system", "assistant", "tool"]
    assert len(sent["tools"]) == len(body["tools"])


@pytest.mark.engine
def test_bad_requests_get_anthropic_errors_and_rows(gateway: Gateway, session_id: str) -> None:
    user = {"role": "user", "content": "hi"}
    bad = [
        (b'{"model": "claude", "max_tokens": 5, "messages": [', "not valid JSON"),
        (json.dumps({"model": "claude", "messages": [user]}).encode(), "max_tokens"),
        (json.dumps({"model": "claude", "max_tokens": 5, "messages": [user, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}).encode(), "toolu_nope"),
        (json.dumps({"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}]}).encode(), "container_upload"),
    ]
    with proxy_env(gateway, session_id):
        with httpx.Client() as client:
            for body, says in bad:
                response = client.post("https://api.anthropic.com/v1/messages", content=body, headers={"content-type": "application/json", "x-api-key": "sk-ant-x"})
                assert response.status_code == 400
                error = response.json()
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and says in error["error"]["message"]
        # the SDK reads the same shape as a typed error; the gateway keeps serving afterwards
        client = sdk_client()
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
        assert raised.value.body["error"]["type"] == "invalid_request_error" and "document" in raised.value.message
        ok = client.messages.create(model=MODEL, max_tokens=8, messages=[user], extra_body=forced("still here"))
    assert ok.content[0].text == "still here"
    rows = gateway.exchanges(session_id)
    assert [row["status"] for row in rows] == ["bad_request"] * 5 + ["ok"]
    assert all(row["api"] == "anthropic_messages" and row["error"] for row in rows[:5])
    assert [json.loads(row["response_body"])["error"]["type"] for row in rows[:5]] == ["invalid_request_error"] * 5
    assert rows[0]["request_body"] == bad[0][0].decode() and rows[1]["model_requested"] == "claude"
    assert "sk-ant-x" not in json.dumps(rows[0]["request_headers"])




# -- an engine without a reasoning parser, through `polar-mitm gateway --split-reasoning`


@pytest.mark.engine
def test_split_reasoning_round_trips_through_the_thinking_signature(make_gateway: Any, session_id: str) -> None:
    """The engine answers `<think>...</think>` inline before a tool call; the client gets a thinking block with its
    signature, streamed as non-streamed, and sending the turn back gives the engine what it sampled."""
    # --split-reasoning is for an engine that returns reasoning inline: chat mode's (tokens mode splits it itself)
    gateway = make_gateway("--render", "chat", "--split-reasoning")
    thought = "The user wants the files; Bash can list them."
    sampled = f"<think>\n{thought}\n</think>\n\n{FORCED_CALL}"
    user = {"role": "user", "content": "List the files"}
    request = dict(model=MODEL, thinking={"type": "enabled", "budget_tokens": 1024}, tools=[BASH_TOOL], tool_choice={"type": "auto"})
    with proxy_env(gateway, session_id):
        client = sdk_client()
        plain, streamed, helper = three_ways(client, **request, max_tokens=96, messages=[user], extra_body=forced(sampled))
        thinking, call = plain["content"]
        assert thinking == {"type": "thinking", "thinking": thought, "signature": reasoning.seal(thought)}
        assert (call["type"], call["name"], call["input"], plain["stop_reason"]) == ("tool_use", "Bash", {"command": "ls -la"}, "tool_use")
        rows = assert_rows(gateway, session_id, 3)
        assert_streams_match_rows(rows, plain, streamed, helper)
        deltas = [data["delta"]["type"] for name, data in sse_events(rows[1]["response_stream"]) if name == "content_block_delta"]
        assert deltas == ["thinking_delta", "signature_delta", "input_json_delta"]
        # turn 2: Claude Code streams; it sends back the message the stream helper built, then the tool result
        tool_use_id = helper["content"][1]["id"]
        history = [user, {"role": "assistant", "content": helper["content"]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "README.md"}]}]
        answer = client.messages.create(**request, max_tokens=16, messages=history, extra_body=forced("There is one file."))
    assert answer.content[0].text == "There is one file."
    rows = assert_rows(gateway, session_id, 4)
    # splitting is presentation only: the row keeps the engine's whole sample, `<think>` (151667) first
    assert rows[0]["completion_token_ids"][0] == 151667
    sent = json.loads(rows[3]["engine_request"])
    assistant = sent["messages"][1]
    assert assistant["reasoning_content"] == thought and sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [(tool_use_id, "Bash", {"command": "ls -la"})]
    # the engine's next prompt holds the assistant turn exactly as the engine sampled it (turn 1, the helper's stream)
    sampled_turn = detokenize(gateway, rows[2]["completion_token_ids"])
    assert sampled_turn.startswith(sampled) and sampled_turn.endswith("<|im_end|>")
    assert f"<|im_start|>assistant\n{sampled_turn}" in detokenize(gateway, rows[3]["prompt_token_ids"])


def detokenize(gateway: Gateway, token_ids: list[int]) -> str:
    reply = httpx.post(f"{gateway.upstream.removesuffix('/v1')}/detokenize", json={"model": "qwen3-tiny", "tokens": token_ids}, trust_env=False, timeout=30)
    return reply.json()["prompt"]
