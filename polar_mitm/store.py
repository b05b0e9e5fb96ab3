"""The DuckDB store: one row per model exchange, committed before the client gets its reply.

DuckDB allows one writing process per file. The gateway owns the file while it runs: a single writer
thread does group commits (the event loop never touches DuckDB), and read-only SQL from other processes
is answered by the gateway itself over a loopback control endpoint named in `<db>.control.json`.

Layout. `exchanges` is a view over two kinds of storage, with the contract's column types either way:

- journal tables (`exchange_journal_NNNNNN`): where each exchange is committed before its reply, as six
  columns: the four live SQL filters on most, then the other fields in two JSON records (see JOURNAL_COLUMNS).
  No list columns there: DuckDB writes a list column's whole uncheckpointed data into the WAL again on every
  commit (measured on 1.3 to 2.0: the Nth single-row commit of a 14k-id array logs N x 56 KB), which made each
  commit slower than the last until a checkpoint; a JSON record is logged once.
- segments (`<db>.segments/NNNNNN.parquet`, listed in `exchange_segments`): immutable Parquet files with
  INTEGER[] / DOUBLE[] columns. When a journal reaches `segment_rows` rows the writer starts a new one, and a
  compactor thread copies the full journal into a segment (fsynced, then renamed), after which the writer drops
  the journal and re-points the view in one transaction. A crash at any point leaves either the journal or the
  segment registered, never both and never neither; leftover journals are compacted when the store reopens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa

log = logging.getLogger("polar_mitm.store")

SCHEMA_VERSION = 2

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
    # the gateway's policy version when this row's engine call started (POST /control/resume sets it)
    "policy_version": "INTEGER",
}

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

JOURNAL_PREFIX = "exchange_journal_"
SEGMENTS_TABLE = "exchange_segments"
EXCHANGES_DOC = (
    "One row per model exchange, in commit order within a session (seq): the request as received (API keys redacted), "
    "the engine request and reply as they crossed the wire, prompt and sampled token ids, sampled logprobs, finish "
    "reason, status and timings. Recent rows come from the journal, older ones from Parquet segments."
)


def _base(kind: str) -> str:
    return kind.split()[0]


JSON_COLUMNS = {name for name, kind in EXCHANGE_COLUMNS.items() if _base(kind) == "JSON"}

# A journal row is six columns: the ones live SQL filters on most, then the other fields as two JSON objects, a
# small head (scalars, headers) and a body (texts, token ids, logprobs), so a query on the head never parses a
# body. DuckDB charges ~20 us per column for every INSERT however small, which the reply waits for; the records
# are parsed back when read (json_transform) and once more when the journal becomes a segment.
JOURNAL_COLUMNS = {"exchange_id": "VARCHAR", "session_id": "VARCHAR", "seq": "INTEGER", "status": "VARCHAR", "head": "BLOB", "body": "BLOB"}
BODY_FIELDS = ["request_body", "engine_request", "engine_response", "response_body", "response_stream", "prompt_token_ids", "completion_token_ids", "completion_logprobs"]
HEAD_FIELDS = [name for name in EXCHANGE_COLUMNS if name not in JOURNAL_COLUMNS and name not in BODY_FIELDS]


def _record_type(kind: str) -> Any:
    """How a field is spelled in a record, as a json_transform structure. JSON columns travel as strings (their
    text is kept exactly), DOUBLE[] as text DuckDB casts (JSON has no inf or nan)."""
    base = _base(kind)
    if base in ("JSON", "DOUBLE[]"):
        return "VARCHAR"
    return [base[:-2]] if base.endswith("[]") else base


# where in engine_response the prompt ids are, when they are left out of the body (see journal_records)
PROMPT_IDS_AT = "prompt_token_ids_at"
HEAD_STRUCTURE = json.dumps({name: _record_type(EXCHANGE_COLUMNS[name]) for name in HEAD_FIELDS}, separators=(",", ":"))
BODY_STRUCTURE = json.dumps({**{name: _record_type(EXCHANGE_COLUMNS[name]) for name in BODY_FIELDS}, PROMPT_IDS_AT: ["BIGINT"]}, separators=(",", ":"))
DOUBLE_LISTS = {name for name, kind in EXCHANGE_COLUMNS.items() if _base(kind) == "DOUBLE[]"}


_ARROW_TYPES = {"VARCHAR": pa.string(), "INTEGER": pa.int32(), "TIMESTAMPTZ": pa.timestamp("us", tz="UTC"), "BLOB": pa.binary()}
# a group commit's rows reach DuckDB as one Arrow table: one statement for the batch instead of one per row
JOURNAL_ARROW_SCHEMA = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in JOURNAL_COLUMNS.items()])
SESSION_ARROW_SCHEMA = pa.schema([(name, _ARROW_TYPES[_base(SESSION_COLUMNS[name])]) for name in ("session_id", "created_at", "last_seen_at", "n_exchanges", "harness")])

# an UPDATE plus an INSERT of the sessions not there yet: DuckDB's INSERT ... ON CONFLICT DO UPDATE cost ~3x more
_UPDATE_SESSIONS = (
    "UPDATE sessions SET last_seen_at = p.last_seen_at, n_exchanges = coalesce(sessions.n_exchanges, 0) + p.n_exchanges, "
    "harness = coalesce(sessions.harness, p.harness) FROM polar_pending_sessions p WHERE sessions.session_id = p.session_id"
)
_UPDATE_SESSION = "UPDATE sessions SET last_seen_at = ?, n_exchanges = coalesce(n_exchanges, 0) + ?, harness = coalesce(harness, ?) WHERE session_id = ?"
_INSERT_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, created_at, last_seen_at, n_exchanges, harness FROM polar_pending_sessions "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions)"
)


# after a crash: session counters the writer had not flushed yet, recounted from the exchanges themselves
_RECOUNT_NEW_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, min(started_at), max(coalesce(ended_at, started_at)), count(*), any_value(harness) FROM exchanges "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions) GROUP BY session_id"
)
_RECOUNT_SESSIONS = (
    "UPDATE sessions SET n_exchanges = e.n, last_seen_at = greatest(sessions.last_seen_at, e.last_seen_at), harness = coalesce(sessions.harness, e.harness) "
    "FROM (SELECT session_id, count(*) AS n, max(coalesce(ended_at, started_at)) AS last_seen_at, any_value(harness) AS harness "
    "FROM exchanges GROUP BY session_id) e WHERE sessions.session_id = e.session_id"
)


def now() -> datetime:
    return datetime.now(timezone.utc)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def journal_table(number: int) -> str:
    return f"{JOURNAL_PREFIX}{number:06d}"


def segments_dir(db_path: str | os.PathLike[str]) -> Path:
    return Path(str(db_path) + ".segments")


def _from_journal(name: str) -> str:
    """The contract-typed expression for one column, read from a journal row."""
    kind = _base(EXCHANGE_COLUMNS[name])
    if name in JOURNAL_COLUMNS:
        return f'"{name}"'
    record = "b" if name in BODY_FIELDS else "h"
    if name == "prompt_token_ids":
        from_response = f"json_transform(substr(b.engine_response, b.{PROMPT_IDS_AT}[1], b.{PROMPT_IDS_AT}[2]), '[\"INTEGER\"]')"
        return f'coalesce(b."{name}", {from_response}) AS "{name}"'
    if kind in ("JSON", "DOUBLE[]"):
        return f'CAST({record}."{name}" AS {kind}) AS "{name}"'
    return f'{record}."{name}" AS "{name}"'


JOURNAL_SELECT = ", ".join(_from_journal(name) for name in EXCHANGE_COLUMNS)


def journal_source(number: int) -> str:
    columns = ", ".join(f'"{name}"' for name in JOURNAL_COLUMNS if name not in ("head", "body"))
    return (
        f"(SELECT {columns}, json_transform(decode(head), {_quote(HEAD_STRUCTURE)}) AS h, "
        f"json_transform(decode(body), {_quote(BODY_STRUCTURE)}) AS b FROM {journal_table(number)})"
    )


def _contract_select(present: Collection[str] | None = None) -> str:
    """Every exchange column with its contract type; those not in `present` (when given) as typed NULLs."""
    return ", ".join(
        f"CAST({name if present is None or name in present else 'NULL'} AS {_base(kind)}) AS {name}" for name, kind in EXCHANGE_COLUMNS.items()
    )


SEGMENT_SELECT = _contract_select()


def segment_file(number: int) -> str:
    return f"{number:06d}.parquet"


def _register_segment(con: duckdb.DuckDBPyConnection, number: int, rows: int) -> None:
    con.execute(f"INSERT INTO {SEGMENTS_TABLE} VALUES (?, ?, ?, ?)", [number, segment_file(number), rows, now()])


def exchanges_view_sql(segment_files: list[Path], journals: list[int]) -> str:
    parts = []
    if segment_files:
        files = ", ".join(_quote(str(path)) for path in segment_files)
        # union_by_name: segments written before a column was added read it as NULL
        parts.append(f"SELECT {SEGMENT_SELECT} FROM read_parquet([{files}], union_by_name = true)")
    parts += [f"SELECT {JOURNAL_SELECT} FROM {journal_source(number)}" for number in journals]
    return "CREATE OR REPLACE VIEW exchanges AS " + " UNION ALL ".join(parts)


def _create_table(con: duckdb.DuckDBPyConnection, table: str, columns: dict[str, str]) -> None:
    con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{n} {t}' for n, t in columns.items())})")
    # later versions add columns; never rename
    existing = {r[0] for r in con.execute(f"SELECT column_name FROM information_schema.columns WHERE table_name = '{table}'").fetchall()}
    for name, kind in columns.items():
        if name not in existing:
            con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind.replace(' PRIMARY KEY', '').replace(' NOT NULL', '')}")


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()}


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """The tables beside the exchanges (sessions, meta, the segment list); Store creates journals and the view."""
    _create_table(con, "sessions", SESSION_COLUMNS)
    con.execute(f"CREATE TABLE IF NOT EXISTS {SEGMENTS_TABLE} (segment INTEGER PRIMARY KEY, file VARCHAR NOT NULL, rows BIGINT, created_at TIMESTAMPTZ)")
    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)")


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


def _list_text(values: Any) -> str:
    text = orjson.dumps(values)
    if b"null" in text:
        # orjson writes inf and nan as null; DuckDB's DOUBLE[] cast reads Python's spelling of them
        return "[" + ", ".join("NULL" if v is None else repr(float(v)) for v in values) + "]"
    return text.decode()


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=_as_list)
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


def journal_records(row: dict[str, Any]) -> tuple[bytes, bytes]:
    """The head and body JSON objects of a row's fields beyond the journal's own columns (absent ones left out).

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
    for name in BODY_FIELDS:
        value = row.get(name)
        if value is None or (prompt_ids_at and name == "prompt_token_ids"):
            continue
        if name in JSON_COLUMNS:
            value = _json_text(value)
        elif name in DOUBLE_LISTS:
            value = _list_text(value)
        body[name] = value
    return _dumps(head), _dumps(body)


@dataclass
class _Pending:
    """One queued write: an exchange row, a statement from execute_write, or a step of the store itself."""

    sql: str = ""
    params: list[Any] = field(default_factory=list)
    done: Any = None  # called with (error or None) from the writer thread
    row: dict[str, Any] | None = None
    step: Callable[[duckdb.DuckDBPyConnection], None] | None = None  # runs alone, in its own transaction


class Store:
    """The single writer of one DuckDB file; safe to use from an asyncio event loop."""

    def __init__(self, path: str | os.PathLike[str], batch_max: int = 256, segment_rows: int = 256):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.segments_dir = segments_dir(self.path)
        self.segment_rows = segment_rows
        self.con = duckdb.connect(str(self.path))
        # Checkpoints are the compactor's, right after it drops a journal (when there is least to write); the
        # automatic ones, which would stall a commit, only if the WAL grows past 1 GB. DuckDB's default would also
        # checkpoint instead of logging any commit over 100 KB, i.e. every exchange.
        self.con.execute(f"SET auto_checkpoint_skip_wal_threshold = {2**62}")
        self.con.execute("SET checkpoint_threshold = '1GB'")
        # every statement on the hot path is one small insert; parallel scans would only compete with the proxy
        self.con.execute("SET threads = 1")
        ensure_schema(self.con)
        self._segments: list[Path] = [self.segments_dir / file for (file,) in self.con.execute(f"SELECT file FROM {SEGMENTS_TABLE} ORDER BY segment").fetchall()]
        self._migrate_v1()
        self._journals = sorted(int(name[len(JOURNAL_PREFIX):]) for name in _tables(self.con) if re.fullmatch(JOURNAL_PREFIX + r"\d+", name))
        numbers = self._journals + [int(path.stem) for path in self._segments if path.stem.isdigit()]
        self._next_number = max(numbers, default=0) + 1
        # journals left by a crash (or a hard stop) become segments before anything new is written
        leftovers = list(self._journals)
        self._rotate(self.con)
        for number in leftovers:
            self._compact(self.con, number)
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        from polar_mitm import views  # views depend on the tables above

        views.create_views(self.con)
        if self.con.execute("SELECT value FROM meta WHERE key = 'closed_cleanly'").fetchall() != [("true",)]:
            self.con.execute(_RECOUNT_NEW_SESSIONS)
            self.con.execute(_RECOUNT_SESSIONS)
        self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'false')")
        self._seq: dict[str, int] = dict(self.con.execute("SELECT session_id, max(seq) FROM exchanges GROUP BY session_id").fetchall())
        self._journal_rows = 0
        self._known_sessions = {session_id for (session_id,) in self.con.execute("SELECT session_id FROM sessions").fetchall()}
        self._session_counts: dict[str, dict[str, Any]] = {}  # committed exchanges not yet counted into `sessions`
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._batch_max = batch_max
        self._compactions: queue.Queue[int | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="polar-store-writer", daemon=True)
        self._writer.start()
        self._compactor = threading.Thread(target=self._compact_loop, name="polar-store-compactor", daemon=True)
        self._compactor.start()
        self._control: ThreadingHTTPServer | None = None
        self.commits = 0

    # -- sequencing: in memory, so the event loop never waits on DuckDB for it
    def next_seq(self, session_id: str) -> int:
        seq = self._seq.get(session_id, 0) + 1
        self._seq[session_id] = seq
        return seq

    # -- writes
    async def commit_exchange(self, row: dict[str, Any]) -> None:
        """Commit one exchange row; returns only once it is durable in DuckDB."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

            loop.call_soon_threadsafe(settle)

        # the row is converted in the writer thread, in bulk: the event loop only queues it
        self._queue.put(_Pending(row=row, done=done))
        await future

    def execute_write(self, sql: str, params: list[Any] | None = None) -> None:
        """Run one write statement through the writer thread (serialised with exchange commits)."""
        self._call_writer(_Pending(sql, params or []))

    def _call_writer(self, item: _Pending) -> None:
        event = threading.Event()
        errors: list[BaseException] = []

        def done(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            event.set()

        item.done = done
        self._queue.put(item)
        event.wait()
        if errors:
            raise errors[0]

    def _write_loop(self) -> None:
        con = self.con.cursor()
        # exchange rows go in through a connection of their own, without DuckDB's optimizer: there is nothing to
        # optimize in an INSERT of values, and its passes cost ~0.15 ms of each commit (measured, DuckDB 2.0)
        appends = self.con.cursor()
        appends.execute("SET SESSION enable_optimizer = false")  # SESSION: a plain SET switches it off for every connection
        unflushed_batches = 0
        while True:
            try:
                # session counters wait for a quiet moment: flushing right away held the GIL just as the event loop
                # was woken to send the reply
                first = self._queue.get(timeout=0.005 if self._session_counts else None)
            except queue.Empty:
                self._flush_sessions(con)
                unflushed_batches = 0
                continue
            if first is None:
                self._flush_sessions(con)
                return
            if first.step is not None:
                self._run_step(con, first)
                continue
            batch, step = [first], None
            while len(batch) < self._batch_max:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                if item.step is not None:
                    step = item  # runs alone, right after this batch
                    break
                batch.append(item)
            self._commit_batch(con, appends, batch)
            if step is not None:
                self._run_step(con, step)
            unflushed_batches += 1
            # session counters follow the replies: after 5 ms without new rows, or every 8 batches under load
            if unflushed_batches >= 8:
                self._flush_sessions(con)
                unflushed_batches = 0
            if self._journal_rows >= self.segment_rows:
                try:
                    full = self._rotate(con)
                except Exception:  # noqa: BLE001 - keep journaling into the current table; retried after the next batch
                    log.exception("polar-mitm: could not start a new journal")
                    continue
                if full is not None:
                    self._compactions.put(full)

    def _run_step(self, con: duckdb.DuckDBPyConnection, item: _Pending) -> None:
        assert item.step is not None
        try:
            item.step(con)
        except Exception as error:  # noqa: BLE001 - reported to the waiting caller
            if item.done:
                item.done(error)
            return
        if item.done:
            item.done(None)

    def _commit_batch(self, con: duckdb.DuckDBPyConnection, appends: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        try:
            if all(item.row is not None for item in batch):
                # one INSERT is its own transaction: no BEGIN/COMMIT statements to pay for (~0.5 ms at one row)
                _insert_journal_rows(appends, [item.row for item in batch], journal_table(self._journals[-1]))  # type: ignore[misc]
            else:
                with _transaction(con):
                    self._apply(con, batch)
            self.commits += 1
        except Exception:
            # one bad row must not fail its neighbours: retry each alone
            for item in batch:
                try:
                    with _transaction(con):
                        self._apply(con, [item])
                except Exception as error:  # noqa: BLE001 - reported to the waiting caller
                    if item.done:
                        item.done(error)
                    continue
                self._committed([item])
            return
        self._committed(batch)

    def _committed(self, batch: list[_Pending]) -> None:
        rows = [item.row for item in batch if item.row is not None]
        self._journal_rows += len(rows)
        _count_sessions(self._session_counts, rows)
        for item in batch:
            if item.done:
                item.done(None)

    def _apply(self, con: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        """The batch's writes in queue order; each run of exchange rows goes in as one insert."""
        table = journal_table(self._journals[-1])
        rows: list[dict[str, Any]] = []
        for item in batch:
            if item.row is not None:
                rows.append(item.row)
                continue
            _insert_journal_rows(con, rows, table)
            rows = []
            con.execute(item.sql, item.params)
        _insert_journal_rows(con, rows, table)

    def _flush_sessions(self, con: duckdb.DuckDBPyConnection) -> None:
        """Count committed exchanges into `sessions`, in a transaction of their own.

        Kept out of the exchange's commit, which the client waits for (each DuckDB statement costs ~0.5 ms). If the
        process dies in between, the next open recounts the sessions from the exchanges.
        """
        if not self._session_counts:
            return
        counts = self._session_counts
        try:
            if len(counts) == 1 and self._known_sessions.issuperset(counts):
                _update_sessions(con, counts, self._known_sessions)  # one UPDATE: its own transaction
            else:
                with _transaction(con):
                    _update_sessions(con, counts, self._known_sessions)
        except Exception:  # noqa: BLE001 - kept, and retried with the next flush
            log.exception("polar-mitm: could not update session counters")
            return
        self._known_sessions.update(counts)
        self._session_counts = {}

    # -- journals and segments
    def _rotate(self, con: duckdb.DuckDBPyConnection) -> int | None:
        """Start a new journal; returns the full one, for the compactor. Writer thread (or before it starts)."""
        number = self._next_number
        journals = self._journals + [number]
        with _transaction(con):
            con.execute(f"CREATE TABLE {journal_table(number)} ({', '.join(f'{n} {t}' for n, t in JOURNAL_COLUMNS.items())})")
            self._write_view(con, self._segments, journals)
        self._next_number += 1
        full, self._journals, self._journal_rows = self._journals, journals, 0
        return full[-1] if full else None

    def _write_view(self, con: duckdb.DuckDBPyConnection, segment_files: list[Path], journals: list[int]) -> None:
        con.execute(exchanges_view_sql(segment_files, journals))
        con.execute(f"COMMENT ON VIEW exchanges IS {_quote(EXCHANGES_DOC)}")

    def _write_segment(self, con: duckdb.DuckDBPyConnection, number: int) -> int:
        """Copy journal `number` (no longer written to) into its Parquet segment; returns the rows copied."""
        rows = con.execute(f"SELECT count(*) FROM {journal_table(number)}").fetchall()[0][0]
        if rows:
            write_parquet(con, f"SELECT {JOURNAL_SELECT} FROM {journal_source(number)}", self.segments_dir / segment_file(number))
        return rows

    def _install_segment(self, con: duckdb.DuckDBPyConnection, number: int, rows: int) -> None:
        """Swap journal `number` for its segment in one transaction: the rows are never in both or in neither."""
        segments = self._segments + ([self.segments_dir / segment_file(number)] if rows else [])
        journals = [j for j in self._journals if j != number]
        with _transaction(con):
            if rows:
                _register_segment(con, number, rows)
            self._write_view(con, segments, journals)
            con.execute(f"DROP TABLE {journal_table(number)}")
        self._segments, self._journals = segments, journals

    def _compact(self, con: duckdb.DuckDBPyConnection, number: int) -> None:
        """Journal to segment, all in the calling thread (start-up and close, when nothing else writes)."""
        self._install_segment(con, number, self._write_segment(con, number))

    def _compact_loop(self) -> None:
        # compaction yields to the proxy: DuckDB runs it on this thread alone (threads=1, set at open), niced
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        con = self.con.cursor()
        while True:
            number = self._compactions.get()
            if number is None:
                return
            started = time.perf_counter()
            try:
                rows = self._write_segment(con, number)
                written = time.perf_counter()
                self._call_writer(_Pending(step=lambda writer, number=number, rows=rows: self._install_segment(writer, number, rows)))
            except Exception:  # noqa: BLE001 - the journal stays (and stays in the view); compacted again at the next open
                log.exception(f"polar-mitm: could not compact {journal_table(number)}")
                continue
            installed = time.perf_counter()
            checkpointed = _checkpoint_soon(con)
            log.info(
                f"polar-mitm: segment {number:06d}: {rows} exchanges written in {1000 * (written - started):.0f} ms, installed in "
                f"{1000 * (installed - written):.0f} ms, {'checkpoint' if checkpointed else 'no checkpoint'} in {1000 * (time.perf_counter() - installed):.0f} ms"
            )

    def _migrate_v1(self) -> None:
        """Schema 1 kept `exchanges` as a table: it becomes the first segment."""
        is_table = self.con.execute("SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = 'exchanges'").fetchall()[0][0]
        if not is_table:
            return
        number = _next_segment(self.con)
        rows = self.con.execute("SELECT count(*) FROM exchanges").fetchall()[0][0]
        if rows:
            columns = {r[0] for r in self.con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'exchanges'").fetchall()}
            write_parquet(self.con, f"SELECT {_contract_select(columns)} FROM exchanges", self.segments_dir / segment_file(number))
        with _transaction(self.con):
            if rows:
                _register_segment(self.con, number, rows)
            self.con.execute("DROP TABLE exchanges")
        if rows:
            self._segments.append(self.segments_dir / segment_file(number))

    # -- reads (any thread)
    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        cursor = self.con.cursor()
        try:
            result = cursor.execute(sql, params or [])
            columns = [d[0] for d in result.description] if result.description else []
            return columns, result.fetchall()
        finally:
            cursor.close()

    # -- the control endpoint for readers in other processes
    def serve_sql(self, port: int = 0) -> str:
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                length = int(self.headers.get("content-length") or 0)
                try:
                    request = json.loads(self.rfile.read(length) or b"{}")
                    sql = request["sql"]
                    check_read_only(sql)
                    columns, rows = store.query(sql, request.get("params"))
                    status, payload = 200, {"columns": columns, "rows": [list(r) for r in rows]}
                except Exception as error:  # noqa: BLE001 - returned to the caller
                    status, payload = 400, {"error": f"{type(error).__name__}: {error}"}
                data = json.dumps(payload, default=_json_default).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._control = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self._control.serve_forever, name="polar-sql", daemon=True).start()
        url = f"http://127.0.0.1:{self._control.server_address[1]}"
        control_file(self.path).write_text(json.dumps({"pid": os.getpid(), "sql_url": url}))
        return url

    def close(self) -> None:
        """Stop writing; every journal becomes a segment, so a closed store holds its exchanges in Parquet."""
        if self._control is not None:
            self._control.shutdown()
            control_file(self.path).unlink(missing_ok=True)
            self._control = None
        self._compactions.put(None)  # finishes the compactions queued so far (their last step needs the writer)
        self._compactor.join(timeout=600)
        self._queue.put(None)
        self._writer.join(timeout=60)
        try:
            full = list(self._journals)
            self._rotate(self.con)
            for number in full:
                self._compact(self.con, number)
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('closed_cleanly', 'true')")
            self.con.execute("CHECKPOINT")
        except Exception:  # noqa: BLE001 - the journals stay; the next open compacts them
            log.exception("polar-mitm: could not compact the journal at close")
        self.con.close()


def write_parquet(con: duckdb.DuckDBPyConnection, select: str, path: Path) -> None:
    """Write a segment durably: to a temporary name, fsynced, then renamed (a segment file is whole or absent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    # lz4: about half zstd's CPU here (token ids are random-looking integers), in files ~1.5x the size
    con.execute(f"COPY ({select}) TO {_quote(str(temporary))} (FORMAT parquet, COMPRESSION lz4_raw)")
    _fsync(temporary)
    os.replace(temporary, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_soon(con: duckdb.DuckDBPyConnection, attempts: int = 2000) -> bool:
    """CHECKPOINT in a gap between the writer's transactions (DuckDB refuses one while another write is open)."""
    for _ in range(attempts):
        try:
            con.execute("CHECKPOINT")
            return True
        except duckdb.TransactionException:
            time.sleep(0.001)
    log.info("polar-mitm: no gap for a checkpoint; DuckDB checkpoints by itself past 1 GB of WAL")
    return False


def add_segment(con: duckdb.DuckDBPyConnection, db_path: str | os.PathLike[str], rows: pa.Table) -> None:
    """Bulk-load exchange rows (an Arrow table, any subset of the columns) as one segment of a store no Store has open."""
    number = _next_segment(con)
    con.register("polar_bulk_rows", rows)
    try:
        write_parquet(con, f"SELECT {_contract_select(rows.column_names)} FROM polar_bulk_rows", segments_dir(db_path) / segment_file(number))
    finally:
        con.unregister("polar_bulk_rows")
    _register_segment(con, number, rows.num_rows)


def _next_segment(con: duckdb.DuckDBPyConnection) -> int:
    return con.execute(f"SELECT coalesce(max(segment), 0) + 1 FROM {SEGMENTS_TABLE}").fetchall()[0][0]


def _insert_journal_rows(con: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]], table: str) -> None:
    """Insert exchange rows into a journal table: one statement, however many rows."""
    if not rows:
        return
    if len(rows) == 1:
        row = rows[0]
        con.execute(f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?)", [row["exchange_id"], row["session_id"], row["seq"], row["status"], *journal_records(row)])
        return
    # DuckDB reads the Arrow table by its variable name (a replacement scan: cheaper than register())
    records = [journal_records(row) for row in rows]
    polar_pending_exchanges = pa.table(  # noqa: F841 - read by DuckDB
        {
            "exchange_id": [row["exchange_id"] for row in rows],
            "session_id": [row["session_id"] for row in rows],
            "seq": [row["seq"] for row in rows],
            "status": [row["status"] for row in rows],
            # orjson's output: UTF-8 by construction, so no validation on the way in
            "head": pa.array([head for head, _ in records], pa.binary()),
            "body": pa.array([body for _, body in records], pa.binary()),
        },
        schema=JOURNAL_ARROW_SCHEMA,
    )
    con.execute(f"INSERT INTO {table} SELECT * FROM polar_pending_exchanges")


@contextmanager
def _transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
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


def _count_sessions(counts: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    for row in rows:
        stamp = row.get("ended_at") or now()
        entry = counts.get(row["session_id"])
        if entry is None:
            counts[row["session_id"]] = {"created_at": row.get("started_at") or stamp, "last_seen_at": stamp, "n_exchanges": 1, "harness": row.get("harness")}
        else:
            entry["last_seen_at"] = stamp
            entry["n_exchanges"] += 1
            entry["harness"] = entry["harness"] or row.get("harness")


def _update_sessions(con: duckdb.DuckDBPyConnection, counts: dict[str, dict[str, Any]], known: set[str]) -> None:
    """Add counts to the sessions that exist (e.g. recorded by the rollout server), then insert the new ones."""
    new = not known.issuperset(counts)
    if len(counts) == 1:
        ((session_id, entry),) = counts.items()
        con.execute(_UPDATE_SESSION, [entry["last_seen_at"], entry["n_exchanges"], entry["harness"], session_id])
        if not new:
            return
    polar_pending_sessions = pa.table(  # noqa: F841 - read by DuckDB
        {"session_id": list(counts), **{key: [entry[key] for entry in counts.values()] for key in ("created_at", "last_seen_at", "n_exchanges", "harness")}},
        schema=SESSION_ARROW_SCHEMA,
    )
    if len(counts) > 1:
        con.execute(_UPDATE_SESSIONS)
    if new:
        con.execute(_INSERT_SESSIONS)


def control_file(db_path: str | os.PathLike[str]) -> Path:
    return Path(str(db_path) + ".control.json")


READ_ONLY_STATEMENTS = {"SELECT", "EXPLAIN", "PRAGMA", "SHOW", "DESCRIBE", "SUMMARIZE"}


def check_read_only(sql: str) -> None:
    for statement in duckdb.extract_statements(sql):
        kind = statement.type.name
        if kind not in READ_ONLY_STATEMENTS:
            raise PermissionError(f"only read-only SQL is answered while the gateway owns the store ({kind} refused)")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


def query(db_path: str | os.PathLike[str], sql: str, params: list[Any] | None = None, timeout: float = 60) -> tuple[list[str], list[list[Any]]]:
    """Read the store from any process: directly when no gateway holds it, else through the gateway."""
    path = Path(db_path)
    control = control_file(path)
    if control.exists():
        info = json.loads(control.read_text())
        if _pid_alive(info.get("pid")):
            import httpx

            check_read_only(sql)
            response = httpx.post(info["sql_url"] + "/sql", json={"sql": sql, "params": params}, timeout=timeout, trust_env=False)
            payload = response.json()
            if response.status_code != 200:
                raise RuntimeError(payload.get("error", response.text))
            return payload["columns"], payload["rows"]
    if not path.exists():
        raise FileNotFoundError(f"no store at {path}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            con = duckdb.connect(str(path), read_only=True)
            break
        except duckdb.IOException:
            # the gateway may be starting: its control file appears right after it opens the store
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            if control.exists():
                return query(db_path, sql, params, timeout)
    try:
        result = con.execute(sql, params or [])
        columns = [d[0] for d in result.description] if result.description else []
        return columns, [list(r) for r in result.fetchall()]
    finally:
        con.close()


def query_dicts(db_path: str | os.PathLike[str], sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
    columns, rows = query(db_path, sql, params)
    return [dict(zip(columns, row)) for row in rows]


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
