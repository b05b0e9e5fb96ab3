"""SQL views over the store for the questions users ask most."""

from __future__ import annotations

import duckdb

VIEWS: dict[str, str] = {
    "session_timeline": """
        SELECT session_id, seq, api, status, model_requested, stream, finish_reason,
               len(prompt_token_ids) AS prompt_len, len(completion_token_ids) AS completion_len,
               started_at, ended_at,
               date_diff('millisecond', started_at, ended_at) AS latency_ms,
               date_diff('millisecond', engine_started_at, engine_ended_at) AS engine_ms
        FROM exchanges ORDER BY session_id, seq""",
    "token_usage": """
        SELECT session_id, any_value(harness) AS harness, count(*) AS exchanges,
               sum(len(prompt_token_ids)) AS prompt_tokens, sum(len(completion_token_ids)) AS completion_tokens,
               count(*) FILTER (WHERE status <> 'ok') AS errors
        FROM exchanges GROUP BY session_id""",
}


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    for name, sql in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
