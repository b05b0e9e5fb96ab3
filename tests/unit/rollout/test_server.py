"""The rollout server's HTTP API over its local backend (polar_mitm/rollout/server.py, backend.py): a real
GatewayNode (in-process mitmproxy gateway, DuckDB store) in front of a stand-in engine that can be stopped.

The control routes reach the node's real gateway; /nodes and /sql, which only a multi-node backend has, answer
404 saying why; /health reports whether the gateway's engine answers (issue 31: it said "ok" while the engine was
down and sessions timed out for it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.rollout import node as node_module
from polar_mitm.rollout.node import NodeConfig
from polar_mitm.rollout.server import LocalBackend, create_app
from tests.support.upstream_standins import RecordingVLLMStandin


def wait_for_health(client: TestClient, wanted: bool, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = client.get("/health").json()
        if health["engine_reachable"] is wanted or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def test_the_local_backend_serves_control_health_and_says_why_it_has_no_nodes_or_sql(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_module, "ENGINE_PROBE_SECONDS", 0.2)
    engine = RecordingVLLMStandin()
    db = tmp_path / "store.duckdb"
    config = NodeConfig(gateway=GatewayConfig(upstream=engine.url, engine_model="standin", db=db, confdir=str(tmp_path / "confdir")))
    try:
        with TestClient(create_app(LocalBackend(config))) as client:
            health = client.get("/health").json()
            assert health["status"] == "ok" and health["engine_reachable"] is True, health
            assert health["engines"] == [{"url": engine.url, "reachable": True, "error": None}]
            gateway = health["gateway"]

            # the engine goes away: /health says so (and why) within a probe or two
            engine.stop()
            health = wait_for_health(client, False)
            assert health["engine_reachable"] is False and health["status"] == "degraded", health
            assert health["engines"][0]["url"] == engine.url and health["engines"][0]["error"].startswith(("ConnectError", "ReadError")), health

            # control reaches the node's own gateway, keyed by its URL; a refusal keeps the gateway's status code
            status = client.get("/control/status")
            assert status.status_code == 200 and status.json()["nodes"][gateway]["state"] == "serving", status.text
            paused = client.post("/control/pause", json={"mode": "drain", "timeout_seconds": 30})
            assert paused.status_code == 200 and paused.json()["nodes"][gateway]["state"] == "paused", paused.text
            again = client.post("/control/pause", json={})
            assert again.status_code == 409 and again.json()["node"] == gateway and gateway in again.json()["refused"], again.text
            resumed = client.post("/control/resume", json={"policy_version": 3})
            assert resumed.status_code == 200 and resumed.json()["nodes"][gateway]["policy_version"] == 3, resumed.text

            # what only a multi-node (Ray) backend has: 404, saying why and what to use instead
            for response in (client.get("/nodes"), client.delete("/nodes/n0"), client.post("/nodes/n0/engines/take-out", json={"url": engine.url})):
                assert response.status_code == 404 and "without --ray" in response.json()["message"], response.text
            sql = client.get("/sql", params={"q": "SELECT 1"})
            assert sql.status_code == 404 and f"polar-mitm sql --db {db}" in sql.json()["message"], sql.text
    finally:
        engine.stop()
