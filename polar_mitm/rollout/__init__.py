"""The rollout server: a trainer submits a task (instruction, N samples, harness, sandbox, evaluator) and gets
back N evaluated, token-faithful trajectories.

    models.py       TaskRequest / SessionResult / TaskResult (the HTTP and callback boundary)
    server.py       the FastAPI service over a Backend (backend.py); LocalBackend: one gateway node
    scheduler.py    the head side: tasks -> sessions on a `Node`, task export, callbacks (callbacks.py)
    session_run.py  the node side: one session through its stages (limits, timeouts, cancellation)
    node.py         the gateway node: in-process gateway + store, sandboxes, assembly; one per machine
    runtimes/       local (temp workspace + private HOME) and docker sandboxes; relay.py links them to the gateway
    evaluation.py   rewards
    ray/            scale-out: a gateway node per Ray node, the head, its durable store (ray_cluster.py: re-export)
    console.py      what `polar-mitm rollout submit|run` prints around the API client
"""
