"""Where trainers import the Ray scale-out from: `RolloutCluster` and `ClusterConfig` (polar_mitm/rollout/ray/)."""

from polar_mitm.rollout.ray import ClusterConfig, RolloutCluster

__all__ = ["ClusterConfig", "RolloutCluster"]
