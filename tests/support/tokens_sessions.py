"""Tokens-mode sessions shared by the tests of `--render tokens` and `--render auto`: the steering hooks, an agent's
chat-completions session through a gateway (the official openai SDK as the client), its rows, and the check that
a session assembled into one sequence holding every sampled token once under mask 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from polar_mitm.assembler import assemble
from polar_mitm.store import JSON_COLUMNS
from tests.support import harness_steering, tokens_steering
from tests.support.gatewayproc import Gateway, proxy_env

HOOKS = {name: f"{Path(module.__file__).resolve()}:{name}" for module, name in ((harness_steering, "steer"), (tokens_steering, "think"), (tokens_steering, "broken_call"), (tokens_steering, "coder_xml"))}
TOOL_OUTPUT = "written"
FOLLOW_UP = "Thanks. Is the file there?"
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
SYSTEM = "You are a coding agent. Use the shell tool."
INSTRUCTION = "Create the proof file."


def chat_session(gateway: Gateway, session_id: str, messages: list[dict[str, Any]] | None = None, turns: int = 3) -> list[dict[str, Any]]:
    """`turns` turns of the session from `messages` (default: its start); the conversation so far."""
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-tokens", max_retries=0)
    tools = [{"type": "function", "function": {"name": "run_shell_command", "description": "Run a shell command.", "parameters": SHELL_SCHEMA}}]
    messages = messages or [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INSTRUCTION}]
    for _ in range(turns):
        stream = client.chat.completions.create(model="qwen3-coder-plus", messages=messages, tools=tools, stream=True, max_tokens=512)
        content, calls = "", {}
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
        messages.append({"role": "assistant", "content": content or None, **({"tool_calls": list(calls.values())} if calls else {})})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": TOOL_OUTPUT} for call in calls.values()]
        if not calls:
            messages.append({"role": "user", "content": FOLLOW_UP})
    return messages


def rows_of(gateway: Gateway, session_id: str) -> list[dict[str, Any]]:
    return [{k: json.loads(v) if k in JSON_COLUMNS and isinstance(v, str) else v for k, v in row.items()} for row in gateway.exchanges(session_id)]


def assert_one_sequence_per_session(gateway: Gateway, session_id: str, rows: list[dict[str, Any]]) -> None:
    by_id = {row["exchange_id"]: row for row in rows}
    [sequence] = assemble(gateway.db, builder="prefix_merging", session=session_id).sequences
    assert sequence.exchange_ids == [row["exchange_id"] for row in rows]
    sampled = [token for token, mask in zip(sequence.input_ids, sequence.loss_mask, strict=True) if mask]
    assert sampled == [token for row in rows for token in row["completion_token_ids"]]
    assert [lp for lp, mask in zip(sequence.rollout_logprobs, sequence.loss_mask, strict=True) if mask] == [lp for row in rows for lp in row["completion_logprobs"]]
    assert sequence.input_ids[: sequence.prompt_len] == by_id[sequence.exchange_ids[0]]["prompt_token_ids"]
