"""A Ray worker node for tests/integration/test_ray_pull.py, run inside `unshare --mount` after a private tmpfs is
mounted over the stores' folder, so nothing it writes there is visible to the head.

Started the way ray.cluster_utils starts its worker nodes (`ray start` cannot join a loopback-only cluster: it
swaps 127.0.0.1 for the machine's outward address). Usage: python private_disk_node.py GCS_ADDRESS NODE_NAME.
SIGTERM stops the node's Ray processes.
"""

from __future__ import annotations

import signal
import sys

from ray._private.node import Node
from ray._private.parameter import RayParams


def main() -> None:
    gcs_address, name = sys.argv[1], sys.argv[2]
    params = RayParams(
        gcs_address=gcs_address, node_ip_address="127.0.0.1", num_cpus=1, num_gpus=0, resources={"polar_node": 1}, labels={"polar-node": name},
        object_store_memory=80 * 2**20, min_worker_port=0, max_worker_port=0, include_log_monitor=False, node_manager_port=0,
    )
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(f"node {name} up: {node.node_id}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    node.kill_all_processes(check_alive=False, allow_graceful=False)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
