"""The writer's session counters: committed exchanges counted into `sessions` after their replies
(SessionCounters, flushed by the Store's writer thread), and recounted from the exchanges after a crash cut a flush
short."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from polar_mitm.store import views
from polar_mitm.store.schema import ARROW_TYPES, SESSION_COLUMNS, arrow_array, base_type, now
from polar_mitm.store.segments import transaction

SESSION_ARROW_SCHEMA = pa.schema([(name, ARROW_TYPES[base_type(SESSION_COLUMNS[name])]) for name in ("session_id", "created_at", "last_seen_at", "n_exchanges", "harness")])

# counters are flushed with the commit log's moves (polar_mitm.store.commit_log) and before every read of `sessions`,
# so a reader still sees every committed exchange counted: a flush is an UPDATE of `sessions` by its primary key, which
# cost the writer as much as the journal inserts when it followed every commit (bench/scale.py at 64 sessions, py-spy:
# 12.5% vs 11.4% of the gateway's samples)
# the SQL that may read `sessions`: the table, or one of the store's views over it
READS_SESSIONS = re.compile(
    r"\b(" + "|".join(["sessions", *(name for name, view in views.VIEWS.items() if re.search(r"\bsessions\b", view.sql))]) + r")\b", re.IGNORECASE
)

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
    columns = {"session_id": list(counts), **{key: [entry[key] for entry in counts.values()] for key in ("created_at", "last_seen_at", "n_exchanges", "harness")}}
    polar_pending_sessions = pa.table(  # noqa: F841 - read by DuckDB
        [arrow_array(values, SESSION_ARROW_SCHEMA.field(name).type) for name, values in columns.items()], schema=SESSION_ARROW_SCHEMA
    )
    if len(counts) > 1:
        con.execute(UPDATE_SESSIONS)
    if new:
        con.execute(INSERT_SESSIONS)



class SessionCounters:
    """Committed exchanges not yet counted into `sessions`, by session. The writer thread adds and flushes; any
    thread may look whether some are `pending`."""

    def __init__(self, known: set[str]) -> None:
        self.known = known  # the sessions that have a row
        self.pending: dict[str, dict[str, Any]] = {}

    def add(self, rows: Sequence[Mapping[str, Any]]) -> None:
        count_sessions(self.pending, rows)

    def flush(self, con: duckdb.DuckDBPyConnection, trouble: Callable[[str, BaseException], None]) -> None:
        """Count the pending exchanges into `sessions`, in a transaction of their own: kept out of the exchange's
        commit, which the client waits for (each DuckDB statement costs ~0.5 ms). If the process dies in between,
        the next open recounts the sessions from the exchanges. A failure goes to `trouble`; the counts are kept for
        the next flush."""
        if not self.pending:
            return
        counts = self.pending
        try:
            if len(counts) == 1 and self.known.issuperset(counts):
                update_sessions(con, counts, self.known)  # one UPDATE: its own transaction
            else:
                with transaction(con):
                    update_sessions(con, counts, self.known)
        except Exception as error:  # noqa: BLE001 - kept, and retried with the next flush
            trouble("updating session counters", error)
            return
        self.known.update(counts)
        self.pending = {}


class IssuedSeqs(dict[str, int]):
    """Each session's last issued exchange seq, kept in memory so the event loop never waits on DuckDB for one (the
    writer's Store and a gateway's StoreProcess both issue them so)."""

    def next(self, session_id: str) -> int:
        seq = self[session_id] = self.get(session_id, 0) + 1
        return seq

    def raise_to(self, seqs: dict[str, int]) -> None:
        """Never issue again a seq below these (a store process opened afresh: what it found committed)."""
        for session_id, seq in seqs.items():
            self[session_id] = max(seq, self.get(session_id, 0))
