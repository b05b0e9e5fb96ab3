"""Journal records: how an exchange row is written into a journal table, and read back with the contract's types.

A journal row is eleven columns: the four live SQL filters on most, the other small fields and the token lists as
two JSON objects, a head (scalars, headers) and a body (token ids, logprobs), so a query on the head never parses a
body, and the five texts (request and reply bodies, the engine's request and reply) as columns of their own. The
records are parsed back when read (json_transform) and once more when the journal becomes a segment; DuckDB charges
~20 us per column for every INSERT however small, which the reply waits for, hence records and not a column each.

The texts were fields of the body record until 2026-12 (a store's schema 3 either way): each was escaped into it
(orjson, on the writer thread, holding the GIL: 0.2 ms of each exchange's 2.9 ms of GIL time at 64 sessions) and
parsed out again at every read and compaction. As columns they go in as they are. A journal of that older layout is
given the columns when a writer opens its store (add_text_columns), before it is compacted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import duckdb
import orjson
import pyarrow as pa

from polar_mitm.store.schema import (
    ARROW_TYPES,
    DOUBLE_LISTS,
    ENGINE_REQUEST_IDS_AT,
    ENGINE_RESPONSE_IDS_AT,
    EXCHANGE_COLUMNS,
    JSON_COLUMNS,
    arrow_array,
    base_type,
    quote,
)

JOURNAL_PREFIX = "exchange_journal_"
TEXT_FIELDS = ["request_body", "engine_request", "engine_response", "response_body", "response_stream"]  # columns of their own
JOURNAL_COLUMNS = {
    "exchange_id": "VARCHAR", "session_id": "VARCHAR", "seq": "INTEGER", "status": "VARCHAR", "head": "BLOB", "body": "BLOB",
    **{name: "BLOB" for name in TEXT_FIELDS},  # UTF-8 (decode() reads it): a VARCHAR's compression analysis cost each checkpoint more
}
BODY_FIELDS = ["prompt_token_ids", "completion_token_ids", "completion_logprobs"]
HEAD_FIELDS = [name for name in EXCHANGE_COLUMNS if name not in JOURNAL_COLUMNS and name not in BODY_FIELDS]


def _record_type(kind: str) -> Any:
    """How a field is spelled in a record, as a json_transform structure. JSON columns travel as strings (their
    text is kept exactly), DOUBLE[] as text DuckDB casts (JSON has no inf or nan)."""
    base = base_type(kind)
    if base in ("JSON", "DOUBLE[]"):
        return "VARCHAR"
    return [base[:-2]] if base.endswith("[]") else base


# where in engine_response the prompt ids are, when they are left out of the body (see journal_records)
PROMPT_IDS_AT = "prompt_token_ids_at"
HEAD_STRUCTURE = json.dumps({name: _record_type(EXCHANGE_COLUMNS[name]) for name in HEAD_FIELDS}, separators=(",", ":"))
BODY_STRUCTURE = json.dumps(
    {**{name: _record_type(EXCHANGE_COLUMNS[name]) for name in BODY_FIELDS}, PROMPT_IDS_AT: ["BIGINT"], ENGINE_REQUEST_IDS_AT: "BIGINT", ENGINE_RESPONSE_IDS_AT: "BIGINT"},
    separators=(",", ":"),
)
# a group commit's rows reach DuckDB as one Arrow table: one statement for the batch instead of one per row
JOURNAL_ARROW_SCHEMA = pa.schema([(name, ARROW_TYPES[kind]) for name, kind in JOURNAL_COLUMNS.items()])


def journal_table(number: int) -> str:
    return f"{JOURNAL_PREFIX}{number:06d}"


def _from_journal(name: str) -> str:
    """The contract-typed expression for one column, read from a journal row."""
    kind = base_type(EXCHANGE_COLUMNS[name])
    if name in JOURNAL_COLUMNS:
        return f'CAST("{name}" AS JSON) AS "{name}"' if kind == "JSON" else f'"{name}"'
    record = "b" if name in BODY_FIELDS else "h"
    if name == "prompt_token_ids":
        from_response = f"json_transform(substr(engine_response, b.{PROMPT_IDS_AT}[1], b.{PROMPT_IDS_AT}[2]), '[\"INTEGER\"]')"
        return f'coalesce(b."{name}", {from_response}) AS "{name}"'
    if kind in ("JSON", "DOUBLE[]"):
        return f'CAST({record}."{name}" AS {kind}) AS "{name}"'
    return f'{record}."{name}" AS "{name}"'


JOURNAL_SELECT = ", ".join(_from_journal(name) for name in EXCHANGE_COLUMNS)
# a journal's rows as stored: the engine request as written, with its place (schema.SPLICED_TEXTS), the reply whole
JOURNAL_STORED_SELECT = f"{JOURNAL_SELECT}, b.{ENGINE_REQUEST_IDS_AT} AS {ENGINE_REQUEST_IDS_AT}, NULL::BIGINT AS {ENGINE_RESPONSE_IDS_AT}"
# and as its segment stores them: the reply's echo of the prompt ids, when the journal found it in their compact
# spelling (journal_records), is `[]` there too
_REPLY_WITHOUT_IDS = (
    f"CAST(CASE WHEN b.{ENGINE_RESPONSE_IDS_AT} IS NULL THEN engine_response ELSE concat(left(engine_response, b.{ENGINE_RESPONSE_IDS_AT}), '[]', "
    f"substr(engine_response, b.{ENGINE_RESPONSE_IDS_AT} + 1 + b.{PROMPT_IDS_AT}[2])) END AS JSON) AS engine_response"
)
JOURNAL_SEGMENT_SELECT = (
    ", ".join(_REPLY_WITHOUT_IDS if name == "engine_response" else _from_journal(name) for name in EXCHANGE_COLUMNS)
    + f", b.{ENGINE_REQUEST_IDS_AT} AS {ENGINE_REQUEST_IDS_AT}, b.{ENGINE_RESPONSE_IDS_AT} AS {ENGINE_RESPONSE_IDS_AT}"
)


def journal_numbers(con: duckdb.DuckDBPyConnection) -> list[int]:
    """The journals whose tables exist (in the caller's transaction, if any), in order."""
    found = con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND starts_with(table_name, ?)", [JOURNAL_PREFIX]).fetchall()
    return sorted(int(name[len(JOURNAL_PREFIX):]) for (name,) in found if name[len(JOURNAL_PREFIX):].isdigit())


def journal_source(number: int, where: str = "") -> str:
    """A journal's rows with their records parsed (h, b); `where`: only the rows it selects (their records only
    are parsed)."""
    return records_source(journal_table(number), where)


def records_source(relation: str, where: str = "") -> str:
    """journal_source over any relation with JOURNAL_COLUMNS: a journal table, or records as an Arrow table."""
    columns = ", ".join(f'decode("{name}") AS "{name}"' if name in TEXT_FIELDS else f'"{name}"' for name in JOURNAL_COLUMNS if name not in ("head", "body"))
    return (
        f"(SELECT {columns}, json_transform(decode(head), {quote(HEAD_STRUCTURE)}) AS h, "
        f"json_transform(decode(body), {quote(BODY_STRUCTURE)}) AS b FROM {relation}{f' WHERE {where}' if where else ''})"
    )


def _json_text(value: Any) -> str:
    """The JSON text of a JSON column's value; text that is not strict JSON (e.g. NaN) is stored as re-encoded."""
    text = getattr(value, "text", None)  # the engine's request and reply, kept as they crossed the wire
    if isinstance(text, str):
        if getattr(value, "strict", True):
            return text
        return _dumps(dict(value)).decode()
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        try:
            orjson.loads(value)
            return value
        except orjson.JSONDecodeError:
            return _dumps(value).decode()  # kept whole, as a JSON string
    return _dumps(value).decode()


def _prompt_ids_at(response: Any, prompt_ids: Any) -> list[int] | None:
    """[start, length] of the prompt ids' array inside the engine reply's text (1-based, in characters, as DuckDB's
    substr counts), when the ids are a slice of that text (engines.base.TokenIds); readers parse just that slice."""
    text = getattr(response, "text", None)
    if text is None or getattr(prompt_ids, "source", None) is not text or not getattr(response, "strict", False):
        return None
    return [prompt_ids.start + 1, prompt_ids.end - prompt_ids.start]


# where a token-in request carries its prompt (vLLM's completions, SGLang's /generate); a key inside a string value
# would have its quotes escaped, so a match is a key
PROMPT_KEYS = ('"prompt":[', '"input_ids":[')
MIN_PROMPT_CHARS = 1024  # a shorter array is not worth the view's splice


def _request_without_prompt_ids(request: Any, prompt_ids: Any) -> tuple[str, int] | None:
    """The engine request's text with its prompt-id array replaced by `[]`, and the characters before it, when that
    array is this row's prompt ids as `to_json` spells them (schema.ENGINE_REQUEST_IDS_AT); else None (kept whole).

    The array is an engine request's own (orjson's compact spelling), digits and commas only, and the same text as the
    ids the row keeps: its echo in the engine reply (a slice of that text) or the ids' list encoded."""
    text = getattr(request, "text", None)
    if not isinstance(text, str) or not getattr(request, "strict", False) or not prompt_ids:
        return None
    at = -1
    for key in PROMPT_KEYS:
        if (at := text.find(key)) >= 0:
            at += len(key) - 1
            break
    end = text.find("]", at) + 1 if at >= 0 else 0
    array = text[at:end]
    if not _compact_ids(array):
        return None
    source = getattr(prompt_ids, "source", None)
    same = source[prompt_ids.start : prompt_ids.end] == array if isinstance(source, str) else orjson.dumps(list(prompt_ids)) == array.encode()
    return (text[:at] + "[]" + text[end:], at) if same else None


def _compact_ids(array: str) -> bool:
    """Whether a JSON array of ids (valid JSON, as read) is long enough to splice and spelled as `to_json` spells
    it: digits and commas only between its brackets."""
    if len(array) < MIN_PROMPT_CHARS or array[0] != "[" or array[-1] != "]":
        return False
    return not array[1:-1].encode("utf-8", "replace").translate(None, b"0123456789,")


def _list_text(values: Any) -> str:
    text = orjson.dumps(values)
    if b"null" in text:
        # orjson writes inf and nan as null; DuckDB's DOUBLE[] cast reads Python's spelling of them
        return "[" + ", ".join("NULL" if v is None else repr(float(v)) for v in values) + "]"
    return text.decode()


def _dumps(value: Any) -> bytes:
    try:
        # a copy of its own length, held until its group commit is written: orjson returns the buffer it reserved,
        # several times the output for long strings (polar_mitm.util.exact_bytes, which the store may not import)
        return bytes(memoryview(orjson.dumps(value, default=_as_list)))
    except (orjson.JSONEncodeError, TypeError):
        # lone surrogates, integers beyond 64 bits, odd types: stored as near as JSON allows, not refused
        return json.dumps(_sanitized(value), ensure_ascii=False, allow_nan=False, default=str).encode("utf-8", "replace")


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)  # e.g. TokenIds
    raise TypeError(f"cannot store a {type(value).__name__} as JSON")


def _sanitized(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {_sanitized(str(k)): _sanitized(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_sanitized(v) for v in value]
    return value


def journal_records(row: Mapping[str, Any]) -> tuple[bytes, bytes, list[str | bytes | None]]:
    """The head and body JSON objects of a row's fields beyond the journal's own columns (absent ones left out), and
    its texts (TEXT_FIELDS, in order; JSON ones as their JSON text).

    Prompt ids are most of a row, and an engine reply that carries them has them already: then the body keeps
    only where they are in it (they were parsed from that very text), and readers extract them from there.
    """
    head: dict[str, Any] = {}
    for name in HEAD_FIELDS:
        value = row.get(name)
        if value is not None:
            head[name] = _json_text(value) if name in JSON_COLUMNS else value
    body: dict[str, Any] = {}
    prompt_ids_at = _prompt_ids_at(row.get("engine_response"), row.get("prompt_token_ids"))
    if prompt_ids_at:
        body[PROMPT_IDS_AT] = prompt_ids_at
        if _compact_ids(row["engine_response"].text[prompt_ids_at[0] - 1 : sum(prompt_ids_at) - 1]):
            body[ENGINE_RESPONSE_IDS_AT] = prompt_ids_at[0] - 1  # its segment keeps the reply without them
    for name in BODY_FIELDS:
        value = row.get(name)
        if value is None or (prompt_ids_at and name == "prompt_token_ids"):
            continue
        body[name] = _list_text(value) if name in DOUBLE_LISTS else value
    texts = [None if (value := row.get(name)) is None else _json_text(value) if name in JSON_COLUMNS else _text(value) for name in TEXT_FIELDS]
    if without_ids := _request_without_prompt_ids(row.get("engine_request"), row.get("prompt_token_ids")):
        texts[TEXT_FIELDS.index("engine_request")], body[ENGINE_REQUEST_IDS_AT] = without_ids
    return _dumps(head), _dumps(body), texts


# a row as its journal stores it: exchange_id, session_id, seq, status, head, body, then TEXT_FIELDS as UTF-8
JournalRecord = tuple[Any, ...]


def journal_record(row: Mapping[str, Any]) -> JournalRecord:
    """A row as the journal's columns hold it (JOURNAL_COLUMNS' order), texts encoded: what the commit log keeps
    and an INSERT takes. Raises (UnicodeEncodeError) for ids that are not text, before the row is committed."""
    head, body, texts = journal_records(row)
    exchange_id, session_id = str(row["exchange_id"]), str(row["session_id"])
    for key in (exchange_id, session_id):
        key.encode()  # a lone surrogate fails this row now, not the move of the records around it
    return (exchange_id, session_id, int(row["seq"]), str(row["status"]), head, body, *map(_utf8, texts))


def record_bytes(record: JournalRecord) -> int:
    """What a record counts toward its journal's size: its head, body and texts."""
    return sum(len(value) for value in record[4:] if value is not None)


# record_bytes of a journal table's row, in SQL (the texts too: a harness's are most of a row, its head and body ~5 KB)
RECORD_BYTES_SQL = " + ".join(f'coalesce(octet_length("{name}"), 0)' for name in ("head", "body", *TEXT_FIELDS))


def insert_journal_rows(con: duckdb.DuckDBPyConnection, rows: Sequence[Mapping[str, Any]], table: str) -> int:
    """Insert exchange rows into a journal table: one statement, however many rows. Returns their records' and
    texts' bytes (what a journal's size is counted in)."""
    return insert_journal_records(con, [journal_record(row) for row in rows], table)


def insert_journal_records(con: duckdb.DuckDBPyConnection, records: Iterable[JournalRecord], table: str, slice_bytes: int = 0) -> int:
    """Insert journal records (journal_record) into a journal table; returns their bytes. `slice_bytes` (0: one
    statement, in the caller's transaction): one statement per slice of at most that many bytes of records, all in
    one transaction of its own. A whole commit log in one statement (up to a journal's 32 MB, moved at a close, a
    read or an open after a crash) raised RSS by ~6x its bytes while DuckDB took it (140 Qwen Code rows of 14k prompt
    ids, 28 MB: +172 MB), in 8 MB slices by ~4.5x (+127 MB)."""
    written = 0
    with transaction(con) if slice_bytes else nullcontext():
        for some in in_slices(records, slice_bytes):
            if len(some) == 1:
                con.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(JOURNAL_COLUMNS))})", list(some[0]))
            else:
                # DuckDB reads the Arrow table by its variable name (a replacement scan: cheaper than register())
                polar_pending_exchanges = records_table(some)  # noqa: F841 - read by DuckDB
                con.execute(f"INSERT INTO {table} SELECT * FROM polar_pending_exchanges")
                del polar_pending_exchanges  # before the next slice's is built
            written += sum(record_bytes(record) for record in some)
    return written


def in_slices(records: Iterable[JournalRecord], slice_bytes: int) -> Iterator[list[JournalRecord]]:
    """Records in lists of at most `slice_bytes` of them (record_bytes; a larger record alone; 0: one list of all),
    taken from `records` as each list is asked for."""
    return in_batches(records, record_bytes, slice_bytes)


def in_batches[T](items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """`items` in lists whose sizes add up to at most `limit` (an item larger than that alone; 0: one list of all),
    taken from `items` as each list is asked for (also the assembler's batches of sessions)."""
    if not limit:
        batch = list(items)
        if batch:
            yield batch
        return
    batch = []
    total = 0
    for item in items:
        measured = size(item)
        if batch and total + measured > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += measured
    if batch:
        yield batch


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """BEGIN ... COMMIT around the block; rolled back (and the error raised again) if the block or COMMIT fails."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except duckdb.TransactionException:
            pass  # nothing left open to roll back
        raise


def records_table(records: Sequence[JournalRecord]) -> pa.Table:
    """Journal records as one Arrow table with a journal's columns (each value copied once, into Arrow buffers)."""
    return pa.table(
        [arrow_array([record[index] for record in records], JOURNAL_ARROW_SCHEMA.field(index).type) for index in range(len(JOURNAL_COLUMNS))],
        schema=JOURNAL_ARROW_SCHEMA,
    )


def _text(value: Any) -> str | bytes:
    """A text column's value: a str, or bytes that are UTF-8 as they are (a request body: no decoded copy, no
    encoding again), other bytes decoded (invalid UTF-8 replaced), anything else as str() spells it."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value)
        return value if _is_utf8(value) else value.decode("utf-8", "replace")
    return str(value)


def _is_utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _utf8(text: str | bytes | None) -> bytes | None:
    if text is None or isinstance(text, bytes):
        return text
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a harness that cut a string inside an emoji): stored as "?"
        return text.encode("utf-8", "replace")


def add_text_columns(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Give a journal of the layout before TEXT_FIELDS were columns (each a field of its body record) those columns,
    filled from its records. True if it was of that layout. Its records keep the texts too (unread from now on),
    until the journal becomes a segment."""
    present = {name for (name,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]).fetchall()}
    missing = [name for name in TEXT_FIELDS if name not in present]
    if not missing:
        return False
    for name in missing:
        con.execute(f"ALTER TABLE {table} ADD COLUMN {name} BLOB")
    con.execute(f"UPDATE {table} SET {', '.join(f'{name} = encode(json_extract_string(decode(body), {quote('$.' + name)}))' for name in missing)}")
    return True
