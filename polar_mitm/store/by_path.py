"""Reading a store from any process: `query` and `query_dicts`; `load_trajectories` writes the one thing a live
store takes from other processes.

When a gateway holds the store (its control file names a live process), the SQL goes to the gateway's loopback
endpoint, checked read-only here first; otherwise the file is opened read-only directly (segments.connect: from
any working directory), once `recover` has put back what a crashed writer left in its commit log.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.store.commit_log import commit_logs
from polar_mitm.store.segments import connect
from polar_mitm.store.sql_endpoint import check_read_only, control_file
from polar_mitm.store.writer import Store, open_stores

log = logging.getLogger("polar_mitm.store")
_recovering = threading.Lock()


def recover(db_path: str | os.PathLike[str]) -> None:
    """A store whose writer died (a SIGKILL, a lost node) may hold its last commits (up to a segment's worth, and
    the sealed ones the compactor had not written yet) in its commit logs only, not yet in the file a bare DuckDB
    client reads. Open it as its writer once, which puts them back, and close it. Nothing to do (and nothing done)
    when there is no such log, or a Store of this process or another process holds the file (then the logs are that
    writer's)."""
    path = Path(db_path)
    with _recovering:
        try:
            logs = [log_path for log_path in commit_logs(path) if log_path.stat().st_size]
        except FileNotFoundError:
            return
        if not logs or path.resolve() in open_stores or live_holder(path):
            return
        try:
            Store(path).close()
        except (duckdb.Error, OSError) as error:  # another process writes it, or it cannot be written here: read what the file holds
            log.warning(f"polar-mitm: {path} has committed exchanges in {', '.join(logged.name for logged in logs)} that could not be put back now ({error}); reads miss them until its next writer opens it")


def live_holder(db_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The control file of the gateway that holds the store now ({"pid", "sql_url"}), or None (no file, or the
    process it names is gone)."""
    try:
        info = json.loads(control_file(Path(db_path)).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return info if isinstance(info, dict) and pid_alive(info.get("pid")) else None


def live_endpoint(db_path: str | os.PathLike[str]) -> str | None:
    """The SQL endpoint of the gateway that holds the store now, or None."""
    holder = live_holder(db_path)
    return holder.get("sql_url") if holder else None


def load_trajectories(db_path: str | os.PathLike[str], parquet: Path, timeout: float = 300) -> bool:
    """Load an assembler Parquet file into the `trajectories` table of a store a gateway holds, through its writer.
    False when no gateway holds the store (open it for writing yourself)."""
    url = live_endpoint(db_path)
    if url is None:
        return False
    import httpx

    response = httpx.post(url + "/sql", json={"trajectories_parquet": str(parquet.resolve())}, timeout=timeout, trust_env=False)
    if response.status_code != 200:
        raise RuntimeError(response.json().get("error", response.text))
    return True


def query(db_path: str | os.PathLike[str], sql: str, params: list[Any] | None = None, timeout: float = 60) -> tuple[list[str], list[list[Any]]]:
    """Read the store from any process: directly when no gateway holds it, else through the gateway."""
    path = Path(db_path)
    control = control_file(path)
    if url := live_endpoint(path):
        import httpx

        check_read_only(sql)
        response = httpx.post(url + "/sql", json={"sql": sql, "params": params}, timeout=timeout, trust_env=False)
        payload = response.json()
        if response.status_code != 200:
            raise RuntimeError(payload.get("error", response.text))
        return payload["columns"], payload["rows"]
    if not path.exists():
        raise FileNotFoundError(f"no store at {path}")
    recover(path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            con = connect(path, read_only=True)
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


def pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
