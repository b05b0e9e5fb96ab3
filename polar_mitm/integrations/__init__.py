"""Trainers driving polar-mitm through their own extension points, with no glue in the user's script.

- `polar_mitm.integrations.trl`: TRL's `GRPOTrainer(rollout_func=...)`.
- `polar_mitm.integrations.verl`: a verl `AgentLoop` registered as "polar_mitm".

Each runs in the trainer's environment (Python >= 3.11) and reaches polar-mitm the way `polar_mitm.client` does:
over HTTP and through the Parquet files the rollout server writes. The trainer package itself is imported only by
the module that integrates with it.
"""
