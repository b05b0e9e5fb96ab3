"""README's "Use it" block, its Ray-on-one-machine block and docs/debugging.md's SQL block, run byte for byte.

Each command line goes to bash exactly as printed (its `# ...` comment too: bash drops it), one `bash -c` per line as a
user types them, in a fresh folder outside the checkout (tmp_path), with what a user who ran `source .venv/bin/activate`
has: the venv's bin first on PATH, VIRTUAL_ENV, no PYTHONPATH, nothing pointing past the proxy. HOME is fresh too (the
default confdir `~/.mitmproxy` is this test's own), so POLAR_MITM_HOME keeps the engine and the pinned harnesses where
setup put them, as a user's unmoved HOME would. A line that keeps serving (a gateway, a rollout server) runs in the
background until the lines after it are done, as in a second terminal. The blocks name fixed ports (8080, 8070, Ray's
6379): a test whose port is taken on this machine is skipped, saying which.

The Ray block runs a real `ray start --head`, whose processes the test ends itself, by pid (the README's `ray stop`
would end every Ray process of this user on the machine). Its RAY_TMPDIR is the test's own, so `--ray auto` finds
this cluster. It is skipped while another Ray cluster runs on the machine (Ray's `auto` discovery falls back to any
live GCS, in both directions); one started while it runs can still slow or break its start on a small machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from polar_mitm.local_engine.build import engine_home
from polar_mitm.store import query
from tests.support.user_stores import STRIPPED

if TYPE_CHECKING:
    import psutil

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: polar-mitm, ray
README_ENGINE = "http://127.0.0.1:8011/v1"
RUN_BUDGET_S = 60  # the README's "Use it" must finish in under a minute on the bundled engine


def code_block(document: Path, after: str) -> list[str]:
    """The command lines of the first ``` block after the line `after`, as printed.

    Blank lines and whole-line comments are left out (bash would do nothing with them); a line continued with a
    trailing backslash is joined to the next, as bash reads it."""
    text = document.read_text()
    block = re.search(r"```\n(.*?)```", text[text.index(after):], re.DOTALL)
    assert block, f"no code block after {after!r} in {document}"
    joined = block.group(1).replace("\\\n", "")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {*STRIPPED, "PYTHONPATH", "POLAR_MITM_GATEWAY", "RAY_ADDRESS"}}
    env.update(HOME=str(home), POLAR_MITM_HOME=str(engine_home()), VIRTUAL_ENV=str(BIN.parent), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env | extra


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def shell(line: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`line` run to its end, which must be exit 0 within `timeout`; past it, its process group is stopped and the
    test fails."""
    process = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process, grace=20)  # SIGTERM first: `polar-mitm run` then stops its harness and removes its HOME
        stdout, stderr = process.communicate()
        raise AssertionError(f"still running after {timeout:.0f}s: {line}\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    assert process.returncode == 0, f"{line}\nexit {process.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@contextmanager
def serving(line: str, cwd: Path, env: dict[str, str], logs: Path) -> Iterator[subprocess.Popen]:
    """`line` running in the background (its own process group; output to `logs`.out/.err, files, so a chatty server
    never blocks on a full pipe), stopped with SIGTERM at the end."""
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        process = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, start_new_session=True)
    try:
        yield process
    finally:
        stop_group(process, grace=60)


def stop_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process's group (what is left of it), SIGKILL after `grace` seconds."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def first_line(process: subprocess.Popen, logs: Path, timeout: float = 120) -> str:
    """The first line the background process printed to stdout (its stderr's tail if it exited first)."""
    deadline = time.monotonic() + timeout
    while "\n" not in (printed := Path(f"{logs}.out").read_text()):
        assert process.poll() is None, f"exited {process.returncode}: {Path(f'{logs}.err').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"printed nothing in {timeout:.0f}s: {Path(f'{logs}.err').read_text()[-3000:]}"
        time.sleep(0.2)
    return printed.splitlines()[0]


def test_the_readme_use_it_commands_run_as_printed(tmp_path: Path, engine_url: str) -> None:
    if engine_url != README_ENGINE:
        pytest.skip(f"the README's commands name the local engine at {README_ENGINE}")
    if port_taken(8080):
        pytest.skip("the README's gateway line listens on 127.0.0.1:8080, which another process holds")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = user_env(home)
    engine, gateway_line, run_line, sql_line, assemble_line = code_block(REPO / "README.md", "## Use it")
    assert "--harness qwen" in run_line and run_line.endswith('-- qwen --yolo "fix the tests"')

    assert README_ENGINE in shell(engine, work, env).stdout  # reuses the live engine
    with serving(gateway_line, work, env, tmp_path / "gateway") as gateway:
        started = first_line(gateway, tmp_path / "gateway")
        assert f"listening on http://127.0.0.1:8080, store {work / 'rollouts.duckdb'}, engine vllm {README_ENGINE} serving 'qwen3-tiny'" in started, started
        began = time.monotonic()
        ran = shell(run_line, work, env, timeout=RUN_BUDGET_S)
        print(f"the README's run line took {time.monotonic() - began:.1f}s")
        assert "polar-mitm run: session s1 via gateway" in ran.stderr
        rows = shell(sql_line, work, env).stdout
        assert "s1" in rows and "openai_chat" in rows
        assembled = shell(assemble_line, work, env)
        assert "wrote" in assembled.stdout and str(work / "train.parquet") in assembled.stdout  # absolute: readable from anywhere
        assert "loaded into table trajectories" in assembled.stdout and "through the writer of the gateway" in assembled.stdout
        # docs/debugging.md's SQL, against the live store: the views over trajectories work while the gateway runs
        for line in code_block(REPO / "docs" / "debugging.md", "## SQL"):
            shell(line, work, env)
        by_class = shell('polar-mitm sql --db rollouts.duckdb --json "SELECT count(*) AS n FROM trajectories WHERE session_id = \'s1\'"', work, env).stdout
        assert '"n": 0' not in by_class
        # the hook forced only the output: the harness's own budget and sampling reached the engine
        _, calls = query(work / "rollouts.duckdb", "SELECT request_body, engine_request FROM exchanges WHERE session_id = 's1' AND status = 'ok'")
        assert calls
        for request_body, engine_request in calls:
            sent, engine_got = (json.loads(value) if isinstance(value, str) else value for value in (request_body, engine_request))
            assert engine_got["structured_outputs"]["regex"]
            assert engine_got.get("temperature") == sent.get("temperature")
            if "max_tokens" in sent:
                assert engine_got["max_tokens"] == sent["max_tokens"]


def ray_processes(pgid: int) -> list[psutil.Process]:
    """The processes `ray start` left in its process group (GCS, raylet, dashboard, ...) and their descendants (the
    workers the raylet started, the node actor among them)."""
    import psutil
    leaders = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                leaders.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    found = {process.pid: process for process in leaders}
    for leader in leaders:
        try:
            found.update((child.pid, child) for child in leader.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def stop_ray(pgid: int) -> None:
    import psutil

    processes = ray_processes(pgid)
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(processes, timeout=20)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=10)


def test_the_readme_ray_on_one_machine_block_runs_as_printed(tmp_path: Path, engine_url: str) -> None:
    if engine_url != README_ENGINE:
        pytest.skip(f"the README's commands name the local engine at {README_ENGINE}")
    if taken := [port for port in (6379, 8070) if port_taken(port)]:
        pytest.skip(f"the README's Ray block uses ports 6379 (Ray) and 8070 (rollout server); {taken} held by another process")
    psutil = pytest.importorskip("psutil")  # comes with ray
    if other_gcs := [process.pid for process in psutil.process_iter(["name"]) if process.info["name"] == "gcs_server"]:
        pytest.skip(f"another Ray cluster runs on this machine (gcs_server pid {other_gcs}): `--ray auto` could join it, and the block's cluster would disturb it")
    block = code_block(REPO / "README.md", "### Scale-out on Ray")
    assert block == code_block(REPO / "docs" / "ray.md", "## On one machine"), "README and docs/ray.md give the same block"
    ray_start, serve_line, submit_line, sql_line = block
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    shutil.copy(REPO / "examples" / "hello-task.yaml", work / "task.yaml")  # "task.yaml: a copy of examples/hello-task.yaml"
    ray_tmp = tempfile.mkdtemp(prefix="pr", dir="/tmp")  # short: Ray's socket paths live under it
    env = user_env(home, RAY_TMPDIR=ray_tmp)

    started: list[int] = []  # the process groups of `ray start` (the pgids the test stops them by)
    try:
        for attempt in (1, 2):
            # its daemons stay in its process group and inherit its output: a file, not a pipe
            with open(tmp_path / f"ray-start-{attempt}.log", "w") as log:
                ray = subprocess.Popen(["bash", "-c", ray_start], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            started.append(ray.pid)
            if ray.wait(timeout=180) == 0:
                break
            printed = (tmp_path / f"ray-start-{attempt}.log").read_text()
            # Ray 2.60 gives its raylet a fixed 30 s to register with the GCS (node.py); a loaded machine can miss it
            assert attempt == 1 and "timed out during startup" in printed, printed[-3000:]
            stop_ray(ray.pid)
        with serving(serve_line, work, env, tmp_path / "server") as server:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get("http://127.0.0.1:8070/health", timeout=5, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert server.poll() is None and time.monotonic() < deadline, f"the rollout server did not serve: {(tmp_path / 'server.err').read_text()[-3000:]}"
                time.sleep(1)
            submitted = shell(submit_line, work, env, timeout=420)
            assert "task hello: completed (3 of 3 sessions)" in submitted.stdout, submitted.stdout + submitted.stderr[-3000:]
            # where the README says Ray writes the task's Parquet: <db stem>.head/<task>.parquet
            assert f"trajectories: {work / 'polar.head' / 'hello.parquet'}" in submitted.stdout
            assert (work / "polar.head" / "hello.parquet").is_file() and not (work / "polar.rollouts").exists()
            assert (work / "polar.local.duckdb").is_file() and (work / "polar.head.duckdb").is_file()
            by_node = shell(sql_line, work, env).stdout
            assert re.search(r"^local\s*\|\s*[1-9]", by_node, re.MULTILINE), by_node
    finally:
        for pgid in started:
            stop_ray(pgid)
        shutil.rmtree(ray_tmp, ignore_errors=True)
