"""The DuckDB store on its own: journals, segments, crash safety, a bare client, what the `exchanges` view returns."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import orjson
import pyarrow as pa
import pytest

from polar_mitm import store
from polar_mitm.engines.base import WireJSON, _decode
from polar_mitm.store import ExchangeRow, Store
from tests.support.rows import exchange_row

CONTRACT_TYPES = {name: kind.split()[0].replace("TIMESTAMPTZ", "TIMESTAMP WITH TIME ZONE") for name, kind in store.EXCHANGE_COLUMNS.items()}


def comparable(row: dict) -> dict:
    """A row as the view should return it."""
    out = {name: row.get(name) for name in store.EXCHANGE_COLUMNS}
    for name in store.JSON_COLUMNS:
        value = out[name]
        out[name] = None if value is None else json.loads(value.text if isinstance(value, WireJSON) else json.dumps(value))
    return out


def fetched(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for row in rows:
        row = dict(row)
        for name in store.JSON_COLUMNS:
            row[name] = None if row[name] is None else json.loads(row[name])
        out[row["exchange_id"]] = row
    return out


async def commit_all(target: Store, rows: list[ExchangeRow], concurrency: int = 8) -> None:
    for start in range(0, len(rows), concurrency):
        await asyncio.gather(*(target.commit_exchange(row) for row in rows[start : start + concurrency]))


def test_a_journal_of_the_layout_before_text_columns_is_read_and_compacted_the_same(tmp_path: Path) -> None:
    """A store a crash left with a journal of the earlier layout (texts as fields of the body record, six columns):
    the next writer gives it the text columns and compacts it; every row reads back as committed, prompt ids from
    their slice of the engine reply included."""
    from polar_mitm.store import records

    db = tmp_path / "s.duckdb"
    Store(db).close()
    rows = [exchange_row("old", seq, prompt_len=300) for seq in range(1, 6)]
    rows[1]["response_stream"] = 'data: {"x": "é \\"q\\""}\n\n'
    rows[2]["engine_response"] = None  # a failed call: no reply, and no prompt ids
    rows[2]["prompt_token_ids"] = None
    con = duckdb.connect(str(db))
    table = store.journal_table(900)  # after the empty journal a clean close leaves
    con.execute(f"CREATE TABLE {table} (exchange_id VARCHAR, session_id VARCHAR, seq INTEGER, status VARCHAR, head BLOB, body BLOB)")
    for row in rows:
        head, body, texts = records.journal_records(row)
        old_body = {**orjson.loads(body), **{name: text for name, text in zip(records.TEXT_FIELDS, texts, strict=True) if text is not None}}
        con.execute(f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?)", [row["exchange_id"], "old", row["seq"], "ok", head, orjson.dumps(old_body)])
    con.execute("UPDATE meta SET value = 'false' WHERE key = 'closed_cleanly'")
    con.close()
    Store(db).close()
    assert fetched(store.query_dicts(db, "SELECT * FROM exchanges")) == {row["exchange_id"]: comparable(row) for row in rows}
    assert store.query(db, "SELECT n_exchanges FROM sessions WHERE session_id = 'old'")[1] == [[5]]
    assert not [t for (t,) in store.query(db, "SELECT table_name FROM duckdb_tables()")[1] if t == table]


def test_rows_read_back_the_same_from_journal_and_segments(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    rows = [exchange_row(f"s{i % 3}", i // 3 + 1) for i in range(45)]
    target = Store(db, segment_rows=16)
    try:
        asyncio.run(commit_all(target, rows))
        deadline = time.monotonic() + 30
        while len(target.query(f"SELECT * FROM {store.SEGMENTS_TABLE}")[1]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        columns, live = target.query("SELECT * FROM exchanges")
        arrow = target.arrow("SELECT exchange_id, prompt_token_ids, completion_logprobs FROM exchanges WHERE seq > ?", [0])
        segments = target.query(f"SELECT segment, rows FROM {store.SEGMENTS_TABLE} ORDER BY segment")[1]
        journal_rows = target.query(f"SELECT count(*) FROM {store.journal_table(target._journals[-1])}")[1][0][0]
    finally:
        target.close()
    # while running: some rows in segments (16 per full journal), the rest in the journal, each exactly once
    assert sum(n for _, n in segments) >= 32 and journal_rows <= 45 - 32
    expected = {row["exchange_id"]: comparable(row) for row in rows}
    assert fetched([dict(zip(columns, r, strict=True)) for r in live]) == expected
    # Store.arrow: the same rows from journal and segments, list columns as Arrow lists
    assert arrow.schema.field("prompt_token_ids").type == pa.list_(pa.int32()) and arrow.num_rows == 45
    by_id = {row["exchange_id"]: row for row in arrow.to_pylist()}
    assert {i: (r["prompt_token_ids"], r["completion_logprobs"]) for i, r in by_id.items()} == {
        i: (row["prompt_token_ids"], row["completion_logprobs"]) for i, row in expected.items()
    }
    # closed: every journal became a segment, types are the contract's, values unchanged
    described = dict((name, kind) for name, kind, *_ in store.query(db, "DESCRIBE exchanges")[1])
    assert described == CONTRACT_TYPES
    assert fetched(store.query_dicts(db, "SELECT * FROM exchanges")) == expected
    assert not [t for t in store.query(db, "SELECT table_name FROM duckdb_tables()")[1] if t[0].startswith(store.JOURNAL_PREFIX)][1:]
    counts = dict(store.query(db, "SELECT session_id, n_exchanges FROM sessions")[1])
    assert counts == {"s0": 15, "s1": 15, "s2": 15}


def test_session_counters_are_flushed_seldom_under_load_and_every_read_sees_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_mitm.store import commit_log, session_counts

    flushes: list[int] = []
    counted = session_counts.update_sessions
    monkeypatch.setattr(session_counts, "update_sessions", lambda con, counts, known: (flushes.append(len(counts)), counted(con, counts, known)))
    target = Store(tmp_path / "s.duckdb")

    async def steady() -> None:
        # 4 sessions, one commit every ~10 ms: the queue is quiet (5 ms) between almost every two commits
        for seq in range(1, 11):
            for session in range(4):
                await target.commit_exchange(exchange_row(f"s{session}", seq))
                await asyncio.sleep(0.01)

    try:
        started = time.monotonic()
        asyncio.run(steady())
        elapsed = time.monotonic() - started
        # a read right after the last commit sees every exchange counted (the writer flushes for it)
        assert dict(target.query("SELECT session_id, n_exchanges FROM sessions")[1]) == {f"s{i}": 10 for i in range(4)}
    finally:
        target.close()
    # 40 commits, fewer than a segment's worth, never a quiet second: the read's flush, and perhaps one more on a slow
    # machine's pause (it was one flush per commit, then one per 0.25 s)
    assert 1 <= len(flushes) <= 2 + int(elapsed / commit_log.FLUSH_WHEN_QUIET_S)
    assert dict(store.query(tmp_path / "s.duckdb", "SELECT session_id, n_exchanges FROM sessions")[1]) == {f"s{i}": 10 for i in range(4)}


def test_values_json_cannot_hold_survive(tmp_path: Path) -> None:
    db = tmp_path / "odd.duckdb"
    row = exchange_row("odd", 1)
    row.update(
        completion_logprobs=[-math.inf, -0.25, math.nan, -1.0000000000000002],
        engine_response=_decode('{"choices": [], "weird": NaN}'),  # only Python's json reads this
        engine_request=WireJSON({"k": 1}, '{"k":   1}'),  # spacing as sent
        lineage="not json at all",
        ignored_fields=['comma,inside', 'quote"inside'],
    )
    row["prompt_token_ids"] = [1, 2, 3]
    target = Store(db)
    try:
        asyncio.run(target.commit_exchange(row))
        live = target.query("SELECT completion_logprobs, engine_response, engine_request, lineage, ignored_fields, prompt_token_ids FROM exchanges")[1][0]
    finally:
        target.close()
    closed = store.query(db, "SELECT completion_logprobs, engine_response, engine_request, lineage, ignored_fields, prompt_token_ids FROM exchanges")[1][0]
    for logprobs, response, request, lineage, ignored, prompt in (live, closed):
        assert logprobs[0] == -math.inf and math.isnan(logprobs[2]) and logprobs[3] == -1.0000000000000002
        assert json.loads(response) == {"choices": [], "weird": None}  # stored, re-encoded, rather than refused
        assert request == '{"k":   1}' and json.loads(lineage) == "not json at all"
        assert ignored == ['comma,inside', 'quote"inside'] and prompt == [1, 2, 3]


@pytest.mark.parametrize("batched", [False, True])
def test_texts_with_odd_characters_are_kept_alone_and_in_a_batch(tmp_path: Path, batched: bool) -> None:
    """The five texts are journal columns of their own (UTF-8): a lone surrogate (a harness that cut a string inside
    an emoji) is kept with "?" in its place, a NUL and characters past Latin-1 as they are, bytes as their text; one
    row goes in as VALUES, a group commit as an Arrow table."""
    db = tmp_path / "odd.duckdb"
    rows = [exchange_row("odd", seq) for seq in range(1, 4 if batched else 2)]
    for row in rows:
        row.update(request_body='{"text": "cut \ud83d here"}', response_stream="data: \x00 漢字 \ud83d\n\n")
    rows[0]["request_body"] = b'{"raw": "\xff bytes"}'
    target = Store(db)
    try:
        async def commit() -> None:
            await asyncio.gather(*(target.commit_exchange(row) for row in rows))

        asyncio.run(commit())
        live = sorted(target.query("SELECT seq, request_body, response_stream FROM exchanges")[1])
    finally:
        target.close()
    closed = sorted(tuple(r) for r in store.query(db, "SELECT seq, request_body, response_stream FROM exchanges")[1])
    expected = [(1, '{"raw": "\ufffd bytes"}', "data: \x00 漢字 ?\n\n")] + [(row["seq"], '{"text": "cut ? here"}', "data: \x00 漢字 ?\n\n") for row in rows[1:]]
    assert [tuple(r) for r in live] == closed == expected
    if batched:  # the same rows in one insert, as a group commit makes it (the Store's writer may have split them)
        from polar_mitm.store import records

        con = duckdb.connect()
        con.execute(f"CREATE TABLE {records.journal_table(1)} ({', '.join(f'{n} {t}' for n, t in records.JOURNAL_COLUMNS.items())})")
        records.insert_journal_rows(con, rows, records.journal_table(1))
        assert sorted(con.execute(f"SELECT seq, request_body, response_stream FROM {records.journal_source(1)}").fetchall()) == expected


def test_prompt_ids_read_from_the_engine_reply(tmp_path: Path) -> None:
    """Ids the engine reply carries are not stored twice; vLLM and SGLang places both read back exactly."""
    db = tmp_path / "ids.duckdb"
    vllm = exchange_row("v", 1, prompt_len=5000)
    sglang = exchange_row("g", 1)
    reply = _decode(orjson.dumps({"choices": [{"prompt_token_ids": list(range(7, 70)), "token_ids": [1]}]}).decode())
    sglang.update(engine_response=reply, prompt_token_ids=reply["choices"][0]["prompt_token_ids"])
    copied = exchange_row("c", 1, prompt_len=5000)
    copied["prompt_token_ids"] = list(copied["prompt_token_ids"])  # equal but not read from the reply: stored itself
    assert len(store.journal_records(vllm)[1]) < len(store.journal_records(copied)[1]) - 5000 * 3
    target = Store(db)
    try:
        asyncio.run(commit_all(target, [vllm, sglang, copied]))
        live = dict(target.query("SELECT session_id, prompt_token_ids FROM exchanges")[1])
    finally:
        target.close()
    closed = dict(store.query(db, "SELECT session_id, prompt_token_ids FROM exchanges")[1])
    for ids in (live, closed):
        assert ids == {"v": vllm["prompt_token_ids"], "g": list(range(7, 70)), "c": copied["prompt_token_ids"]}


def test_prompt_ids_in_the_engine_texts_are_stored_once_and_every_reader_gets_the_texts_exactly(tmp_path: Path) -> None:
    """Tokens mode sends the prompt as ids: the engine request keeps `[]` in their place wherever it is stored, and so
    does the engine reply's echo of them in a segment; the view, a snapshot's Parquet files and a segment made before
    (whole texts) give back the exact texts."""
    from polar_mitm.store import UnionStore, records
    from polar_mitm.store.schema import whole_text

    db = tmp_path / "tokens.duckdb"
    vllm = exchange_row("vllm", 1, prompt_len=3000)  # the ids echoed in the reply, read from there
    ids = list(vllm["prompt_token_ids"])
    # characters before the array that are one character to Python but not one byte, or a combining mark
    vllm["engine_request"] = WireJSON({"model": "m", "stop": ["e\u0301 😀 \"prompt\":["], "prompt": ids, "max_tokens": 5, "logprobs": 0})
    sglang = exchange_row("sglang", 1, prompt_len=3000)
    sglang["prompt_token_ids"] = list(sglang["prompt_token_ids"])  # no echo: the ids as the gateway had them
    sglang["engine_request"] = WireJSON({"input_ids": sglang["prompt_token_ids"], "sampling_params": {"max_new_tokens": 5}})
    other = exchange_row("other", 1, prompt_len=3000)  # an array that is not this row's prompt: kept whole
    other["engine_request"] = WireJSON({"prompt": list(reversed(other["prompt_token_ids"]))})
    spaced = exchange_row("spaced", 1, prompt_len=3000)  # not orjson's spelling: kept whole
    spaced["engine_request"] = WireJSON({"prompt": list(spaced["prompt_token_ids"])}, json.dumps({"prompt": list(spaced["prompt_token_ids"])}))
    chat = exchange_row("chat", 1, prompt_len=3000)
    rows = [vllm, sglang, other, spaced, chat]
    expected = {row["session_id"]: row["engine_request"].text for row in rows}
    stored = {row["session_id"]: records.journal_records(row)[2][records.TEXT_FIELDS.index("engine_request")] for row in rows}
    assert {name: len(text) < 200 for name, text in stored.items() if text != expected[name]} == {"vllm": True, "sglang": True}

    expected_replies = {row["session_id"]: row["engine_response"].text for row in rows}

    def requests(reader) -> dict[str, str]:
        found = reader.query("SELECT session_id, CAST(engine_request AS VARCHAR), CAST(engine_response AS VARCHAR) FROM exchanges")[1]
        assert {name: reply for name, _, reply in found} == expected_replies
        return {name: request for name, request, _ in found}

    target = Store(db, segment_rows=3)
    try:
        asyncio.run(commit_all(target, rows, concurrency=1))
        assert requests(target) == expected  # from segments and the journal
        snap = target.snapshot("n1", tmp_path / "snap")
        union = UnionStore([snap])
        try:
            assert requests(union) == expected
        finally:
            union.close()
    finally:
        target.close()
    assert requests(_Reader(db)) == expected  # closed: every row in a segment, read bare
    con = duckdb.connect(str(db))
    try:
        segments = [name for (name,) in con.execute(f"SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '{store.SEGMENT_PREFIX}')").fetchall()]
        sql = "SELECT session_id, length(CAST(engine_request AS VARCHAR)), length(CAST(engine_response AS VARCHAR)) FROM {}"
        kept = [row for table in segments for row in con.execute(sql.format(table)).fetchall()]
        assert sorted(name for name, length, _ in kept if length < len(expected[name])) == ["sglang", "vllm"] and len(kept) == len(rows)
        # every reply that echoed its prompt ids (all but the one whose ids the gateway had as a list)
        assert sorted(name for name, _, length in kept if length < len(expected_replies[name]) - 10_000) == ["chat", "other", "spaced", "vllm"]
        # a segment made before the column: whole requests, no column; it reads the same once a writer opens it
        for table in segments:
            con.execute(f"UPDATE {table} SET engine_request = {whole_text('engine_request')}, engine_response = {whole_text('engine_response')}")
            for column in ("engine_request_ids_at", "engine_response_ids_at"):
                con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    finally:
        con.close()
    Store(db).close()
    assert requests(_Reader(db)) == expected


class _Reader:
    """A bare DuckDB client on a closed store (no helper, no settings)."""

    def __init__(self, db: Path) -> None:
        self.db = db

    def query(self, sql: str) -> tuple[None, list[tuple]]:
        con = duckdb.connect(str(self.db), read_only=True)
        try:
            return None, con.execute(sql).fetchall()
        finally:
            con.close()


def test_commits_log_the_same_bytes_however_many_rows_came_before(tmp_path: Path) -> None:
    """DuckDB logs a list column's whole uncheckpointed data again on every commit (1.3 through 2.0): the Nth
    single-row commit of a 14k-id array wrote N x 56 KB to the WAL. Journals keep a commit's WAL bytes flat (each
    row moved from the commit log into the journal alone here, by a read right after its commit)."""
    db = tmp_path / "wal.duckdb"
    wal = Path(str(db) + ".wal")
    rows = [exchange_row("w", i + 1, prompt_len=14_000) for i in range(60)]
    target = Store(db, segment_rows=1000)
    try:
        growth = []
        for row in rows:
            before = wal.stat().st_size if wal.exists() else 0
            asyncio.run(target.commit_exchange(row))
            target.query("SELECT count(*) FROM exchanges")  # a read: what the commit log holds goes into the journal
            growth.append(wal.stat().st_size - before)
    finally:
        target.close()
    early, late = sorted(growth[5:15])[5], sorted(growth[50:60])[5]
    assert late < early * 1.5, (early, late)


CRASH_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    from test_store import exchange_row
    from polar_mitm.store import Store, commit_log
    commit_log.FLUSH_WHEN_QUIET_S = {quiet}

    async def main():
        target = Store({db!r}, segment_rows={segment_rows})
        target.execute_write("INSERT INTO sessions (session_id, task_id, n_exchanges) VALUES ('k1', 'task', 0)")
        seq = {{}}
        for i in range({count}):
            session = f"k{{i % 3}}"
            seq[session] = seq.get(session, 0) + 1
            row = exchange_row(session, seq[session], prompt_len=3000)
            await target.commit_exchange(row)
            print(row["exchange_id"], flush=True)
        await asyncio.sleep(3600)  # killed meanwhile

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("after", [25, 61])
def test_sigkill_mid_compaction_loses_and_duplicates_nothing(tmp_path: Path, after: int) -> None:
    db = tmp_path / "crash.duckdb"
    script = tmp_path / "writer.py"
    script.write_text(CRASH_WRITER.format(tests=str(Path(__file__).parent), db=str(db), segment_rows=6, count=10_000, quiet=0.25))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    writer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    committed = []
    assert writer.stdout is not None
    for line in writer.stdout:
        committed.append(line.strip())
        if len(committed) >= after:
            break
    writer.send_signal(signal.SIGKILL)  # journals rotate every 6 rows: compactions are under way
    writer.wait()
    reopened = Store(db)
    try:
        ids = [r[0] for r in reopened.query("SELECT exchange_id FROM exchanges")[1]]
        sessions = dict(reopened.query("SELECT session_id, n_exchanges FROM sessions")[1])
        per_session = dict(reopened.query("SELECT session_id, count(*) FROM exchanges GROUP BY ALL")[1])
        task = reopened.query("SELECT task_id FROM sessions WHERE session_id = 'k1'")[1][0][0]
        seqs = reopened.query("SELECT session_id, list(seq ORDER BY seq) FROM exchanges GROUP BY ALL")[1]
    finally:
        reopened.close()
    # a segment table the kill left unlisted (its journal was compacted again) is gone; every listed one is there
    listed = {store.segment_table(r[0]) for r in store.query(db, f"SELECT segment FROM {store.SEGMENTS_TABLE}")[1]}
    present = {r[0] for r in store.query(db, f"SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '{store.SEGMENT_PREFIX}')")[1]}
    assert present == listed
    assert len(ids) == len(set(ids)), "an exchange is in a journal and a segment at once"
    assert set(committed) <= set(ids), "a committed exchange was lost"
    # counters the writer had not flushed are recounted from the exchanges; what the rollout wrote is kept
    assert sessions == per_session and task == "task"
    for _, listed in seqs:
        assert listed == list(range(1, len(listed) + 1))


def test_store_of_schema_1_opens_with_its_rows(tmp_path: Path) -> None:
    """Schema 1 kept `exchanges` as a table; opening it makes that table the first segment."""
    db = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(db))
    columns = {n: k.split()[0] for n, k in store.EXCHANGE_COLUMNS.items() if n not in ("engine_started_at",)}  # an older column set
    con.execute(f"CREATE TABLE exchanges ({', '.join(f'{n} {k}' for n, k in columns.items())})")
    con.execute("CREATE TABLE sessions (session_id VARCHAR PRIMARY KEY, n_exchanges INTEGER)")
    con.execute("INSERT INTO exchanges (exchange_id, session_id, seq, status, prompt_token_ids, engine_response) VALUES ('e1', 'old', 1, 'ok', [1, 2, 3], '{\"a\": 1}')")
    con.execute("INSERT INTO sessions VALUES ('old', 1)")
    con.close()
    target = Store(db)
    try:
        assert target.next_seq("old") == 2
        asyncio.run(target.commit_exchange(exchange_row("old", 2)))
    finally:
        target.close()
    rows = store.query_dicts(db, "SELECT exchange_id, seq, prompt_token_ids, engine_response, engine_started_at FROM exchanges ORDER BY seq")
    assert [(r["exchange_id"], r["seq"]) for r in rows][0] == ("e1", 1) and len(rows) == 2
    assert rows[0]["prompt_token_ids"] == [1, 2, 3] and json.loads(rows[0]["engine_response"]) == {"a": 1} and rows[0]["engine_started_at"] is None
    assert store.query(db, "SELECT n_exchanges FROM sessions WHERE session_id = 'old'")[1][0][0] == 2
    assert store.query(db, "SELECT table_type FROM information_schema.tables WHERE table_name = 'exchanges'")[1][0][0] == "VIEW"


def test_live_queries_keep_the_optimizer(tmp_path: Path) -> None:
    """Exchange rows go in through a connection without DuckDB's optimizer; every other connection keeps it (a plain
    SET had switched it off for all of them, and every live query over the journal parsed every row's body)."""
    target = Store(tmp_path / "store.duckdb", segment_rows=10**6)
    try:
        rows = [exchange_row(f"s{i % 4}", i // 4 + 1) for i in range(40)]
        for row in rows:
            asyncio.run(target.commit_exchange(row))
        assert target.query("SELECT current_setting('enable_optimizer')")[1] == [(True,)]
        plan = "\n".join(text for _, text in target.query("EXPLAIN SELECT session_id, count(*) FROM exchanges GROUP BY session_id")[1])
        assert "json_transform" not in plan  # the bodies a query does not read are not parsed
    finally:
        target.close()


def test_a_closed_store_opens_bare_in_any_duckdb_client_from_any_folder_and_moved_or_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything is in the `.duckdb` file: a plain `duckdb.connect(path)` (no helper, no setting) reads every
    exchange, segments and journals, from any working directory, after the file alone was moved or copied."""
    monkeypatch.chdir(tmp_path)
    writer = Store("first.duckdb", segment_rows=2)
    rows = [exchange_row("s", seq, prompt_len=20) for seq in (1, 2, 3, 4, 5)]
    try:
        for row in rows:
            asyncio.run(writer.commit_exchange(row))
        _wait_for_segments(writer, 2)
    finally:
        writer.close()
    moved = tmp_path / "moved" / "second.duckdb"
    moved.parent.mkdir()
    os.rename("first.duckdb", moved)
    copied = tmp_path / "copies" / "third.duckdb"
    copied.parent.mkdir()
    shutil.copy(moved, copied)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    expected = sorted((row["exchange_id"], list(row["prompt_token_ids"])) for row in rows)
    for path in (moved, copied, Path("../moved/second.duckdb")):
        con = duckdb.connect(str(path), read_only=True)
        try:
            assert sorted(con.execute("SELECT exchange_id, prompt_token_ids FROM exchanges").fetchall()) == expected
        finally:
            con.close()
    assert not any(tmp_path.rglob("*.parquet"))  # nothing beside the file: no snapshot was taken


def test_a_killed_writers_store_opens_bare_with_its_journal(tmp_path: Path) -> None:
    """A store whose writer was SIGKILLed (rows still in journals, its last commits in its commit log only) reads bare
    too, without duplicates; once read through polar_mitm (which puts the log's rows back), bare with every
    committed row."""
    db = tmp_path / "crash.duckdb"
    script = tmp_path / "writer.py"
    # 15 commits, fewer than a segment's worth, and no read: they are in the commit log only when it dies
    script.write_text(CRASH_WRITER.format(tests=str(Path(__file__).parent), db=str(db), segment_rows=1000, count=15, quiet=3600))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    writer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert writer.stdout is not None
    committed = [writer.stdout.readline().strip() for _ in range(15)]
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert store.commit_log_path(db).stat().st_size > 0  # the last commits: not moved into the file yet

    def bare() -> list[str]:
        con = duckdb.connect(str(db), read_only=True)
        try:
            return [r[0] for r in con.execute("SELECT exchange_id FROM exchanges").fetchall()]
        finally:
            con.close()

    before = bare()
    assert len(before) == len(set(before)) and not set(committed) & set(before)
    assert set(committed) <= {r[0] for r in store.query(db, "SELECT exchange_id FROM exchanges")[1]}
    assert not store.commit_log_path(db).exists()
    after = bare()
    assert set(committed) <= set(after) and len(after) == len(set(after)) and set(before) <= set(after)


def _wait_for_segments(target: Store, count: int) -> None:
    deadline = time.monotonic() + 30
    while target.query(f"SELECT count(*) FROM {store.SEGMENTS_TABLE}")[1][0][0] < count and time.monotonic() < deadline:
        time.sleep(0.05)
