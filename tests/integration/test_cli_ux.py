"""What a user meets at the command line (issue 31), through the real console script (`.venv/bin/polar-mitm`) in
subprocesses: `rollout list | status | cancel`, `control pause|resume|status` as sub-commands that name their
gateway, gateway discovery that leaves a rollout server's own gateway node out, Ctrl-C on `rollout submit --wait`,
`rollout run` and `rollout serve` (SIGINT sent to the real process), and output without noise: no PyTorch notice
from a tokens-mode gateway, no Node proxy warning from a routed command, `assemble` and `diff` saying what they mean.

One user gateway (tokens mode, steered) and one `rollout serve` (the real engine, steered Qwen Code sessions in local
sandboxes) share a confdir, the gateway started first: the rollout server's node gateway is the newest one listed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from polar_mitm import harnesses, routing, store
from polar_mitm.rollout.runtimes.local import marked_processes
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.processes import stop_process_group

pytestmark = [pytest.mark.engine, pytest.mark.harness]

REPO = Path(__file__).resolve().parents[2]
POLAR = Path(sys.executable).with_name("polar-mitm")  # the console script of the venv running the tests
HOOK = f"{REPO / 'examples' / 'steer_tiny_model.py'}:steer"
# blocks a session in its prepare stage until it is cancelled (no harness or engine call needed)
BLOCKING_PREPARE = [{"exec": 'python3 -c "import time; time.sleep(600)"'}]


def polar(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run([str(POLAR), *args], capture_output=True, text=True, timeout=timeout, **kwargs)


@dataclass
class Interactive:
    """A console-script process whose stderr is read as it comes, to send it SIGINT at the right moment."""

    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, *args: str, **kwargs: Any) -> Interactive:
        # SIGINT as a terminal's foreground command has it: a suite started in the background (`pytest &` in a
        # script) passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler (`submit --wait`
        # followed its task to the end and exited 0)
        process = subprocess.Popen(
            [str(POLAR), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs
        )
        run = cls(process)
        threading.Thread(target=lambda: run.lines.extend(process.stderr), daemon=True).start()  # type: ignore[arg-type]
        return run

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None and time.monotonic() < deadline, f"no {text!r} in:\n{self.stderr}"
            time.sleep(0.1)

    def interrupt(self, timeout: float = 90) -> tuple[int, str, str]:
        """SIGINT, as Ctrl-C sends it; (exit status, stdout, stderr)."""
        self.process.send_signal(signal.SIGINT)
        stdout = self.process.stdout.read() if self.process.stdout else ""
        code = self.process.wait(timeout=timeout)
        time.sleep(0.2)  # the reader thread's last lines
        return code, stdout, self.stderr

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def sandboxes_left(session_ids: list[str]) -> list[str]:
    """What is left of local sandboxes: their directories, processes carrying their marker."""
    left = [str(p) for s in session_ids for p in Path(tempfile.gettempdir()).glob(f"polar-sandbox-{s[:60]}-*")]
    return left + [f"pid {pid}" for s in session_ids for pid in marked_processes(s)]


def write_task(path: Path, **task: Any) -> Path:
    path.write_text(yaml.safe_dump({"instruction": "wait", "num_samples": 2, "timeout_seconds": 120, "agent": {"harness": "qwen"}, **task}))
    return path


@pytest.fixture(scope="module")
def qwen_installed() -> None:
    try:
        harnesses.get("qwen").executable()
    except harnesses.HarnessNotInstalled as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("confdir")


@pytest.fixture(scope="module")
def user_gateway(engine_url: str, confdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("user")
    gateway = Gateway(port=free_port(), db=base / "user.duckdb", confdir=confdir, upstream=engine_url, args=["--render", "tokens", "--engine-hook", HOOK]).start()
    yield gateway
    gateway.stop()


@dataclass
class Rollout:
    url: str
    db: Path
    log: Path
    process: subprocess.Popen
    confdir: Path

    def node_gateway(self) -> str:
        return next(url for url, entry in routing.live_gateways(self.confdir).items() if entry.get("pid") == self.process.pid)


@pytest.fixture(scope="module")
def rollout(engine_url: str, confdir: Path, user_gateway: Gateway, qwen_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rollout]:
    """`polar-mitm rollout serve` started after the user gateway, in its confdir; the last test stops it with SIGINT."""
    base = tmp_path_factory.mktemp("rollout")
    port = free_port()
    log = base / "serve.log"
    command = [str(POLAR), "rollout", "serve", "--port", str(port), "--upstream", engine_url, "--db", str(base / "rollout.duckdb"), "--confdir", str(confdir), "--engine-hook", HOOK]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    server = Rollout(f"http://127.0.0.1:{port}", base / "rollout.duckdb", log, process, confdir)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None and time.monotonic() < deadline, f"rollout server did not come up:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{server.url}/health", trust_env=False).status_code == 200 and any(e.get("pid") == process.pid for e in routing.live_gateways(confdir).values()):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    yield server
    if process.poll() is None:
        stop_process_group(process, grace=60)


# -- gateway discovery and control
def test_default_discovery_leaves_the_rollout_servers_node_gateway_out(user_gateway: Gateway, rollout: Rollout, confdir: Path) -> None:
    node = rollout.node_gateway()
    assert routing.live_gateways(confdir)[node].get("node") is True  # the node gateway marked itself when it announced
    # a plain `run` records into the user's gateway, not into the rollout server's store
    shown = polar("run", "--confdir", str(confdir), "--", sys.executable, "-c", "import os; print(os.environ['HTTPS_PROXY'].rsplit(':', 1)[1])")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == str(user_gateway.port), (shown.stdout, shown.stderr, node)
    status = polar("control", "status", "--confdir", str(confdir))
    assert status.returncode == 0, status.stderr
    # the gateway acted on is named, and the node that was passed over
    assert f"polar-mitm control status: gateway {user_gateway.proxy_url()} (the newest live gateway in" in status.stderr, status.stderr
    assert f"left out: rollout server gateway node {node}" in status.stderr, status.stderr
    assert json.loads(status.stdout)["state"] == "serving"


def test_control_actions_are_sub_commands_and_the_old_forms_still_work(user_gateway: Gateway) -> None:
    overview = polar("control", "--help")
    assert overview.returncode == 0 and all(action in overview.stdout for action in ("pause", "resume", "status")), overview.stdout
    pause_help, resume_help = polar("control", "pause", "--help"), polar("control", "resume", "--help")
    assert pause_help.returncode == 0 and "--mode {drain,abort}" in pause_help.stdout and "--timeout" in pause_help.stdout, pause_help.stdout
    assert "--policy-version" in resume_help.stdout and "--mode" not in resume_help.stdout, resume_help.stdout
    url = user_gateway.proxy_url()
    # flags before the action, as before it had sub-commands
    paused = polar("control", "--gateway", url, "--mode", "abort", "pause")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["pause_mode"] == "abort" and f"polar-mitm control pause: gateway {url} (--gateway)" in paused.stderr
    resumed = polar("control", "resume", "--gateway", url, "--policy-version", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["state"] == "serving" and json.loads(resumed.stdout)["policy_version"] == 1


# -- tokens mode: a quiet start, `diff` and `assemble` on a session with a side call
def test_a_side_call_is_a_new_lineage_and_tokens_mode_is_quiet(user_gateway: Gateway, session_id: str) -> None:
    with proxy_env(user_gateway, session_id):
        client = openai.OpenAI(api_key="sk-cli-ux", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."}]
        first = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=32)
        # a side call between two turns, as a harness makes one (a title, Gemini CLI's router)
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "system", "content": "Write a title."}, {"role": "user", "content": "List the files."}], max_tokens=16)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=32)
    rows = user_gateway.exchanges(session_id)
    assert [(r["seq"], r["bridged"]) for r in rows] == [(1, False), (2, False), (3, True)], [(r["seq"], r["bridged"], r["bridge_reason"]) for r in rows]

    overview = polar("diff", session_id, "--db", str(user_gateway.db))
    assert overview.returncode == 0, overview.stderr
    lines = [line.strip() for line in overview.stdout.splitlines() if line.strip().startswith("seq ")]
    assert lines[0].startswith("seq 1 → 2  new lineage (side call or sub-agent;") and "BREAK" not in lines[0], lines
    assert lines[1].startswith("seq 2 → 3  continues seq 1, not seq 2;") and lines[1].endswith("; bridged"), lines
    detail = polar("diff", session_id, "--db", str(user_gateway.db), "--turn", "2")
    assert "render: tokens · seq 3 bridged: its prompt is seq 1's prompt + sampled ids + the new messages" in detail.stdout, detail.stdout

    assembled = polar("assemble", "--db", str(user_gateway.db), "--session", session_id)
    assert assembled.returncode == 0, assembled.stderr
    [tokenizer] = [line for line in assembled.stdout.splitlines() if line.startswith("tokenizer ")]
    assert tokenizer.split(None, 1)[1] == "none needed (no break to classify)", assembled.stdout

    # the gateway rendered those prompts itself (transformers' tokenizer), and said nothing of PyTorch
    log = user_gateway.log.read_text() if user_gateway.log else ""
    assert "listening on" in log and "PyTorch was not found" not in log, log[-2000:]


def test_a_routed_node_command_prints_no_proxy_agent_warning(user_gateway: Gateway, confdir: Path) -> None:
    node_dir = harnesses.node_bin_dir()
    if node_dir is None:
        pytest.skip("no Node >= 22 here (sandboxes/harnesses/install.sh fetches one)")
    # Node's fetch() through HTTPS_PROXY (NODE_USE_ENV_PROXY, which `run` sets) builds an EnvHttpProxyAgent
    fetch = "fetch('https://api.openai.com/v1/models').then(r => console.log('answered', r.status), e => console.log('failed', e.cause?.code ?? e))"
    done = polar("run", "--gateway", user_gateway.proxy_url(), "--confdir", str(confdir), "--", str(node_dir / "node"), "-e", fetch)
    assert done.returncode == 0 and done.stdout.startswith("answered "), (done.stdout, done.stderr)
    assert "EnvHttpProxyAgent" not in done.stderr and "ExperimentalWarning" not in done.stderr, done.stderr


# -- rollout list | status | cancel
def test_rollout_list_status_and_cancel(rollout: Rollout, tmp_path: Path) -> None:
    server = ("--server", rollout.url)
    task_file = write_task(tmp_path / "blocked.yaml", task_id="cli-blocked", runtime={"backend": "local", "prepare": BLOCKING_PREPARE})
    submitted = polar("rollout", "submit", str(task_file), *server)
    assert submitted.returncode == 0 and submitted.stdout.strip() == "cli-blocked", submitted.stderr
    deadline = time.monotonic() + 60
    while True:
        listed = polar("rollout", "list", *server)
        assert listed.returncode == 0, listed.stderr
        row = next(line.split(None, 4) for line in listed.stdout.splitlines() if line.startswith("cli-blocked "))
        if row[3:] and row[3].startswith("preparing"):
            break
        assert time.monotonic() < deadline, listed.stdout
        time.sleep(0.5)
    assert listed.stdout.splitlines()[0].split() == ["task", "status", "done", "sessions", "created"] and row[1:3] == ["running", "0/2"], listed.stdout
    status = polar("rollout", "status", "cli-blocked", *server)
    assert status.returncode == 0 and "task cli-blocked: running; preparing 2" in status.stdout, status.stdout
    session_ids = [s["session_id"] for s in json.loads(polar("rollout", "status", "cli-blocked", *server, "--json").stdout)["sessions"]]
    missing = polar("rollout", "status", "no-such-task", *server)
    assert missing.returncode == 1 and f"no task 'no-such-task' on the rollout server at {rollout.url}" in missing.stderr, missing.stderr

    cancelled = polar("rollout", "cancel", "cli-blocked", *server)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.splitlines() == ["task cli-blocked: cancelled 2 unfinished sessions; what they recorded stays in the store", "task cli-blocked: cancelled; cancelled 2"], cancelled.stdout
    assert sandboxes_left(session_ids) == []
    again = polar("rollout", "cancel", "cli-blocked", *server)
    assert again.returncode == 0 and "already ended, nothing to cancel" in again.stdout
    unreachable = polar("rollout", "list", "--server", f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 2 and "cannot reach the rollout server" in unreachable.stderr and "Traceback" not in unreachable.stderr


# -- Ctrl-C
def test_ctrl_c_on_submit_wait_leaves_the_task_running_and_a_rerun_reattaches(rollout: Rollout, tmp_path: Path) -> None:
    server = ("--server", rollout.url)
    task_file = write_task(
        tmp_path / "hello.yaml", task_id="cli-reattach", num_samples=1, timeout_seconds=240,
        instruction="Write ok into answer.txt.\nSTEER-COMMAND: echo ok > answer.txt",
        runtime={"backend": "local", "prepare": [{"exec": "sleep 3"}]},  # still running when interrupted
        evaluator={"command": "test -s answer.txt", "timeout_seconds": 30},
    )
    follow = Interactive.start("rollout", "submit", str(task_file), *server, "--wait")
    follow.wait_for("sessions done")
    code, stdout, stderr = follow.interrupt()
    assert code == 130 and "Traceback" not in stderr, stderr
    [said] = [line for line in stderr.splitlines() if line.startswith("polar-mitm rollout:")]
    assert said == (
        f"polar-mitm rollout: stopped following task cli-reattach; it goes on on the rollout server at {rollout.url}: "
        f"`polar-mitm rollout status cli-reattach --server {rollout.url}` shows it, "
        f"re-running `polar-mitm rollout submit {task_file} --server {rollout.url} --wait` re-attaches to it"
    ), said
    first = httpx.get(f"{rollout.url}/tasks/cli-reattach", trust_env=False).json()
    assert [s["status"] for s in first["sessions"]] != ["cancelled"], first  # the server went on with it

    rerun = polar("rollout", "submit", str(task_file), *server, "--wait", timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"task cli-reattach: 1 sessions ({first['sessions'][0]['session_id']})" in rerun.stderr  # the same task, not a new one
    assert "task cli-reattach: completed (1 of 1 sessions)" in rerun.stdout, rerun.stdout
    assert "EnvHttpProxyAgent" not in rerun.stdout + rerun.stderr


def test_ctrl_c_on_rollout_run_cancels_its_task_and_cleans_up(engine_url: str, qwen_installed: None, tmp_path: Path) -> None:
    task_file = write_task(tmp_path / "run.yaml", task_id="cli-run", runtime={"backend": "local", "prepare": BLOCKING_PREPARE})
    db, confdir = tmp_path / "run.duckdb", tmp_path / "confdir"
    running = Interactive.start("rollout", "run", str(task_file), "--upstream", engine_url, "--db", str(db), "--confdir", str(confdir), "--engine-hook", HOOK, cwd=tmp_path)
    running.wait_for("sessions done")
    code, stdout, stderr = running.interrupt()
    assert code == 130 and "Traceback" not in stderr, stderr
    [said] = [line for line in stderr.splitlines() if line.startswith("polar-mitm rollout")]
    assert said == f"polar-mitm rollout run: interrupted: cancelled task cli-run's unfinished sessions and waited for them to end, sandboxes removed (cancelled 2); what they recorded is in {db.resolve()}", said
    rows = store.query_dicts(db, "SELECT session_id, status FROM sessions WHERE task_id = 'cli-run' ORDER BY session_id")
    assert [r["status"] for r in rows] == ["cancelled", "cancelled"], rows
    assert sandboxes_left([r["session_id"] for r in rows]) == []
    assert routing.live_gateways(confdir) == {}  # its node gateway stopped and withdrew itself


def test_ctrl_c_on_rollout_serve_cancels_its_sessions_and_stops(rollout: Rollout) -> None:
    """Last: it stops the module's rollout server."""
    task = {"task_id": "cli-serve", "instruction": "wait", "num_samples": 2, "agent": {"harness": "qwen"}, "runtime": {"backend": "local", "prepare": BLOCKING_PREPARE}}
    accepted = httpx.post(f"{rollout.url}/tasks", json=task, trust_env=False).json()
    deadline = time.monotonic() + 60
    while {s["status"] for s in httpx.get(f"{rollout.url}/tasks/cli-serve", trust_env=False).json()["sessions"]} != {"preparing"}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    node = rollout.node_gateway()
    os.kill(rollout.process.pid, signal.SIGINT)
    code = rollout.process.wait(timeout=90)
    log = rollout.log.read_text()
    assert code == 130 and "Traceback" not in log, log[-3000:]
    assert [line for line in log.splitlines() if line.startswith("polar-mitm rollout: stopped")] == [
        f"polar-mitm rollout: stopped (Ctrl-C): cancelled 2 unfinished sessions of task cli-serve; what they recorded is in {rollout.db.resolve()}; "
        "a new server does not resume them (submit the task again)"
    ], log[-2000:]
    assert [r["status"] for r in store.query_dicts(rollout.db, "SELECT status FROM sessions WHERE task_id = 'cli-serve'")] == ["cancelled", "cancelled"]
    assert sandboxes_left(accepted["session_ids"]) == []
    assert node not in routing.live_gateways(rollout.confdir)
