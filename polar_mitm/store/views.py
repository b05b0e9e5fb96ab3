"""SQL views over the store for the questions users ask most.

Each view carries its documentation as a DuckDB comment, so `polar-mitm sql --db X --list`, the `duckdb` CLI
(`SELECT view_name, comment FROM duckdb_views()`) and pandas/polars users all see the same text. The views are
(re)created whenever a process opens the store for writing (the gateway, `polar-mitm assemble`).

"Trajectory material" below means what the assembler trains on: status 'ok', action 'generate', not a replay.
The views over the assembler's `trajectories` table name it only (schema.TRAJECTORIES); this module imports no
assembler code, so the store stays the bottom layer.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from polar_mitm.store.schema import (
    COMPLETED_STATUSES,
    MARKS_TABLE,
    MATERIAL,
    TRAJECTORIES,
    TRAJECTORIES_SCHEMA,
)

log = logging.getLogger("polar_mitm.views")


@dataclass(frozen=True)
class View:
    doc: str
    sql: str


def _completed_statuses() -> str:
    return ", ".join(f"'{status}'" for status in sorted(COMPLETED_STATUSES))


def _sent(row: str) -> tuple[str, str]:
    """SQL for the messages and tools a request carried (`row`: the table alias): what the engine got as a chat request
    (chat mode), else (tokens mode, where the engine got token ids, or no engine call) what the harness sent, counted
    as its dialect hands it on (a system prompt or instructions count as one message, Gemini's function
    declarations one tool each)."""
    body = f"CASE WHEN json_valid({row}.request_body) THEN {row}.request_body END"

    def items(path: str) -> str:
        return f"CASE json_type({body}, '{path}') WHEN 'ARRAY' THEN json_array_length({body}, '{path}') WHEN 'VARCHAR' THEN 1 ELSE 0 END"

    def present(path: str) -> str:
        return f"(({body} ->> '{path}') IS NOT NULL)::INTEGER"

    harness_messages = (
        f"CASE {row}.api WHEN 'openai_chat' THEN {items('$.messages')} "
        f"WHEN 'anthropic_messages' THEN {items('$.messages')} + {present('$.system')} "
        f"WHEN 'openai_responses' THEN {items('$.input')} + {present('$.instructions')} "
        f"WHEN 'gemini' THEN {items('$.contents')} + {present('$.systemInstruction')} END"
    )
    harness_tools = f"CASE {row}.api WHEN 'gemini' THEN len(json_extract({body}, '$.tools[*].functionDeclarations[*]')) ELSE {items('$.tools')} END"
    chat = f"({row}.engine_request -> '$.messages') IS NOT NULL"
    return (
        f"CASE WHEN {chat} THEN json_array_length({row}.engine_request -> '$.messages') ELSE {harness_messages} END",
        f"CASE WHEN {chat} THEN coalesce(json_array_length({row}.engine_request -> '$.tools'), 0) ELSE coalesce({harness_tools}, 0) END",
    )


TIMELINE_MESSAGES, TIMELINE_TOOLS = _sent("e")
SIZES_MESSAGES, SIZES_TOOLS = _sent("material")


VIEWS: dict[str, View] = {
    "session_timeline": View(
        "One row per exchange, in session order: api, harness, status, replay flag, messages and tools sent (the chat "
        "request the engine got; in tokens mode, where it got token ids, the harness's request), prompt and sampled "
        "token counts, whether the prompt extends the previous trajectory exchange of the session token for token "
        "(extends_previous; NULL on the first), the new prompt tokens it adds, and latencies.",
        f"""
        WITH material AS (
            SELECT exchange_id,
                   lag(list_concat(prompt_token_ids, completion_token_ids)) OVER (PARTITION BY session_id ORDER BY seq) AS previous
            FROM exchanges WHERE {MATERIAL}
        )
        SELECT e.session_id, e.seq, e.api, e.harness, e.status, coalesce(e.replay, false) AS replay, e.model_requested,
               e.stream, e.finish_reason,
               {TIMELINE_MESSAGES} AS messages,
               {TIMELINE_TOOLS} AS tools,
               len(e.prompt_token_ids) AS prompt_len, len(e.completion_token_ids) AS completion_len,
               e.prompt_token_ids[1:len(m.previous)] = m.previous AS extends_previous,
               CASE WHEN e.prompt_token_ids[1:len(m.previous)] = m.previous THEN len(e.prompt_token_ids) - len(m.previous) END AS new_prompt_tokens,
               e.started_at, e.ended_at,
               date_diff('millisecond', e.started_at, e.ended_at) AS latency_ms,
               date_diff('millisecond', e.engine_started_at, e.engine_ended_at) AS engine_ms
        FROM exchanges e LEFT JOIN material m USING (exchange_id)
        ORDER BY e.session_id, e.seq""",
    ),
    "token_usage": View(
        "One row per session: harness, exchanges, prompt and sampled tokens summed over its exchanges, the largest "
        "prompt, errors (status other than 'ok') and replays.",
        """
        SELECT session_id, any_value(harness) AS harness, count(*) AS exchanges,
               sum(len(prompt_token_ids)) AS prompt_tokens, sum(len(completion_token_ids)) AS completion_tokens,
               count(*) FILTER (WHERE status <> 'ok') AS errors,
               max(len(prompt_token_ids)) AS max_prompt_tokens,
               count(*) FILTER (WHERE replay) AS replays
        FROM exchanges GROUP BY session_id ORDER BY session_id""",
    ),
    "harness_prompt_sizes": View(
        "Prompt sizes per harness and API over trajectory material: the first prompt of each session (system prompt + "
        "tools + first message: what the harness costs before any work), every prompt (average, median, p90, max), "
        "messages and tools per request, request body size.",
        f"""
        WITH material AS (
            SELECT *, row_number() OVER (PARTITION BY session_id ORDER BY seq) AS turn FROM exchanges WHERE {MATERIAL}
        )
        SELECT coalesce(harness, 'unknown') AS harness, api, count(DISTINCT session_id) AS sessions, count(*) AS exchanges,
               round(avg(len(prompt_token_ids)) FILTER (WHERE turn = 1))::BIGINT AS avg_first_prompt_tokens,
               round(avg(len(prompt_token_ids)))::BIGINT AS avg_prompt_tokens,
               quantile_disc(len(prompt_token_ids), 0.5) AS median_prompt_tokens,
               quantile_disc(len(prompt_token_ids), 0.9) AS p90_prompt_tokens,
               max(len(prompt_token_ids)) AS max_prompt_tokens,
               round(avg({SIZES_MESSAGES}), 1) AS avg_messages,
               round(avg({SIZES_TOOLS}), 1) AS avg_tools,
               round(avg(length(request_body)))::BIGINT AS avg_request_chars
        FROM material GROUP BY ALL ORDER BY harness, api""",
    ),
    "breaks": View(
        "One row per sequence whose conversation broke the strict token prefix (from the assembler's `trajectories` "
        "table: run `polar-mitm assemble` first): session, builder, break class (retokenized, rerendered, rewritten, "
        "truncated, unknown), token index, region and the assembler's explanation.",
        """
        SELECT session_id, builder, harness, sequence_id, exchange_seqs[1] AS seq, break_kind, break_index, break_region,
               break_from, break_exchange_id, break_detail
        FROM trajectories WHERE break_kind IS NOT NULL ORDER BY session_id, builder, seq""",
    ),
    "breaks_by_class": View(
        "Prefix breaks counted by builder, harness and class, with the sequences they are out of (from the `trajectories` "
        "table: run `polar-mitm assemble` first). A break is where a harness's next prompt does not start with the "
        "tokens sampled so far, so the conversation cannot be one training sequence.",
        """
        WITH totals AS (SELECT builder, harness, count(*) AS sequences FROM trajectories GROUP BY ALL)
        SELECT t.builder, coalesce(t.harness, 'unknown') AS harness, t.break_kind, count(*) AS breaks,
               any_value(totals.sequences) AS sequences, count(DISTINCT t.session_id) AS sessions,
               round(avg(t.break_index))::BIGINT AS avg_break_index, any_value(t.break_detail) AS example
        FROM trajectories t JOIN totals ON t.builder = totals.builder AND t.harness IS NOT DISTINCT FROM totals.harness
        WHERE t.break_kind IS NOT NULL GROUP BY ALL ORDER BY t.builder, harness, breaks DESC""",
    ),
    "reward_by_harness_task": View(
        "Rewards per task and harness from the sessions table (the rollout server records task, status and reward): "
        "sessions, completed ones, scored ones, mean, standard deviation, min and max reward.",
        f"""
        SELECT coalesce(task_id, '(no task)') AS task_id, coalesce(harness, 'unknown') AS harness, count(*) AS sessions,
               count(*) FILTER (WHERE status IS NULL OR lower(status) IN ({_completed_statuses()})) AS completed,
               count(reward) AS scored, round(avg(reward), 4) AS mean_reward, round(stddev_samp(reward), 4) AS std_reward,
               min(reward) AS min_reward, max(reward) AS max_reward
        FROM sessions GROUP BY ALL ORDER BY task_id, harness""",
    ),
    "rollout_stats": View(
        "One row per session, over its trajectory material: what a trainer checks before it trains on it. Exchanges, "
        "sampled tokens, tool_call_parse_failures (sampled tool calls that did not parse and went back as text: tokens "
        "mode parses them itself), tokens_mode_exchanges, bridged_fraction (of the tokens-mode exchanges that continue an "
        "earlier turn, the fraction bridged onto its exact tokens), and the lowest and highest policy version sampled under.",
        f"""
        SELECT e.session_id, any_value(s.task_id) AS task_id, any_value(e.harness) AS harness, count(*) AS exchanges,
               sum(len(e.completion_token_ids)) AS sampled_tokens,
               count(*) FILTER (WHERE e.output_parse_error IS NOT NULL) AS tool_call_parse_failures,
               count(*) FILTER (WHERE e.render_mode = 'tokens') AS tokens_mode_exchanges,
               round(count(*) FILTER (WHERE e.bridged)
                     / nullif(count(*) FILTER (WHERE e.render_mode = 'tokens' AND e.bridge_reason IS DISTINCT FROM 'first_turn'), 0), 4) AS bridged_fraction,
               min(e.policy_version) AS min_policy_version, max(e.policy_version) AS max_policy_version
        FROM (SELECT * FROM exchanges WHERE {MATERIAL}) e LEFT JOIN sessions s USING (session_id)
        GROUP BY e.session_id ORDER BY e.session_id""",
    ),
    "errors": View(
        "Exchanges that did not succeed, newest first: status class, HTTP status and message, in the provider's shape the "
        "client got.",
        """
        SELECT session_id, seq, api, harness, status, http_status, error, started_at
        FROM exchanges WHERE status <> 'ok' ORDER BY started_at DESC""",
    ),
}


def create_views(con: duckdb.DuckDBPyConnection, unless_current: bool = False) -> None:
    """Create (or replace) every view of VIEWS. `unless_current`: not if each exists as this version defines it (a
    writer's open: each view binds every table the `exchanges` view names, ~4.6 s at 3,000 segments)."""
    # the views' text, and the columns of what they read (a view is bound with the types its sources had)
    sources = con.execute(
        "SELECT table_name, list(column_name || ' ' || data_type ORDER BY column_index) FROM duckdb_columns() "
        "WHERE schema_name = 'main' AND list_contains(?, table_name) GROUP BY 1 ORDER BY 1", [["exchanges", "sessions", TRAJECTORIES, MARKS_TABLE]]
    ).fetchall()
    digest = hashlib.sha256(repr((sorted((name, view.sql, view.doc) for name, view in VIEWS.items()), sources)).encode()).hexdigest()
    if unless_current and _current(con, digest):
        return
    # DuckDB binds a view's tables when the view is created, and `trajectories` exists only once `polar-mitm
    # assemble` has run: stand an empty one in while the views are created (views are re-bound at each query)
    missing = not con.execute(f"SELECT count(*) FROM duckdb_tables() WHERE table_name = '{TRAJECTORIES}'").fetchall()[0][0]
    if missing:
        _create_empty_trajectories(con)
    created = 0
    try:
        for name, view in VIEWS.items():
            try:
                con.execute(f"CREATE OR REPLACE VIEW {name} AS {view.sql}")
            except duckdb.Error as error:
                # e.g. a trajectories table written by an older assembler: the store must still open
                log.warning(f"polar-mitm: view {name} not created: {error}")
                continue
            con.execute(f"COMMENT ON VIEW {name} IS '{view.doc.replace(chr(39), chr(39) * 2)}'")
            created += 1
    finally:
        if missing:
            con.execute(f"DROP TABLE {TRAJECTORIES}")
    # remembered only when all were made: a view that failed is tried again at the next open
    con.execute("INSERT OR REPLACE INTO meta VALUES ('views', ?)", [digest if created == len(VIEWS) else ""])


def _current(con: duckdb.DuckDBPyConnection, digest: str) -> bool:
    """Whether every view exists as the views of this digest made it."""
    if con.execute("SELECT value FROM meta WHERE key = 'views'").fetchall() != [(digest,)]:
        return False
    present = con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal AND list_contains(?, view_name)", [list(VIEWS)]).fetchall()
    return bool(present[0][0] == len(VIEWS))


def _create_empty_trajectories(con: duckdb.DuckDBPyConnection) -> None:
    con.register("polar_empty_trajectories", pa.Table.from_batches([], schema=TRAJECTORIES_SCHEMA))
    try:
        con.execute(f"CREATE TABLE {TRAJECTORIES} AS SELECT * FROM polar_empty_trajectories")
    finally:
        con.unregister("polar_empty_trajectories")
