"""Reading trajectory material from the store, in bounded batches of sessions.

Everything goes through `polar_mitm.store.query` (or an in-process `Store.query`), so it works while a
gateway owns the file: then the gateway's read-only SQL endpoint answers. Bodies are never bulk-loaded:
only token ids, logprobs and the role list of each request; the diagnosis fetches full messages for the
few exchanges at a break.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from polar_mitm import store

# (sql, params) -> (columns, rows)
Reader = Callable[..., tuple[list[str], list[Any]]]

MATERIAL = "status = 'ok' AND coalesce(action, 'generate') = 'generate' AND NOT coalesce(replay, false) AND prompt_token_ids IS NOT NULL"
# exchanges per query: bounds what one batch holds in memory and what one SQL-endpoint answer carries
BATCH_TOKENS = 20_000_000


@dataclass
class Exchange:
    """One sampled turn, as the assembler needs it."""

    exchange_id: str
    session_id: str
    seq: int
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    finish_reason: str | None
    roles: list[str] | None
    retry_count: int | None
    api: str | None
    harness: str | None
    model_requested: str | None
    model_engine: str | None


@dataclass
class SessionInfo:
    session_id: str
    task_id: str | None
    status: str | None
    reward: float | None
    metadata: str | None


def reader_for(db_path: str | os.PathLike[str] | None = None, store_object: store.Store | None = None) -> Reader:
    if store_object is not None:
        return store_object.query
    if db_path is None:
        raise ValueError("give a store path or an open Store")
    return partial(store.query, db_path)


def session_sizes(read: Reader, session: str | None = None) -> list[tuple[str, int]]:
    """(session_id, tokens) of each session that has trajectory material, in session order."""
    where = MATERIAL + (" AND session_id = ?" if session is not None else "")
    _, rows = read(
        f"SELECT session_id, sum(len(prompt_token_ids) + coalesce(len(completion_token_ids), 0))::BIGINT FROM exchanges WHERE {where} GROUP BY session_id ORDER BY session_id",
        [session] if session is not None else [],
    )
    return [(row[0], int(row[1])) for row in rows]


def skipped_count(read: Reader, session: str | None = None) -> int:
    where = f"NOT ({MATERIAL})" + (" AND session_id = ?" if session is not None else "")
    _, rows = read(f"SELECT count(*) FROM exchanges WHERE {where}", [session] if session is not None else [])
    return int(rows[0][0])


def batches(sizes: list[tuple[str, int]], limit: int = BATCH_TOKENS) -> Iterator[list[str]]:
    batch: list[str] = []
    total = 0
    for session_id, tokens in sizes:
        if batch and total + tokens > limit:
            yield batch
            batch, total = [], 0
        batch.append(session_id)
        total += tokens
    if batch:
        yield batch


def load_exchanges(read: Reader, session_ids: list[str]) -> dict[str, list[Exchange]]:
    """The material exchanges of these sessions, in seq order per session."""
    _, rows = read(
        "SELECT exchange_id, session_id, seq, prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, "
        "json_extract_string(engine_request, '$.messages[*].role') AS roles, retry_count, api, harness, model_requested, model_engine "
        f"FROM exchanges WHERE {MATERIAL} AND session_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY session_id, seq",
        [session_ids],
    )
    out: dict[str, list[Exchange]] = {}
    for row in rows:
        completion = row[4] or []
        logprobs = row[5] or []
        if len(logprobs) != len(completion):
            # the gateway refuses such replies; a store written by something else must not misalign the mask
            raise ValueError(f"exchange {row[0]}: {len(completion)} sampled tokens but {len(logprobs)} logprobs")
        out.setdefault(row[1], []).append(
            Exchange(row[0], row[1], row[2], row[3], completion, logprobs, row[6], row[7], row[8], row[9], row[10], row[11], row[12])
        )
    return out


def load_sessions(read: Reader, session_ids: list[str]) -> dict[str, SessionInfo]:
    _, rows = read(
        "SELECT session_id, task_id, status, reward, metadata FROM sessions WHERE session_id IN (SELECT unnest(?::VARCHAR[]))",
        [session_ids],
    )
    return {
        row[0]: SessionInfo(row[0], row[1], row[2], None if row[3] is None else float(row[3]), row[4] if row[4] is None or isinstance(row[4], str) else json.dumps(row[4]))
        for row in rows
    }


def load_messages(read: Reader, exchange_ids: list[str]) -> dict[str, dict[str, Any]]:
    """exchange_id -> {"messages": request messages, "reply": the engine's assistant message} (for diagnosis)."""
    _, rows = read(
        "SELECT exchange_id, engine_request -> '$.messages' AS messages, engine_response -> '$.choices[0].message' AS reply "
        "FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[]))",
        [exchange_ids],
    )
    return {row[0]: {"messages": _json(row[1]) or [], "reply": _json(row[2]) or {}} for row in rows}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value
