"""Fixtures shared by the integration tests (the session-wide engine and gateways are in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from polar_mitm import harnesses
from tests.support.harness_runs import INSTALL
from tests.support.ray_runs import LOOPBACK_ENV, NODES, start_ray_node
from tests.support.rollout_runs import REPO, Receiver


@pytest.fixture(scope="module")
def installed() -> float:
    """Run the install recipe (idempotent; fetches Node 22 and the pinned harnesses from the npm registry)."""
    started = time.monotonic()
    try:
        result = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{INSTALL.name} did not finish within 20 minutes")
    if result.returncode != 0:
        pytest.skip(f"{INSTALL.name} failed (exit {result.returncode}); the harnesses cannot be installed here:\n{result.stderr[-2000:]}")
    elapsed = time.monotonic() - started
    print(f"\nharness install: {elapsed:.1f}s")
    return elapsed


@pytest.fixture(scope="module")
def harness_installed() -> None:
    install = REPO / "sandboxes" / "harnesses" / "install.sh"
    result = subprocess.run([str(install)], capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        pytest.skip(f"{install.name} failed (exit {result.returncode}); the harnesses cannot be installed here:\n{result.stderr[-2000:]}")
    try:
        harnesses.get("qwen").executable()
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kwargs: Any) -> Receiver:
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="module")
def ray_cluster():
    """Head n0 + workers n1, n2; one CPU each (the node actors take none). Loopback only: with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 every Ray process (and the server's driver) takes 127.0.0.1 as its address
    instead of the machine's outward one."""
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)

    def node_args(name: str) -> dict[str, Any]:
        return {"num_cpus": 1, "resources": {"polar_node": 1}, "labels": {"polar-node": name}, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}

    cluster = start_ray_node(lambda: Cluster(initialize_head=True, connect=False, head_node_args={**node_args("n0"), "include_dashboard": False}))
    try:
        workers = {name: start_ray_node(lambda name=name: cluster.add_node(**node_args(name))) for name in NODES[1:]}
        cluster.wait_for_nodes()
        cluster.workers = workers  # type: ignore[attr-defined]
        cluster.node_args = node_args  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.shutdown()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
