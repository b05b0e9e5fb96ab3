"""The counts a session's trajectory summary carries for a trainer (rollout/node.py ROLLOUT_COUNTS), over a real
store: only trajectory material counts; the bridged fraction is of the tokens-mode turns that could continue an
earlier one (first turns left out)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_mitm.rollout.node import ROLLOUT_COUNTS
from polar_mitm.store import Store


def test_parse_failures_tokens_mode_and_bridged_turns_are_counted_over_material(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    base = {"session_id": "s", "action": "generate", "prompt_token_ids": [1], "completion_token_ids": [2], "render_mode": "tokens"}
    rows = [
        {"status": "ok", "bridged": False, "bridge_reason": "first_turn"},
        {"status": "ok", "bridged": True, "output_parse_error": "hermes tool call not parsed: not JSON"},
        {"status": "ok", "bridged": False, "bridge_reason": "edited_history"},
        {"status": "engine_error", "bridged": True, "output_parse_error": "not counted: no answer"},
    ]

    async def commit() -> None:
        for seq, row in enumerate(rows):
            await store.commit_exchange({**base, **row, "exchange_id": f"e{seq}", "seq": seq})
        await store.commit_exchange({**base, "exchange_id": "chat", "seq": 9, "status": "ok", "render_mode": "chat", "session_id": "other"})

    try:
        asyncio.run(commit())
        assert store.query(ROLLOUT_COUNTS, session="s")[1] == [(1, 3, 1, 2)]  # parse failures, tokens rows, bridged, could be
        assert store.query(ROLLOUT_COUNTS, session="other")[1] == [(0, 0, 0, 0)]
    finally:
        store.close()
