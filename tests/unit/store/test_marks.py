"""A mark (schema.MARKS_TABLE) gives a committed exchange its later status, the way a reply that never reached its
client becomes `client_disconnected`: every reader of `exchanges` sees it, whether the row is still in a journal or
in a segment, after a reopen, and through a snapshot and the union of nodes a head reads. A real DuckDB store."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from polar_mitm.store import Store
from polar_mitm.store.reading import ClosedStore
from polar_mitm.store.schema import MATERIAL
from polar_mitm.store.union import UnionStore


def rows(n: int, session_id: str = "s") -> list[dict]:
    return [
        {"exchange_id": str(uuid.uuid4()), "session_id": session_id, "seq": seq, "status": "ok", "action": "generate", "api": "openai_chat", "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4]}
        for seq in range(1, n + 1)
    ]


def statuses(reader, exchange_ids: list[str]) -> list[tuple]:
    return [tuple(row) for row in reader.query("SELECT status, error FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY seq", [exchange_ids])[1]]


def test_a_mark_is_what_every_reader_of_exchanges_sees(tmp_path: Path) -> None:
    db = tmp_path / "store.duckdb"
    store = Store(db, segment_rows=4)  # the first rows are compacted into a segment before the end
    made = rows(6)

    async def commit() -> None:
        for row in made:
            await store.commit_exchange(row)
        await store.commit_mark(made[0]["exchange_id"], "client_disconnected", "not delivered: the client had closed its connection")
        await store.commit_mark(made[5]["exchange_id"], "client_disconnected", "not delivered: reset")

    asyncio.run(commit())
    ids = [row["exchange_id"] for row in made]
    marked = [("client_disconnected", "not delivered: the client had closed its connection"), *[("ok", None)] * 4, ("client_disconnected", "not delivered: reset")]
    assert statuses(store, ids) == marked
    assert store.query(f"SELECT count(*) FROM exchanges WHERE {MATERIAL}")[1] == [(4,)]  # never trajectory material
    assert store.query("SELECT count(*) FROM errors")[1] == [(2,)]
    snapshot = store.snapshot("n0", tmp_path / "snapshots")
    store.close()
    with UnionStore([snapshot]) as union:  # a head's view of the node
        assert statuses(union, ids) == marked
        assert union.query(f"SELECT count(*) FROM exchanges WHERE {MATERIAL}")[1] == [(4,)]
    with ClosedStore(db) as closed:  # every row in a segment now
        assert statuses(closed, ids) == marked
    Store(db).close()  # reopened by a writer: the marks stay
    with ClosedStore(db) as closed:
        assert statuses(closed, ids) == marked
