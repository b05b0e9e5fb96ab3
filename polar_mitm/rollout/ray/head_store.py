"""The durable head: the rollout server's own DuckDB file of tasks, session states and callback deliveries.

Written at every step that must survive the head: a task when it is accepted (before the 202), a session when it
is dispatched to a node (before the node is called) and when it ends, a delivery before each POST and after it.
A restarted head reads it back (`RayScheduler.recover`): every accepted task is reported again; a session that
had ended keeps its result; one that was dispatched is re-attached to its node (never run again: if the node
no longer knows it, it ends `failed`); one that was never dispatched is dispatched now; a delivery that was not
acknowledged is sent again with its delivery id, one that was is never sent again.

One process owns the file (the head); it is small (no exchanges), so writes are synchronous on the event loop.
The file is created at the first read or write, not when the HeadStore is made: a head that cannot join its Ray
cluster leaves none behind.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from polar_mitm.rollout.models import Delivery, SessionResult, TaskRequest
from polar_mitm.store import now

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS head_tasks (task_id VARCHAR PRIMARY KEY, request JSON NOT NULL, session_ids JSON NOT NULL, "
    "created_at TIMESTAMPTZ NOT NULL, finished_at TIMESTAMPTZ, trajectories VARCHAR, trajectory_stats JSON, early_stopped BOOLEAN DEFAULT false)",
    "CREATE TABLE IF NOT EXISTS head_sessions (session_id VARCHAR PRIMARY KEY, task_id VARCHAR NOT NULL, sample_index INTEGER NOT NULL, node VARCHAR, status VARCHAR NOT NULL, "
    "result JSON, dispatched_at TIMESTAMPTZ, updated_at TIMESTAMPTZ NOT NULL)",
    "CREATE TABLE IF NOT EXISTS head_deliveries (delivery_id VARCHAR PRIMARY KEY, kind VARCHAR NOT NULL, url VARCHAR NOT NULL, status VARCHAR NOT NULL, "
    "attempts INTEGER NOT NULL, delivered_at TIMESTAMPTZ, last_error VARCHAR, updated_at TIMESTAMPTZ NOT NULL)",
]


@dataclass
class StoredTask:
    task_id: str
    request: TaskRequest
    session_ids: list[str]
    created_at: datetime
    finished_at: datetime | None
    trajectories: str | None
    trajectory_stats: dict[str, Any] | None
    early_stopped: bool
    sessions: dict[str, tuple[str | None, str, SessionResult | None]]  # session id -> (node, status, final result)


class HeadStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The file's connection, opened (and the file made) on first use; call with `lock` held."""
        if self._con is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._con = duckdb.connect(str(self.path))
            for statement in SCHEMA:
                self._con.execute(statement)
        return self._con

    def _write(self, sql: str, params: list[Any]) -> None:
        with self.lock:
            self.con.execute(sql, params)

    def _read(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.con.execute(sql, params or []).fetchall()

    # -- tasks
    def add_task(self, task_id: str, request: TaskRequest, session_ids: list[str], created_at: datetime) -> None:
        """The task and its sessions (`session_ids` in sample order), in one transaction."""
        with self.lock:
            self.con.execute("BEGIN TRANSACTION")
            self.con.execute(
                "INSERT INTO head_tasks (task_id, request, session_ids, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [task_id, request.model_dump_json(), json.dumps(session_ids), created_at],
            )
            for index, session_id in enumerate(session_ids):
                self.con.execute(
                    "INSERT INTO head_sessions (session_id, task_id, sample_index, status, updated_at) VALUES (?, ?, ?, 'queued', ?) ON CONFLICT DO NOTHING",
                    [session_id, task_id, index, now()],
                )
            self.con.execute("COMMIT")

    def task_finished(self, task_id: str, finished_at: datetime, trajectories: str | None, stats: dict[str, Any] | None, early_stopped: bool) -> None:
        self._write(
            "UPDATE head_tasks SET finished_at = ?, trajectories = ?, trajectory_stats = ?, early_stopped = ? WHERE task_id = ?",
            [finished_at, trajectories, json.dumps(stats, default=str), early_stopped, task_id],
        )

    # -- sessions
    def dispatched(self, session_id: str, node: str) -> None:
        self._write("UPDATE head_sessions SET node = ?, status = 'dispatched', dispatched_at = ?, updated_at = ? WHERE session_id = ?", [node, now(), now(), session_id])

    def requeued(self, session_id: str) -> None:
        """Its node died before the session started there: back in the queue, for another node."""
        self._write("UPDATE head_sessions SET node = NULL, status = 'queued', dispatched_at = NULL, updated_at = ? WHERE session_id = ?", [now(), session_id])

    def session_ended(self, result: SessionResult) -> None:
        self._write("UPDATE head_sessions SET status = ?, result = ?, updated_at = ? WHERE session_id = ?", [result.status, result.model_dump_json(), now(), result.session_id])

    def session_state(self, session_id: str) -> tuple[str | None, str, SessionResult | None] | None:
        rows = self._read("SELECT node, status, result FROM head_sessions WHERE session_id = ?", [session_id])
        if not rows:
            return None
        node, status, result = rows[0]
        return node, status, SessionResult.model_validate_json(result) if result else None

    # -- deliveries
    def delivery(self, delivery_id: str) -> Delivery | None:
        rows = self._read("SELECT delivery_id, kind, url, status, attempts, delivered_at, last_error FROM head_deliveries WHERE delivery_id = ?", [delivery_id])
        if not rows:
            return None
        keys = ("delivery_id", "kind", "url", "status", "attempts", "delivered_at", "last_error")
        return Delivery.model_validate(dict(zip(keys, rows[0], strict=True)))

    def save_delivery(self, delivery: Delivery) -> None:
        self._write(
            "INSERT INTO head_deliveries VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (delivery_id) DO UPDATE SET status = excluded.status, "
            "attempts = excluded.attempts, delivered_at = excluded.delivered_at, last_error = excluded.last_error, updated_at = excluded.updated_at",
            [delivery.delivery_id, delivery.kind, delivery.url, delivery.status, delivery.attempts, delivery.delivered_at, delivery.last_error, now()],
        )

    # -- recovery
    def tasks(self) -> list[StoredTask]:
        sessions: dict[str, dict[str, tuple[str | None, str, SessionResult | None]]] = {}
        for session_id, task_id, node, status, result in self._read("SELECT session_id, task_id, node, status, result FROM head_sessions"):
            sessions.setdefault(task_id, {})[session_id] = (node, status, SessionResult.model_validate_json(result) if result else None)
        stored = []
        for row in self._read("SELECT task_id, request, session_ids, created_at, finished_at, trajectories, trajectory_stats, early_stopped FROM head_tasks ORDER BY created_at"):
            task_id, request, session_ids, created_at, finished_at, trajectories, stats, early_stopped = row
            stored.append(StoredTask(
                task_id=task_id, request=TaskRequest.model_validate_json(request), session_ids=json.loads(session_ids), created_at=created_at,
                finished_at=finished_at, trajectories=trajectories, trajectory_stats=json.loads(stats) if stats else None,
                early_stopped=bool(early_stopped), sessions=sessions.get(task_id, {}),
            ))
        return stored

    def close(self) -> None:
        with self.lock:
            if self._con is not None:
                self._con.close()
                self._con = None
