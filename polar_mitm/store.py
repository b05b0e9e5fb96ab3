"""The DuckDB store: one row per model exchange, committed before the client gets its reply.

DuckDB allows one writing process per file. The gateway owns the file while it runs: a single writer
thread does group commits (the event loop never touches DuckDB), and read-only SQL from other processes
is answered by the gateway itself over a loopback control endpoint named in `<db>.control.json`.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

SCHEMA_VERSION = 1

EXCHANGE_COLUMNS: dict[str, str] = {
    "exchange_id": "VARCHAR PRIMARY KEY",
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

JSON_COLUMNS = {name for name, kind in EXCHANGE_COLUMNS.items() if kind == "JSON"}

# exchange rows reach DuckDB as one Arrow table per group commit: one statement for the batch instead of one per
# row, and token arrays converted in C rather than element by element as statement parameters
_ARROW_TYPES = {
    "VARCHAR": pa.string(),
    "JSON": pa.string(),
    "INTEGER": pa.int32(),
    "BIGINT": pa.int64(),
    "BOOLEAN": pa.bool_(),
    "DOUBLE": pa.float64(),
    "TIMESTAMPTZ": pa.timestamp("us", tz="UTC"),
}


def _arrow_type(kind: str) -> pa.DataType:
    """The Arrow type carrying a column of DuckDB type `kind` (e.g. "INTEGER[] NOT NULL")."""
    base = kind.split()[0]
    return pa.list_(_ARROW_TYPES[base[:-2]]) if base.endswith("[]") else _ARROW_TYPES[base]


EXCHANGE_ARROW_SCHEMA = pa.schema([(name, _arrow_type(kind)) for name, kind in EXCHANGE_COLUMNS.items()])
SESSION_ARROW_SCHEMA = pa.schema([(name, _arrow_type(SESSION_COLUMNS[name])) for name in ("session_id", "created_at", "last_seen_at", "n_exchanges", "harness")])
_INSERT_EXCHANGES = f"INSERT INTO exchanges ({', '.join(EXCHANGE_COLUMNS)}) SELECT {', '.join(EXCHANGE_COLUMNS)} FROM polar_pending_exchanges"
# an UPDATE plus an INSERT of the sessions not there yet: DuckDB's INSERT ... ON CONFLICT DO UPDATE cost ~3x more
_UPDATE_SESSIONS = (
    "UPDATE sessions SET last_seen_at = p.last_seen_at, n_exchanges = sessions.n_exchanges + p.n_exchanges, "
    "harness = coalesce(sessions.harness, p.harness) FROM polar_pending_sessions p WHERE sessions.session_id = p.session_id"
)
_INSERT_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, created_at, last_seen_at, n_exchanges, harness FROM polar_pending_sessions "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions)"
)


def now() -> datetime:
    return datetime.now(timezone.utc)


def _create_table(con: duckdb.DuckDBPyConnection, table: str, columns: dict[str, str]) -> None:
    con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(f'{n} {t}' for n, t in columns.items())})")
    # later versions add columns; never rename
    existing = {r[0] for r in con.execute(f"SELECT column_name FROM information_schema.columns WHERE table_name = '{table}'").fetchall()}
    for name, kind in columns.items():
        if name not in existing:
            con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind.replace(' PRIMARY KEY', '').replace(' NOT NULL', '')}")


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    _create_table(con, "exchanges", EXCHANGE_COLUMNS)
    _create_table(con, "sessions", SESSION_COLUMNS)
    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
    from polar_mitm import views  # views depend on the tables above

    views.create_views(con)


def _json(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


@dataclass
class _Pending:
    """One queued write: an exchange row, or a statement from execute_write."""

    sql: str = ""
    params: list[Any] = field(default_factory=list)
    done: Any = None  # called with (error or None) from the writer thread
    row: dict[str, Any] | None = None


class Store:
    """The single writer of one DuckDB file; safe to use from an asyncio event loop."""

    def __init__(self, path: str | os.PathLike[str], batch_max: int = 256):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con = duckdb.connect(str(self.path))
        # Exchange rows are big (token-id lists, 100+ KB of JSON) and every checkpoint rewrites the table's partly
        # filled row group. DuckDB's defaults checkpoint at every commit over 100 KB (skipping the WAL) and every
        # 16 MB of WAL, so the writer's cost per row grew with the table; logging every commit and checkpointing
        # every 256 MB roughly halves it (bench/run.py). The price: a longer WAL to replay after a crash.
        self.con.execute(f"SET auto_checkpoint_skip_wal_threshold = {2**62}")
        self.con.execute("SET checkpoint_threshold = '256MB'")
        ensure_schema(self.con)
        self._seq: dict[str, int] = dict(
            self.con.execute("SELECT session_id, max(seq) FROM exchanges GROUP BY session_id").fetchall()
        )
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._batch_max = batch_max
        self._writer = threading.Thread(target=self._write_loop, name="polar-store-writer", daemon=True)
        self._writer.start()
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
        event = threading.Event()
        errors: list[BaseException] = []

        def done(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            event.set()

        self._queue.put(_Pending(sql, params or [], done=done))
        event.wait()
        if errors:
            raise errors[0]

    def _write_loop(self) -> None:
        con = self.con.cursor()
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self._batch_max:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            self._commit_batch(con, batch)

    def _commit_batch(self, con: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        try:
            con.execute("BEGIN TRANSACTION")
            self._apply(con, batch)
            con.execute("COMMIT")
            self.commits += 1
        except Exception:
            con.execute("ROLLBACK")
            _release(con)
            # one bad row must not fail its neighbours: retry each alone
            for item in batch:
                try:
                    con.execute("BEGIN TRANSACTION")
                    self._apply(con, [item])
                    con.execute("COMMIT")
                except Exception as error:  # noqa: BLE001 - reported to the waiting caller
                    con.execute("ROLLBACK")
                    _release(con)
                    if item.done:
                        item.done(error)
                    continue
                _release(con)
                if item.done:
                    item.done(None)
            return
        _release(con)
        for item in batch:
            if item.done:
                item.done(None)

    def _apply(self, con: duckdb.DuckDBPyConnection, batch: list[_Pending]) -> None:
        """The batch's writes in queue order; each run of exchange rows goes in as one insert."""
        rows: list[dict[str, Any]] = []
        for item in batch:
            if item.row is not None:
                rows.append(item.row)
                continue
            _insert_exchanges(con, rows)
            rows = []
            con.execute(item.sql, item.params)
        _insert_exchanges(con, rows)

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
        if self._control is not None:
            self._control.shutdown()
            control_file(self.path).unlink(missing_ok=True)
            self._control = None
        self._queue.put(None)
        self._writer.join(timeout=30)
        self.con.close()


def _insert_exchanges(con: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]]) -> None:
    """Insert exchange rows and count them into their sessions: three statements, however many rows."""
    if not rows:
        return
    columns = {name: [row.get(name) for row in rows] for name in EXCHANGE_COLUMNS}
    for name in JSON_COLUMNS:
        columns[name] = [_json(value) for value in columns[name]]
    sessions: dict[str, dict[str, Any]] = {}
    for row in rows:
        stamp = row.get("ended_at") or now()
        entry = sessions.get(row["session_id"])
        if entry is None:
            sessions[row["session_id"]] = {"created_at": row.get("started_at") or stamp, "last_seen_at": stamp, "n_exchanges": 1, "harness": row.get("harness")}
        else:
            entry["last_seen_at"] = stamp
            entry["n_exchanges"] += 1
            entry["harness"] = entry["harness"] or row.get("harness")
    exchanges = pa.table(columns, schema=EXCHANGE_ARROW_SCHEMA)
    session_rows = pa.table(
        {"session_id": list(sessions), **{key: [entry[key] for entry in sessions.values()] for key in ("created_at", "last_seen_at", "n_exchanges", "harness")}},
        schema=SESSION_ARROW_SCHEMA,
    )
    # unregistered by _release once the transaction has ended (inside an aborted one, unregister itself fails)
    con.register("polar_pending_exchanges", exchanges)
    con.register("polar_pending_sessions", session_rows)
    con.execute(_INSERT_EXCHANGES)
    con.execute(_UPDATE_SESSIONS)
    con.execute(_INSERT_SESSIONS)


def _release(con: duckdb.DuckDBPyConnection) -> None:
    con.unregister("polar_pending_exchanges")
    con.unregister("polar_pending_sessions")


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
