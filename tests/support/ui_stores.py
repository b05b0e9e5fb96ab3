"""Stores for the dashboard's tests and benchmark: sessions shaped like an agent loop, written by the real writer.

`session_rows` makes one session's exchanges from tests/support/rows.py's `exchange_row`, where the dashboard looks:
a prompt that grows turn by turn (a system prompt and tools, then +CONTEXT_TOKENS context and SAMPLED_TOKENS
sampled tokens a turn, so prefix merging makes one sequence of it), chat messages and tools in the engine request,
a policy version that moves every 5 turns, and one exchange in 20 an engine error (no tokens).
"""

from __future__ import annotations

import asyncio
import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson

from polar_mitm.engines.base import WireJSON, _decode
from polar_mitm.store import Store
from tests.support.rows import exchange_row

SYSTEM_TOKENS = 1000
CONTEXT_TOKENS = 100
SAMPLED_TOKENS = 40
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}: does a thing.", "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}} for i in range(6)]
SYSTEM = "You are a coding agent. " * 80


def session_rows(rng: random.Random, session_id: str, turns: int, start: datetime, model_engine: str | None = "qwen3-tiny") -> list[dict]:
    """The session's exchanges, in seq order, `start` + 4 s a turn."""
    prompt = [rng.randrange(150_000) for _ in range(SYSTEM_TOKENS)]
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task for {session_id}: fix the bug."}]
    rows = []
    for seq in range(1, turns + 1):
        at = start + timedelta(seconds=seq * 4 + rng.random())
        row = exchange_row(session_id, seq, prompt_len=1, rng=rng)
        sampled = [rng.randrange(150_000) for _ in range(SAMPLED_TOKENS)]
        logprobs = [-rng.random() * 3 for _ in sampled]
        reply = _decode(orjson.dumps({
            "id": f"chatcmpl-{seq}", "prompt_token_ids": prompt,
            "choices": [{"message": {"role": "assistant", "content": f"step {seq}", "tool_calls": [{"id": f"c{seq}", "type": "function", "function": {"name": "tool_1", "arguments": "{\"arg\": \"x\"}"}}]},
                         "token_ids": sampled, "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in logprobs]}}],
        }).decode())
        row.update(
            engine_request=WireJSON({"model": "qwen3-tiny", "messages": list(messages), "tools": TOOLS}), engine_response=reply,
            prompt_token_ids=reply["prompt_token_ids"], completion_token_ids=sampled, completion_logprobs=logprobs,
            prompt_tokens=len(prompt), completion_tokens=len(sampled), model_engine=model_engine, policy_version=seq // 5,
            started_at=at, engine_started_at=at, engine_ended_at=at + timedelta(seconds=1), ended_at=at + timedelta(seconds=1.1),
        )
        if seq % 20 == 7:  # an engine error: no tokens, not trajectory material
            row.update(status="engine_error", error="engine answered 500", http_status=502, prompt_token_ids=None, completion_token_ids=None,
                       completion_logprobs=None, prompt_tokens=None, completion_tokens=None, engine_response=None)
        rows.append(row)
        if row["status"] == "ok":
            messages += [{"role": "assistant", "content": f"step {seq}", "tool_calls": [{"id": f"c{seq}", "type": "function", "function": {"name": "tool_1", "arguments": "{\"arg\": \"x\"}"}}]},
                         {"role": "tool", "tool_call_id": f"c{seq}", "content": f"result {seq}"}]
            prompt = prompt + sampled + [rng.randrange(150_000) for _ in range(CONTEXT_TOKENS)]
    return rows


async def write_store(db: Path, sessions: int, turns: int, model_engine: str | None = "qwen3-tiny") -> None:
    """`sessions` sessions of `turns` exchanges through the real writer, then their rollout-server rows: tasks of 10
    sessions (`task-000`, ...), every 23rd session failed, rewards 0/1 (every 5th task all 1: no signal), timings."""
    rng = random.Random(7)
    store = Store(db)
    start = datetime.now(UTC) - timedelta(hours=1)
    try:
        for first in range(0, sessions, 25):
            batch = [row for index in range(first, min(first + 25, sessions)) for row in session_rows(rng, f"s{index:04d}", turns, start + timedelta(seconds=index * 3), model_engine)]
            await asyncio.gather(*(store.commit_exchange(row) for row in batch))
        for index in range(sessions):
            created = start + timedelta(seconds=index * 3)
            timings = {"queued": {"started_at": created.isoformat(), "ended_at": (created + timedelta(seconds=1)).isoformat(), "seconds": 1.0},
                       "running": {"started_at": (created + timedelta(seconds=1)).isoformat(), "ended_at": (created + timedelta(seconds=90)).isoformat(), "seconds": 89.0}}
            status = "failed" if index % 23 == 0 else "completed"
            reward = 1.0 if index // 10 % 5 == 0 else float(rng.random() < 0.5)  # every 5th task all 1: no signal
            # as the rollout server records a session (an upsert: the writer may not have counted its exchanges yet)
            store.execute_write(
                "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, task_id, status, reward, timings) VALUES (?, ?, ?, 0, ?, ?, ?, ?) "
                "ON CONFLICT (session_id) DO UPDATE SET task_id = excluded.task_id, status = excluded.status, reward = excluded.reward, timings = excluded.timings",
                [f"s{index:04d}", created, created, f"task-{index // 10:03d}", status, reward, json.dumps(timings)],
            )
    finally:
        store.close()
