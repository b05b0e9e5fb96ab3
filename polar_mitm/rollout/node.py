"""The gateway node: one per machine. It runs the polar gateway in-process, owns the store, makes sandboxes
and runs this machine's sessions (session_run.SessionRun) behind the scheduler's one narrow interface, `Node`.

Store writes. DuckDB allows one writing process per file, and the gateway's Store already has the one writer
thread (group commits). The node runs the gateway in its own process, so it takes that same Store object
(`addon.store`) and sends its own statements through `Store.execute_write`: the `sessions` row of each
session (task id, status, reward, timings, metadata, error) is upserted at every stage change, serialised
with the exchange commits, without touching the gateway's `n_exchanges`/`last_seen_at` bookkeeping. Reads
(exchange counts, the assembler) use `Store.query`; other processes read through the store's SQL endpoint
as usual (`polar-mitm sql`, `polar_mitm.store.query`).

Engine reachability. The node asks its engine(s) for `/models` when it starts and every ENGINE_PROBE_SECONDS
after; `health()` reports the last answer (the rollout server's GET /health), so a dead engine shows there
rather than only as sessions that time out.

Scale-out: the ray package (polar_mitm/rollout/ray/) runs one GatewayNode per Ray node (ray/actor.py, a Ray
actor) and implements `Node` by forwarding check / run_session to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field, field_validator

from polar_mitm import harnesses
from polar_mitm.api_auth import GATEWAY_TOKEN_ENV
from polar_mitm.errors import GatewayStartError, RequestRejected
from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.rollout import relay, runtimes
from polar_mitm.rollout.backend import ControlCall, GatewayReply
from polar_mitm.rollout.models import SessionResult, TaskRequest, TrajectorySummary, UploadStep
from polar_mitm.rollout.relay_dirs import SOCKET, make_relay_dir, reap_relay_dirs
from polar_mitm.rollout.runtimes import GatewayAccess, Sandbox, SandboxSpec
from polar_mitm.rollout.session_run import ExchangeOutcomes, Report, SessionRun, SessionWork, StageLimits, Stages
from polar_mitm.store import MATERIAL, ExchangeStore, StoreReader, now
from polar_mitm.util import free_port, listening, load_function

log = logging.getLogger("polar_mitm.rollout")


# gateway options the node sets itself: sandboxes reach it at 127.0.0.1 (gateway_url, the relay); every sandbox
# gets its own session credentials, so the gateway refuses traffic without them; it runs on a thread, without mitmweb
NODE_OPTIONS = {"host": "127.0.0.1", "require_auth": True, "web": False}


class NodeConfig(BaseModel):
    gateway: GatewayConfig = Field(
        description="The node's gateway: it owns the store (`gateway.db`); NODE_OPTIONS override its values. Its port: a free one "
        "unless set (0 or unset); a port that is set is taken as is, so several nodes on one machine cannot share it."
    )
    output_dir: Path | None = Field(None, description="Harness logs and Parquet files (default: <db>.rollouts/ beside the store).")
    limits: StageLimits = Field(default_factory=StageLimits)
    sandbox_owner: str | None = Field(None, description="Tag for this node's sandboxes (rollout/durable.py sandbox_owner): a restarted server reaps what a killed one left.")

    @field_validator("gateway")
    @classmethod
    def _free_port_unless_set(cls, gateway: GatewayConfig) -> GatewayConfig:
        # GatewayConfig's port defaults to the gateway command's 8080; a node left with it would clash with every
        # other node (and anything else) on its machine, so a port nobody set is a free one, as `rollout serve` does
        if "port" not in gateway.model_fields_set:
            return gateway.model_copy(update={"port": 0})
        return gateway


# what a trainer checks of a session before it trains on it (TrajectorySummary): over its trajectory material
ROLLOUT_COUNTS = f"""
    SELECT count(*) FILTER (WHERE output_parse_error IS NOT NULL), count(*) FILTER (WHERE render_mode = 'tokens'),
           count(*) FILTER (WHERE bridged), count(*) FILTER (WHERE render_mode = 'tokens' AND bridge_reason IS DISTINCT FROM 'first_turn')
    FROM exchanges WHERE {MATERIAL}"""  # of one session: Store.query(..., session=)
PORT_ATTEMPTS = 3  # free ports tried when the one picked is taken before the gateway binds it
ENGINE_PROBE_SECONDS = 5.0  # between the node's checks that its engine(s) answer
ENGINE_PROBE_TIMEOUT = 3.0


class EngineReach(BaseModel):
    """Whether one engine answered the node's last `GET <url>/models`."""

    url: str
    reachable: bool
    error: str | None = None


async def probe_engines(upstream: str | None) -> list[EngineReach]:
    """Ask each engine of a gateway's `upstream` (comma-separated URLs) for its models, at once."""
    urls = [url.strip() for url in (upstream or "").split(",") if url.strip()]

    async def one(client: httpx.AsyncClient, url: str) -> EngineReach:
        try:
            reply = await client.get(f"{url.rstrip('/')}/models")
        except httpx.HTTPError as error:
            return EngineReach(url=url, reachable=False, error=f"{type(error).__name__}: {error}".rstrip(": "))
        return EngineReach(url=url, reachable=reply.is_success, error=None if reply.is_success else f"GET /models: HTTP {reply.status_code}")

    async with httpx.AsyncClient(trust_env=False, timeout=ENGINE_PROBE_TIMEOUT) as client:
        return list(await asyncio.gather(*(one(client, url) for url in urls)))


async def gateway_control(gateway_url: str, call: ControlCall) -> GatewayReply:
    """`call` sent to one gateway's /control/* (loopback: the node's own gateway), its answer passed back as is."""
    headers = {"content-type": "application/json", **({"authorization": call.authorization} if call.authorization else {})}
    # no timeout: a pause(drain) answers once the gateway's calls have finished, bounded by its own timeout_seconds
    async with httpx.AsyncClient(trust_env=False, timeout=None) as client:
        reply = await client.request(call.method, f"{gateway_url}/control/{call.action}", content=call.body, headers=headers)
    try:
        body = reply.json()
    except ValueError:
        body = {"error": {"type": "not_json", "message": reply.text[:500]}}
    return GatewayReply(status=reply.status_code, body=body if isinstance(body, dict) else {"answer": body})


class InProcessGateway:
    """mitmproxy with the polar addon on its own thread and event loop, in this process."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.master: Any = None
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    @property
    def store(self) -> ExchangeStore:
        store = self.master.addons.get("polaraddon").store if self.master else None
        if store is None:
            raise RuntimeError("the gateway's store is not open")
        return store

    def start(self, timeout: float = 60.0) -> None:
        created = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(created,), name="polar-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        ca = Path(self.config.confdir).expanduser() / "mitmproxy-ca-cert.pem"
        while time.monotonic() < deadline:
            if self.failure is not None or not self.thread.is_alive():
                raise GatewayStartError(self.config.port, self.startup_errors() or [repr(self.failure)])
            if created.is_set() and ca.exists() and listening(self.config.port) and self.master.addons.get("polaraddon").started.is_set():
                return
            time.sleep(0.05)
        raise TimeoutError(f"the gateway did not listen on 127.0.0.1:{self.config.port} within {timeout:.0f}s")

    def _main(self, created: threading.Event) -> None:
        from polar_mitm.gateway.server import make_master, release_log_handlers

        async def serve() -> None:
            self.master = make_master(self.config, start_line=sys.stderr, rollout_node=True)
            created.set()
            await self.master.run()

        try:
            asyncio.run(serve())
        except BaseException as error:  # noqa: BLE001 - SystemExit from mitmproxy's startup check included
            self.failure = error
            if self.master is not None:
                release_log_handlers(self.master)

    def startup_errors(self) -> list[str]:
        """Why the gateway exited while starting: what its startup check logged, one line each."""
        from polar_mitm.gateway.server import startup_message

        check = self.master.addons.get("errorcheck") if self.master is not None else None
        return [startup_message(record.getMessage()) for record in check.logger.has_errored] if check is not None else []

    def stop(self) -> None:
        if self.master is not None and self.thread is not None and self.thread.is_alive():  # one that failed to start has no loop left
            self.master.shutdown()
        if self.thread is not None:
            self.thread.join(timeout=30)


class GatewayNode:
    """This machine: its gateway, store, sandboxes and stage limits. Implements scheduler.Node."""

    def __init__(self, config: NodeConfig):
        # sandboxes run elsewhere: every path handed to them must be absolute
        self.confdir = Path(config.gateway.confdir).expanduser().resolve()
        self.config = config
        self.port = config.gateway.port or free_port()
        self.output_dir = (config.output_dir or config.gateway.db.with_suffix(".rollouts")).resolve()
        self.gateway = InProcessGateway(config.gateway.model_copy(update={"port": self.port, "confdir": str(self.confdir), **NODE_OPTIONS}))
        self.stages: Stages | None = None
        self.relay_dir: Path | None = None
        self.relay_server: asyncio.AbstractServer | None = None
        self.engines: list[EngineReach] = []  # the last probe's answer (empty: none yet)
        self.engine_watch: asyncio.Task | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store(self) -> ExchangeStore:
        return self.gateway.store

    async def start(self) -> None:
        for attempt in range(PORT_ATTEMPTS):
            try:
                await asyncio.to_thread(self.gateway.start)
                break
            except GatewayStartError as error:
                if self.config.gateway.port or not error.port_in_use or attempt == PORT_ATTEMPTS - 1:
                    raise
                # the free port picked in __init__ was taken before the gateway bound it (e.g. by another node
                # starting on this machine at the same moment): another free one
                log.warning(f"polar node: gateway port {self.port} was taken meanwhile; trying another")
                self.port = free_port()
                self.gateway = InProcessGateway(self.gateway.config.model_copy(update={"port": self.port}))
        self.output_dir.mkdir(parents=True, exist_ok=True)  # once the gateway is up: a node that cannot start leaves none
        self.stages = Stages(self.config.limits)
        # sandboxes without a network reach the gateway through this socket (mounted into containers)
        await asyncio.to_thread(reap_relay_dirs)  # a glob and a connect per folder: off the event loop
        self.relay_dir = make_relay_dir()
        self.relay_server = await relay.serve_unix_to_tcp(str(self.relay_dir / SOCKET), "127.0.0.1", self.port)
        self.engines = await probe_engines(self.config.gateway.upstream)
        self.engine_watch = asyncio.create_task(self._watch_engines(), name="polar node engine probe")

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_PROBE_SECONDS)
            self.engines = await probe_engines(self.config.gateway.upstream)

    @property
    def engine_reachable(self) -> bool | None:
        """Some engine of the gateway answered the last probe (None: no probe yet)."""
        return any(engine.reachable for engine in self.engines) if self.engines else None

    async def stop(self) -> None:
        if self.engine_watch is not None:
            self.engine_watch.cancel()
            await asyncio.gather(self.engine_watch, return_exceptions=True)
        if self.relay_server is not None:
            self.relay_server.close()
        if self.relay_dir is not None:
            shutil.rmtree(self.relay_dir, ignore_errors=True)
        await asyncio.to_thread(self.gateway.stop)

    def health(self) -> dict[str, Any]:
        return {
            "gateway": self.gateway_url, "gateway_listening": listening(self.port), "upstream": self.config.gateway.upstream,
            "engine_reachable": self.engine_reachable, "engines": [engine.model_dump() for engine in self.engines],
            "db": str(self.config.gateway.db), "limits": self.config.limits.model_dump(),
        }

    async def control(self, call: ControlCall) -> GatewayReply:
        """A control call on this node's gateway."""
        return await gateway_control(self.gateway_url, call)

    # -- the Node interface
    async def check(self, request: TaskRequest) -> None:
        await asyncio.to_thread(self._check, request)

    def _check(self, request: TaskRequest) -> None:
        runtime = request.runtime
        harness = harnesses.get(request.agent.harness)
        if runtime.backend == "local" or runtime.mount_harnesses:
            try:
                harness.executable()
            except harnesses.HarnessNotInstalled as error:
                raise RequestRejected(("agent", "harness"), str(error)) from None
        if runtime.backend == "docker":
            from polar_mitm.rollout.runtimes import docker

            try:
                docker.client()
            except docker.DockerUnavailable as error:
                raise RequestRejected(("runtime", "backend"), str(error)) from None
            try:
                docker.check_image(runtime.image)
            except docker.DockerUnavailable as error:
                raise RequestRejected(("runtime", "image"), str(error)) from None
        for index, step in enumerate(runtime.prepare):
            if isinstance(step, UploadStep) and step.upload.source is not None and not Path(step.upload.source).expanduser().exists():
                raise RequestRejected(("runtime", "prepare", str(index), "upload", "source"), f"{step.upload.source!r} does not exist on the rollout server's machine")
        if request.evaluator is not None and request.evaluator.python is not None:
            try:
                load_function(request.evaluator.python)
            except Exception as error:  # noqa: BLE001 - any import failure is the request's problem
                raise RequestRejected(("evaluator", "python"), f"cannot load {request.evaluator.python!r}: {error}") from None

    async def run_session(self, work: SessionWork, report: Report) -> SessionResult:
        assert self.stages is not None, "start() the node first"
        return await SessionRun(work, self, self.stages, report).run()

    async def export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        return await asyncio.to_thread(self._export_task, task_id, session_ids, builder, options)

    def _export_task(self, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        from polar_mitm.assembler.export import store_trajectories

        path, stats = export_sessions(self.store, task_id, session_ids, builder, options, self.output_dir / f"{task_id}.parquet")
        stats["table"] = store_trajectories(None, path, store_object=self.store).message
        return str(path), stats

    # -- the Workbench SessionRun uses
    async def create_sandbox(self, work: SessionWork) -> Sandbox:
        access = GatewayAccess(url=self.gateway_url, confdir=self.confdir, relay_socket=self.relay_dir / SOCKET if self.relay_dir else None)
        return await runtimes.create(SandboxSpec(sandbox_id=work.session_id, runtime=work.request.runtime, gateway=access, owner=self.config.sandbox_owner))

    async def count_exchanges(self, session_id: str) -> int:
        _, rows = await asyncio.to_thread(self.store.query, "SELECT count(*) FROM exchanges", None, session_id)
        return int(rows[0][0])

    async def settle_exchanges(self, session_id: str, timeout: float) -> int:
        # an exchange gets its seq when the gateway begins it, its row when it ends: fewer rows than seqs is a call
        # still in flight (its client just went away: the gateway cancels it and commits the row within moments)
        deadline = time.monotonic() + timeout
        while True:
            open_calls = self.store.issued_seqs(session_id) - await self.count_exchanges(session_id)
            if open_calls <= 0 or time.monotonic() >= deadline:
                return max(open_calls, 0)
            await asyncio.sleep(0.05)

    async def exchange_outcomes(self, session_id: str) -> ExchangeOutcomes:
        _, rows = await asyncio.to_thread(self.store.query, "SELECT status, count(*), any_value(error) FROM exchanges GROUP BY status", None, session_id)
        return {str(status): (int(count), error) for status, count, error in rows}

    async def build(self, session_id: str, builder: str, options: dict[str, Any]) -> TrajectorySummary:
        return await asyncio.to_thread(self._build, session_id, builder, options, await self._policy_version())

    async def _policy_version(self) -> int | None:
        """The node gateway's policy version now (None if it does not say)."""
        token = os.environ.get(GATEWAY_TOKEN_ENV)  # the node's gateway inherits it from this process
        try:
            reply = await self.control(ControlCall(method="GET", action="status", authorization=f"Bearer {token}" if token else None))
        except httpx.HTTPError:
            return None
        version = reply.body.get("policy_version") if reply.status == 200 else None
        return version if isinstance(version, int) else None

    def _build(self, session_id: str, builder: str, options: dict[str, Any], policy_version: int | None = None) -> TrajectorySummary:
        from polar_mitm.assembler import assemble

        _, [(parse_failures, tokens_rows, bridged, bridgeable)] = self.store.query(ROLLOUT_COUNTS, session=session_id)
        counts = {
            "tool_call_parse_failures": int(parse_failures), "tokens_mode_exchanges": int(tokens_rows),
            "bridged_fraction": round(bridged / bridgeable, 4) if bridgeable else None, "policy_version": policy_version,
        }
        try:
            assembled = assemble(None, builder, session_id, store=self.store, lenient=bool(options.get("lenient")))
        except LookupError:
            return TrajectorySummary(builder=builder, **counts)
        stats, versions = assembled.stats, [[s.min_policy_version, s.max_policy_version] for s in assembled.sequences]
        return TrajectorySummary(
            builder=builder, sequences=stats.sequences, exchanges=stats.exchanges, sampled_tokens=stats.sampled_tokens,
            sequence_tokens=stats.sequence_tokens, breaks={kind: n for kind, n in stats.breaks.items() if n},
            sequence_policy_versions=versions,
            staleness=[None if policy_version is None or low is None else policy_version - low for low, _ in versions], **counts,
        )

    async def record(self, result: SessionResult) -> None:
        stamp = now()
        params = [
            result.session_id, stamp, stamp, result.harness, result.task_id, result.status, result.reward,
            json.dumps({stage: timing.model_dump(mode="json") for stage, timing in result.timings.items()}),
            json.dumps(result.metadata), result.error,
        ]
        await asyncio.to_thread(self.store.execute_write, RECORD_SESSION, params)


def export_sessions(store: StoreReader, task_id: str, session_ids: list[str], builder: str, options: dict[str, Any], path: Path) -> tuple[Path, dict[str, Any]]:
    """Assemble a task's sessions from `store` (the node's Store, a cluster's UnionStore) into the task's Parquet
    in one assembly pass over just those sessions (their GRPO group read from the whole store): (path, stats)."""
    from polar_mitm.assembler import assemble
    from polar_mitm.assembler.export import write_parquet

    # a session without trajectory material (no model exchange was ever answered) yields no sequence
    assembly = assemble(None, builder, store=store, session_ids=session_ids, lenient=bool(options.get("lenient")))
    sequences = assembly.sequences
    groups = [g for g in assembly.groups if g.group_id == task_id]
    path = write_parquet(sequences, path)
    return path, {
        "builder": builder,
        "sequences": len(sequences),
        "sessions": len({s.session_id for s in sequences}),
        "trainable_sequences": sum(s.trainable for s in sequences),
        "sampled_tokens": sum(s.sampled_tokens for s in sequences),
        "trainable_tokens": sum(sum(s.loss_mask) for s in sequences),
        "sequence_tokens": sum(len(s.input_ids) for s in sequences),
        "group": groups[0].model_dump() if groups else None,
    }


# n_exchanges starts at 0 so the gateway's `n_exchanges + 1` counts on from it; its columns are left alone
RECORD_SESSION = (
    "INSERT INTO sessions (session_id, created_at, last_seen_at, n_exchanges, harness, task_id, status, reward, timings, metadata, error) "
    "VALUES (?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (session_id) DO UPDATE SET task_id = excluded.task_id, status = excluded.status, reward = excluded.reward, "
    "timings = excluded.timings, metadata = excluded.metadata, error = excluded.error, harness = coalesce(sessions.harness, excluded.harness)"
)
