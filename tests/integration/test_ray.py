"""Scale-out on a real local Ray cluster: a head and two worker nodes (ray.cluster_utils.Cluster, separate raylets on
127.0.0.1, each with the `polar_node` resource and a `polar-node` label), `polar-mitm rollout serve --ray ADDRESS`
as its own process, real Qwen Code sessions in local sandboxes, the real engine steered by
examples/steer_tiny_model.py, a real HTTP callback receiver. Every cluster and server is shut down by its fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pyarrow.parquet as pq
import pytest

from polar_mitm.local_engine.steering import has_tool_result, shell_tool
from polar_mitm.rollout.runtimes.local import marked_processes
from tests.support.gated_engine import GatedEngineRelay
from tests.support.matrix import long_case
from tests.support.ray_runs import (
    NODES,
    end_sessions_left,
    sleeping_task,
    sql,
    start_ray_node,
    start_server,
    stop_server,
    wait_for,
    wait_task,
)
from tests.support.rollout_runs import HOOK, TASK_WAIT, Receiver, RolloutServer, coding_task

pytestmark = [pytest.mark.harness, pytest.mark.engine]

ray = pytest.importorskip("ray")
TRAINER = Path(__file__).resolve().parents[1] / "support" / "ray_trainer.py"


@pytest.fixture
def cluster_server(ray_cluster, engine_url: str, harness_installed: None, tmp_path: Path):
    server = start_server(ray_cluster, engine_url, tmp_path)
    yield server
    stop_server(server)


def test_six_sessions_spread_over_three_nodes_with_trajectories_and_sql_over_every_store(cluster_server: RolloutServer, engine_url: str, receiver) -> None:
    rx: Receiver = receiver()
    task = {**coding_task("ray-six", engine_url, "local", 6), "callback_url": rx.url}
    accepted = cluster_server.submit(task)
    result = wait_task(cluster_server, accepted["task_id"], TASK_WAIT * 2)
    sessions = {s["session_id"]: s for s in result["sessions"]}
    assert result["status"] == "completed" and result["counts"] == {"completed": 6}, json.dumps(result)[:4000]
    for session_id, session in sessions.items():
        assert session["evaluation"]["details"]["content"] == session_id  # this session's own sandbox
        assert session["reward"] == session["sample_index"] / 2 and session["n_exchanges"] == 2
    # spread: with one prepare and one run slot per node, every node got sessions
    by_node: dict[str, set[str]] = {}
    for session in sessions.values():
        by_node.setdefault(session["node"], set()).add(session["session_id"])
    assert set(by_node) == set(NODES), by_node

    # SQL over every node's store, as one: each session's exchanges come from the node that ran it
    rows = sql(cluster_server, f"SELECT node, session_id, count(*) AS n FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%' GROUP BY ALL")
    assert {(r["node"], r["session_id"]) for r in rows} == {(s["node"], sid) for sid, s in sessions.items()}
    assert all(r["n"] == 2 for r in rows)
    stored = sql(cluster_server, f"SELECT session_id, status, reward, node FROM sessions WHERE task_id = '{accepted['task_id']}'")
    assert {r["session_id"]: (r["status"], r["reward"], r["node"]) for r in stored} == {sid: ("completed", s["reward"], s["node"]) for sid, s in sessions.items()}
    # each node's own store file, on its disk
    for node in NODES:
        assert (cluster_server.db.parent / f"store.{node}.duckdb").exists()
    # the catalog the head refreshes answers `polar-mitm sql` like any store
    catalog = cluster_server.db.parent / "store.head" / "cluster.duckdb"
    out = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "sql", "--db", str(catalog), f"SELECT count(DISTINCT node) AS nodes, count(*) AS exchanges FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%'"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "12" in out.stdout and "3" in out.stdout, out.stdout + out.stderr

    # the task's Parquet, assembled by the head over the union: group advantages across nodes
    table = pq.read_table(result["trajectories"]).to_pylist()
    assert {r["session_id"] for r in table} == set(sessions)
    advantage = {r["session_id"]: r["advantage"] for r in table}
    assert advantage[min(sessions, key=lambda s: sessions[s]["reward"])] < 0 < advantage[max(sessions, key=lambda s: sessions[s]["reward"])]
    assert sorted(result["trajectory_stats"]["nodes"]) == list(NODES)

    # callbacks: every session once, then the task
    task_result = rx.wait_for_task_result()
    assert {r["session_id"] for r in rx.results("session_result")} == set(sessions)
    assert task_result["counts"] == {"completed": 6}


def nodes_status(server: RolloutServer) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in server.client.get("/nodes").json()["nodes"]}


@long_case  # ~2 min; every session accounted for after a kill: test_head_restart_loses_no_task... and test_rollout_durable.py
def test_a_node_killed_mid_task_every_session_accounted_for_and_its_store_comes_back(ray_cluster, cluster_server: RolloutServer, engine_url: str) -> None:
    # 7 sessions, 2 admitted per node: 6 dispatched at once (one running, one waiting per node), 1 in the head queue
    accepted = cluster_server.submit(sleeping_task("ray-kill", engine_url, 7, 20))
    session_ids = accepted["session_ids"]
    try:
        # n2 runs a session whose first model call (the tool call that sleeps) is committed in n2's store
        on_n2 = f"SELECT count(*) AS n FROM exchanges WHERE node = 'n2' AND session_id LIKE '{accepted['task_id']}-%'"
        wait_for(lambda: sql(cluster_server, on_n2)[0]["n"] >= 1, 240, "an exchange committed on n2", interval=1.0)
        ray_cluster.remove_node(ray_cluster.workers.pop("n2"), allow_graceful=False)
        result = wait_task(cluster_server, accepted["task_id"], TASK_WAIT * 2)
    finally:
        end_sessions_left(session_ids)
    sessions = {s["session_id"]: s for s in result["sessions"]}
    assert set(sessions) == set(session_ids) and all(s["status"] in ("completed", "failed") for s in sessions.values()), result["counts"]
    lost = [s for s in sessions.values() if s["node"] == "n2"]
    # the one running on n2 failed, saying where its exchanges are; a session n2 had not started went elsewhere
    assert lost and all(s["status"] == "failed" and "node n2 died" in s["error"] for s in lost), lost
    assert any(s["n_exchanges"] >= 1 for s in lost)  # its first model call (the tool call) was committed on n2
    completed = [s for s in sessions.values() if s["status"] == "completed"]
    assert len(completed) == 7 - len(lost) and {s["node"] for s in completed} <= {"n0", "n1"}
    # n2's second session was preparing (waiting for n2's run slot) with nothing recorded: it ran elsewhere
    assert "had not started on lost node n2; dispatching it again" in cluster_server.log.read_text()
    assert not nodes_status(cluster_server)["n2"]["alive"]

    # n2 comes back under its label: its actor reopens its store and marks the lost sessions failed there too
    ray_cluster.workers["n2"] = start_ray_node(lambda: ray_cluster.add_node(**ray_cluster.node_args("n2")))
    wait_for(lambda: nodes_status(cluster_server)["n2"]["alive"], 120, "n2 back")
    lost_ids = ", ".join(f"'{s['session_id']}'" for s in lost)
    stored = sql(cluster_server, f"SELECT session_id, status, node, error FROM sessions WHERE session_id IN ({lost_ids})")
    assert {(r["session_id"], r["status"], r["node"]) for r in stored} == {(s["session_id"], "failed", "n2") for s in lost}
    assert all("restarted mid-session" in r["error"] for r in stored)
    kept = sql(cluster_server, f"SELECT session_id, count(*) AS n FROM exchanges WHERE session_id IN ({lost_ids}) GROUP BY ALL")
    assert {r["session_id"]: r["n"] for r in kept} == {s["session_id"]: s["n_exchanges"] for s in lost if s["n_exchanges"]}


def test_early_stop_cancels_stragglers_and_a_drained_node_gets_nothing(cluster_server: RolloutServer, engine_url: str, tmp_path: Path) -> None:
    assert cluster_server.client.delete("/nodes/n1").status_code == 202
    assert nodes_status(cluster_server)["n1"]["draining"]
    # the first session to run its command finishes at once; the others would run five minutes. Which one is first
    # is not fixed: a node starts the sessions it was given in whatever order its actor takes the calls. (The
    # nodes share this machine, so one directory decides.)
    first = tmp_path / "first"
    command = f'mkdir {first} 2>/dev/null && echo "$POLAR_MITM_SESSION" > {first}/session || python3 -c "import time; time.sleep(300)"'
    task = sleeping_task("ray-early", engine_url, 4, 0, early_stop_min_usable_sessions=1)
    task["instruction"] = f"Run it.\nSTEER-COMMAND: {command}"
    started = time.monotonic()
    accepted = cluster_server.submit(task)
    try:
        result = wait_task(cluster_server, accepted["task_id"], TASK_WAIT)
    finally:
        end_sessions_left(accepted["session_ids"])
    assert time.monotonic() - started < 240  # far less than the stragglers' five minutes
    winner = (first / "session").read_text().strip()
    statuses = {s["session_id"]: (s["status"], s["error"]) for s in result["sessions"]}
    assert statuses.pop(winner)[0] == "completed", statuses
    assert [status for status, _ in statuses.values()] == ["cancelled"] * 3, statuses
    usable = next(s for s in result["sessions"] if s["session_id"] == winner)
    assert usable["trajectory"]["sampled_tokens"] > 0
    assert result["early_stopped"] is True and result["status"] == "completed"
    assert all(s["node"] in ("n0", "n2") for s in result["sessions"] if s["node"]), [s["node"] for s in result["sessions"]]
    # the trajectories: only the usable session is trainable; a cancelled one contributes nothing trainable
    table = pq.read_table(result["trajectories"]).to_pylist()
    assert {r["session_id"] for r in table if r["trainable"]} == {winner}
    for session_id in statuses:
        assert not marked_processes(session_id)  # the harness was stopped, not left running


def test_head_restart_loses_no_task_double_runs_no_session_and_redelivers_callbacks(ray_cluster, engine_url: str, harness_installed: None, tmp_path: Path, receiver) -> None:
    rx: Receiver = receiver(fail_first={"session_result": 10**6, "task_result": 10**6})  # the trainer is down until the head restarts
    first = start_server(ray_cluster, engine_url, tmp_path)
    second: RolloutServer | None = None
    accepted = first.submit({**sleeping_task("ray-restart", engine_url, 7, 8), "callback_url": rx.url})
    session_ids = accepted["session_ids"]
    try:
        wait_for(lambda: any(s["status"] == "completed" for s in first.task(accepted["task_id"])["sessions"]), 300, "a completed session")
        before = first.task(accepted["task_id"])
        stop_server(first, signal.SIGKILL)  # the head dies; the node actors (detached) and their sessions go on
        rx.fail_first.clear()
        second = start_server(ray_cluster, engine_url, tmp_path)
        recovered = second.task(accepted["task_id"])  # accepted before the restart: still known
        assert recovered["task_id"] == accepted["task_id"] and {s["session_id"] for s in recovered["sessions"]} == set(session_ids)
        for old in before["sessions"]:
            if old["status"] == "completed":
                assert next(s for s in recovered["sessions"] if s["session_id"] == old["session_id"])["status"] == "completed"
        result = wait_task(second, accepted["task_id"], TASK_WAIT * 2)
        assert result["counts"] == {"completed": 7}, json.dumps(result)[:3000]
        # never run twice: every session's two exchanges on one node (a second run would add two more, anywhere)
        query = f"SELECT session_id, count(*) AS n, count(DISTINCT node) AS nodes FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%' GROUP BY ALL"
        rows = sql(second, query)
        assert {r["session_id"]: (r["n"], r["nodes"]) for r in rows} == {sid: (2, 1) for sid in session_ids}
        # callbacks that were not acknowledged before the restart were delivered after it, each id acknowledged once
        rx.wait_for_task_result()
    finally:
        end_sessions_left(session_ids)
        if second is not None:
            stop_server(second)
        elif first.process.poll() is None:
            stop_server(first)
    acknowledged: dict[str, int] = {}
    for attempt in rx.attempts:
        if attempt["status"] == 200:
            acknowledged[attempt["delivery_id"]] = acknowledged.get(attempt["delivery_id"], 0) + 1
    assert acknowledged == {**{f"{sid}:session_result": 1 for sid in session_ids}, f"{accepted['task_id']}:task_result": 1}


# -- the Python entry point, as a trainer's driver uses it inside its own Ray job ----------------------------------


def cluster_config(engine_url: str, base: Path) -> Any:
    """What a trainer writes: the engine, the store, the steering hook; no gateway port (each node picks a free one),
    one prepare and one run slot per node, as the server tests' `rollout serve --ray` has."""
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.ray_cluster import ClusterConfig
    from polar_mitm.rollout.session_run import StageLimits

    gateway = GatewayConfig(upstream=engine_url, db=base / "store.duckdb", confdir=str(base / "confdir"), engine_hook=HOOK)
    return ClusterConfig(node=NodeConfig(gateway=gateway, limits=StageLimits(prepare=1, run=1)))


def trainer_job(ray_cluster, config: Any, scenario: str, tasks: list[dict[str, Any]], base: Path) -> dict[str, Any]:
    """tests/support/ray_trainer.py, a trainer's driver process on the cluster; what it saw."""
    out, log = base / f"trainer-{scenario}.json", base / f"trainer-{scenario}.log"
    command = [sys.executable, str(TRAINER), ray_cluster.address, config.model_dump_json(), scenario, json.dumps(tasks), str(out)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        process.wait(timeout=TASK_WAIT * 2)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        end_sessions_left([s["session_id"] for task in (json.loads(out.read_text())["accepted"] if out.exists() else []) for s in task["sessions"]])
    assert process.returncode == 0, log.read_text()[-5000:]
    return json.loads(out.read_text())


def test_a_trainer_runs_a_task_through_the_python_entry_point_in_its_own_ray_job(ray_cluster, engine_url: str, harness_installed: None, tmp_path: Path) -> None:
    from polar_mitm.client import load_batch

    seen = trainer_job(ray_cluster, cluster_config(engine_url, tmp_path), "run", [coding_task("ray-python", engine_url, "local", 2)], tmp_path)
    # every node came up, each gateway on a port of its own (GatewayConfig's default port made all but one exit)
    assert seen["health"]["nodes"] == dict.fromkeys(NODES, True)
    assert len({n["gateway"] for n in seen["nodes"]}) == len(NODES), seen["nodes"]
    # submit answered at once: running, every session queued
    accepted, result = seen["accepted"][0], seen["results"][0]
    assert accepted["status"] == "running" and [s["status"] for s in accepted["sessions"]] == ["queued", "queued"]
    assert seen["now"] == result
    sessions = {s["session_id"]: s for s in result["sessions"]}
    assert result["status"] == "completed" and result["counts"] == {"completed": 2}, json.dumps(result)[:3000]
    assert set(sessions) == {s["session_id"] for s in accepted["sessions"]}
    for session_id, session in sessions.items():
        assert session["evaluation"]["details"]["content"] == session_id  # its own sandbox
        assert session["reward"] == session["sample_index"] / 2 and session["n_exchanges"] == 2 and session["node"] in NODES
    # SQL over every node's store: each session's two exchanges, in the store of the node that ran it
    assert sorted(map(tuple, seen["rows"])) == sorted((s["node"], sid, 2) for sid, s in sessions.items())
    # the trajectories come back to the trainer as a batch, assembled over every node's store
    batch = load_batch(result["trajectories"])
    assert set(batch.session_ids) == set(sessions) and batch.sampled_tokens > 0
    assert sorted(result["trajectory_stats"]["nodes"]) == list(NODES)
    # closed: the node actors are gone; the trainer's Ray connection was left to the trainer
    assert seen["actors_left"] == [] and seen["ray_connected"] is True


@long_case  # ~3 min; the head's queue order by priority: test_ray_dispatch.py
def test_a_higher_dispatch_priority_goes_first_through_limited_slots(ray_cluster, engine_url: str, harness_installed: None, tmp_path: Path) -> None:
    """One node open (the others drained): two slots (one preparing, one running). A busy task fills them; a task
    with priority 0 is queued, then one with priority 90. The later, higher-priority task's sessions are dispatched
    first, as the head store records and the node's session start times show."""
    tasks = [
        sleeping_task("ray-prio-busy", engine_url, 2, 5, dispatch_priority=50),
        sleeping_task("ray-prio-low", engine_url, 2, 0, dispatch_priority=0),
        sleeping_task("ray-prio-high", engine_url, 2, 0, dispatch_priority=90),
    ]
    config = cluster_config(engine_url, tmp_path)
    seen = trainer_job(ray_cluster, config, "priority", tasks, tmp_path)
    # while the busy task held both slots, the other four sessions waited in the head queue
    assert seen["queue"] == {"sessions": 4, "priorities": [90, 0]}, seen["queue"]
    for result in seen["results"]:
        assert result["counts"] == {"completed": 2} and {s["node"] for s in result["sessions"]} == {seen["open_node"]}, json.dumps(result)[:3000]

    # the head store: the order in which sessions were handed to the node
    with duckdb.connect(str(config.resolved().head_db), read_only=True) as head:
        order = [row[0] for row in head.execute("SELECT task_id FROM head_sessions ORDER BY dispatched_at").fetchall()]
    assert order == ["ray-prio-busy"] * 2 + ["ray-prio-high"] * 2 + ["ray-prio-low"] * 2, order
    # the node: every high-priority session started preparing before any low-priority one
    started = {r["task_id"]: sorted(s["timings"]["preparing"]["started_at"] for s in r["sessions"]) for r in seen["results"]}
    assert started["ray-prio-high"][-1] < started["ray-prio-low"][0], started


# -- the Ray head's /control/* across nodes (issue 25: it read a gateway URL the
# cluster does not have, so a trainer could not pause or resume the nodes' gateways for a weight sync). On this
# module's cluster: `polar-mitm rollout serve --ray`, three real Qwen Code sessions, one per node, each node's first
# model call held in flight at a relay in front of the real engine (tests/support/gated_engine.py) while the trainer
# calls pause(drain) on the head; then resume with a new policy version.


def first_agent_turn(request: dict[str, Any]) -> bool:
    """The agent loop's first call (its shell tool offered, no tool result yet): what the relay holds."""
    return bool(shell_tool(request)) and not has_tool_result(request)


def gateways(server: RolloutServer) -> dict[str, dict[str, Any]]:
    """GET /control/status on the head: node -> its gateway's control status."""
    response = server.client.get("/control/status")
    assert response.status_code == 200, response.text
    return response.json()["nodes"]


def every_node_probed(server: RolloutServer) -> dict[str, Any] | None:
    """GET /health once every node has reported whether its engine answers (its first load after start)."""
    health = server.client.get("/health").json()
    by_node = health["engine_reachable_by_node"]
    return health if len(by_node) == len(NODES) and None not in by_node.values() else None


@long_case  # ~1.5 min; pause/resume through a server: test_clients.py, the drain itself: test_control.py
def test_pause_drains_every_node_s_gateway_and_resume_versions_every_node_s_later_rows(ray_cluster, engine_url: str, harness_installed: None, tmp_path: Path) -> None:
    relay = GatedEngineRelay(engine_url, held=first_agent_turn)
    server = start_server(ray_cluster, relay.url, tmp_path)
    session_ids: list[str] = []
    pauser = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    try:
        assert {name: status["state"] for name, status in gateways(server).items()} == dict.fromkeys(NODES, "serving")
        # /health: every node's engine answers its node's probe (through the relay, which passes GET /models)
        health = wait_for(lambda: every_node_probed(server), 60, "every node's engine probed")
        assert health["status"] == "ok" and health["engine_reachable_by_node"] == dict.fromkeys(NODES, True), health
        accepted = server.submit(sleeping_task("ray-control", relay.url, 3, 0))
        session_ids = accepted["session_ids"]
        # every node's gateway has its session's first engine call in flight (held at the relay)
        wait_for(lambda: [s["in_flight"] for s in gateways(server).values()] == [1, 1, 1], 300, "a call in flight on every node", interval=1.0)
        assert relay.waiting == 3

        with ThreadPoolExecutor(1) as pool:
            pausing = pool.submit(pauser.post, "/control/pause", json={"mode": "drain", "timeout_seconds": 300})
            wait_for(lambda: [s["state"] for s in gateways(server).values()] == ["draining"] * 3, 60, "every node draining")
            # two nodes' calls finish: those gateways are paused; the pause waits for the third
            relay.release(2)
            wait_for(lambda: sorted(s["state"] for s in gateways(server).values()) == ["draining", "paused", "paused"], 120, "two nodes paused")
            assert not pausing.done()
            assert sorted(s["in_flight"] for s in gateways(server).values()) == [0, 0, 1]
            relay.release(1)
            paused = pausing.result(timeout=120)
        assert paused.status_code == 200, paused.text
        assert {name: (s["state"], s["in_flight"]) for name, s in paused.json()["nodes"].items()} == dict.fromkeys(NODES, ("paused", 0))
        # each harness's next call waits on its node's paused gateway
        wait_for(lambda: all(s["waiting"] >= 1 for s in gateways(server).values()), 180, "every node holding the next call", interval=1.0)

        resumed = server.client.post("/control/resume", json={"policy_version": 5})
        assert resumed.status_code == 200, resumed.text
        assert {name: (s["state"], s["policy_version"]) for name, s in resumed.json()["nodes"].items()} == dict.fromkeys(NODES, ("serving", 5))
        result = wait_task(server, accepted["task_id"], TASK_WAIT)
        assert result["counts"] == {"completed": 3} and {s["node"] for s in result["sessions"]} == set(NODES), result["counts"]

        # on every node: the call made before the pause at version 0, the one after the resume at version 5
        rows = sql(server, f"SELECT node, finish_reason, policy_version FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%' ORDER BY node, started_at")
        by_node: dict[str, list[tuple[str, int]]] = {}
        for row in rows:
            by_node.setdefault(row["node"], []).append((row["finish_reason"], row["policy_version"]))
        assert by_node == dict.fromkeys(NODES, [("tool_calls", 0), ("stop", 5)]), by_node
    finally:
        relay.close()
        pauser.close()
        end_sessions_left(session_ids)
        stop_server(server)
