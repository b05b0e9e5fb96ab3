"""The views' messages and tools per request (session_timeline, harness_prompt_sizes) in both render modes: chat mode
counts the chat request the engine got; tokens mode, where the engine got token ids, counts the harness's own request
in its dialect's terms. A real DuckDB store."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from polar_mitm.store import Store

TOOL = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}
# api -> (the harness's request body, messages and tools as the dialect hands them on)
REQUESTS = {
    "openai_chat": ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "tools": [TOOL, TOOL]}, 2, 2),
    "anthropic_messages": ({"system": "s", "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}, 2, 3),
    "openai_responses": ({"instructions": "s", "input": "hi", "tools": [{"type": "function", "name": "a"}]}, 2, 1),
    "gemini": ({"systemInstruction": {"parts": [{"text": "s"}]}, "contents": [{"role": "user", "parts": [{"text": "hi"}]}] * 3,
                "tools": [{"functionDeclarations": [{"name": "a"}, {"name": "b"}]}, {"functionDeclarations": [{"name": "c"}]}]}, 4, 3),
}


def row(api: str, mode: str, body: dict, messages: int, tools: int) -> dict:
    engine_request = (
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4} if mode == "tokens"
        else {"model": "m", "messages": [{"role": "user", "content": "x"}] * messages, **({"tools": [TOOL] * tools} if tools else {})}
    )
    return {
        "exchange_id": str(uuid.uuid4()), "session_id": f"{api}-{mode}", "seq": 1, "status": "ok", "action": "generate", "api": api,
        "harness": api, "render_mode": mode, "request_body": json.dumps(body), "engine_request": engine_request,
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4], "completion_logprobs": [-0.5],
    }


@pytest.mark.parametrize("mode", ["chat", "tokens"])
def test_messages_and_tools_are_counted_in_both_render_modes(tmp_path: Path, mode: str) -> None:
    store = Store(tmp_path / "store.duckdb")
    try:
        made = [row(api, mode, body, messages, tools) for api, (body, messages, tools) in REQUESTS.items()]
        # a body that is not JSON, refused before any engine call: counted as nothing, not an error of the view
        made.append({**row("openai_chat", mode, {}, 0, 0), "session_id": "broken", "request_body": "{not json", "engine_request": None, "status": "bad_request"})

        async def commit() -> None:
            for exchange in made:
                await store.commit_exchange(exchange)

        asyncio.run(commit())
        timeline = {r[0]: (r[1], r[2]) for r in store.query("SELECT session_id, messages, tools FROM session_timeline")[1]}
        sizes = {r[0]: (r[1], r[2]) for r in store.query("SELECT harness, avg_messages, avg_tools FROM harness_prompt_sizes")[1]}
    finally:
        store.close()
    expected = {api: (messages, tools) for api, (_, messages, tools) in REQUESTS.items()}
    assert {session.removesuffix(f"-{mode}"): counts for session, counts in timeline.items() if session != "broken"} == expected
    assert timeline["broken"] == (0, 0)
    assert sizes == {api: (float(messages), float(tools)) for api, (messages, tools) in expected.items()}
