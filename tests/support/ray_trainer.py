"""A trainer's driver on a Ray cluster, as tests/integration/test_ray.py runs it: its own process, `ray.init` on the
cluster's address in its own namespace, then the rollout head in-process through the Python entry point
(`RolloutCluster`), with no HTTP server. It writes what the trainer saw as JSON for the test to check.

    python tests/support/ray_trainer.py ADDRESS CONFIG_JSON SCENARIO TASKS_JSON OUT_JSON

CONFIG_JSON: a ClusterConfig. TASKS_JSON: a list of TaskRequests. SCENARIO:
  run       submit the one task, wait for it, query the cluster's SQL for its exchanges per node and session
  priority  drain every node but the first, submit the tasks in order (each waits in the head queue once the
            open node's slots are full), note the head queue, wait for every task
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import ray

from polar_mitm.rollout.models import TaskRequest
from polar_mitm.rollout.ray.config import NAMESPACE
from polar_mitm.rollout.ray_cluster import ClusterConfig, RolloutCluster


async def run(cluster: RolloutCluster, tasks: list[TaskRequest]) -> dict[str, Any]:
    accepted = await cluster.submit(tasks[0])
    result = await cluster.wait(accepted.task_id)
    _, rows = await cluster.query(f"SELECT node, session_id, count(*) FROM exchanges WHERE session_id LIKE '{accepted.task_id}-%' GROUP BY ALL")
    return {"accepted": [accepted.model_dump(mode="json")], "results": [result.model_dump(mode="json")], "now": cluster.task(accepted.task_id).model_dump(mode="json"),
            "rows": [list(r) for r in rows]}


async def priority(cluster: RolloutCluster, tasks: list[TaskRequest]) -> dict[str, Any]:
    first, *others = sorted(node["name"] for node in cluster.status()["nodes"])
    for name in others:
        cluster.drain(name)
    accepted = [await cluster.submit(task) for task in tasks]
    await asyncio.sleep(1.0)  # every session of every task has reached the head (dispatched, or in its queue)
    queue = cluster.status()["queue"]
    results = [await cluster.wait(task.task_id) for task in accepted]
    return {"open_node": first, "accepted": [a.model_dump(mode="json") for a in accepted], "queue": queue, "results": [r.model_dump(mode="json") for r in results]}


SCENARIOS = {"run": run, "priority": priority}


def actors_left(names: list[str]) -> list[str]:
    left = []
    for name in names:
        try:
            ray.get_actor(f"polar-node-{name}", namespace=NAMESPACE)
        except ValueError:
            continue
        left.append(name)
    return left


def main(address: str, config: str, scenario: str, tasks: str, out: str) -> None:
    ray.init(address=address, namespace="trainer-job", logging_level=logging.WARNING)
    cluster_config = ClusterConfig.model_validate_json(config)
    requests = [TaskRequest.model_validate(t) for t in json.loads(tasks)]

    async def trainer() -> dict[str, Any]:
        async with RolloutCluster(cluster_config) as cluster:
            nodes = cluster.status()["nodes"]
            report = {"health": cluster.health(), "nodes": nodes, **await SCENARIOS[scenario](cluster, requests)}
        return report

    report = asyncio.run(trainer())
    # after the block: the node actors are stopped, the trainer's own Ray connection is still up
    report["actors_left"] = actors_left([n["name"] for n in report["nodes"]])
    report["ray_connected"] = ray.is_initialized()
    Path(out).write_text(json.dumps(report))
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
