"""The head's dispatch queue (polar_mitm/rollout/ray/nodes.py) without a cluster: admission per node, the least
filled node first, `dispatch_priority` ordering, a draining node skipped. Nodes are NodeHandles without an actor:
admission never calls one, so what is tested is the head's own code, as it runs under `rollout serve --ray`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.rollout.durable import DurableStore
from polar_mitm.rollout.models import TaskRequest
from polar_mitm.rollout.node import NodeConfig
from polar_mitm.rollout.ray.config import ClusterConfig
from polar_mitm.rollout.ray.nodes import NodeHandle, RayNodes
from polar_mitm.rollout.session_run import SessionWork


def work(session_id: str, priority: int) -> SessionWork:
    request = TaskRequest(instruction="x", agent={"harness": "qwen"}, dispatch_priority=priority)
    return SessionWork(session_id=session_id, task_id="t", sample_index=0, request=request)


def nodes_of(tmp_path: Path, *capacities: int) -> RayNodes:
    config = ClusterConfig(node=NodeConfig(gateway=GatewayConfig(upstream="http://127.0.0.1:1/v1", db=tmp_path / "s.duckdb"))).resolved()
    nodes = RayNodes(config, DurableStore(tmp_path / "head.duckdb"))
    for index, capacity in enumerate(capacities):
        nodes.nodes[f"n{index}"] = NodeHandle(name=f"n{index}", ray_node_id=str(index), actor=None, info={}, capacity=capacity, db=tmp_path / f"n{index}.duckdb")
    return nodes


def test_admission_spreads_then_queues_by_priority(tmp_path: Path) -> None:
    async def main() -> None:
        nodes = nodes_of(tmp_path, 2, 2)
        first = [asyncio.create_task(nodes._admit(work(f"a{i}", 0))) for i in range(4)]
        placed = [(await t).name for t in first]
        assert sorted(placed) == ["n0", "n0", "n1", "n1"] and placed[:2] == ["n0", "n1"]  # the least filled node first
        low = [asyncio.create_task(nodes._admit(work(f"low{i}", 10))) for i in range(2)]
        high = asyncio.create_task(nodes._admit(work("high", 90)))
        await asyncio.sleep(0)
        assert not any(t.done() for t in [*low, high])  # every slot taken: they wait in the head queue
        assert nodes.status()["queue"] == {"sessions": 3, "priorities": [90, 10]}
        nodes.nodes["n1"].active.discard("a1")
        nodes._dispatch()
        await asyncio.sleep(0)
        assert high.done() and (await high).name == "n1" and not any(t.done() for t in low)  # priority, not arrival
        nodes.drain("n0")
        nodes.nodes["n0"].active.clear()
        nodes._dispatch()
        await asyncio.sleep(0)
        assert not any(t.done() for t in low)  # a draining node takes nothing new
        nodes.nodes["n1"].active.clear()
        nodes._dispatch()
        assert [(await t).name for t in low] == ["n1", "n1"]  # arrival order within a priority

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue(tmp_path: Path) -> None:
    async def main() -> None:
        nodes = nodes_of(tmp_path, 1)
        assert (await nodes._admit(work("a", 0))).name == "n0"
        waiting = asyncio.create_task(nodes._admit(work("b", 0)))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        nodes.nodes["n0"].active.clear()
        nodes._dispatch()
        assert nodes.nodes["n0"].active == set() and nodes.status()["queue"]["sessions"] == 0

    asyncio.run(main())


def test_repeated_upstreams_and_ray_flags_reach_the_cluster_config(tmp_path: Path) -> None:
    from polar_mitm.cli import build_parser
    from polar_mitm.cli import rollout as rollout_cli
    from polar_mitm.engines import make_engine
    from polar_mitm.engines.pool import EngineRouter

    argv = ["rollout", "serve", "--upstream", "http://127.0.0.1:9/v1", "--upstream", "http://127.0.0.1:10/v1", "--db", str(tmp_path / "s.duckdb"), "--ray", "127.0.0.1:6379"]
    args = build_parser().parse_args(argv)
    node = rollout_cli._node_config(args)
    assert node.gateway.upstream == "http://127.0.0.1:9/v1,http://127.0.0.1:10/v1" and args.ray == "127.0.0.1:6379"
    router = make_engine("vllm", node.gateway.upstream)
    assert isinstance(router, EngineRouter) and [r["url"] for r in router.status()] == ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]
    config = ClusterConfig(address=args.ray, node=node).resolved()
    assert config.head_db == tmp_path / "s.head.duckdb" and config.output_dir == tmp_path / "s.head"
    assert build_parser().parse_args(["rollout", "serve", "--upstream", "http://x/v1", "--ray"]).ray == "auto"
    single = rollout_cli._node_config(build_parser().parse_args(["rollout", "serve", "--upstream", "http://127.0.0.1:9/v1"]))
    assert single.gateway.upstream == "http://127.0.0.1:9/v1" and not isinstance(make_engine("vllm", single.gateway.upstream), EngineRouter)
