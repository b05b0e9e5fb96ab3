"""Store rows shaped like the gateway's, for tests that need a store without running an engine."""

from __future__ import annotations

import asyncio
import json
import os
import random
import uuid

import orjson

from polar_mitm.engines.base import WireJSON, _decode
from polar_mitm.store import ExchangeRow, Store, now


def exchange_row(session: str, seq: int, prompt_len: int = 2000, rng: random.Random | None = None) -> ExchangeRow:
    """A row shaped like the gateway's: the engine reply as its wire text, prompt ids parsed from it."""
    rng = rng or random.Random(seq)
    prompt = [rng.randrange(150_000) for _ in range(prompt_len)]
    sampled = [rng.randrange(150_000) for _ in range(12)]
    logprobs = [-rng.random() * 5 for _ in sampled]
    reply = _decode(orjson.dumps({
        "id": f"chatcmpl-{seq}", "prompt_token_ids": prompt,
        "choices": [{"message": {"content": "ok"}, "token_ids": sampled, "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in logprobs]}}],
    }).decode())
    return {
        "exchange_id": str(uuid.uuid4()), "session_id": session, "seq": seq, "api": "openai_chat", "action": "generate",
        "stream": seq % 2 == 0, "status": "ok", "http_status": 200, "model_requested": "gpt-4o", "harness": "qwen",
        "request_headers": {"user-agent": "t"}, "request_body": json.dumps({"messages": [{"role": "user", "content": f"turn {seq} \"quoted\" é"}]}),
        "ignored_fields": ["metadata", "a,b"], "normalizations": [], "engine_request": WireJSON({"model": "m", "messages": []}),
        "engine_response": reply, "response_body": {"choices": [{"message": {"content": "ok"}}]},
        "prompt_token_ids": reply["prompt_token_ids"], "completion_token_ids": sampled, "completion_logprobs": logprobs,
        "finish_reason": "stop", "prompt_tokens": prompt_len, "completion_tokens": len(sampled),
        "started_at": now(), "ended_at": now(),
    }


def commit_in_order(target: Store, rows: list[ExchangeRow]) -> None:
    """Commit `rows` one after another through the gateway's commit path, each durable before the next."""

    async def commit_all() -> None:
        for row in rows:
            await target.commit_exchange(row)

    asyncio.run(commit_all())


def fill_the_disk_under(target: Store) -> None:
    """A real failure of the real store, provoked in-process: from now on its commit log writes to /dev/full (every
    write fails with ENOSPC, as on a full disk), so each commit is refused."""
    full = os.open("/dev/full", os.O_WRONLY)
    log = target._log
    if log._fd is None:
        log._fd = full
    else:
        os.dup2(full, log._fd)
        os.close(full)
