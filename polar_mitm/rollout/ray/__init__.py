"""The rollout server scaled out on Ray: one gateway node actor per Ray node, the head dispatching sessions to them.

    config.py      ClusterConfig, the names nodes and head agree on (resource, label, namespace)
    actor.py       NodeActor: a GatewayNode on one Ray node
    nodes.py       the head's node handles: membership, dispatch, failure, control fan-out
    data.py        the head's reads of every node's store: snapshots, catalog, task export, SQL
    head.py        RolloutCluster (the Backend of `rollout serve --ray`, the trainer's entry point) over the
                   durable scheduler of ../durable.py

Ray itself is imported only inside functions of this package, when a cluster starts: importing it (or the rollout
server) imports no Ray module.
"""

from polar_mitm.rollout.ray.config import ClusterConfig
from polar_mitm.rollout.ray.head import RolloutCluster

__all__ = ["ClusterConfig", "RolloutCluster"]
