"""Stores made the way users make them: `--db` given as a RELATIVE path, in a working directory of their own.

- `readme_store`: the README's main job, `polar-mitm rollout run examples/hello-task.yaml --db hello.duckdb
  --engine-hook examples/steer_tiny_model.py:steer` (three Qwen Code samples, evaluated, assembled).
- `run_store`: `polar-mitm gateway --db run.duckdb` and two `polar-mitm run` sessions of a small multi-turn
  program using the official `openai` SDK: a store without any rollout task.

Both run the `polar-mitm` console script, as a user would; the gateway has stopped when they return (so the
exchanges are in segments, which schema 2 kept as Parquet files beside the store: the case that broke when the store
was read from another directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm import harnesses
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway

REPO = Path(__file__).resolve().parents[2]
POLAR_MITM = str(Path(sys.executable).parent / "polar-mitm")  # the console script of this environment
# what a user's shell would not have: nothing may point past the proxy
STRIPPED = {*harnesses.BASE_URL_VARIABLES, "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"}

# a multi-turn conversation through the proxy with the official SDK (no base URL: api.openai.com via HTTPS_PROXY)
CHAT = """
import sys, openai
client = openai.OpenAI()
messages = [{"role": "user", "content": "Say hello."}]
for turn in range(int(sys.argv[1])):
    reply = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}, {"role": "user", "content": f"Again ({turn + 1})."}]
"""


def user_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in STRIPPED} | extra


def polar_mitm(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the console script in `cwd`; a non-zero exit is the caller's to check."""
    return subprocess.run([POLAR_MITM, *args], cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


@dataclass
class UserStore:
    db: Path  # absolute; the store was made with --db relative to db.parent
    sessions: dict[str, int]  # session id -> exchanges
    tasks: list[str] = field(default_factory=list)
    live_sql: str = ""  # `polar-mitm sql` from another directory while the gateway held the store (run_store)


def build_readme_store(engine_url: str, base: Path) -> UserStore:
    harnesses.get("qwen").executable()  # HarnessNotInstalled: the caller skips
    folder = base / "readme"
    folder.mkdir()
    done = polar_mitm(
        "rollout", "run", str(REPO / "examples" / "hello-task.yaml"), "--db", "hello.duckdb", "--upstream", engine_url,
        "--confdir", str(base / "confdir"), "--engine-hook", f"{REPO / 'examples' / 'steer_tiny_model.py'}:steer",
        cwd=folder, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "3/3 sessions done" in done.stderr, done.stderr[-3000:]
    sessions = {line.split()[0]: int(line.split()[3]) for line in done.stdout.splitlines()[1:4]}
    return UserStore(db=folder / "hello.duckdb", sessions=sessions, tasks=["hello"])


def build_run_store(engine_url: str, base: Path) -> UserStore:
    folder, elsewhere = base / "runs", base / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    gateway = Gateway(port=free_port(), db=folder / "run.duckdb", confdir=base / "confdir", upstream=engine_url, cwd=folder).start()
    sessions = {"plain-three-turns": 3, "plain-two-turns": 2}
    try:
        for session_id, turns in sessions.items():
            done = subprocess.run(
                [POLAR_MITM, "run", "--gateway", gateway.proxy_url(), "--confdir", str(gateway.confdir), "--session", session_id, "--", sys.executable, "-c", CHAT, str(turns)],
                cwd=folder, env=user_env(OPENAI_API_KEY="sk-test"), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
            )
            assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        live = polar_mitm("sql", "--db", os.path.relpath(gateway.db, elsewhere), "SELECT session_id, count(*) AS n FROM exchanges GROUP BY ALL ORDER BY ALL", cwd=elsewhere)
        assert live.returncode == 0, live.stderr
    finally:
        gateway.stop()
    return UserStore(db=gateway.db, sessions=sessions, live_sql=live.stdout)
