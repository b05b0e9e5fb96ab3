"""The loopback SQL endpoint: while a gateway owns the store (DuckDB allows one writing process per file), it
answers read-only SQL from other processes over HTTP on 127.0.0.1, at the address it writes to `<db>.control.json`
(the control file; polar_mitm.store.by_path reads it). Its one write: loading an assembler Parquet file into the
`trajectories` table through the store's writer (`{"trajectories_parquet": ABSOLUTE_PATH}`), so `polar-mitm
assemble` and the views over that table work while the gateway runs.

A gateway killed hard leaves its control file behind: readers see its pid is gone and open the file themselves,
and the next gateway on the store writes its own."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import duckdb

# (sql, params) -> (columns, rows): Store.query
RunQuery = Callable[[str, Any], tuple[list[str], list[Any]]]
# absolute Parquet path -> None: Store.load_trajectories
LoadTrajectories = Callable[[Path], None]


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


def serve_sql(
    db_path: str | os.PathLike[str], run_query: RunQuery, port: int = 0, load_trajectories: LoadTrajectories | None = None, pid: int | None = None,
) -> ThreadingHTTPServer:
    """Answer read-only SQL with `run_query` (and trajectory loads with `load_trajectories`) on a loopback port, and
    name the endpoint in the control file, with the pid of the gateway that holds the store (default: this process;
    a store in a process of its own names its gateway's, which it does not outlive)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server API
            length = int(self.headers.get("content-length") or 0)
            try:
                request = json.loads(self.rfile.read(length) or b"{}")
                if "trajectories_parquet" in request:
                    parquet = Path(request["trajectories_parquet"])
                    if load_trajectories is None or not parquet.is_absolute():
                        raise PermissionError("this endpoint loads trajectories only from an absolute Parquet path")
                    load_trajectories(parquet)
                    status, payload = 200, {"loaded": str(parquet)}
                else:
                    sql = request["sql"]
                    check_read_only(sql)
                    columns, rows = run_query(sql, request.get("params"))
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

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="polar-sql", daemon=True).start()
    # whole or absent: a reader never sees half a file
    control = control_file(db_path)
    partial = control.with_name(control.name + f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"pid": pid or os.getpid(), "sql_url": sql_url(server)}))
    os.replace(partial, control)
    return server


def sql_url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def stop_serving(db_path: str | os.PathLike[str], server: ThreadingHTTPServer) -> None:
    server.shutdown()
    control_file(db_path).unlink(missing_ok=True)
