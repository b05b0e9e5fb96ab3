"""Scale-out on Ray, measured: `python -m bench.ray_bench [--quick] [--parts scheduler,nodes,union]`.

scheduler  The head's dispatch path alone at scale: `RayNodes.run_session` (head queue, admission, least-filled
           node, the durable head store's writes, the actor call and the monitor's polls) for 10,000 queued
           sessions against simulated node actors (real Ray actors whose "session" sleeps `hold` seconds and
           returns a SessionResult). Several simulated nodes share one actor process: 64 actor processes do not
           fit on 2 cores. Reports sessions/s, the head's CPU per session, the queue wait (p50/p99) and the time
           one `_dispatch` call takes.
nodes      1, 2 and 4 real gateway node actors (one per Ray node of a local ray.cluster_utils.Cluster, each a
           GatewayNode with its own gateway and store) in front of the stand-in engine (bench/stub_upstream.py);
           this process drives sessions straight at each node's gateway as harnesses do (CONNECT + TLS with
           session credentials, real Qwen Code request bodies, bench/client.py), the same number per node.
           Reports sessions/s (a session: 4 exchanges), exchanges/s, and each node actor's CPU per exchange.
union      The head's view of every node's store (store/snapshots.py, store/union.py): a node's snapshot (journal tail +
           sessions to Parquet) and one query over the union, by rows stored.

Everything runs on one machine: with 2 cores shared by the load client, the head, every node and the stub, the
numbers say what each part costs per unit of work (CPU per exchange, head CPU per session), not how a cluster of
real machines scales; bench/ray_results.md says what they can and cannot show.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import BENCH, STUB_MODEL, Service, free_port, load_requests, percentile

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # every Ray process on 127.0.0.1 (read when ray is imported)
os.environ.update(LOOPBACK_ENV)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- scheduler -----------------------------------------------------------------------------------------------


class SimulatedNode:
    """A stand-in node actor for the scheduler bench: run_session holds a slot `hold` seconds and completes."""

    def __init__(self, hold: float):
        self.hold = hold
        self.active: dict[str, float] = {}
        self.received: dict[str, float] = {}

    async def run_session(self, work: dict[str, Any]) -> dict[str, Any]:
        from polar_mitm.rollout.models import SessionResult

        session_id = work["session_id"]
        self.received[session_id] = time.time()
        self.active[session_id] = time.time()
        await asyncio.sleep(self.hold)
        del self.active[session_id]
        request = work["request"]
        return SessionResult(session_id=session_id, task_id=work["task_id"], sample_index=work["sample_index"], status="completed", harness=request["agent"]["harness"]).model_dump(mode="json")

    def load(self) -> dict[str, Any]:
        return {"active": dict.fromkeys(self.active), "finished": len(self.received) - len(self.active), "engines": []}

    def receipts(self) -> dict[str, float]:
        return self.received


async def scheduler_bench(sessions: int, nodes: int, capacity: int, hold: float, processes: int, tmp: Path) -> dict[str, Any]:
    import ray

    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.durable import DurableStore
    from polar_mitm.rollout.models import TaskRequest
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.ray import config as ray_config
    from polar_mitm.rollout.ray import nodes as ray_nodes
    from polar_mitm.rollout.session_run import SessionWork
    from polar_mitm.store import now

    actors = [ray.remote(SimulatedNode).options(num_cpus=0, max_concurrency=100_000).remote(hold) for _ in range(processes)]
    await asyncio.gather(*(a.load.remote() for a in actors))
    config = ray_config.ClusterConfig(node=NodeConfig(gateway=GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp / "sched.duckdb"))).resolved()
    head = DurableStore(Path(tempfile.mkdtemp(dir=tmp)) / "sched.head.duckdb")  # a fresh head per run
    cluster = ray_nodes.RayNodes(config, head)
    for index in range(nodes):
        name = f"sim{index:03d}"
        cluster.nodes[name] = ray_nodes.NodeHandle(name=name, ray_node_id=name, actor=actors[index % processes], info={}, capacity=capacity, db=tmp / f"{name}.duckdb")
    dispatch_seconds: list[float] = []
    original = cluster._dispatch

    def timed_dispatch() -> None:
        started = time.perf_counter()
        original()
        dispatch_seconds.append(time.perf_counter() - started)

    cluster._dispatch = timed_dispatch  # type: ignore[method-assign]
    cluster.monitor = asyncio.create_task(cluster._monitor())
    request = TaskRequest(instruction="bench", agent={"harness": "qwen"})
    works = [SessionWork(session_id=f"s{i:06d}", task_id="bench", sample_index=i, request=request) for i in range(sessions)]
    head.add_task("bench", request, [w.session_id for w in works], now())  # as submit does, before any dispatch
    cpu0, wall0 = cpu_s(), time.time()
    submitted = {w.session_id: time.time() for w in works}
    results = await asyncio.gather(*(cluster.run_session(w, lambda _: None) for w in works))
    wall, cpu = time.time() - wall0, cpu_s() - cpu0
    cluster.monitor.cancel()
    receipts: dict[str, float] = {}
    for actor in actors:
        receipts.update(await actor.receipts.remote())
    waits = [receipts[sid] - submitted[sid] for sid in submitted]
    for actor in actors:
        ray.kill(actor)
    head.close()
    assert all(r.status == "completed" for r in results)
    slots = nodes * capacity
    return {
        "sessions": sessions, "nodes": nodes, "capacity": capacity, "slots": slots, "hold_s": hold, "actor_processes": processes,
        "wall_s": round(wall, 2), "sessions_per_s": round(sessions / wall, 1), "ideal_sessions_per_s": round(slots / hold, 1) if hold else None,
        "head_cpu_ms_per_session": round(1000 * cpu / sessions, 3), "queue_wait_p50_s": round(percentile(waits, 50), 2),
        "queue_wait_p99_s": round(percentile(waits, 99), 2), "dispatch_call_p50_us": round(1e6 * percentile(dispatch_seconds, 50), 1),
        "dispatch_call_p99_us": round(1e6 * percentile(dispatch_seconds, 99), 1),
    }


def head_store_cost(n: int, tmp: Path) -> dict[str, Any]:
    """What the durable head's per-session writes cost alone (dispatched + ended)."""
    from polar_mitm.rollout.durable import DurableStore
    from polar_mitm.rollout.models import SessionResult, TaskRequest
    from polar_mitm.store import now

    head = DurableStore(tmp / "cost.head.duckdb")
    request = TaskRequest(instruction="x", agent={"harness": "qwen"})
    ids = [f"c{i}" for i in range(n)]
    head.add_task("cost", request, ids, now())
    started = time.perf_counter()
    for sid in ids:
        head.dispatched(sid, "n0")
        head.session_ended(SessionResult(session_id=sid, task_id="cost", sample_index=0, status="completed", harness="qwen"))
    seconds = time.perf_counter() - started
    head.close()
    return {"sessions": n, "ms_per_session": round(1000 * seconds / n, 3)}


# -- gateway nodes -------------------------------------------------------------------------------------------


@contextmanager
def local_cluster(n: int):
    """n Ray nodes on 127.0.0.1, each with the polar_node resource and a polar-node label."""
    from ray.cluster_utils import Cluster

    def args(name: str) -> dict[str, Any]:
        return {"num_cpus": 1, "resources": {"polar_node": 1}, "labels": {"polar-node": name}, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}

    os.environ.update(LOOPBACK_ENV)
    with raised_priority():
        cluster = Cluster(initialize_head=True, connect=False, head_node_args={**args("b0"), "include_dashboard": False})
        for index in range(1, n):
            cluster.add_node(**args(f"b{index}"))
        cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@contextmanager
def raised_priority():
    """Ray's raylet gives its node agents ~15 s to start; on a loaded 2-core machine that needs a raised priority."""
    import psutil

    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        for child in psutil.Process().children(recursive=True):
            try:
                child.nice(0)
            except psutil.Error:
                pass
        os.setpriority(os.PRIO_PROCESS, 0, 0)


async def nodes_bench(n: int, seconds: float, sessions_per_node: int, calls_per_session: int, stub_port: int, tmp: Path) -> dict[str, Any]:
    import ssl

    import psutil
    import ray

    from bench.client import Pool, Target
    from polar_mitm import session
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.durable import DurableStore
    from polar_mitm.rollout.node import NodeConfig
    from polar_mitm.rollout.ray import config as ray_config
    from polar_mitm.rollout.ray import nodes as ray_nodes

    base = tmp / f"nodes{n}"
    confdir = base / "confdir"
    gateway = GatewayConfig(upstream=f"http://127.0.0.1:{stub_port}/v1", db=base / "store.duckdb", confdir=str(confdir), engine_model=STUB_MODEL)
    with local_cluster(n) as cluster:
        ray.init(address=cluster.address, namespace="polar-mitm-bench")
        try:
            config = ray_config.ClusterConfig(node=NodeConfig(gateway=gateway)).resolved()
            nodes = ray_nodes.RayNodes(config, DurableStore(base / "head.duckdb"))
            await nodes.discover()
            if len(nodes.nodes) != n:  # a node whose actor did not start would make this a run of fewer nodes
                raise RuntimeError(f"{len(nodes.nodes)} of {n} node actors started (the head's log says why)")
            context = ssl.create_default_context(cafile=str(confdir / "mitmproxy-ca-cert.pem"))
            secret = session.load_secret(confdir)

            def credentials(index: int) -> tuple[str, str]:
                user = f"bench-{index // calls_per_session}"  # a session: `calls_per_session` exchanges
                return user, session.session_token(secret, user)

            specs = load_requests()
            handles = sorted(nodes.nodes.values(), key=lambda h: h.name)
            pools = []
            for index, handle in enumerate(handles):
                port = int(handle.info["gateway"].rsplit(":", 1)[1])
                target = Target(handle.name, port, "connect", context, provider_paths=True, credentials=credentials)
                pools.append(Pool(target, specs, sessions_per_node, stream=False, session_base=index * 100_000))
            await asyncio.gather(*(p.warm() for p in pools))
            procs = {h.name: psutil.Process(h.info["pid"]) for h in handles}
            cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            client0 = cpu_s()
            results = await asyncio.gather(*(p.run_for(seconds) for p in pools))
            cpu1 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            client_cpu = cpu_s() - client0
            load = os.getloadavg()[0]  # the machine's 1-minute load at the end: other work shares the two cores
            errors = sum(len(p.errors) for p in pools)
            for pool in pools:
                pool.close()
            per_node = {h.name: {"exchanges": done, "cpu_ms_per_exchange": round(1000 * (cpu1[h.name] - cpu0[h.name]) / max(done, 1), 2)} for h, (done, _) in zip(handles, results, strict=True)}
            exchanges = sum(done for done, _ in results)
            elapsed = max(e for _, e in results)
            await nodes.stop()
        finally:
            ray.shutdown()
    return {
        "nodes": n, "sessions_per_node": sessions_per_node, "seconds": round(elapsed, 1), "exchanges": exchanges, "errors": errors,
        "exchanges_per_s": round(exchanges / elapsed, 1), "sessions_per_s": round(exchanges / calls_per_session / elapsed, 2), "per_node": per_node,
        "client_cpu_ms_per_exchange": round(1000 * client_cpu / max(exchanges, 1), 2), "load_1m": round(load, 1),
    }


# -- union ---------------------------------------------------------------------------------------------------


def union_bench(rows_per_node: list[int], tmp: Path) -> list[dict[str, Any]]:
    """Snapshot cost and one union query over 3 stores, each filled with `rows` exchange rows through Store."""
    import random

    from polar_mitm.store import Store, UnionStore, now, pull_snapshot, read_range

    out = []
    for rows in rows_per_node:
        stores = []
        for node in range(3):
            store = Store(tmp / f"union{rows}-{node}.duckdb")
            loop = asyncio.new_event_loop()
            for i in range(rows):
                ids = [random.randrange(150000) for _ in range(2000)]
                row = {"exchange_id": f"{node}-{i}", "session_id": f"s{node}-{i // 4}", "seq": i % 4, "status": "ok", "api": "openai_chat", "action": "generate",
                       "prompt_token_ids": ids, "completion_token_ids": ids[:100], "completion_logprobs": [-0.5] * 100, "started_at": now(), "ended_at": now()}
                loop.run_until_complete(store.commit_exchange(row))
            loop.close()
            stores.append(store)
        started = time.perf_counter()
        snaps = [s.snapshot(f"n{k}") for k, s in enumerate(stores)]
        snapshot_s = time.perf_counter() - started
        union = UnionStore(snaps)
        started = time.perf_counter()
        _, result = union.query("SELECT node, count(*), sum(len(prompt_token_ids)) FROM exchanges GROUP BY node ORDER BY node")
        query_s = time.perf_counter() - started
        union.close()
        # a head without the nodes' disk: node 0's files pulled into a mirror (the copy alone, no network), then
        # a refresh after one more row (its segments are in the mirror already: only the tail and sessions move)
        store = stores[0]

        async def read(path: str, offset: int, length: int, db: Path = store.path) -> bytes:
            return read_range(db, path, offset, length)

        mirror = tmp / f"mirror{rows}"
        started = time.perf_counter()
        first = asyncio.run(pull_snapshot(snaps[0], mirror, read, "pull"))
        pull_first_s = time.perf_counter() - started
        loop = asyncio.new_event_loop()
        loop.run_until_complete(store.commit_exchange({**row, "exchange_id": f"0-{rows}", "started_at": now(), "ended_at": now()}))
        loop.close()
        started = time.perf_counter()
        refresh = asyncio.run(pull_snapshot(store.snapshot("n0"), mirror, read, "pull"))
        pull_refresh_s = time.perf_counter() - started
        for store in stores:
            store.close()
        assert [r[1] for r in result] == [rows] * 3
        out.append({
            "rows_per_node": rows, "snapshot_ms_per_node": round(1000 * snapshot_s / 3, 1), "parquet_files_per_node": [len(s.exchanges) for s in snaps], "union_query_ms": round(1000 * query_s, 1),
            "pull_first_ms": round(1000 * pull_first_s, 1), "pull_first_mb": round(first.pulled_bytes / 2**20, 2),
            "refresh_with_pull_ms": round(1000 * pull_refresh_s, 1), "refresh_pulled_mb": round(refresh.pulled_bytes / 2**20, 3),
        })
    return out


# -- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="scheduler,union,nodes")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="polar-ray-bench-"))
    report: dict[str, Any] = {}
    if "union" in parts:
        report["union"] = union_bench([100, 1000] if args.quick else [100, 1000, 4000], tmp)
        print("union", report["union"], flush=True)
    if "scheduler" in parts:
        import ray

        report["head_store"] = head_store_cost(500 if args.quick else 2000, tmp)
        print("head_store", report["head_store"], flush=True)
        os.environ.update(LOOPBACK_ENV)
        with raised_priority():
            ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="polar-mitm-bench")
        try:
            runs = [(2000, 16, 4, 0.0, 4)] if args.quick else [(10_000, 64, 4, 0.0, 8), (10_000, 64, 4, 0.5, 8)]
            report["scheduler"] = [asyncio.run(scheduler_bench(s, n, c, h, p, tmp)) for s, n, c, h, p in runs]
        finally:
            ray.shutdown()
        print("scheduler", report["scheduler"], flush=True)
    if "nodes" in parts:
        stub_port = free_port()
        stub = Service("stub", stub_port, [os.sys.executable, str(BENCH / "stub_upstream.py"), "--port", str(stub_port), "--delay-ms", "25"], tmp / "stub.log").start()
        try:
            stub.wait(30)
            seconds = 6.0 if args.quick else 15.0
            report["nodes"] = [asyncio.run(nodes_bench(n, seconds, 8, 4, stub_port, tmp)) for n in (1, 2, 4)]
        finally:
            stub.stop()
        print("nodes", report["nodes"], flush=True)
    import json

    (tmp / "ray_bench.json").write_text(json.dumps(report, indent=2))
    print(f"results: {tmp / 'ray_bench.json'}")


if __name__ == "__main__":
    main()
