"""The rollout server: a trainer submits a task (instruction, N samples, harness, sandbox, evaluator) and gets
back N evaluated, token-faithful trajectories.

    models.py     TaskRequest / SessionResult / TaskResult (the HTTP and callback boundary)
    server.py     the FastAPI service; client.py: its client (`polar-mitm rollout`: polar_mitm/cli/rollout.py)
    scheduler.py  tasks -> sessions -> stages (limits, timeouts, cancellation), the `Node` interface
    node.py       the gateway node: in-process gateway + store, sandboxes, assembly; one per machine
    runtimes/     local (temp workspace + private HOME) and docker sandboxes; relay.py links them to the gateway
    evaluation.py rewards; callbacks.py: results POSTed with retries and delivery ids
"""
