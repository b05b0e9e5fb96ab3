"""The soak's rollout phase: `polar-mitm rollout serve` SIGKILLed while its sessions run, and restarted on the same
store, against what the durable single-machine server promises (issue 28): the restarted server reports every
task it accepted; each session ends exactly once (one whose sandbox died with the server is failed, not run
again), with one SessionResult callback per session; no sandbox process outlives the server; the next task runs.

Sessions are real Qwen Code runs in local sandboxes behind the server's own gateway node, against the soak's
stand-in engine, which ends each agent loop at once (the instruction says SOAK-FINAL: a text reply, no tool
call). Each task's prepare step holds its sessions (`sleep`) so the SIGKILL finds them running, in their
sandboxes. The SIGKILL goes to the server's process only, as an OOM kill or a crash would: what it leaves behind
is the server's doing, not the test's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import free_port
from polar_mitm import harnesses
from polar_mitm.rollout.runtimes.local import marked_processes
from tests.support.processes import stop_process_group
from tests.support.rollout_runs import Receiver, RolloutServer

FINAL = {"completed", "failed", "timed_out", "cancelled"}


@dataclass(frozen=True)
class RolloutPlan:
    tasks: int
    samples: int
    hold_s: float  # each session's prepare step sleeps this long: still running when the server is killed
    wait_s: float  # how long the restarted server gets to report every session final


def qwen_missing() -> str | None:
    """Why the phase cannot run here (Qwen Code not installed: sandboxes/harnesses/install.sh), or None."""
    try:
        harnesses.get("qwen").executable()
    except harnesses.HarnessNotInstalled as error:
        return str(error)
    return None


def start_server(command: list[str], log: Path, db: Path, port: int, timeout: float = 120) -> tuple[RolloutServer, float]:
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    server = RolloutServer(f"http://127.0.0.1:{port}", db, log, process)
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if server.client.get("/health").status_code == 200:
                return server, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"rollout server did not come up in {timeout:g}s:\n{server.log_tail()}")


def task(task_id: str, samples: int, hold_s: float, callback_url: str) -> dict[str, Any]:
    return {
        "task_id": task_id, "instruction": "SOAK-FINAL: say that you are done.", "num_samples": samples, "timeout_seconds": max(120, hold_s + 60),
        "runtime": {"backend": "local", "prepare": [{"exec": f"sleep {hold_s:g}"}] if hold_s else []},
        "agent": {"harness": "qwen"}, "callback_url": callback_url, "metadata": {"soak": True},
    }


def reported_sessions(server: RolloutServer) -> dict[str, dict[str, Any]]:
    """Every task the server lists (GET /tasks), by task id."""
    response = server.client.get("/tasks")
    response.raise_for_status()
    return {t["task_id"]: t for t in response.json()}


def rollout_phase(tmp: Path, engine_url: str, plan: RolloutPlan, seed: int) -> dict[str, Any]:
    base = tmp / "rollout"
    base.mkdir()
    port = free_port()
    db, log = base / "store.duckdb", base / "server.log"
    command = [sys.executable, "-m", "polar_mitm.cli", "rollout", "serve", "--port", str(port), "--upstream", engine_url, "--db", str(db),
               "--confdir", str(base / "confdir"), "--run-limit", str(plan.tasks * plan.samples), "--prepare-limit", str(plan.tasks * plan.samples), "-v",
               # chat mode: the stand-in engine ends a session when it sees the tool's result among the messages (token
               # ids it cannot read: in tokens mode it would call the tool until the harness gives up)
               "--render", "chat"]
    receiver = Receiver()
    figures: dict[str, Any] = {}
    orphans: list[int] = []
    marked: list[int] = []
    server: RolloutServer | None = None
    try:
        server, start_s = start_server(command, log, db, port)
        figures["start_s"] = round(start_s, 1)
        accepted = [server.submit(task(f"soak-{seed}-t{i}", plan.samples, plan.hold_s, receiver.url)) for i in range(plan.tasks)]
        session_ids = [s for a in accepted for s in a["session_ids"]]
        # killed once every session is in its sandbox (preparing: the prepare step's sleep runs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            statuses = [s["status"] for a in accepted for s in server.task(a["task_id"])["sessions"]]
            if all(status in ("preparing", "running") for status in statuses) and all(marked_processes(s) for s in session_ids):
                break
            time.sleep(0.5)
        figures["tasks_accepted"] = len(accepted)
        figures["sessions_in_flight_at_kill"] = len(session_ids)
        figures["statuses_at_kill"] = ", ".join(sorted(set(statuses)))
        os.kill(server.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        server.process.wait(timeout=30)
        server.client.close()
        time.sleep(1.0)
        orphans = sorted({pid for s in session_ids for pid in marked_processes(s)})
        figures["sandbox_processes_alive_after_kill"] = len(orphans)
        server, start_s = start_server(command, log, db, port)
        figures["restart_s"] = round(time.monotonic() - killed, 1)
        figures["restart_start_s"] = round(start_s, 1)
        # what the restarted server reports, once every session it lists is final (or wait_s ran out)
        deadline = time.monotonic() + plan.wait_s
        while True:
            tasks = reported_sessions(server)
            listed = [s for t in tasks.values() for s in t["sessions"]]
            if (all(s["status"] in FINAL for s in listed) and len(tasks) >= len(accepted)) or time.monotonic() > deadline:
                break
            time.sleep(1)
        reported = [a["task_id"] for a in accepted if a["task_id"] in tasks]
        listed_ids = [s["session_id"] for t in tasks.values() for s in t["sessions"]]
        figures["tasks_reported_after_restart"] = len(reported)
        figures["sessions_reported_after_restart"] = len(set(listed_ids) & set(session_ids))
        figures["session_statuses_after_restart"] = dict(sorted(Counter(s["status"] for t in tasks.values() for s in t["sessions"]).items()))
        marked = sorted({pid for s in session_ids for pid in marked_processes(s)})
        figures["sandbox_processes_alive_after_restart"] = len(marked)
        callbacks = Counter(body["session_id"] for body in receiver.results("session_result"))
        figures["session_callbacks"] = sum(callbacks.values())
        # the next task, on the restarted server
        started = time.monotonic()
        following = server.submit(task(f"soak-{seed}-after", 1, 0, receiver.url))
        result = server.wait(following["task_id"], timeout=plan.wait_s + 60)
        figures["next_task"] = f"{result['status']} ({', '.join(s['status'] for s in result['sessions'])}) in {time.monotonic() - started:.0f} s"
        next_ok = result["status"] == "completed" and all(s["status"] == "completed" for s in result["sessions"])
        invariants = {
            "tasks_lost": {"value": len(accepted) - len(reported), "holds": len(reported) == len(accepted)},
            "sessions_not_final": {"value": sum(s["status"] not in FINAL for s in listed) + len(set(session_ids) - set(listed_ids)),
                                   "holds": set(session_ids) <= set(listed_ids) and all(s["status"] in FINAL for s in listed)},
            "sessions_listed_twice": {"value": len(listed_ids) - len(set(listed_ids)), "holds": len(listed_ids) == len(set(listed_ids))},
            "sessions_completed_again": {"value": sum(s["status"] == "completed" for t in tasks.values() for s in t["sessions"] if s["session_id"] in session_ids),
                                         "holds": not any(s["status"] == "completed" for t in tasks.values() for s in t["sessions"] if s["session_id"] in session_ids)},
            "session_callbacks_not_once": {"value": sum(callbacks.get(s, 0) != 1 for s in session_ids), "holds": all(callbacks.get(s, 0) == 1 for s in session_ids)},
            "sandboxes_outliving_server": {"value": len(orphans), "holds": not orphans},
            "next_task_completed": {"value": figures["next_task"], "holds": next_ok},
        }
        return {"figures": figures, "invariants": invariants}
    finally:
        receiver.close()
        if server is not None:
            server.client.close()
            if server.process.poll() is None:
                stop_process_group(server.process, grace=30)
        for pid in sorted(set(orphans) | set(marked)):  # sandbox processes the killed server left: this run started them, this run ends them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

