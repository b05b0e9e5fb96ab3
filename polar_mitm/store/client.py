"""Reading a store from any process: `query` and `query_dicts`.

When a gateway holds the store (its control file names a live process), the SQL goes to the gateway's loopback
endpoint, checked read-only here first; otherwise the file is opened read-only directly.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.store.control import check_read_only, control_file


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
    return [dict(zip(columns, row, strict=True)) for row in rows]


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
