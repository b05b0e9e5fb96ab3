"""The store's contract, at the bottom of the import graph: every other polar_mitm module may import this one,
and it imports nothing of ours.

- EXCHANGE_COLUMNS: the `exchanges` columns and their DuckDB types (a public interface: add, never rename);
  ExchangeRow, the same fields as a typed dict, is what the gateway hands Store.commit_exchange.
- SESSION_COLUMNS: the `sessions` table.
- MARKS_TABLE / MARK_COLUMNS: an exchange's later status (a reply that could not be delivered), which the
  `exchanges` view shows instead of the committed one.
- MATERIAL: the SQL filter for trajectory material (what the assembler trains on).
- TRAJECTORIES / TRAJECTORIES_SCHEMA: the assembler's table and Parquet schema (written by
  polar_mitm.assembler.export, read by the views).
- COMPLETED_STATUSES: the session statuses that count as complete (rewards, the reward view).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from itertools import accumulate
from pathlib import Path
from typing import Any, TypedDict

import pyarrow as pa

SCHEMA_VERSION = 4  # 1: an exchanges table; 2: Parquet segments beside the file; 3: segment tables in the file; 4: and merged tables

EXCHANGE_COLUMNS: dict[str, str] = {
    "exchange_id": "VARCHAR NOT NULL",
    "session_id": "VARCHAR NOT NULL",
    "seq": "INTEGER NOT NULL",
    "api": "VARCHAR",
    "action": "VARCHAR",
    "stream": "BOOLEAN",
    "status": "VARCHAR NOT NULL",
    "error": "VARCHAR",
    "http_status": "INTEGER",
    "model_requested": "VARCHAR",
    "model_engine": "VARCHAR",
    "engine_kind": "VARCHAR",
    "method": "VARCHAR",
    "host": "VARCHAR",
    "path": "VARCHAR",
    "harness": "VARCHAR",
    "user_agent": "VARCHAR",
    "lineage": "JSON",
    "retry_count": "INTEGER",
    "replay": "BOOLEAN",
    "request_headers": "JSON",
    "request_body": "VARCHAR",
    "ignored_fields": "VARCHAR[]",
    "normalizations": "VARCHAR[]",
    "engine_request": "JSON",
    "engine_response": "JSON",
    "response_body": "JSON",
    "response_stream": "VARCHAR",
    "prompt_token_ids": "INTEGER[]",
    "completion_token_ids": "INTEGER[]",
    "completion_logprobs": "DOUBLE[]",
    "finish_reason": "VARCHAR",
    "prompt_tokens": "INTEGER",
    "completion_tokens": "INTEGER",
    "started_at": "TIMESTAMPTZ",
    "engine_started_at": "TIMESTAMPTZ",
    "engine_ended_at": "TIMESTAMPTZ",
    "ended_at": "TIMESTAMPTZ",
    # who rendered the prompt (chat: the engine; tokens: the gateway), and in tokens mode whether it continues an
    # earlier exchange's exact tokens (bridged) or why not; output_parse_error: sampled tool calls that did not parse
    "render_mode": "VARCHAR",
    "bridged": "BOOLEAN",
    "bridge_reason": "VARCHAR",
    "output_parse_error": "VARCHAR",
    # the gateway's policy version when this row's engine call started (POST /control/resume sets it)
    "policy_version": "INTEGER",
    # tokens mode: the digest of this exchange's conversation + our answer (+ tools and template arguments); a
    # later request of the session whose history starts with it is bridged onto this row's tokens, also when the
    # gateway no longer holds the session's lineage in memory (restarted, or the session evicted)
    "bridge_key": "VARCHAR",
}


# The prompt's ids, as compact JSON (`[1,2,3]`: orjson's spelling, vLLM's and DuckDB's `to_json`), are in two texts
# besides the `prompt_token_ids` column: the engine reply's echo (~6 characters an id: 44 KB of a 7k-token exchange),
# and in tokens mode the engine request (its `prompt`). Where such a text is stored with `[]` in the array's place,
# the place (the characters before it) is in a column of the table's own (not a contract column; NULL: the text is
# whole), and the `exchanges` view puts the ids back from `prompt_token_ids`: the exact text. Journals splice the
# request (the reply's echo is where their prompt ids are read from); segments splice both (SPLICED_TEXTS).
ENGINE_REQUEST_IDS_AT = "engine_request_ids_at"
ENGINE_RESPONSE_IDS_AT = "engine_response_ids_at"
SPLICED_TEXTS = {"engine_request": ENGINE_REQUEST_IDS_AT, "engine_response": ENGINE_RESPONSE_IDS_AT}


def whole_text(column: str) -> str:
    """The SQL for a SPLICED_TEXTS column's whole text, the ids put back where its place column says."""
    at = SPLICED_TEXTS[column]
    text = f"CAST({column} AS VARCHAR)"
    return (
        f"CASE WHEN {at} IS NULL THEN {column} ELSE CAST(concat(left({text}, {at}), CAST(to_json(prompt_token_ids) AS VARCHAR), "
        f"substr({text}, {at} + 3)) AS JSON) END"
    )


def with_whole_texts(stored: str) -> str:
    """The rows `stored` selects (the contract's columns, then SPLICED_TEXTS' places) as the contract has them."""
    replaced = ", ".join(f"{whole_text(column)} AS {column}" for column in SPLICED_TEXTS)
    return f"SELECT * EXCLUDE ({', '.join(SPLICED_TEXTS.values())}) REPLACE ({replaced}) FROM ({stored}) AS stored"


class ExchangeRow(TypedDict, total=False):
    """One exchange as the gateway builds it, keyed by EXCHANGE_COLUMNS (absent keys are stored as NULL).

    JSON columns take any JSON-able value, or an object with the exact wire `text` (engines.base keeps the
    engine's request and reply that way); token ids may be a slice of that text (engines.base.TokenIds).
    """

    exchange_id: str
    session_id: str
    seq: int
    api: str | None
    action: str | None
    stream: bool | None
    status: str
    error: str | None
    http_status: int | None
    model_requested: str | None
    model_engine: str | None
    engine_kind: str | None
    method: str | None
    host: str | None
    path: str | None
    harness: str | None
    user_agent: str | None
    lineage: Any
    retry_count: int | None
    replay: bool | None
    request_headers: Any
    request_body: str | bytes | None  # bytes: UTF-8 as they are (others are decoded, invalid UTF-8 replaced)
    ignored_fields: Sequence[str] | None
    normalizations: Sequence[str] | None
    engine_request: Any
    engine_response: Any
    response_body: Any
    response_stream: str | None
    prompt_token_ids: Sequence[int] | None
    completion_token_ids: Sequence[int] | None
    completion_logprobs: Sequence[float] | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    started_at: datetime | None
    engine_started_at: datetime | None
    engine_ended_at: datetime | None
    ended_at: datetime | None
    render_mode: str | None
    bridged: bool | None
    bridge_reason: str | None
    output_parse_error: str | None
    policy_version: int | None
    bridge_key: str | None


SESSION_COLUMNS: dict[str, str] = {
    "session_id": "VARCHAR PRIMARY KEY",
    "created_at": "TIMESTAMPTZ",
    "last_seen_at": "TIMESTAMPTZ",
    "n_exchanges": "INTEGER",
    "harness": "VARCHAR",
    "task_id": "VARCHAR",
    "status": "VARCHAR",
    "reward": "DOUBLE",
    "timings": "JSON",
    "metadata": "JSON",
    "error": "VARCHAR",
}


EXCHANGES_DOC = (
    "One row per model exchange, in commit order within a session (seq): the request as received (API keys redacted), "
    "the engine request and reply as they crossed the wire, prompt and sampled token ids, sampled logprobs, finish "
    "reason, status and timings. Recent rows come from the journal, older ones from compacted segments."
)


def base_type(kind: str) -> str:
    return kind.split()[0]


JSON_COLUMNS = {name for name, kind in EXCHANGE_COLUMNS.items() if base_type(kind) == "JSON"}

DOUBLE_LISTS = {name for name, kind in EXCHANGE_COLUMNS.items() if base_type(kind) == "DOUBLE[]"}
ARROW_TYPES = {"VARCHAR": pa.string(), "INTEGER": pa.int32(), "TIMESTAMPTZ": pa.timestamp("us", tz="UTC"), "BLOB": pa.binary()}


EPOCH, MICROSECOND = datetime(1970, 1, 1, tzinfo=UTC), timedelta(microseconds=1)


def _microseconds(stamp: datetime) -> int:
    """Since the epoch; a naive datetime is read as UTC (as pa.array reads it)."""
    return ((stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)) - EPOCH) // MICROSECOND


def arrow_array(values: Sequence[Any], kind: pa.DataType) -> pa.Array:
    """Values of one of ARROW_TYPES (str, bytes, int, an aware datetime; None: null) as an Arrow array, built from
    its buffers. Not pa.array(): pyarrow's conversion of Python objects imports pandas the first time it runs (340
    modules, +39 MB RSS, 0.25 s holding the GIL: a stall of every reply in flight when a gateway's writer first
    flushed), and nothing here needs pandas."""
    count = len(values)
    validity = None
    if None in values:
        bits = bytearray((count + 7) // 8)
        for index, value in enumerate(values):
            if value is not None:
                bits[index >> 3] |= 1 << (index & 7)
        validity = pa.py_buffer(bits)
    if kind in (pa.string(), pa.binary()):
        data = [b"" if value is None else value.encode() if isinstance(value, str) else value for value in values]
        offsets = array("i", accumulate(map(len, data), initial=0))
        return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])
    if kind == pa.int32():
        numbers = array("i", [0 if value is None else value for value in values])
    elif kind == ARROW_TYPES["TIMESTAMPTZ"]:
        numbers = array("q", [0 if value is None else _microseconds(value) for value in values])
    else:
        raise TypeError(f"no Arrow buffers for {kind}")
    return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(numbers)])


# trajectory material: what the assembler trains on (a sampled turn of a live request, with its token ids)
MATERIAL = "status = 'ok' AND coalesce(action, 'generate') = 'generate' AND NOT coalesce(replay, false) AND prompt_token_ids IS NOT NULL"

# later word on an exchange, committed after its row (which is never rewritten): a reply the gateway committed
# `ok` and then could not deliver (its client had closed or reset the connection before or while it was written)
# gets a mark with status `client_disconnected` and an error saying why. The `exchanges` view shows a marked row
# with its mark's status and error, so every reader (MATERIAL, the assembler, the views) sees it as it ended.
MARKS_TABLE = "exchange_marks"
MARK_COLUMNS: dict[str, str] = {"exchange_id": "VARCHAR PRIMARY KEY", "status": "VARCHAR NOT NULL", "error": "VARCHAR", "marked_at": "TIMESTAMPTZ"}

# session statuses that count as complete (compared lower-cased); no status at all counts as complete too
COMPLETED_STATUSES = frozenset({"completed", "complete", "success", "succeeded", "done", "ok", "finished"})

# the assembler's table: one row per trainable sequence (columns: polar_mitm.assembler.export, docs/trainers.md)
TRAJECTORIES = "trajectories"


# trajectories columns newer than the first version of the table (stores keep their table across versions)
TRAJECTORY_ADDED_COLUMNS = {"min_policy_version": "INTEGER", "max_policy_version": "INTEGER", "token_policy_versions": "INTEGER[]"}


def trajectory_statements(parquet: Path) -> list[str]:
    """The statements that load an assembler Parquet file into the `trajectories` table, replacing the rows of the
    (builder, session) pairs it holds; run them in one transaction (or through the store's writer)."""
    source = "read_parquet('" + str(parquet.resolve()).replace("'", "''") + "')"
    return [
        f"CREATE TABLE IF NOT EXISTS {TRAJECTORIES} AS SELECT * FROM {source} LIMIT 0",
        # columns added since a store's table was created
        *(f"ALTER TABLE {TRAJECTORIES} ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in TRAJECTORY_ADDED_COLUMNS.items()),
        f"DELETE FROM {TRAJECTORIES} WHERE (builder, session_id) IN (SELECT DISTINCT builder, session_id FROM {source})",
        f"INSERT INTO {TRAJECTORIES} BY NAME SELECT * FROM {source}",
    ]
TRAJECTORIES_SCHEMA = pa.schema(
    [
        ("sequence_id", pa.string()),
        ("builder", pa.string()),
        ("session_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("rollout_logprobs", pa.list_(pa.float64())),
        ("prompt_len", pa.int32()),
        ("sampled_tokens", pa.int32()),
        ("n_exchanges", pa.int32()),
        ("exchange_ids", pa.list_(pa.string())),
        ("exchange_seqs", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("break_kind", pa.string()),
        ("break_index", pa.int32()),
        ("break_region", pa.string()),
        ("break_from", pa.string()),
        ("break_exchange_id", pa.string()),
        ("break_detail", pa.string()),
        ("retry_of", pa.string()),
        ("faithful", pa.bool_()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("trainable", pa.bool_()),
        ("no_signal", pa.bool_()),
        ("session_status", pa.string()),
        ("session_metadata", pa.string()),
        ("api", pa.string()),
        ("harness", pa.string()),
        ("model_requested", pa.string()),
        ("model_engine", pa.string()),
        ("min_policy_version", pa.int32()),
        ("max_policy_version", pa.int32()),
        ("token_policy_versions", pa.list_(pa.int32())),
    ]
)


def now() -> datetime:
    return datetime.now(UTC)


def quote(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"
