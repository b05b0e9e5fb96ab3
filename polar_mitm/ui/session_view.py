"""The Session view: one session's stage timeline, its exchanges as the conversation the harness saw, the prompt
diff between turns and the sequences the assembler makes of it.

- timeline: the `sessions` row's `timings` (the rollout server stamps each stage) and each exchange's call;
- conversation: the system prompt and tools once, then per exchange the messages it added to what the engine had
  seen (the chat form the engine got, whichever API the harness spoke; tokens-mode rows read back the way
  `polar-mitm diff` does), its reply or error, status, timings, token counts, normalizations, bridging;
- diff: for each turn and the next, exactly what `polar-mitm diff` prints (polar_mitm.debug.diff);
- sequences: polar_mitm.assembler.assemble over this session (prefix_merging), each linked to its Trajectory view.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from polar_mitm.assembler import Sequence, assemble
from polar_mitm.assembler.diagnosis import TokenText, same_assistant_message
from polar_mitm.debug import diff as prompt_diff
from polar_mitm.store import StoreReader
from polar_mitm.ui.reading import dicts, json_value, log, one
from polar_mitm.ui.tokens import tokenizer_for

STAGE_ORDER = ("queued", "preparing", "running", "post_run", "building", "evaluating", "completed", "failed", "timed_out", "cancelled")

EXCHANGES_SQL = """
SELECT exchange_id, seq, api, action, stream, status, error, http_status, model_requested, model_engine, engine_kind, harness,
       user_agent, retry_count, replay, normalizations, ignored_fields, finish_reason, prompt_tokens, completion_tokens,
       epoch(started_at) AS started, epoch(engine_started_at) AS engine_started, epoch(engine_ended_at) AS engine_ended,
       epoch(ended_at) AS ended, render_mode, bridged, bridge_reason, output_parse_error, policy_version, method, path,
       CAST(engine_request -> '$.messages' AS VARCHAR) AS messages, CAST(engine_request -> '$.tools' AS VARCHAR) AS tools,
       CAST(engine_response -> '$.choices[0].message' AS VARCHAR) AS reply,
       CASE WHEN status <> 'ok' THEN CAST(response_body AS VARCHAR) END AS error_body
FROM exchanges WHERE session_id = ? ORDER BY seq"""


@dataclass
class Stage:
    name: str
    start: float
    end: float | None
    seconds: float | None
    left: float = 0.0  # percent of the timeline
    width: float = 0.0


@dataclass
class SessionPage:
    session_id: str
    row: dict[str, Any]  # the sessions row (timings and metadata parsed)
    stages: list[Stage]
    calls: list[dict[str, Any]]  # exchanges on the timeline: seq, status, left, width (percent)
    span: float  # seconds the timeline covers
    system: list[dict[str, Any]]  # the first exchange's system / developer messages
    tools: list[dict[str, Any]]
    exchanges: list[dict[str, Any]]
    diffs: dict[int, dict[str, str]]  # seq of the later turn -> {"summary", "text"}
    diff_error: str | None
    sequences: list[Sequence]
    sequence_of: dict[str, str]  # exchange_id -> sequence_id
    assembly_error: str | None
    tokenizer: str | None


def session_page(reader: StoreReader, db_path: Path, session_id: str, tokenizer_spec: str | os.PathLike[str] | None = None) -> SessionPage | None:
    """None when the store has no such session."""
    rows = dicts(reader, EXCHANGES_SQL, [session_id])
    row = one(reader, "SELECT session_id, harness, task_id, status, reward, n_exchanges, epoch(created_at) AS created, epoch(last_seen_at) AS last_seen, "
                      "CAST(timings AS VARCHAR) AS timings, CAST(metadata AS VARCHAR) AS metadata, error FROM sessions WHERE session_id = ?", [session_id])
    if not rows and not row:
        return None
    # a live session may have exchanges before its sessions row is written (the writer counts them in batches)
    row = {"session_id": session_id, "harness": None, "task_id": None, "status": None, "reward": None, "n_exchanges": None,
           "created": None, "last_seen": None, "timings": None, "metadata": None, "error": None} | row
    row["timings"], row["metadata"] = json_value(row.get("timings")) or {}, json_value(row.get("metadata"))
    model = next((r["model_engine"] for r in rows if r["model_engine"]), None)
    tokenizer = tokenizer_for(tokenizer_spec, model)

    sequences, sequence_of, assembly, assembly_error = [], {}, None, None
    try:
        assembly = assemble(None, "prefix_merging", session=session_id, store=reader, tokenizer=tokenizer)
        sequences = assembly.sequences
        sequence_of = {exchange_id: s.sequence_id for s in sequences for exchange_id in s.exchange_ids}
    except LookupError:
        pass  # no trajectory material: nothing to assemble
    except Exception as error:  # noqa: BLE001 - the rest of the page still shows
        assembly_error = f"{type(error).__name__}: {error}"
        log.warning(f"polar ui: assembling {session_id}: {assembly_error}")

    turns: dict[str, prompt_diff.Turn] = {}
    diffs: dict[int, dict[str, str]] = {}
    diff_error = None
    try:
        loaded = prompt_diff.load_turns(db_path, session_id)
        turns = {t.exchange_id: t for t in loaded}
        if assembly is not None:
            for turn in loaded[:-1]:
                result = prompt_diff.diff_turns(db_path, session_id, turn.seq, tokenizer, loaded, assembly)
                diffs[result.after.seq] = {"summary": prompt_diff.summary_line(result), "text": prompt_diff.format_diff(result), "before": str(turn.seq)}
    except Exception as error:  # noqa: BLE001 - shown in place of the diffs
        diff_error = f"{type(error).__name__}: {error}"
        log.warning(f"polar ui: diffing {session_id}: {diff_error}")

    exchanges = [_exchange(r, turns.get(r["exchange_id"])) for r in rows]
    _mark_new_messages(exchanges)
    first = next((e for e in exchanges if e["messages"]), None)
    system = [m for m in (first["messages"] if first else []) if m.get("role") in ("system", "developer")]
    tools: list[dict[str, Any]] = next((e["tools"] for e in exchanges if e["tools"]), [])
    for exchange in exchanges:  # the system prompt is shown once, above the conversation
        exchange["system_shown"] = len(system) if exchange["messages"][: len(system)] == system else 0
    stages, calls, span = _timeline(row["timings"], rows)
    return SessionPage(
        session_id, row, stages, calls, span, system, [_tool(t) for t in tools], exchanges, diffs, diff_error, sequences, sequence_of,
        assembly_error, tokenizer.name if isinstance(tokenizer, TokenText) else None,
    )


def _exchange(row: dict[str, Any], turn: prompt_diff.Turn | None) -> dict[str, Any]:
    """A row as the page shows it: its chat messages and reply (a turn's, read as `polar-mitm diff` reads it,
    which covers tokens mode), timings in seconds."""
    raw_messages, raw_reply = row.pop("messages"), row.pop("reply")
    messages = turn.messages if turn is not None and turn.messages else json_value(raw_messages) or []
    reply = turn.reply if turn is not None and turn.reply else json_value(raw_reply) or {}
    row["messages"] = messages if isinstance(messages, list) else []
    row["reply"] = reply if isinstance(reply, dict) else {}
    row["reply_message"] = {"role": "assistant", **row["reply"]}
    row["tools"] = json_value(row.pop("tools")) or []
    row["error_body"] = json_value(row.get("error_body"))
    started, ended = row.get("started"), row.get("ended")
    row["latency"] = ended - started if started is not None and ended is not None else None
    engine_started, engine_ended = row.get("engine_started"), row.get("engine_ended")
    row["engine_seconds"] = engine_ended - engine_started if engine_started is not None and engine_ended is not None else None
    row["queue_seconds"] = engine_started - started if engine_started is not None and started is not None else None
    row["normalizations"] = list(row.get("normalizations") or [])
    row["ignored_fields"] = list(row.get("ignored_fields") or [])
    return row


def _mark_new_messages(exchanges: list[dict[str, Any]]) -> None:
    """Each exchange's `new_from`: the index of its first message that the previous exchange had not already sent
    or received (its messages before that are the conversation so far, shown once, above)."""
    before: list[dict[str, Any]] = []
    for exchange in exchanges:
        messages = exchange["messages"]
        shared = 0
        while shared < min(len(messages), len(before)) and _same(messages[shared], before[shared]):
            shared += 1
        exchange["new_from"] = shared
        if messages:
            reply = {"role": "assistant", **exchange["reply"]} if exchange["reply"] else None
            before = messages + ([reply] if reply else [])


def _same(sent: dict[str, Any], earlier: dict[str, Any]) -> bool:
    if sent.get("role") != earlier.get("role"):
        return False
    if sent.get("role") == "assistant":
        return same_assistant_message(sent, earlier)
    return json.dumps(sent.get("content"), sort_keys=True) == json.dumps(earlier.get("content"), sort_keys=True) and sent.get("tool_call_id") == earlier.get("tool_call_id")


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") or tool
    return {"name": function.get("name") or tool.get("type") or "?", "description": function.get("description") or "",
            "parameters": json.dumps(function.get("parameters") or {}, indent=1, ensure_ascii=False)}


def _epoch(value: Any) -> float | None:
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _timeline(timings: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[Stage], list[dict[str, Any]], float]:
    stages = []
    for name, timing in (timings or {}).items():
        if not isinstance(timing, dict) or (start := _epoch(timing.get("started_at"))) is None:
            continue
        stages.append(Stage(name, start, _epoch(timing.get("ended_at")), timing.get("seconds")))
    stages.sort(key=lambda s: (s.start, STAGE_ORDER.index(s.name) if s.name in STAGE_ORDER else len(STAGE_ORDER)))
    times = [s.start for s in stages] + [s.end for s in stages if s.end] + [r["started"] for r in rows if r["started"]] + [r["ended"] for r in rows if r["ended"]]
    if not times:
        return stages, [], 0.0
    origin, last = min(times), max(times)
    span = max(last - origin, 1e-3)

    def place(start: float, end: float | None) -> tuple[float, float]:
        left = (start - origin) / span * 100
        return round(left, 2), round(max(((end if end is not None else last) - start) / span * 100, 0.4), 2)

    for stage in stages:
        stage.left, stage.width = place(stage.start, stage.end)
    calls = []
    for r in rows:
        if r["started"] is not None:
            left, width = place(r["started"], r["ended"])
            calls.append({"seq": r["seq"], "status": r["status"], "left": left, "width": width})
    return stages, calls, span
