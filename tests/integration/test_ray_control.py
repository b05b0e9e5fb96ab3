"""The Ray head's /control/* across nodes (issue 25: it read a gateway URL the cluster does not have, so a trainer
could not pause or resume the nodes' gateways for a weight sync). On the real local 3-node Ray cluster of
test_ray.py: `polar-mitm rollout serve --ray`, three real Qwen Code sessions, one per node, each node's first model
call held in flight at a relay in front of the real engine (tests/support/gated_engine.py) while the trainer calls
pause(drain) on the head; then resume with a new policy version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_mitm.local_engine.steering import has_tool_result, shell_tool
from tests.support.gated_engine import GatedEngineRelay
from tests.support.ray_runs import (
    NODES,
    end_sessions_left,
    sleeping_task,
    sql,
    start_server,
    stop_server,
    wait_for,
    wait_task,
)
from tests.support.rollout_runs import TASK_WAIT, RolloutServer

pytestmark = [pytest.mark.harness, pytest.mark.engine]

ray = pytest.importorskip("ray")


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
