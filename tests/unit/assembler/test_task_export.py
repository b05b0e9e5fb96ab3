"""Task export: one assembly pass over a task's sessions, touching only those sessions (and their group's rewards),
with the same sequences, rewards and GRPO advantages as assembling the whole store."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.assembler import Assembly, assemble, source
from polar_mitm.errors import ConfigError
from polar_mitm.rollout.node import RECORD_SESSION, export_sessions
from polar_mitm.store import Store, StoreReader, now

MAIN = [f"main-{i}" for i in range(6)]  # task-main: main-5 failed (incomplete), the others completed
OTHER = [f"other-{i}" for i in range(3)]
STRAYS = ["stray-0", "stray-1"]  # a plain gateway's sessions: no task
EMPTY = "main-empty"  # in task-main, but its one exchange failed: no trajectory material
WANTED = ["main-3", "main-0", EMPTY, "main-1", "main-2"]  # what the export asks for, in the task's order


def _agent_rows(session_id: str, turns: int, rng: random.Random) -> list[dict[str, Any]]:
    """An agent loop: each prompt is the last one, its sample and a tool result (so prefix merging merges)."""
    prompt = [rng.randrange(1000, 150_000) for _ in range(40)]
    rows = []
    for seq in range(1, turns + 1):
        sample = [rng.randrange(1000, 150_000) for _ in range(6)] + [151645]
        rows.append({"exchange_id": f"{session_id}-x{seq}", "session_id": session_id, "seq": seq, "status": "ok", "api": "openai_chat", "action": "generate",
                     "prompt_token_ids": list(prompt), "completion_token_ids": sample, "completion_logprobs": [-rng.random() for _ in sample],
                     "finish_reason": "stop", "started_at": now(), "ended_at": now()})
        prompt += sample + [rng.randrange(1000, 150_000) for _ in range(10)]
    return rows


@pytest.fixture(scope="module")
def task_store(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("export") / "node.duckdb"
    store = Store(db, segment_rows=16)  # most rows in segments, the newest in the journal, as on a running node
    rng = random.Random(7)
    rows = [row for session in [*MAIN, *OTHER, *STRAYS] for row in _agent_rows(session, 3, rng)]
    rng.shuffle(rows)  # sessions interleave in the store, as concurrent sessions do
    rows.sort(key=lambda row: row["seq"])
    failed = {**_agent_rows(EMPTY, 1, rng)[0], "status": "error", "completion_token_ids": None, "completion_logprobs": None}
    loop = asyncio.new_event_loop()
    try:
        for row in [*rows, failed]:
            loop.run_until_complete(store.commit_exchange(row))
    finally:
        loop.close()
    records = [(s, "task-main", "completed", i / 4) for i, s in enumerate(MAIN[:5])] + [("main-5", "task-main", "failed", 1.0), (EMPTY, "task-main", "failed", None)]
    records += [(s, "task-other", "completed", float(i)) for i, s in enumerate(OTHER)]
    for session_id, task_id, status, reward in records:
        store.execute_write(RECORD_SESSION, [session_id, now(), now(), "qwen", task_id, status, reward, "{}", "{}", None])
    yield store
    store.close()


class Recorded:
    """The real store, with every call the assembler makes written down (what it asked the store for)."""

    def __init__(self, inner: StoreReader):
        self.inner = inner
        self.calls: list[tuple[str, list[Any]]] = []

    def query(self, sql: str, params: list[Any] | None = None):
        self.calls.append((sql, params or []))
        return self.inner.query(sql, params)

    def arrow(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        self.calls.append((sql, params or []))
        return self.inner.arrow(sql, params)

    def sessions_named(self) -> set[str]:
        """Every session (or task) id the calls named."""
        return {value for _, params in self.calls for param in params for value in (param if isinstance(param, list) else [param]) if isinstance(value, str)}


def _by_id(assembly: Assembly) -> dict[str, tuple]:
    return {s.sequence_id: (s.session_id, s.group_id, s.reward, s.advantage, s.trainable, s.no_signal, s.input_ids, s.loss_mask, s.rollout_logprobs) for s in assembly.sequences}


def test_a_task_assembles_as_in_the_whole_store_in_one_pass(task_store: Store) -> None:
    whole = assemble(store=task_store)
    recorded = Recorded(task_store)
    scoped = assemble(store=recorded, session_ids=WANTED)

    assert [s.session_id for s in scoped.sequences] == [s for s in WANTED if s != EMPTY]  # the task's order; EMPTY yields nothing
    assert _by_id(scoped) == {k: v for k, v in _by_id(whole).items() if v[0] in WANTED}
    assert any(s.advantage for s in scoped.sequences)  # a real GRPO signal, over all five scored sessions of the task
    assert scoped.groups == [g for g in whole.groups if g.group_id == "task-main"]
    assert scoped.groups[0].scored_sessions == 5 and scoped.stats.sessions == 4 and scoped.stats.exchanges_skipped == 1

    # one pass: two queries on the exchanges (what each session holds, then the token lists, read once, of the
    # asked sessions only); the task's other sessions are read for their rewards, nothing else of the store at all
    on_exchanges = [(sql, params) for sql, params in recorded.calls if "FROM exchanges" in sql]
    assert [sql for sql, _ in on_exchanges] == [source.COUNTS_SQL, source.EXCHANGE_SQL]
    assert on_exchanges[1][1][2] == [s for s in WANTED if s != EMPTY]
    assert set(on_exchanges[0][1][2]) == set(WANTED) | {"main-4", "main-5"}
    assert recorded.sessions_named() - {"task-main"} <= set(WANTED) | set(MAIN)
    assert all(any(isinstance(param, list) for param in params) for _, params in recorded.calls)  # no call reads the whole store

    # the node's Store itself: its reads of these sessions bind only the segment tables listed as holding them
    direct = assemble(store=task_store, session_ids=WANTED)
    assert _by_id(direct) == _by_id(scoped) and direct.groups == scoped.groups and direct.stats == scoped.stats


def test_the_calls_do_not_grow_with_the_sessions_asked_for(task_store: Store) -> None:
    one, four = Recorded(task_store), Recorded(task_store)
    assemble(store=one, session_ids=WANTED[:1])
    assemble(store=four, session_ids=WANTED)
    assert len(one.calls) == len(four.calls) <= 4


def test_export_writes_what_assembling_each_session_alone_gives(task_store: Store, tmp_path: Path) -> None:
    """The per-session way (what export did before) and the one pass give the same Parquet rows and group."""
    path, stats = export_sessions(task_store, "task-main", WANTED, "prefix_merging", {}, tmp_path / "task-main.parquet")
    alone = []
    for session_id in WANTED:
        try:
            alone += assemble(None, "prefix_merging", session_id, store=task_store).sequences
        except LookupError:  # EMPTY: nothing to train on
            continue
    table = pq.read_table(path)
    assert table.column("sequence_id").to_pylist() == [s.sequence_id for s in alone]
    assert table.column("advantage").to_pylist() == [s.advantage for s in alone]
    assert table.column("input_ids").to_pylist() == [s.input_ids for s in alone]
    group = assemble(store=task_store).groups
    assert stats["group"] == next(g for g in group if g.group_id == "task-main").model_dump()
    assert (stats["sessions"], stats["sequences"]) == (4, len(alone))


def test_a_rewards_csv_regroups_a_scoped_run_as_the_whole_store(task_store: Store, tmp_path: Path) -> None:
    """The CSV moves other-0 into task-main and main-4 out of it: the scoped run finds its group mates by the CSV."""
    csv = tmp_path / "rewards.csv"
    csv.write_text("session_id,reward,task_id\nother-0,3.0,task-main\nmain-4,0.5,task-other\nmain-0,2.0,\n")
    whole = assemble(store=task_store, rewards_csv=csv)
    scoped = assemble(store=task_store, rewards_csv=csv, session_ids=["main-0", "main-1"])
    assert _by_id(scoped) == {k: v for k, v in _by_id(whole).items() if v[0] in ("main-0", "main-1")}
    assert [(g.group_id, g.scored_sessions) for g in scoped.groups] == [("task-main", 5)]


def test_one_session_keeps_its_contract(task_store: Store) -> None:
    with pytest.raises(LookupError, match="no trajectory material"):
        assemble(store=task_store, session=EMPTY)
    with pytest.raises(ConfigError, match="not both"):
        assemble(store=task_store, session="main-0", session_ids=["main-1"])
    assert assemble(store=task_store, session_ids=[EMPTY]).sequences == []
