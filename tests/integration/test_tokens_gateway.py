"""`--render tokens` through a real gateway and the real engine, driven by the four official SDKs.

Each session is an agent's lineage: a shell tool call, the tool's result, a text answer, then a follow-up user
turn and another answer. The engine is steered with structured outputs (tests/harness_steering.py), so its
sampled tokens are not the canonical tokenization of the text: in chat mode the next turn's re-rendered prompt
does not extend them. In tokens mode every turn after the first is bridged and the session assembles into one
sequence holding every sampled token once under mask 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from polar_mitm import store
from polar_mitm.assembler import assemble
from polar_mitm.debug import diff as diff_cli
from polar_mitm.util import free_port
from tests.support import harness_steering, tokens_steering
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.tokens_sessions import (
    FOLLOW_UP,
    HOOKS,
    INSTRUCTION,
    SHELL_SCHEMA,
    SYSTEM,
    TOOL_OUTPUT,
    assert_one_sequence_per_session,
    chat_session,
    rows_of,
)


def responses_session(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-tokens", max_retries=0)
    tools = [{"type": "function", "name": "exec_command", "description": "Run a shell command.", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": INSTRUCTION}]}]
    for _ in range(3):
        final = None
        for event in client.responses.create(model="gpt-5-codex", instructions=SYSTEM, input=items, tools=tools, store=False, stream=True):
            if event.type == "response.completed":
                final = event.response
        assert final is not None
        items += [item.model_dump(exclude_none=True) for item in final.output]
        calls = [item for item in final.output if item.type == "function_call"]
        items += [{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT} for call in calls]
        if not calls:
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": FOLLOW_UP}]})


def anthropic_session(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = anthropic.Anthropic(api_key="sk-ant-tokens", max_retries=0)
    tools = [{"name": "Bash", "description": "Run a shell command.", "input_schema": SHELL_SCHEMA}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": INSTRUCTION}]}]
    for _ in range(3):
        with client.messages.stream(model="claude-opus-4-8", max_tokens=1024, system=SYSTEM, tools=tools, messages=messages) as stream:
            message = stream.get_final_message()
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]})
        uses = [block for block in message.content if block.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_OUTPUT} for use in uses]})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": FOLLOW_UP}]})


def gemini_session(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = genai.Client(api_key="tokens")
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(name="run_shell_command", description="Run a shell command.", parameters_json_schema=SHELL_SCHEMA)])
    config = types.GenerateContentConfig(tools=[tool], system_instruction=SYSTEM, automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents: list[types.Content] = [types.Content(role="user", parts=[types.Part(text=INSTRUCTION)])]
    for _ in range(3):
        chunks = list(client.models.generate_content_stream(model="gemini-2.5-pro", contents=contents, config=config))
        parts = [part for chunk in chunks for part in (chunk.candidates[0].content.parts or [])]
        contents.append(types.Content(role="model", parts=parts))
        calls = [part.function_call for part in parts if part.function_call]
        if calls:
            contents.append(types.Content(role="user", parts=[types.Part.from_function_response(name=call.name, response={"output": TOOL_OUTPUT}) for call in calls]))
        else:
            contents.append(types.Content(role="user", parts=[types.Part(text=FOLLOW_UP)]))


SESSIONS = {"openai_chat": chat_session, "openai_responses": responses_session, "anthropic_messages": anthropic_session, "gemini": gemini_session}


def sequence_count(gateway: Gateway, session_id: str) -> int:
    return len(assemble(gateway.db, builder="prefix_merging", session=session_id).sequences)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory, engine_url: str):
    """A tokens-mode and a chat-mode gateway with the same steering."""
    started = {}
    for mode in ("tokens", "chat"):
        base = tmp_path_factory.mktemp(f"gw-{mode}")
        started[mode] = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine_url, args=["--render", mode, "--engine-hook", HOOKS["steer"]]).start()
    yield started
    for gateway in started.values():
        gateway.stop()


@pytest.mark.engine
@pytest.mark.parametrize("api", list(SESSIONS))
def test_every_dialect_bridges_every_turn_into_one_sequence(gateways, api: str, session_id: str) -> None:
    tokens, chat = gateways["tokens"], gateways["chat"]
    SESSIONS[api](tokens, session_id)
    rows = rows_of(tokens, session_id)
    summary = [(r["seq"], r["status"], r["finish_reason"], r["bridged"], r["bridge_reason"], r["error"]) for r in rows]
    assert len(rows) == 3 and all(r["status"] == "ok" and r["api"] == api for r in rows), summary
    assert [r["render_mode"] for r in rows] == ["tokens"] * 3
    assert [(r["bridged"], r["bridge_reason"]) for r in rows] == [(False, "first_turn"), (True, None), (True, None)], summary
    assert [r["finish_reason"] for r in rows] == ["tool_calls", "stop", "stop"], summary
    for row in rows:
        assert row["engine_request"]["prompt"] == row["prompt_token_ids"]  # token-in: the engine got exactly these ids
        assert row["engine_response"]["choices"][0]["token_ids"] == row["completion_token_ids"]
        assert row["output_parse_error"] is None
    # the tool call the client received is the one sampled
    call = json.loads(rows[1]["request_body"])
    assert harness_steering.proof_command() in json.dumps(call)
    assert_one_sequence_per_session(tokens, session_id, rows)

    # the same session in chat mode: the engine re-renders, and the forced (non-canonical) samples break the prefix
    SESSIONS[api](chat, session_id)
    chat_rows = rows_of(chat, session_id)
    assert [r["render_mode"] for r in chat_rows] == ["chat"] * 3 and all(r["bridged"] is None for r in chat_rows)
    assert sequence_count(chat, session_id) == 3


@pytest.mark.engine
def test_a_lineage_survives_a_gateway_restart(tmp_path: Path, engine_url: str, session_id: str) -> None:
    """Issue 29: lineages live in memory, so a restarted gateway made every session's next turn `no_lineage`, a
    full render that breaks the sequence. Now the next turn is matched against the store's rows (`bridge_key`)."""

    def gateway() -> Gateway:
        return Gateway(port=free_port(), db=tmp_path / "store.duckdb", confdir=tmp_path / "confdir", upstream=engine_url, args=["--render", "tokens", "--engine-hook", HOOKS["steer"]]).start()

    first = gateway()
    try:
        messages = chat_session(first, session_id, turns=1)  # the tool call, then the gateway goes
    finally:
        first.stop()
    second = gateway()  # a new process on the same store: nothing of the session in memory
    try:
        chat_session(second, session_id, messages, turns=2)
        rows = rows_of(second, session_id)
        summary = [(r["seq"], r["status"], r["finish_reason"], r["bridged"], r["bridge_reason"], r["error"]) for r in rows]
        assert [(r["bridged"], r["bridge_reason"]) for r in rows] == [(False, "first_turn"), (True, None), (True, None)], summary
        assert len({r["bridge_key"] for r in rows}) == 3 and all(r["bridge_key"] for r in rows), summary
        assert_one_sequence_per_session(second, session_id, rows)
        [stats] = store.query_dicts(second.db, "SELECT * FROM rollout_stats WHERE session_id = ?", [session_id])
        assert (stats["exchanges"], stats["tokens_mode_exchanges"], stats["bridged_fraction"], stats["tool_call_parse_failures"]) == (3, 3, 1.0, 0), stats
    finally:
        second.stop()


@pytest.mark.engine
def test_qwen3_think_stripping_is_bridged_and_breaks_chat_mode(make_gateway, session_id: str) -> None:
    """Turn 1 thinks, then calls the tool. After the follow-up user turn the template drops that <think>."""
    tokens = make_gateway("--render", "tokens", "--engine-hook", HOOKS["think"])
    chat = make_gateway("--render", "chat", "--engine-hook", HOOKS["think"], "--split-reasoning")
    chat_session(tokens, session_id)
    rows = rows_of(tokens, session_id)
    assert [(r["bridged"], r["bridge_reason"]) for r in rows] == [(False, "first_turn"), (True, None), (True, None)]
    assert rows[0]["response_body"]["choices"][0]["message"]["reasoning_content"] == tokens_steering.REASONING
    first = rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"]
    assert rows[2]["prompt_token_ids"][: len(first)] == first  # after the follow-up user turn: the reasoning kept, verbatim
    assert_one_sequence_per_session(tokens, session_id, rows)

    chat_session(chat, session_id)
    assert sequence_count(chat, session_id) == 3


@pytest.mark.engine
def test_qwen3_coder_xml_tool_calls(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--render", "tokens", "--tool-parser", "qwen3_coder", "--engine-hook", HOOKS["coder_xml"])
    chat_session(gateway, session_id)
    rows = rows_of(gateway, session_id)
    assert [(r["finish_reason"], r["bridged"], r["output_parse_error"]) for r in rows] == [("tool_calls", False, None), ("stop", True, None), ("stop", True, None)]
    [call] = rows[0]["response_body"]["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("run_shell_command", {"command": harness_steering.proof_command()})
    assert_one_sequence_per_session(gateway, session_id, rows)


@pytest.mark.engine
def test_a_compacted_history_is_a_new_lineage_with_its_reason(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--render", "tokens", "--engine-hook", HOOKS["steer"])
    chat_session(gateway, session_id)
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-tokens", max_retries=0)
    summary = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summary so far: the proof file was written."}, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": FOLLOW_UP}]
    client.chat.completions.create(model="qwen3-coder-plus", messages=summary, max_tokens=64)
    rows = rows_of(gateway, session_id)
    assert [(r["bridged"], r["bridge_reason"]) for r in rows] == [(False, "first_turn"), (True, None), (True, None), (False, "compaction")]
    sequences = assemble(gateway.db, builder="prefix_merging", session=session_id).sequences
    assert [s.exchange_ids for s in sequences] == [[r["exchange_id"] for r in rows[:3]], [rows[3]["exchange_id"]]]
    # `polar-mitm diff` shows which turns were bridged, and why the last was not
    lines = [diff_cli.summary_line(diff) for diff in diff_cli.overview(gateway.db, session_id)]
    assert [line.split("  ")[1].split(" (")[0] for line in lines] == ["extends", "extends", "new lineage"] and "new lineage (compaction;" in lines[2], lines
    assert lines[0].endswith("; bridged") and lines[1].endswith("; bridged") and lines[2].endswith("; not bridged (compaction)"), lines
    detail = diff_cli.format_diff(diff_cli.diff_turns(gateway.db, session_id, 1))
    assert "render: tokens · seq 2 bridged" in detail and "= [2] assistant: turn's reply" in detail and "+ [3] tool" in detail, detail


@pytest.mark.engine
def test_an_edited_history_is_a_new_lineage_with_its_reason(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--render", "tokens", "--engine-hook", HOOKS["steer"])
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-tokens", max_retries=0)
    tools = [{"type": "function", "function": {"name": "run_shell_command", "description": "Run a shell command.", "parameters": SHELL_SCHEMA}}]
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INSTRUCTION}]
    reply = client.chat.completions.create(model="qwen3-coder-plus", messages=history, tools=tools, max_tokens=512).choices[0].message
    result = [{"role": "tool", "tool_call_id": call.id, "content": TOOL_OUTPUT} for call in reply.tool_calls]
    edited = [history[0], {"role": "user", "content": INSTRUCTION + " Quickly."}, reply.model_dump(exclude_none=True), *result]
    client.chat.completions.create(model="qwen3-coder-plus", messages=edited, tools=tools, max_tokens=512)
    rows = rows_of(gateway, session_id)
    assert [(r["bridged"], r["bridge_reason"]) for r in rows] == [(False, "first_turn"), (False, "edited_history")]
    assert sequence_count(gateway, session_id) == 2


@pytest.mark.engine
def test_a_tool_call_that_does_not_parse_is_returned_as_text_and_flagged(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--render", "tokens", "--engine-hook", HOOKS["broken_call"])
    with proxy_env(gateway, session_id):
        client = anthropic.Anthropic(api_key="sk-ant-tokens", max_retries=0)
    message = client.messages.create(model="claude-opus-4-8", max_tokens=256, system=SYSTEM, tools=[{"name": "Bash", "description": "Run.", "input_schema": SHELL_SCHEMA}], messages=[{"role": "user", "content": INSTRUCTION}])
    assert [block.type for block in message.content] == ["text"] and message.content[0].text.startswith("<tool_call>")
    assert message.stop_reason == "end_turn"
    [row] = rows_of(gateway, session_id)
    assert row["status"] == "ok" and "hermes tool call not parsed: not JSON" in row["output_parse_error"]
    [stats] = store.query_dicts(gateway.db, "SELECT * FROM rollout_stats WHERE session_id = ?", [session_id])
    assert (stats["tool_call_parse_failures"], stats["tokens_mode_exchanges"], stats["bridged_fraction"]) == (1, 1, None), stats


@pytest.mark.engine
@pytest.mark.parametrize(
    "template, error, status, message",
    [
        (None, openai.InternalServerError, 500, "has no chat template"),
        ("{{ raise_exception('this template needs a system message') }}", openai.BadRequestError, 400, "this template needs a system message"),
    ],
    ids=["no_chat_template", "template_raises"],
)
def test_a_prompt_that_cannot_be_rendered_gets_a_provider_shaped_error(make_gateway, session_id: str, engine_url: str, tmp_path: Path, template, error, status: int, message: str) -> None:
    import urllib.request

    with urllib.request.urlopen(engine_url + "/models", timeout=30) as reply:
        root = Path(json.load(reply)["data"][0]["root"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / name, tmp_path / name)
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    gateway = make_gateway("--render", "tokens", "--render-model", str(tmp_path))
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-tokens", max_retries=0)
    with pytest.raises(error) as caught:
        client.chat.completions.create(model="qwen3-coder-plus", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert message in caught.value.body["message"]
    [row] = rows_of(gateway, session_id)
    assert (row["status"], row["http_status"], row["render_mode"]) == ("render_error", status, "tokens") and message in row["error"]
