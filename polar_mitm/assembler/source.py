"""Reading trajectory material from the store, in bounded batches of sessions.

Every read goes through a `polar_mitm.store.StoreReader`: the gateway's own `Store` in its process, a
`UnionStore` over a cluster's nodes, or a `StorePath` (the file read-only when no other process holds it,
else the gateway's read-only SQL endpoint). Token lists come as Arrow buffers, no per-token Python objects.
Bodies are never bulk-loaded: only token ids, logprobs and the role list of each request; the diagnosis
fetches full messages for the few exchanges at a break.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa

from polar_mitm import store
from polar_mitm.store.records import in_batches
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
    policy_version: int | None = None  # the gateway's policy version when the engine call started


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


def open_reader(db_path: str | os.PathLike[str] | None = None, reader: store.StoreReader | None = None) -> store.StoreReader:
    """`reader` if given (an open Store, a UnionStore, ...), else the store at `db_path`, from any process."""
    if reader is not None:
        return reader
    if db_path is None:
        raise ValueError("give a store path or an open store (store=)")
    return store.StorePath(db_path)


def session_sizes(read: store.StoreReader) -> list[tuple[str, int]]:
    """(session_id, tokens) of each session of the store that has trajectory material, in session order."""
    _, rows = read.query(
        f"SELECT session_id, sum(len(prompt_token_ids) + coalesce(len(completion_token_ids), 0))::BIGINT FROM exchanges WHERE {MATERIAL} GROUP BY session_id ORDER BY session_id"
    )
    return [(row[0], int(row[1])) for row in rows]


def skipped_count(read: store.StoreReader) -> int:
    return int(read.query(f"SELECT count(*) FROM exchanges WHERE NOT ({MATERIAL})")[1][0][0])


@dataclass
class SessionCounts:
    material: int  # exchanges that are trajectory material
    tokens: int  # their prompt + sampled tokens
    skipped: int  # the session's other exchanges


# one pass over the exchanges of a few sessions; BETWEEN lets DuckDB skip row groups by their min/max
COUNTS_SQL = (
    f"SELECT session_id, count(*) FILTER (WHERE {MATERIAL}), "
    f"coalesce(sum(len(prompt_token_ids) + coalesce(len(completion_token_ids), 0)) FILTER (WHERE {MATERIAL}), 0)::BIGINT, "
    f"count(*) FILTER (WHERE NOT ({MATERIAL})) "
    "FROM exchanges WHERE session_id BETWEEN ? AND ? AND session_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY session_id"
)


def session_counts(read: store.StoreReader, session_ids: list[str]) -> dict[str, SessionCounts]:
    """What each of these sessions holds, in one query (a session without exchanges is left out). Any query on
    the `exchanges` view scans every segment table's scoping columns (with schema 2's Parquet files it opened every one:
    ~0.3 s at 550 segments, bench/export_results.md), so a scoped assembly asks it twice in all: this, and the token
    lists of its sessions."""
    if not session_ids:
        return {}
    params = [min(session_ids), max(session_ids), session_ids]
    # a gateway's store binds only the tables holding these sessions (polar_mitm.store.session_reads)
    _, rows = read.query(COUNTS_SQL, params, session=session_ids) if isinstance(read, store.ExchangeStore) else read.query(COUNTS_SQL, params)
    return {row[0]: SessionCounts(int(row[1]), int(row[2]), int(row[3])) for row in rows}


def batches(sizes: list[tuple[str, int]], limit: int = BATCH_TOKENS) -> Iterator[list[str]]:
    """Session ids in lists of at most `limit` tokens (a larger session alone), from (session id, tokens) pairs."""
    for batch in in_batches(sizes, itemgetter(1), limit):
        yield [session_id for session_id, _ in batch]


EXCHANGE_SQL = (
    "SELECT exchange_id, session_id, seq, prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, "
    "json_extract_string(engine_request, '$.messages[*].role') AS roles, retry_count, api, harness, model_requested, model_engine, policy_version "
    # BETWEEN lets DuckDB skip row groups by their min/max; no ORDER BY, which would sort the token lists too
    f"FROM exchanges WHERE {MATERIAL} AND session_id BETWEEN ? AND ? AND session_id IN (SELECT unnest(?::VARCHAR[]))"
)


def load_exchanges(read: store.StoreReader, session_ids: list[str]) -> dict[str, list[Exchange]]:
    """The material exchanges of these sessions, in seq order per session."""
    params = [min(session_ids), max(session_ids), session_ids]
    table = read.arrow(EXCHANGE_SQL, params, session=session_ids) if isinstance(read, store.ExchangeStore) else read.arrow(EXCHANGE_SQL, params)
    if table.num_rows == 0:
        return {}
    prompts = _arrays(table.column("prompt_token_ids"), np.int32)
    completions = _arrays(table.column("completion_token_ids"), np.int32)
    logprobs = _arrays(table.column("completion_logprobs"), np.float64)
    names = ["exchange_id", "session_id", "seq", None, None, None, "finish_reason", "roles", "retry_count", "api", "harness", "model_requested", "model_engine", "policy_version"]
    columns = [table.column(n).to_pylist() if n else None for n in names]
    plain = [[c[i] if c else None for c in columns] for i in range(table.num_rows)]
    out: dict[str, list[Exchange]] = {}
    for row, prompt, completion, logprob in zip(plain, prompts, completions, logprobs, strict=True):
        if len(logprob) != len(completion):
            # the gateway refuses such replies; a store written by something else must not misalign the mask
            raise ValueError(f"exchange {row[0]}: {len(completion)} sampled tokens but {len(logprob)} logprobs")
        out.setdefault(row[1], []).append(
            Exchange(row[0], row[1], row[2], prompt, completion, logprob, row[6], row[7], row[8], row[9], row[10], row[11], row[12], row[13])
        )
    for exchanges in out.values():
        exchanges.sort(key=lambda e: e.seq)
    return out


def _arrays(column: pa.ChunkedArray, dtype: type) -> list[np.ndarray]:
    """Per-row numpy views of a list column (no copy of the values)."""
    lists = column.combine_chunks()
    if pa.types.is_null(lists.type):  # every value null (possible in a table built from JSON rows)
        return [np.zeros(0, dtype) for _ in range(len(lists))]
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False) if len(lists.values) else np.zeros(0, dtype)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(lists))]


SESSION_SQL = "SELECT session_id, task_id, status, reward, metadata FROM sessions WHERE "


def load_sessions(read: store.StoreReader, session_ids: list[str]) -> dict[str, SessionInfo]:
    return _session_infos(read.query(SESSION_SQL + "session_id IN (SELECT unnest(?::VARCHAR[]))", [session_ids])[1])


def sessions_of_tasks(read: store.StoreReader, task_ids: list[str]) -> dict[str, SessionInfo]:
    """Every session the store records under one of these tasks (with trajectory material or not)."""
    if not task_ids:
        return {}
    return _session_infos(read.query(SESSION_SQL + "task_id IN (SELECT unnest(?::VARCHAR[]))", [task_ids])[1])


def _session_infos(rows: Sequence[Sequence[Any]]) -> dict[str, SessionInfo]:
    return {
        row[0]: SessionInfo(row[0], row[1], row[2], None if row[3] is None else float(row[3]), row[4] if row[4] is None or isinstance(row[4], str) else json.dumps(row[4]))
        for row in rows
    }


def load_messages(read: store.StoreReader, exchange_ids: list[str]) -> dict[str, dict[str, Any]]:
    """exchange_id -> {"messages": request messages, "reply": the engine's assistant message} (for diagnosis)."""
    _, rows = read.query(
        "SELECT exchange_id, engine_request -> '$.messages' AS messages, engine_response -> '$.choices[0].message' AS reply "
        "FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[]))",
        [exchange_ids],
    )
    return {row[0]: {"messages": _json(row[1]) or [], "reply": _json(row[2]) or {}} for row in rows}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value
