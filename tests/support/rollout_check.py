"""The rollout tests' evaluator, uploaded into each sandbox and run there after the harness.

The steered agent writes its own session id (`$POLAR_MITM_SESSION`, set for the harness and inherited by its
shell tool) into answer.txt. The reward is the sample index in that id (`<task>-<index>-<suffix>`) over 2, so
the three samples of a task score 0.0, 0.5 and 1.0 and each reward can be traced to what this script read.
It also reports what the sandbox looks like from inside: the prepare step's file, whether the engine's port
is reachable directly (it must not be from a docker sandbox), and the memory limit.
"""

import json
import os
import socket
from pathlib import Path


def engine_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", int(os.environ["ENGINE_PORT"])), timeout=3):
            return True
    except OSError:
        return False


def memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None
    return None


answer = Path("answer.txt")
content = answer.read_text().strip() if answer.exists() else None
seed = Path("data/seed.txt")
try:
    reward = int(content.split("-")[-2]) / 2 if content else 0.0
except ValueError:
    reward = 0.0
print("evaluating", flush=True)
print(json.dumps({
    "reward": reward,
    "content": content,
    "seed": seed.read_text().strip() if seed.exists() else None,
    "engine_reachable": engine_reachable(),
    "memory_limit": memory_limit(),
}))
