"""The Run view: the whole store at a glance.

Tasks and their GRPO groups (reward mean / std, each session's advantage, groups without signal: the
assembler's own scoring, polar_mitm.assembler.rewards, over the sessions table), sessions by status, policy
versions and their staleness, throughput over time, errors, and on a cluster's union its nodes and engines. Every
number comes from SQL through the StoreReader over scalar columns (no token list is read), so the page costs the
same on a store of any token length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.assembler import rewards, source
from polar_mitm.store import StoreReader
from polar_mitm.store.schema import MATERIAL
from polar_mitm.ui.reading import dicts, optional

SESSION_LIMIT = 300  # rows of the sessions table shown (newest first); the filter box searches the ones shown
BUCKETS = 60  # bars of the throughput chart at most
BUCKET_SECONDS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)

# trajectory material without reading a token list: the gateway records `prompt_tokens` exactly when it records the
# prompt ids (engines.base refuses a reply without them), and a list column is most of a scan's cost (~4x on a
# 10,000-exchange store); the Session and Trajectory views use the assembler itself
MATERIAL_SCALAR = MATERIAL.replace("prompt_token_ids IS NOT NULL", "prompt_tokens IS NOT NULL")

# one scan of `exchanges` for the whole page (each statement over the view costs its binding, tens of ms on a busy
# machine): per session, per status, per policy version (trajectory material) and per time bucket
FACTS_SQL = f"""
SELECT grouping(session_id) = 0 AS by_session, grouping(status) = 0 AS by_status, grouping(version) = 0 AS by_version,
       grouping(bucket) = 0 AS by_bucket, session_id, status, version, bucket,
       count(*) AS exchanges, count(*) FILTER (WHERE status <> 'ok') AS errors, count(*) FILTER (WHERE material) AS material,
       count(DISTINCT session_id) AS sessions, coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
       coalesce(sum(completion_tokens), 0)::BIGINT AS completion_tokens, epoch(min(started_at)) AS first,
       epoch(max(coalesce(ended_at, started_at))) AS last, max(policy_version) AS newest_version, any_value(harness) AS harness,
       any_value(model_engine) AS model_engine
FROM (SELECT session_id, status, prompt_tokens, completion_tokens, started_at, ended_at, policy_version, harness, model_engine, {MATERIAL_SCALAR} AS material,
             CASE WHEN {MATERIAL_SCALAR} THEN coalesce(policy_version, -1) END AS version,
             floor(epoch(coalesce(ended_at, started_at)) / ?) * ? AS bucket
      FROM exchanges)
GROUP BY GROUPING SETS ((session_id), (status), (version), (bucket), ())"""

SESSIONS_SQL = ("SELECT session_id, harness, task_id, status, reward, CAST(metadata AS VARCHAR) AS metadata, error, "
                "epoch(created_at) AS created, epoch(last_seen_at) AS last_seen FROM sessions")


@dataclass
class Group:
    group_id: str
    sessions: int
    scored: int
    mean: float | None
    std: float | None
    no_signal: bool
    members: list[dict[str, Any]] = field(default_factory=list)  # session_id, reward, advantage, status, trainable


@dataclass
class RunPage:
    totals: dict[str, Any]
    exchange_statuses: list[dict[str, Any]]
    session_statuses: list[dict[str, Any]]
    groups: list[Group]
    versions: list[dict[str, Any]]
    current_version: int | None
    throughput: list[dict[str, Any]]
    bucket_seconds: int
    sessions: list[dict[str, Any]]  # the newest SESSION_LIMIT, with their exchange counts and tokens
    errors: list[dict[str, Any]]
    nodes: list[dict[str, Any]] | None  # from the store: exchanges by node and engine (a cluster's union)
    breaks: list[dict[str, Any]] | None  # breaks_by_class, once `polar-mitm assemble` wrote trajectories
    advantages: dict[str, float | None] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.totals.get("exchanges")


def run_page(reader: StoreReader, policy_version: int | None = None) -> RunPage:
    session_columns, session_rows = reader.query(SESSIONS_SQL)
    rows = {row[0]: dict(zip(session_columns, row, strict=True)) for row in session_rows}
    created = [r["created"] for r in rows.values() if r["created"] is not None]
    seen = [r["last_seen"] for r in rows.values() if r["last_seen"] is not None]
    width = bucket_width(min(created, default=None), max(seen, default=None))
    facts = dicts(reader, FACTS_SQL, [width, width])
    totals = next((f for f in facts if not (f["by_session"] or f["by_status"] or f["by_version"] or f["by_bucket"])), {})
    per_session = {f["session_id"]: f for f in facts if f["by_session"]}
    current = policy_version if policy_version is not None else totals.get("newest_version")
    groups, advantages = score_groups({s: rows.get(s, {}) for s, f in sorted(per_session.items()) if f["material"]})
    versions = sorted(({"version": None if f["version"] == -1 else f["version"], **{k: f[k] for k in ("exchanges", "sessions", "completion_tokens", "first", "last")}}
                       for f in facts if f["by_version"] and f["version"] is not None), key=lambda v: -1 if v["version"] is None else v["version"])
    for version in versions:
        version["staleness"] = None if current is None or version["version"] is None else current - version["version"]
    statuses = Counter(r["status"] or "(none: a plain gateway)" for r in rows.values())
    statuses.update("(no sessions row yet)" for s in per_session if s not in rows)
    return RunPage(
        totals=totals,
        exchange_statuses=sorted(({"status": f["status"], "n": f["exchanges"]} for f in facts if f["by_status"]), key=lambda r: -r["n"]),
        session_statuses=[{"status": status, "n": n} for status, n in statuses.most_common()],
        groups=groups,
        versions=versions,
        current_version=current,
        throughput=sorted(({"bucket": f["bucket"], "exchanges": f["exchanges"], "errors": f["errors"], "sampled_tokens": f["completion_tokens"]}
                           for f in facts if f["by_bucket"] and f["bucket"] is not None), key=lambda b: b["bucket"]),
        bucket_seconds=width,
        sessions=newest_sessions(per_session, rows),
        errors=dicts(reader, "SELECT session_id, seq, api, status, http_status, error, epoch(started_at) AS happened FROM exchanges "
                             "WHERE status <> 'ok' ORDER BY started_at DESC NULLS LAST LIMIT 20") if totals.get("errors") else [],
        nodes=node_engines(reader) if "node" in reader.query("SELECT * FROM sessions LIMIT 0")[0] else None,  # a union names each row's node
        breaks=optional(reader, "SELECT * FROM breaks_by_class"),
        advantages=advantages,
    )


def newest_sessions(per_session: dict[str, dict[str, Any]], rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The sessions table's rows joined with their exchanges' counts, newest activity first."""
    merged = []
    for session_id in set(per_session) | set(rows):
        facts, row = per_session.get(session_id, {}), rows.get(session_id, {})
        merged.append({
            "session_id": session_id, "harness": row.get("harness") or facts.get("harness"), "task_id": row.get("task_id"), "status": row.get("status"),
            "reward": row.get("reward"), "exchanges": facts.get("exchanges", 0), "errors": facts.get("errors", 0),
            "prompt_tokens": facts.get("prompt_tokens", 0), "completion_tokens": facts.get("completion_tokens", 0),
            "version": facts.get("newest_version"), "last": facts.get("last") or row.get("last_seen"), "error": row.get("error"),
        })
    merged.sort(key=lambda r: (-(r["last"] or 0), r["session_id"]))
    return merged[:SESSION_LIMIT]


def score_groups(sessions: dict[str, dict[str, Any]]) -> tuple[list[Group], dict[str, float | None]]:
    """GRPO groups as the assembler scores them (polar_mitm.assembler.rewards): the sessions with trajectory
    material, with their `sessions` rows (task, status, reward)."""
    if not sessions:
        return [], {}
    infos = {s: source.SessionInfo(s, row.get("task_id"), row.get("status"), None if row.get("reward") is None else float(row["reward"]), row.get("metadata"))
             for s, row in sessions.items()}
    scores, stats = rewards.score_sessions(list(sessions), infos)
    members: dict[str, list[dict[str, Any]]] = {}
    for session_id, score in scores.items():
        members.setdefault(score.group_id, []).append(
            {"session_id": session_id, "reward": score.reward, "advantage": score.advantage, "status": score.status, "trainable": score.trainable}
        )
    # tasks first (most sessions first), then the sessions that are a group of their own
    ordered = sorted(stats, key=lambda g: (g.group_id.startswith("session:"), -g.sessions, g.group_id))
    groups = [Group(g.group_id, g.sessions, g.scored_sessions, g.mean, g.std, g.no_signal, members[g.group_id]) for g in ordered]
    return groups, {session_id: score.advantage for session_id, score in scores.items()}


def bucket_width(first: float | None, last: float | None) -> int:
    """The smallest round bucket that draws the run's time span in at most BUCKETS bars."""
    if first is None or last is None:
        return BUCKET_SECONDS[0]
    span = max(float(last) - float(first), 1.0)
    return next((width for width in BUCKET_SECONDS if span / width <= BUCKETS), BUCKET_SECONDS[-1])


def node_engines(reader: StoreReader) -> list[dict[str, Any]]:
    """A cluster's union: exchanges per node and engine model, errors, last activity."""
    return dicts(
        reader,
        "SELECT node, coalesce(engine_kind, '?') AS engine_kind, coalesce(model_engine, '?') AS model_engine, count(*) AS exchanges, "
        "count(DISTINCT session_id) AS sessions, count(*) FILTER (WHERE status <> 'ok') AS errors, epoch(max(ended_at)) AS last "
        "FROM exchanges GROUP BY ALL ORDER BY node, model_engine",
    )


def chart(buckets: list[dict[str, Any]], width: int, key: str = "exchanges", height: int = 90, bar: int = 9) -> dict[str, Any]:
    """An SVG bar chart's geometry (drawn by the template): one bar per bucket, gaps for empty buckets."""
    if not buckets:
        return {"bars": [], "width": 0, "height": height, "peak": 0}
    start = float(buckets[0]["bucket"])
    peak = max(int(b[key] or 0) for b in buckets) or 1
    bars = []
    for b in buckets:
        index = round((float(b["bucket"]) - start) / width)
        value = int(b[key] or 0)
        h = max(1, round(value / peak * (height - 14))) if value else 0
        bars.append({"x": index * (bar + 1), "y": height - h, "h": h, "value": value, "at": float(b["bucket"]), "errors": int(b.get("errors") or 0)})
    return {"bars": bars, "width": bars[-1]["x"] + bar, "height": height, "peak": peak, "bar": bar}
