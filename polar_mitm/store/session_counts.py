"""The writer's session counters: committed exchanges counted into `sessions` after their replies (Store's
_flush_sessions), and recounted from the exchanges after a crash cut a flush short."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.store.schema import ARROW_TYPES, SESSION_COLUMNS, base_type, now

SESSION_ARROW_SCHEMA = pa.schema([(name, ARROW_TYPES[base_type(SESSION_COLUMNS[name])]) for name in ("session_id", "created_at", "last_seen_at", "n_exchanges", "harness")])

# an UPDATE plus an INSERT of the sessions not there yet: DuckDB's INSERT ... ON CONFLICT DO UPDATE cost ~3x more
UPDATE_SESSIONS = (
    "UPDATE sessions SET last_seen_at = p.last_seen_at, n_exchanges = coalesce(sessions.n_exchanges, 0) + p.n_exchanges, "
    "harness = coalesce(sessions.harness, p.harness) FROM polar_pending_sessions p WHERE sessions.session_id = p.session_id"
)
UPDATE_SESSION = "UPDATE sessions SET last_seen_at = ?, n_exchanges = coalesce(n_exchanges, 0) + ?, harness = coalesce(harness, ?) WHERE session_id = ?"
INSERT_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, created_at, last_seen_at, n_exchanges, harness FROM polar_pending_sessions "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions)"
)


# after a crash: session counters the writer had not flushed yet, recounted from the exchanges themselves
RECOUNT_NEW_SESSIONS = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness) "
    "SELECT session_id, min(started_at), max(coalesce(ended_at, started_at)), count(*), any_value(harness) FROM exchanges "
    "WHERE session_id NOT IN (SELECT session_id FROM sessions) GROUP BY session_id"
)
RECOUNT_SESSIONS = (
    "UPDATE sessions SET n_exchanges = e.n, last_seen_at = greatest(sessions.last_seen_at, e.last_seen_at), harness = coalesce(sessions.harness, e.harness) "
    "FROM (SELECT session_id, count(*) AS n, max(coalesce(ended_at, started_at)) AS last_seen_at, any_value(harness) AS harness "
    "FROM exchanges GROUP BY session_id) e WHERE sessions.session_id = e.session_id"
)


def count_sessions(counts: dict[str, dict[str, Any]], rows: Sequence[Mapping[str, Any]]) -> None:
    for row in rows:
        stamp = row.get("ended_at") or now()
        entry = counts.get(row["session_id"])
        if entry is None:
            counts[row["session_id"]] = {"created_at": row.get("started_at") or stamp, "last_seen_at": stamp, "n_exchanges": 1, "harness": row.get("harness")}
        else:
            entry["last_seen_at"] = stamp
            entry["n_exchanges"] += 1
            entry["harness"] = entry["harness"] or row.get("harness")


def update_sessions(con: duckdb.DuckDBPyConnection, counts: dict[str, dict[str, Any]], known: set[str]) -> None:
    """Add counts to the sessions that exist (e.g. recorded by the rollout server), then insert the new ones."""
    new = not known.issuperset(counts)
    if len(counts) == 1:
        ((session_id, entry),) = counts.items()
        con.execute(UPDATE_SESSION, [entry["last_seen_at"], entry["n_exchanges"], entry["harness"], session_id])
        if not new:
            return
    polar_pending_sessions = pa.table(  # noqa: F841 - read by DuckDB
        {"session_id": list(counts), **{key: [entry[key] for entry in counts.values()] for key in ("created_at", "last_seen_at", "n_exchanges", "harness")}},
        schema=SESSION_ARROW_SCHEMA,
    )
    if len(counts) > 1:
        con.execute(UPDATE_SESSIONS)
    if new:
        con.execute(INSERT_SESSIONS)

