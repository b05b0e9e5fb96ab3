"""The reliability soak: `python -m bench.soak [--quick] [--seed N] [--sessions 64] [--out FILE]`.

Load held, faults survived, nothing lost: `--sessions` concurrent harness-shaped sessions through a real
`polar-mitm gateway` process (CONNECT with session credentials, TLS with its CA, --require-auth, a low
--engine-timeout) against a stand-in engine (bench/soak_engine.py: a fake, named as such), all four provider
APIs, streamed and not, with faults injected at a fixed seed, in three phases:

  chat      the gateway in chat mode. Faults: engine 5xx, connection reset, garbage and truncated bodies, a hang
            past --engine-timeout (the stand-in engine, asked by the request); clients hanging up mid-stream and
            before a non-streamed reply, malformed and oversized bodies, missing and wrong proxy credentials (the
            clients, bench/soak_client.py); pause/resume cycles (drain and abort) through /control/*; a SIGKILL of
            the gateway at 3/5 of the phase and its restart on the same store, port and confdir.
  tokens    the same load and faults through a gateway in tokens mode (--render tokens: it renders, the stand-in
            engine answers token-in /completions), without the SIGKILL.
  rollout   `polar-mitm rollout serve` (its own gateway node, the same stand-in engine, real Qwen Code sessions in
            local sandboxes): tasks accepted, a SIGKILL of the server while its sessions run, its restart on the
            same store, then what it reports (bench/soak_rollout.py).

Then each request (what its client got: status, a complete successful reply or not, the exchange id of the
reply headers) is joined with the store's rows (found by exchange id, and by the request id each request's text
carries, which the row's request_body keeps). It prints, and writes with --out (.json, and .md beside it), a
table: requests, faults injected by kind, answered ok, rows, lost (answered ok without an ok row), duplicates (an
exchange id in two rows, or two rows other than pause-aborted attempts for one request), faults answered as
success, faults stored ok, abandoned calls stored trainable, restart times, the gateway's RSS at
start/middle/end with its slope, errors by class. Exit status 1 when an invariant fails (`invariants` in the JSON).

--quick takes under 3 minutes on a 2-core machine; the full run 10+ minutes. Only 127.0.0.1 traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx

# `python bench/soak.py` (from any directory) puts bench/ first on sys.path; its modules are the package `bench`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import Target  # noqa: E402
from bench.common import ROOT, Service, free_port  # noqa: E402
from bench.soak_client import APIS, Sent, Session, wrong_credentials  # noqa: E402
from bench.soak_report import machine, render_markdown, summarize  # noqa: E402
from bench.soak_rollout import RolloutPlan, qwen_missing, rollout_phase  # noqa: E402
from polar_mitm import session as sessions  # noqa: E402
from polar_mitm import store  # noqa: E402
from polar_mitm.api_clients import AsyncGatewayControl  # noqa: E402
from polar_mitm.local_engine import build  # noqa: E402
from tests.support.gatewayproc import Gateway  # noqa: E402

ENGINE_TIMEOUT_S = 2.0  # the gateway's --engine-timeout
# the stand-in's hang: far past the timeout, so that only a gateway that lets the call run on answers it (on this
# loaded 2-core machine the gateway's timer fired up to 1.9 s late, and 3 of ~630 hangs of 4 s were answered)
HANG_S = ENGINE_TIMEOUT_S + 10
KEEPALIVE_S = 0.5  # every streamed reply gets keepalives while the engine works (Gemini's first bytes are one)


@dataclass(frozen=True)
class SoakPlan:
    chat_seconds: float
    tokens_seconds: float
    pause_every_s: float
    rss_every_s: float
    rollout: RolloutPlan


QUICK = SoakPlan(chat_seconds=30, tokens_seconds=18, pause_every_s=6, rss_every_s=1.0, rollout=RolloutPlan(tasks=2, samples=2, hold_s=60, wait_s=40))
FULL = SoakPlan(chat_seconds=300, tokens_seconds=240, pause_every_s=15, rss_every_s=2.0, rollout=RolloutPlan(tasks=3, samples=2, hold_s=120, wait_s=90))


@dataclass
class PhaseRun:
    name: str
    sent: list[Sent]
    rows: list[dict[str, Any]]
    rss: list[tuple[float, int, float]]  # (seconds into the phase, gateway generation, MB)
    restarts_s: list[float]
    pauses: Counter[str]
    kill_at_s: float | None
    seconds: float
    engine_faults: dict[str, int]
    restart_errors: list[str] = field(default_factory=list)


def engine_stats(port: int) -> dict[str, Any]:
    """The stand-in engine's counters: requests served, faults injected by kind."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as response:
        return json.loads(response.read())


async def drive(name: str, gateway: Gateway, n_sessions: int, seconds: float, seed: int, plan: SoakPlan, kill_at: float | None) -> PhaseRun:
    """`n_sessions` sessions for `seconds`, with pause/resume cycles, RSS samples and (kill_at) a SIGKILL + restart."""
    secret = sessions.load_secret(gateway.confdir)
    context = ssl.create_default_context(cafile=str(gateway.ca_cert))
    session_ids = [f"soak-{name}-{i:03d}" for i in range(n_sessions)]

    def credentials(index: int) -> tuple[str, str]:
        return session_ids[index], sessions.session_token(secret, session_ids[index])

    target = Target(name, gateway.port, "connect", context, credentials=credentials)
    bad = Target(name, gateway.port, "connect", context, credentials=lambda index: wrong_credentials(session_ids[index]))
    clients = [Session(target, i, session_ids[i], name, APIS[i % len(APIS)], random.Random(f"{seed}-{name}-{i}"), bad) for i in range(n_sessions)]
    sent: list[Sent] = []
    rss: list[tuple[float, int, float]] = []
    restarts: list[float] = []
    restart_errors: list[str] = []
    pauses: Counter[str] = Counter()
    generation = [0]
    t0 = time.monotonic()
    end = [t0 + seconds]  # the phase's end; a restart that ran late moves it (load after the restart is the point)
    down = asyncio.Event()  # set while the gateway is killed and not yet back

    async def session_loop(client: Session) -> None:
        await asyncio.sleep(client.index * 0.02)  # a ramp, not 64 CONNECTs in one instant
        while time.monotonic() < end[0]:
            if down.is_set():
                await asyncio.sleep(0.2)  # the gateway is down (killed): wait for it, as a harness retrying would
                continue
            request = client.next_request()
            before = generation[0]
            await client.send(request)
            request.generation = generation[0]
            request.across_kill = down.is_set() or before != generation[0]
            sent.append(request)

    async def sample_rss() -> None:
        while time.monotonic() < end[0]:
            if not down.is_set():
                service = Service("gateway", gateway.port, [], gateway.log or Path(os.devnull), process=gateway.process)
                rss.append((time.monotonic() - t0, generation[0], service.rss_mb()))
            await asyncio.sleep(plan.rss_every_s)

    async def pause_cycles() -> None:
        control = AsyncGatewayControl(f"http://127.0.0.1:{gateway.port}", timeout=15)
        cycle = 0
        try:
            while time.monotonic() + plan.pause_every_s < end[0]:
                await asyncio.sleep(plan.pause_every_s)
                if down.is_set():
                    continue
                mode: Literal["drain", "abort"] = "abort" if cycle % 2 else "drain"
                cycle += 1
                try:
                    await control.pause(mode, timeout_seconds=2 * ENGINE_TIMEOUT_S + 2)
                    pauses[f"pause {mode}"] += 1
                    await asyncio.sleep(0.5)
                except Exception as error:  # noqa: BLE001 - counted; a refused pause (a drain timed out) resumes nothing
                    pauses[f"pause {mode} refused: {type(error).__name__}"] += 1
                try:
                    await control.resume()
                    pauses["resume"] += 1
                except Exception as error:  # noqa: BLE001 - a resume without a pause in force is refused (409)
                    pauses[f"resume refused: {type(error).__name__}"] += 1
        finally:
            await control.aclose()

    async def kill_and_restart() -> None:
        assert kill_at is not None
        await asyncio.sleep(kill_at * seconds)
        down.set()
        planned_end, end[0] = end[0], float("inf")  # the phase lasts until the gateway is back, and a while after
        killed = time.monotonic()
        await asyncio.to_thread(gateway.stop, signal.SIGKILL)
        try:
            await asyncio.to_thread(gateway.start, 120)
        except (RuntimeError, TimeoutError) as error:  # it stays down: the phase ends, the invariant fails
            restart_errors.append(str(error)[-2000:])
            end[0] = time.monotonic()
            print(f"  {name}: the gateway did not come back after its SIGKILL: {error}", flush=True)
            return
        restarts.append(time.monotonic() - killed)
        end[0] = max(planned_end, time.monotonic() + max(8.0, 0.2 * seconds))
        generation[0] += 1
        down.clear()
        print(f"  {name}: gateway SIGKILLed at {killed - t0:.1f}s, serving again after {restarts[-1]:.1f}s", flush=True)

    tasks = [session_loop(c) for c in clients] + [sample_rss(), pause_cycles()] + ([kill_and_restart()] if kill_at is not None else [])
    await asyncio.gather(*tasks)
    for client in clients:
        if client.conn is not None:
            client.conn.close()
    return PhaseRun(name, sent, [], rss, restarts, pauses, kill_at * seconds if kill_at is not None else None, time.monotonic() - t0, {}, restart_errors)


ROWS_SQL = (
    "SELECT exchange_id, session_id, status, http_status, stream, api, "
    "regexp_extract(request_body, 'soakreq-[a-z]+-[0-9]+-[0-9]+') AS rid FROM exchanges WHERE session_id LIKE 'soak-%'"
)


def gateway_phase(name: str, tmp: Path, engine: Service, args: argparse.Namespace, plan: SoakPlan, seconds: float, extra: list[str], kill_at: float | None) -> PhaseRun:
    gateway = Gateway(free_port(), tmp / f"{name}.duckdb", tmp / "confdir", f"http://127.0.0.1:{engine.port}/v1",
                      ["--require-auth", "--engine-timeout", str(ENGINE_TIMEOUT_S), "--keepalive-interval", str(KEEPALIVE_S), *extra])
    faults_before = engine_stats(engine.port)["faults"]
    started = time.monotonic()
    gateway.start(120)
    print(f"  {name}: gateway up in {time.monotonic() - started:.1f}s; {args.sessions} sessions for {seconds:g}s", flush=True)
    try:
        run = asyncio.run(drive(name, gateway, args.sessions, seconds, args.seed, plan, kill_at))
    finally:
        gateway.stop()
    faults_after = engine_stats(engine.port)["faults"]
    run.engine_faults = {k: v - faults_before.get(k, 0) for k, v in faults_after.items() if v - faults_before.get(k, 0)}
    run.rows = store.query_dicts(gateway.db, ROWS_SQL)
    print(f"  {name}: {len(run.sent)} requests, {sum(s.success for s in run.sent)} answered ok, {len(run.rows)} rows", flush=True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description="polar-mitm reliability soak (see bench/soak.py's docstring)")
    parser.add_argument("--quick", action="store_true", help="short phases (under 3 minutes)")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the results as JSON here, and as markdown beside it (.md)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    parser.add_argument("--only", choices=("chat", "tokens", "rollout"), action="append", help="run only this phase (repeatable; default: all three)")
    parser.add_argument("--skip-rollout", action="store_true", help="leave out the rollout server phase")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    began = time.monotonic()
    load_at_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="polar-soak-"))
    model_dir = build.model_dir(build.engine_home(), build.DEFAULT_MODEL)
    port = free_port()
    engine = Service("soak-engine", port, [sys.executable, "-m", "bench.soak_engine", "--port", str(port), "--seed", str(args.seed), "--hang-s", str(HANG_S),
                                           *(["--model-dir", str(model_dir)] if (model_dir / "tokenizer.json").exists() else [])], tmp / "engine.log", cwd=ROOT)
    print(f"soak: seed {args.seed}, {args.sessions} sessions, {'quick' if args.quick else 'full'} (logs in {tmp})", flush=True)
    runs: list[PhaseRun] = []
    rollout: dict[str, Any] | None = None
    try:
        engine.start().wait(60)
        phases = set(args.only or ("chat", "tokens", "rollout")) - ({"rollout"} if args.skip_rollout else set())
        if "chat" in phases:
            runs.append(gateway_phase("chat", tmp, engine, args, plan, plan.chat_seconds, ["--render", "chat"], kill_at=0.6))
        if "tokens" not in phases:
            pass
        elif (model_dir / "tokenizer.json").exists():
            runs.append(gateway_phase("tokens", tmp, engine, args, plan, plan.tokens_seconds, ["--render", "tokens", "--render-model", str(model_dir)], kill_at=None))
        else:
            print(f"  tokens: skipped, no model at {model_dir} (polar-mitm engine start builds it)", flush=True)
        if "rollout" not in phases:
            pass
        elif missing := qwen_missing():
            print(f"  rollout: skipped, {missing}", flush=True)
        else:
            try:
                rollout = rollout_phase(tmp, f"http://127.0.0.1:{engine.port}/v1", plan.rollout, args.seed)
            except (RuntimeError, TimeoutError, AssertionError, OSError, httpx.HTTPError) as error:  # the phase's failure is a result too
                said = f"{type(error).__name__}: {error}"[-2000:]
                print(f"  rollout: {said}", flush=True)
                rollout = {"figures": {"error": said}, "invariants": {"phase_ran": {"value": said[:300], "holds": False}}}
    finally:
        engine.stop()
    results = summarize(runs, rollout)
    results.update(machine=machine(), when=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), seed=args.seed, sessions=args.sessions,
                   mode="quick" if args.quick else "full", wall_s=round(time.monotonic() - began, 1), load_at_start=load_at_start)
    report = render_markdown(results)
    print()
    print(report)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
        args.out.with_suffix(".md").write_text(report)
        print(f"written to {args.out} and {args.out.with_suffix('.md')}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [name for name, check in results["invariants"].items() if not check["holds"]]
    if failed:
        print(f"soak: invariants failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
