"""A client of the rollout server's HTTP API (`polar-mitm rollout submit|run`): read a task file, submit it,
follow it with a progress bar, summarise the result."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from polar_mitm.errors import ClientError
from polar_mitm.rollout.models import FINAL_STATUSES


def load_task(path: Path) -> dict[str, Any]:
    """The task file as a dict, relative paths resolved against its directory."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ClientError(f"cannot read task file {path}: {error}") from error
    if not isinstance(data, dict):
        raise ClientError(f"{path}: a task file is a mapping (a TaskRequest)")
    base = path.resolve().parent
    for step in (data.get("runtime") or {}).get("prepare") or []:
        upload = step.get("upload") if isinstance(step, dict) else None
        if isinstance(upload, dict) and isinstance(upload.get("source"), str) and not os.path.isabs(upload["source"]):
            upload["source"] = str(base / upload["source"])
    evaluator = data.get("evaluator")
    if isinstance(evaluator, dict) and isinstance(evaluator.get("python"), str):
        target, _, name = evaluator["python"].rpartition(":")
        if target.endswith(".py") and not os.path.isabs(target):
            evaluator["python"] = f"{base / target}:{name}"
    return data


async def submit_task(client, server: str, task: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{server}/tasks", json=task)
    if response.status_code != 202:
        try:
            message = response.json().get("message") or response.text
        except ValueError:
            message = response.text
        raise ClientError(f"the server refused the task (HTTP {response.status_code}): {message}")
    return response.json()


def progress_line(result: dict[str, Any], started: float, width: int = 30) -> str:
    sessions = result["sessions"]
    done = sum(s["status"] in FINAL_STATUSES for s in sessions)
    filled = round(width * done / max(len(sessions), 1))
    counts = ", ".join(f"{status} {n}" for status, n in sorted(result["counts"].items()))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{len(sessions)} sessions done  ({counts})  {time.monotonic() - started:.0f}s"


async def wait_task(client, server: str, task_id: str, interval: float = 1.0, out=sys.stderr) -> dict[str, Any]:
    started = time.monotonic()
    interactive = out.isatty()
    last = ""
    while True:
        response = await client.get(f"{server}/tasks/{task_id}")
        response.raise_for_status()
        result = response.json()
        line = progress_line(result, started)
        if interactive:
            print(f"\r{line}\x1b[K", end="", file=out, flush=True)
        elif line.split("  ")[0:2] != last.split("  ")[0:2]:
            print(line, file=out, flush=True)  # a log-friendly bar: one line per change
        last = line
        if result["status"] != "running":
            if interactive:
                print(file=out)
            return result
        await asyncio.sleep(interval)


def summary_table(result: dict[str, Any]) -> str:
    header = ("session", "status", "reward", "exchanges", "sequences", "prepare_s", "run_s", "error")
    rows = []
    for s in result["sessions"]:
        timings = s.get("timings") or {}
        rows.append((
            s["session_id"], s["status"], "" if s.get("reward") is None else f"{s['reward']:g}", str(s.get("n_exchanges", 0)),
            str((s.get("trajectory") or {}).get("sequences", "")),
            _seconds(timings.get("preparing")), _seconds(timings.get("running")), (s.get("error") or "")[:70],
        ))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    stats = result.get("trajectory_stats") or {}
    lines.append("")
    lines.append(f"task {result['task_id']}: {result['status']}; " + ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items())))
    if result.get("trajectories"):
        lines.append(f"trajectories: {result['trajectories']} ({stats.get('sequences', 0)} sequences, {stats.get('sampled_tokens', 0)} sampled tokens)")
    elif stats.get("error"):
        lines.append(f"trajectories: not written ({stats['error']})")
    return "\n".join(lines)


def _seconds(timing: dict[str, Any] | None) -> str:
    return "" if not timing or timing.get("seconds") is None else f"{timing['seconds']:.1f}"


async def submit_and_follow(server: str, task: dict[str, Any], wait: bool) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        accepted = await submit_task(client, server, task)
        print(f"task {accepted['task_id']}: {len(accepted['session_ids'])} sessions ({', '.join(accepted['session_ids'])})", file=sys.stderr, flush=True)
        if not wait:
            return accepted
        return await wait_task(client, server, accepted["task_id"])
