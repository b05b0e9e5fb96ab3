"""The dashboard's pages over real stores (the real writer, rows shaped like the gateway's), no engine and no browser:
what each view shows is checked against the store and the assembler; a bad path, a file that is no store, an empty
store and a store held by a live writer each get a clear page (tests/integration/test_ui.py drives them in Chromium)."""

from __future__ import annotations

import asyncio
import html
import re
from pathlib import Path
from typing import Any

import duckdb
import pytest
from starlette.testclient import TestClient

from polar_mitm.assembler import assemble
from polar_mitm.rollout.server import LocalBackend, create_app
from polar_mitm.store import MATERIAL, Store
from polar_mitm.store.reading import snapshot_closed_store
from polar_mitm.store.union import write_catalog
from polar_mitm.ui import PathSource, standalone_app
from polar_mitm.ui.app import rollout_dashboard
from polar_mitm.ui.run_view import MATERIAL_SCALAR
from tests.support.rollout_standins import StandinNode
from tests.support.ui_stores import SAMPLED_TOKENS, write_store

SESSIONS, TURNS = 30, 8


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("ui") / "store.duckdb"
    asyncio.run(write_store(db, SESSIONS, TURNS, model_engine=None))  # no tokenizer: token ids are shown
    return db


def client(db: Path) -> TestClient:
    return TestClient(standalone_app(PathSource(db)))


def text(page: str) -> str:
    """The page's visible text, roughly: tags dropped, entities decoded, spaces collapsed."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_root_sends_the_browser_to_the_dashboard(store_path: Path) -> None:
    reply = client(store_path).get("/", follow_redirects=False)
    assert reply.status_code == 307 and reply.headers["location"] == "/ui/"


def test_run_view_counts_and_groups_agree_with_the_store_and_the_assembler(store_path: Path) -> None:
    reply = client(store_path).get("/ui/")
    assert reply.status_code == 200, reply.text
    page = text(reply.text)
    exchanges = SESSIONS * TURNS
    errors = SESSIONS * sum(1 for seq in range(1, TURNS + 1) if seq % 20 == 7)
    assert f"{exchanges} exchanges" in page and f"{SESSIONS} sessions" in page and f"{errors} errors" in page
    # the GRPO groups are the assembler's: same means, standard deviations and no-signal flags
    assembly = assemble(store_path)
    groups_html = reply.text.split('id="groups"')[1].split("</section>")[0]
    for group in assembly.groups:
        row = next(r for r in groups_html.split("<tr") if f"<td>{group.group_id}</td>" in r)
        if group.mean is not None:
            assert f"{group.mean:.3f}" in row
        if group.std is not None:
            assert f"{group.std:.3f}" in row
        assert ("no signal" in row) == group.no_signal
    # each session's advantage, as the assembler gives it
    advantages = {s.session_id: s.advantage for s in assembly.sequences}
    sessions_html = reply.text.split('id="session-table"')[1]
    for session_id, advantage in list(advantages.items())[:5]:
        row = next(r for r in sessions_html.split("<tr") if f">{session_id}</a>" in r)
        assert f"{advantage:.2f}" in row
    # policy versions: turn // 5 -> versions 0 and 1 over trajectory material; current is the newest
    versions = reply.text.split('id="versions"')[1].split("</section>")[0]
    assert "<td>0</td>" in versions and "<td>1</td>" in versions and "current: 1" in text(versions)
    assert "completed" in page and "failed" in page  # sessions by status
    assert page.count("<rect") == 0 and reply.text.count("<rect") > 0  # the throughput chart has bars


def test_material_without_lists_is_the_store_s_material_on_the_lists_own_count() -> None:
    assert MATERIAL_SCALAR != MATERIAL and "prompt_tokens IS NOT NULL" in MATERIAL_SCALAR


def test_session_view_shows_the_conversation_timings_and_the_assembled_sequence(store_path: Path) -> None:
    reply = client(store_path).get("/ui/session", params={"id": "s0003"})
    assert reply.status_code == 200, reply.text
    page = text(reply.text)
    assert "Task for s0003: fix the bug." in page  # the first user message
    assert "You are a coding agent." in page and "6 tools" in page  # system prompt and tools, once
    for seq in range(1, TURNS + 1):
        assert f'id="seq-{seq}"' in reply.text
    assert "result 3" in page and "step 3" in page  # a tool result the harness sent, a reply the engine gave
    assert "engine answered 500" in page  # the error of seq 7
    assert "queued" in page and "running" in page  # the stage timeline from the sessions row
    # one sequence (the prompts extend each other), linked to its Trajectory view
    [sequence] = assemble(store_path, session="s0003").sequences
    assert f"sequence?id={sequence.sequence_id.replace(':', '%3A')}" in reply.text
    # the diff between turns is `polar-mitm diff`'s summary
    assert "seq 1 → 2 extends" in page


def test_trajectory_view_draws_every_token_with_its_mask_and_logprob(store_path: Path) -> None:
    [sequence] = assemble(store_path, session="s0004").sequences
    reply = client(store_path).get("/ui/sequence", params={"id": sequence.sequence_id})
    assert reply.status_code == 200, reply.text
    tokens = re.findall(r'<span class="t ([^"]*)"[^>]*>([^<]*)</span>', reply.text.split('id="tokens"')[1].split("</div>")[0])
    assert len(tokens) == len(sequence.input_ids)
    assert sum(1 for classes, _ in tokens if classes.split()[0] == "s") == sum(sequence.loss_mask) == sequence.sampled_tokens
    assert sequence.sampled_tokens == (TURNS - 1) * SAMPLED_TOKENS  # seq 7 failed: 7 sampled turns
    # no tokenizer: each token shows its id
    assert [t for _, t in tokens[:3]] == [f"⟨{i}⟩" for i in sequence.input_ids[:3]]
    # a marker where each exchange's sample starts, with its policy version
    assert "seq 1 sampled 40 · policy v0" in text(reply.text) and "seq 8 sampled 40 · policy v1" in text(reply.text)


def test_missing_sessions_and_sequences_are_pages_that_say_so(store_path: Path) -> None:
    ui = client(store_path)
    for path, params, said in [("/ui/session", {"id": "nope"}, "no session 'nope'"), ("/ui/sequence", {"id": "nope"}, "is not a sequence id"),
                               ("/ui/sequence", {"id": "s0001:prefix_merging:99"}, "has no sequence")]:
        reply = ui.get(path, params=params)
        assert reply.status_code == 404 and said in text(reply.text) and "Traceback" not in reply.text


def test_a_fragment_request_answers_only_the_main_content(store_path: Path) -> None:
    reply = client(store_path).get("/ui/", headers={"X-Polar-Fragment": "1"})
    assert reply.status_code == 200 and "<html" not in reply.text and 'id="totals"' in reply.text


def test_bad_paths_and_an_empty_store_are_clear_pages(tmp_path: Path) -> None:
    missing = tmp_path / "missing.duckdb"
    reply = client(missing).get("/ui/")
    assert reply.status_code == 404 and "No store here" in reply.text and 'http-equiv="refresh"' in reply.text
    not_duckdb = tmp_path / "notes.txt"
    not_duckdb.write_text("hello, not a database\n" * 5)
    assert "is not a DuckDB database file" in client(not_duckdb).get("/ui/").text
    assert "is a directory" in client(tmp_path).get("/ui/").text
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    reply = client(other).get("/ui/")
    assert reply.status_code == 404 and "Not a polar-mitm store" in reply.text and "Traceback" not in reply.text
    empty = tmp_path / "empty.duckdb"
    Store(empty).close()
    reply = client(empty).get("/ui/")
    assert reply.status_code == 200 and "No exchanges yet" in reply.text


def test_a_store_held_by_a_live_writer_is_read_through_its_sql_endpoint(tmp_path: Path) -> None:
    db = tmp_path / "live.duckdb"
    asyncio.run(write_store(db, 3, 4, model_engine=None))
    live = Store(db)  # the writer a gateway would be, with the SQL endpoint it serves
    live.serve_sql()
    try:
        reply = client(db).get("/ui/")
        assert reply.status_code == 200 and "written by a live gateway" not in reply.text
        assert "live: gateway pid" in reply.text and 'data-live="1"' in reply.text and "12 exchanges" in text(reply.text)
        session = client(db).get("/ui/session", params={"id": "s0001"})
        assert session.status_code == 200 and "Task for s0001" in session.text
    finally:
        live.close()


class _NodeWithStore(StandinNode):
    """The rollout stand-in node (tests/support/rollout_standins.py) holding a real Store, as GatewayNode does."""

    def __init__(self, store: Store):
        super().__init__("http://127.0.0.1:9")
        self.store = store

    def health(self) -> dict[str, Any]:
        return {**super().health(), "db": str(self.store.path)}


def test_rollout_serve_mounts_the_dashboard_over_its_node_s_store(tmp_path: Path) -> None:
    db = tmp_path / "node.duckdb"
    asyncio.run(write_store(db, 2, 3, model_engine=None))
    store = Store(db)
    try:
        app = create_app(LocalBackend(_NodeWithStore(store)))  # the real rollout server app; its lifespan is not run
        reply = TestClient(app).get("/ui/")
        assert reply.status_code == 200, reply.text
        assert "this rollout server's gateway node" in text(reply.text) and "6 exchanges" in text(reply.text)
        assert TestClient(app).get("/ui/session", params={"id": "s0001"}).status_code == 200
    finally:
        store.close()


class _ClusterSql:
    """Stands in for a Ray backend's SQL source (rollout.ray.data.ClusterData): a real catalog over real node
    snapshots; `query` would refresh it from live nodes, here it counts the refreshes."""

    def __init__(self, catalog: Path):
        self.catalog = catalog
        self.refreshes = 0

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        self.refreshes += 1
        return ["1"], [(1,)]


class _Fleet:
    def status(self) -> dict[str, Any]:
        return {"nodes": [{"name": "node-a", "alive": True, "draining": False, "stages": {"running": 1}, "finished": 2,
                           "engines": [{"url": "http://10.0.0.5:8000/v1", "reachable": True}]}], "queue": {"sessions": 0}}


class _RayBackend:
    def __init__(self, sql: _ClusterSql):
        self.sql, self.fleet = sql, _Fleet()


def test_on_a_cluster_the_run_view_shows_every_node_and_its_engines(tmp_path: Path) -> None:
    snapshots = []
    for node in ("node-a", "node-b"):
        db = tmp_path / node / "store.duckdb"
        db.parent.mkdir()
        asyncio.run(write_store(db, 2, 3, model_engine=None))
        snapshots.append(snapshot_closed_store(db, node, tmp_path / node / "snap"))
    sql = _ClusterSql(write_catalog(tmp_path / "cluster.duckdb", snapshots))
    app = rollout_dashboard(_RayBackend(sql))
    reply = TestClient(app, root_path="/ui").get("/ui/")
    assert reply.status_code == 200, reply.text
    nodes = text(reply.text.split('id="nodes"')[1].split("</section>")[0])
    assert "node-a" in nodes and "node-b" in nodes and "http://10.0.0.5:8000/v1 (up)" in nodes
    assert "12 exchanges" in text(reply.text) and "a Ray cluster of 1 node(s)" in text(reply.text)
    assert sql.refreshes == 1
