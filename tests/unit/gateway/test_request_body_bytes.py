"""A request body goes into its row as the bytes the client sent when they are UTF-8: no decoded copy of a 30-60 KB
harness request held beside the flow's while its exchange runs, no encoding again on the way into the store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mitmproxy import http
from mitmproxy.test import tflow

from polar_mitm.gateway import flows
from polar_mitm.store import Store

BODIES = {
    "ascii": b'{"messages": [{"role": "user", "content": "hi"}]}',
    "utf8": '{"messages": [{"role": "user", "content": "漢字 é 😀"}]}'.encode(),
    "invalid": b'{"raw": "\xff\xfe bytes \xed\xa0\x80"}',  # not UTF-8, an encoded surrogate among them
}


def test_a_body_is_kept_as_its_bytes_and_reads_back_as_text_invalid_utf8_replaced(tmp_path: Path) -> None:
    rows = {}
    for name, body in BODIES.items():
        flow = tflow.tflow()
        flow.request = http.Request.make("POST", "https://api.openai.com/v1/chat/completions", body, {"content-type": "application/json"})
        row, to_parse = flows.request_row(flow, "openai_chat", "/v1/chat/completions", name, 1, None)
        assert to_parse == body
        rows[name] = {**row, "status": "ok"}
    assert all(rows[name]["request_body"] == body for name, body in BODIES.items())  # as sent, not decoded copies
    store = Store(tmp_path / "bodies.duckdb")
    try:
        asyncio.run(store.commit_exchange(rows["ascii"]))  # alone, then two at once (one group commit: an Arrow batch)

        async def both() -> None:
            await asyncio.gather(*(store.commit_exchange(rows[name]) for name in ("utf8", "invalid")))

        asyncio.run(both())
        found = dict(store.query("SELECT session_id, request_body FROM exchanges")[1])
    finally:
        store.close()
    assert found == {name: body.decode("utf-8", "replace") for name, body in BODIES.items()}
