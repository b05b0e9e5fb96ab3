"""Reading trajectory material from the store, in bounded batches of sessions.

When no other process holds the store, it is read directly (read-only DuckDB, token lists as Arrow
buffers, no per-token Python objects). While a gateway holds it, the same SQL goes through the gateway's
read-only endpoint (`polar_mitm.store.query`); in the gateway's own process, through its open `Store`.
Bodies are never bulk-loaded: only token ids, logprobs and the role list of each request; the diagnosis
fetches full messages for the few exchanges at a break.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from polar_mitm import store
from polar_mitm.store.schema import MATERIAL

# exchange tokens per batch: bounds what one batch holds in memory and what one SQL-endpoint answer carries
BATCH_TOKENS = 8_000_000


@dataclass
class Exchange:
    """One sampled turn, as the assembler needs it (token arrays: int32 ids, float64 logprobs)."""

    exchange_id: str
    session_id: str
    seq: int
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    finish_reason: str | None
    roles: list[str] | None
    retry_count: int | None
    api: str | None
    harness: str | None
    model_requested: str | None
    model_engine: str | None


def prompt_key(exchange: Exchange) -> bytes:
    """Equal for equal prompts (a 128-bit digest of the ids): how repeated requests are recognised."""
    return hashlib.blake2b(exchange.prompt.tobytes(), digest_size=16).digest()


@dataclass
class SessionInfo:
    session_id: str
    task_id: str | None
    status: str | None
    reward: float | None
    metadata: str | None


class Reader:
    """Runs read-only SQL on a store given by path (directly, or through its gateway) or as an open Store."""

    def __init__(self, db_path: str | os.PathLike[str] | None = None, store_object: store.Store | None = None):
        if db_path is None and store_object is None:
            raise ValueError("give a store path or an open Store")
        self.db_path = db_path
        self.store_object = store_object

    def rows(self, sql: str, params: list[Any] | None = None) -> list[Any]:
        if self.store_object is not None:
            return self.store_object.query(sql, params)[1]
        return store.query(self.db_path, sql, params)[1]

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table | None:
        """The result as Arrow when the file can be read directly; None when only the gateway can answer."""
        if self.store_object is not None:
            return self.store_object.arrow(sql, params)
        try:
            con = duckdb.connect(str(self.db_path), read_only=True)
        except duckdb.IOException:
            return None  # another process (the gateway) holds the file
        try:
            return con.sql(sql, params=params or []).to_arrow_table()
        finally:
            con.close()


def session_sizes(read: Reader, session: str | None = None) -> list[tuple[str, int]]:
    """(session_id, tokens) of each session that has trajectory material, in session order."""
    where = MATERIAL + (" AND session_id = ?" if session is not None else "")
    rows = read.rows(
        f"SELECT session_id, sum(len(prompt_token_ids) + coalesce(len(completion_token_ids), 0))::BIGINT FROM exchanges WHERE {where} GROUP BY session_id ORDER BY session_id",
        [session] if session is not None else [],
    )
    return [(row[0], int(row[1])) for row in rows]


def skipped_count(read: Reader, session: str | None = None) -> int:
    where = f"NOT ({MATERIAL})" + (" AND session_id = ?" if session is not None else "")
    rows = read.rows(f"SELECT count(*) FROM exchanges WHERE {where}", [session] if session is not None else [])
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


EXCHANGE_SQL = (
    "SELECT exchange_id, session_id, seq, prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, "
    "json_extract_string(engine_request, '$.messages[*].role') AS roles, retry_count, api, harness, model_requested, model_engine "
    # BETWEEN lets DuckDB skip row groups by their min/max; no ORDER BY, which would sort the token lists too
    f"FROM exchanges WHERE {MATERIAL} AND session_id BETWEEN ? AND ? AND session_id IN (SELECT unnest(?::VARCHAR[]))"
)


def load_exchanges(read: Reader, session_ids: list[str]) -> dict[str, list[Exchange]]:
    """The material exchanges of these sessions, in seq order per session."""
    params = [min(session_ids), max(session_ids), session_ids]
    table = read.arrow(EXCHANGE_SQL, params)
    if table is None:
        rows = read.rows(EXCHANGE_SQL, params)
        prompts = [np.asarray(r[3], dtype=np.int32) for r in rows]
        completions = [np.asarray(r[4] or [], dtype=np.int32) for r in rows]
        logprobs = [np.asarray(r[5] or [], dtype=np.float64) for r in rows]
        plain = rows
    else:
        prompts = _arrays(table.column("prompt_token_ids"), np.int32)
        completions = _arrays(table.column("completion_token_ids"), np.int32)
        logprobs = _arrays(table.column("completion_logprobs"), np.float64)
        names = ["exchange_id", "session_id", "seq", None, None, None, "finish_reason", "roles", "retry_count", "api", "harness", "model_requested", "model_engine"]
        columns = [table.column(n).to_pylist() if n else None for n in names]
        plain = [[c[i] if c else None for c in columns] for i in range(table.num_rows)]
    out: dict[str, list[Exchange]] = {}
    for row, prompt, completion, logprob in zip(plain, prompts, completions, logprobs, strict=True):
        if len(logprob) != len(completion):
            # the gateway refuses such replies; a store written by something else must not misalign the mask
            raise ValueError(f"exchange {row[0]}: {len(completion)} sampled tokens but {len(logprob)} logprobs")
        out.setdefault(row[1], []).append(
            Exchange(row[0], row[1], row[2], prompt, completion, logprob, row[6], row[7], row[8], row[9], row[10], row[11], row[12])
        )
    for exchanges in out.values():
        exchanges.sort(key=lambda e: e.seq)
    return out


def _arrays(column: pa.ChunkedArray, dtype: type) -> list[np.ndarray]:
    """Per-row numpy views of a list column (no copy of the values)."""
    lists = column.combine_chunks()
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False) if len(lists.values) else np.zeros(0, dtype)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(lists))]


def load_sessions(read: Reader, session_ids: list[str]) -> dict[str, SessionInfo]:
    rows = read.rows(
        "SELECT session_id, task_id, status, reward, metadata FROM sessions WHERE session_id IN (SELECT unnest(?::VARCHAR[]))",
        [session_ids],
    )
    return {
        row[0]: SessionInfo(row[0], row[1], row[2], None if row[3] is None else float(row[3]), row[4] if row[4] is None or isinstance(row[4], str) else json.dumps(row[4]))
        for row in rows
    }


def load_messages(read: Reader, exchange_ids: list[str]) -> dict[str, dict[str, Any]]:
    """exchange_id -> {"messages": request messages, "reply": the engine's assistant message} (for diagnosis)."""
    rows = read.rows(
        "SELECT exchange_id, engine_request -> '$.messages' AS messages, engine_response -> '$.choices[0].message' AS reply "
        "FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[]))",
        [exchange_ids],
    )
    return {row[0]: {"messages": _json(row[1]) or [], "reply": _json(row[2]) or {}} for row in rows}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value
