"""The views' messages and tools per request (session_timeline, harness_prompt_sizes) in both render modes: chat mode
counts the chat request the engine got; tokens mode, where the engine got token ids, counts the harness's own request
in its dialect's terms. A real DuckDB store."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import duckdb
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


def test_a_writers_open_recreates_the_views_only_when_they_are_not_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each view binds every table the exchanges view names (seconds at thousands of segments), so an open re-creates
    them only if one is missing, its definition changed, or what it reads changed its columns. Seen through a marker:
    `breaks` replaced behind the store's back stays so across an open that re-creates nothing."""
    from polar_mitm.store import views

    db = tmp_path / "s.duckdb"

    def raw(sql: str) -> None:
        con = duckdb.connect(str(db))
        try:
            con.execute(sql)
        finally:
            con.close()

    def made_again() -> bool:
        raw("CREATE OR REPLACE VIEW errors AS SELECT 'marker' AS kind")
        Store(db).close()
        con = duckdb.connect(str(db), read_only=True)
        try:
            assert set(views.VIEWS) <= {name for (name,) in con.execute("SELECT view_name FROM duckdb_views()").fetchall()}
            return [d[0] for d in con.execute("SELECT * FROM errors LIMIT 0").description] != ["kind"]
        finally:
            con.close()

    Store(db).close()
    assert not made_again()  # current: none made again
    raw("DROP VIEW token_usage")
    assert made_again()  # one missing
    assert not made_again()
    monkeypatch.setitem(views.VIEWS, "errors", views.View(views.VIEWS["errors"].doc + " Changed.", views.VIEWS["errors"].sql))
    assert made_again()  # a definition changed
    raw("ALTER TABLE sessions ADD COLUMN extra INTEGER")
    assert made_again()  # what they read changed its columns
    assert not made_again()
