"""A Ray worker node whose disk the head cannot see: its store reaches SQL and the trajectories by being pulled.

Cluster: the head n0 (ray.cluster_utils, with the `polar_node` resource) and a worker n1 started with `ray start`
inside a mount namespace of its own (`unshare --mount`), where a private tmpfs is mounted over the folder that
holds the stores. n1's gateway node writes `store.n1.duckdb` there; on the head's side of the mount that folder
holds no such file, as on two machines without a shared file system. The rollout server runs with the default
`--node-data auto`: n0's files are read in place, n1's are pulled through its node actor into the head's mirror.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from tests.support.matrix import long_case
from tests.support.ray_runs import (
    LOOPBACK_ENV,
    ray_startup_priority,
    sql,
    start_ray_node,
    start_server,
    stop_server,
    wait_for,
    wait_task,
)
from tests.support.rollout_runs import TASK_WAIT, coding_task

pytestmark = [pytest.mark.harness, pytest.mark.engine]

ray = pytest.importorskip("ray")
NODES = ("n0", "n1")
PRIVATE_NODE = Path(__file__).parents[1] / "support" / "private_disk_node.py"


@pytest.fixture(scope="module")
def split_disk_cluster(tmp_path_factory):
    """(cluster, the stores' folder, the private worker's process); everything is stopped afterwards."""
    from ray.cluster_utils import Cluster

    base = tmp_path_factory.mktemp("split-disk")
    saved = {name: os.environ.get(name) for name in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    head_args = {"num_cpus": 1, "resources": {"polar_node": 1}, "labels": {"polar-node": "n0"}, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20, "include_dashboard": False}
    cluster = start_ray_node(lambda: Cluster(initialize_head=True, connect=False, head_node_args=head_args))
    worker = None
    try:
        script = 'mount -t tmpfs polar-n1-disk "$0" && exec "$1" "$2" "$3" n1'
        log = (base.parent / "n1-ray.log").open("ab")
        with ray_startup_priority():
            worker = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(base), sys.executable, str(PRIVATE_NODE), cluster.address],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        wait_for(lambda: len([n for n in ray_nodes(cluster.address) if n["Alive"]]) == 2, 180, "n1 to join the cluster", interval=2)
        yield cluster, base, worker
    finally:
        if worker is not None:
            stop_worker(worker)
        cluster.shutdown()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def ray_nodes(address: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-c", f"import ray, json; ray.init(address={address!r}, logging_level='error'); print(json.dumps(ray.nodes()))"], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


def stop_worker(worker: subprocess.Popen) -> None:
    """The node's Ray processes, ended without grace (as a machine that goes away), and whatever they left."""
    left = _children(worker.pid)
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
    for process in left:
        with suppress(psutil.Error):
            process.kill()


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@long_case  # ~3 min with its own cluster; SQL over every node's store: test_ray.py's six-session test
def test_a_node_on_a_disk_the_head_cannot_see_is_pulled_into_sql_and_trajectories(split_disk_cluster, engine_url: str, harness_installed: None) -> None:
    cluster, base, worker = split_disk_cluster
    server = start_server(cluster, engine_url, base, db=base / "store.duckdb", nodes=NODES)
    try:
        accepted = server.submit(coding_task("pull-two", engine_url, "local", 2))
        result = wait_task(server, accepted["task_id"], TASK_WAIT)
        sessions = {s["session_id"]: s for s in result["sessions"]}
        assert result["counts"] == {"completed": 2}, json.dumps(result)[:4000]
        assert {s["node"] for s in sessions.values()} == set(NODES)  # one prepare/run slot per node: one each

        # the head's side of the folder: n0's store, and no file of n1's
        assert (base / "store.n0.duckdb").exists()
        assert not list(base.glob("store.n1.duckdb*")), sorted(p.name for p in base.iterdir())

        rows = sql(server, f"SELECT node, session_id, count(*) AS n FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%' GROUP BY ALL")
        assert {(r["node"], r["session_id"]) for r in rows} == {(s["node"], sid) for sid, s in sessions.items()}
        assert all(r["n"] == 2 for r in rows)
        stored = sql(server, f"SELECT session_id, status, node FROM sessions WHERE task_id = '{accepted['task_id']}'")
        assert {r["session_id"]: (r["status"], r["node"]) for r in stored} == {sid: ("completed", s["node"]) for sid, s in sessions.items()}

        # n1's files came into the head's mirror; n0's were read in place
        mirror = base / "store.head" / "nodes"
        assert any((mirror / "n1").glob("*.parquet")), list(mirror.rglob("*"))
        assert not any((mirror / "n0").glob("*.parquet"))

        # the trajectories, assembled by the head over both nodes
        table = pq.read_table(result["trajectories"]).to_pylist()
        assert {r["session_id"] for r in table} == set(sessions)
        assert sorted(result["trajectory_stats"]["nodes"]) == list(NODES)

        # n1 goes away: what the head last pulled of it still answers
        stop_worker(worker)
        wait_for(lambda: not {n["name"]: n for n in server.client.get("/nodes").json()["nodes"]}["n1"]["alive"], 120, "the head to see n1 gone")
        after = sql(server, f"SELECT node, count(*) AS n FROM exchanges WHERE session_id LIKE '{accepted['task_id']}-%' GROUP BY ALL")
        assert {r["node"]: r["n"] for r in after} == {"n0": 2, "n1": 2}
        assert "cannot read node n1's store" in server.log.read_text()
    finally:
        stop_server(server)
