"""The polar addon: serve model calls from the training engine and commit each exchange before replying.

One exchange, top to bottom: session (proxy credentials, or a capture namespace's address) -> dialect (parse) ->
engine (one non-streaming call, token ids + logprobs, into the exchange's EngineRecord) -> store (committed) ->
dialect (the provider's JSON or SSE stream). Whatever happens, the row and the answer come from one mapping
(gateway/outcome.py), for a JSON reply and a stream alike.

Length: one mitmproxy addon (one class, as mitmproxy's own), the one exchange read top to bottom; its parts live in
the modules beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import gc
import json
import logging
import sys
import time
import weakref
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from mitmproxy import addonmanager, connection, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ProxyMode, TransparentMode

from polar_mitm import api_auth, capture, dialects, routing, session
from polar_mitm.dialects import CountsTokens, Dialect
from polar_mitm.engines import EngineClient, Reachability, make_engine
from polar_mitm.engines.pool import CURRENT_SESSION
from polar_mitm.errors import CallAbandoned, ConfigError, PolarError, RenderError
from polar_mitm.exchange import EngineError, EngineRecord, ParsedRequest, StreamState
from polar_mitm.gateway import flows, options
from polar_mitm.gateway.control import PolicyControl
from polar_mitm.gateway.delivery import Deliveries
from polar_mitm.gateway.engine_side import EngineHook, EngineSide, unstreamed_timeout
from polar_mitm.gateway.heap import HeapTrimmer
from polar_mitm.gateway.outcome import CommitFailed, Outcome, forget_tracebacks, outcome_of, settle
from polar_mitm.gateway.startup import open_when_readers_leave, why_not_opened
from polar_mitm.gateway.store_process import StoreProcess
from polar_mitm.gateway.streaming import LoopbackStreams, StreamedReply
from polar_mitm.render.serve import TokenPath
from polar_mitm.store import ExchangeRow, ExchangeStore, now
from polar_mitm.util import load_function

log = logging.getLogger("polar_mitm.gateway")

T = TypeVar("T")
# how often an exchange waiting on the engine looks whether its client is still there: mitmproxy queues the
# client's disconnect until our request hook returns, so the hook has to look itself
CLIENT_CHECK_S = 0.25
# at a clean stop, how long calls cancelled on the engine get to commit their rows before the store closes
SHUTDOWN_COMMIT_S = 10.0
# a streamed call's headers wait this long for the engine: a fast failure (a prompt over the context, a request
# the engine refuses) is still answered with the provider's HTTP error, which harnesses handle best; after that,
# headers, the opening events and keepalives go out (well inside the 1 s a first byte is allowed)
STREAM_HOLD_S = 0.3


class PolarAddon:
    def __init__(self, start_line: TextIO | None = None, rollout_node: bool = False) -> None:
        # where the one 'listening on ...' line goes: stdout for `polar-mitm gateway`; a rollout node's in-process
        # gateway sends it to stderr, so the command's own output (its results table) stays clean
        self.start_line = start_line
        # a rollout server's own gateway: announced as a node, which default discovery (`polar-mitm run`) skips,
        # since its store is the rollout server's
        self.rollout_node = rollout_node
        self.store: ExchangeStore | None = None
        self.engine: EngineClient | None = None
        self.secret: bytes = b""
        self.sessions_by_connection: weakref.WeakKeyDictionary[connection.Client, tuple[str, str] | None] = weakref.WeakKeyDictionary()
        self.model_map: list[tuple[str, str | None]] = []
        self.announced: tuple[Path, str] | None = None  # GATEWAY_FILE and our entry in it
        self.engine_hook: EngineHook | None = None
        self.engine_calls: set[asyncio.Future[Any]] = set()  # in flight; cancelled at a clean stop
        self.open_exchanges = 0  # started and not yet committed
        self.all_committed = asyncio.Event()  # set while open_exchanges is 0
        self.all_committed.set()
        self.started = asyncio.Event()  # the store is open: running() is through
        self.tokens: TokenPath | None = None  # --render tokens
        self.streams = LoopbackStreams()  # streamed replies leave through a loopback server (gateway/streaming.py)
        self.stream_tasks: set[asyncio.Task[None]] = set()
        self.deliveries = Deliveries(self._mark)  # replies committed ok that may never reach their client (delivery.py)
        self.control = PolicyControl(model_exists=self._engine_serves, engines=lambda: self.engine.reachability() if self.engine else [])
        self.listen: tuple[str, int] | None = None
        self.log_shown = True  # mitmproxy's termlog prints our log (-v, --web); else warnings are printed (_tell)
        self.trimmer: HeapTrimmer | None = None  # gives freed memory back to the OS (gateway/heap.py)

    def load(self, loader: addonmanager.Loader) -> None:
        options.declare(loader)  # polar_<name> for each row of gateway/options.py

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # eager would resolve provider hostnames on CONNECT, before any hook; offline that is a 502
            ctx.options.connection_strategy = "lazy"
        try:
            options.check_choices(ctx.options, updated)  # engine kind, render mode, tool parser: their registries' names
        except ConfigError as error:
            raise exceptions.OptionsError(str(error)) from error
        engine_options = ("polar_upstream", "polar_engine", "polar_engine_model", "polar_engine_timeout", "polar_split_reasoning", "polar_engine_max_model_len")
        if updated.intersection(engine_options):
            upstream = ctx.options.polar_upstream
            if upstream and not all(url.strip().startswith(("http://", "https://")) for url in upstream.split(",")):
                raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL (or several, comma-separated), got {upstream!r}")
            if ctx.options.polar_engine_timeout <= 0:
                raise exceptions.OptionsError("polar_engine_timeout must be positive")
            if ctx.options.polar_engine_max_model_len < 0:
                raise exceptions.OptionsError("polar_engine_max_model_len must be 0 (from /models) or positive")
            self.engine = make_engine(
                ctx.options.polar_engine, upstream, ctx.options.polar_engine_model or None, ctx.options.polar_engine_timeout,
                ctx.options.polar_split_reasoning, ctx.options.polar_engine_max_model_len or None,
            ) if upstream else None
            for reach in self.engine.reachability() if self.engine else []:
                reach.on_change = self._engine_changed
        if updated & {"polar_upstream", "polar_engine", "polar_engine_model", "polar_engine_timeout", "polar_split_reasoning", "polar_engine_max_model_len", "polar_render", "polar_render_model", "polar_tool_parser"}:
            render = ctx.options.polar_render
            several = "," in ctx.options.polar_upstream
            if render == "tokens" and several:
                raise exceptions.OptionsError("polar_render tokens works with one upstream engine; several are routed in chat mode only")
            if render == "auto" and several:
                log.warning("polar: --render auto: chat mode (the engine renders prompts), since several upstream engines are routed in chat mode only")
            tokens = self.engine if render == "tokens" or (render == "auto" and not several) else None
            self.tokens = TokenPath(
                tokens, ctx.options.polar_render_model or None, ctx.options.polar_tool_parser, stored=lambda: self.store, fallback=render == "auto",
                lineage_bytes=ctx.options.polar_lineage_mb << 20,
            ) if tokens is not None else None
        if "polar_lineage_mb" in updated:
            if ctx.options.polar_lineage_mb < 1:
                raise exceptions.OptionsError("polar_lineage_mb must be at least 1")
            if self.tokens is not None:  # the lineages held so far stay; the next turn remembered evicts down to it
                self.tokens.lineages.max_bytes = ctx.options.polar_lineage_mb << 20
        if "polar_model_map" in updated:
            self.model_map = []
            for entry in ctx.options.polar_model_map:
                pattern, _, target = entry.partition("=")
                if not pattern:
                    raise exceptions.OptionsError(f"polar_model_map entry {entry!r} has no pattern")
                self.model_map.append((pattern, target or None))
        if "polar_engine_hook" in updated:
            try:
                self.engine_hook = load_function(ctx.options.polar_engine_hook) if ctx.options.polar_engine_hook else None
            except ConfigError as error:
                raise exceptions.OptionsError(f"polar_engine_hook: {error}") from error
        if "polar_db" in updated and self.store is not None:
            # changed while running (mitmweb's options): move to the new store; before running() nothing is
            # opened, so a bad option value leaves no file behind
            self.store.close()
            self.store = None
            self._open_store()
        if "polar_policy_version" in updated:
            if ctx.options.polar_policy_version < 0:
                raise exceptions.OptionsError("polar_policy_version must be >= 0")
            self.control.policy_version = ctx.options.polar_policy_version
        if "confdir" in updated or not self.secret:
            self.secret = session.load_secret(ctx.options.confdir)
        if "polar_keepalive_interval" in updated and ctx.options.polar_keepalive_interval < 0:
            raise exceptions.OptionsError("polar_keepalive_interval must be 0 (off) or positive")
        if "polar_heap_trim_s" in updated:
            if ctx.options.polar_heap_trim_s < 0:
                raise exceptions.OptionsError("polar_heap_trim_s must be 0 (never) or positive")
            if self.started.is_set():  # changed while running (mitmweb, --set): the trimmer follows
                self._trim_heap()
        if "polar_store_merge_fanin" in updated and (ctx.options.polar_store_merge_fanin < 0 or ctx.options.polar_store_merge_fanin == 1):
            raise exceptions.OptionsError("polar_store_merge_fanin must be 0 (off) or at least 2 (tables merged at a time)")
        for name in updated & {"polar_store_memory_mb", "polar_store_journal_mb", "polar_store_compact_slice_mb"}:
            if getattr(ctx.options, name) < 0:
                raise exceptions.OptionsError(f"{name} must be 0 (DuckDB's default / no limit) or positive")

    def _open_store(self) -> None:
        db = Path(ctx.options.polar_db)
        try:
            # the store says in one line when it cannot write and when it writes again (not a line per request)
            bounds = (ctx.options.polar_store_memory_mb, ctx.options.polar_store_journal_mb, ctx.options.polar_store_compact_slice_mb, ctx.options.polar_store_merge_fanin)
            self.store = StoreProcess(db, *bounds, self._tell) if ctx.options.polar_store_process else open_when_readers_leave(db, *bounds, self._tell)
            self.store.serve_sql(ctx.options.polar_sql_port)
        except Exception as error:  # noqa: BLE001 - a startup failure, told in one line (errorcheck exits)
            if self.store is not None:
                self.store.close()
                self.store = None
            log.error(f"cannot open the store {db.resolve()}: {why_not_opened(db, ctx.options.confdir, error)}")

    async def running(self) -> None:
        self.log_shown = ctx.master.addons.get("termlog") is not None
        # where it really listens (mitmproxy has bound its listeners by now): beyond loopback, without a token, its
        # /control/* would be open to the network
        proxyserver = ctx.master.addons.get("proxyserver")
        for host, *_ in proxyserver.listen_addrs() if proxyserver else []:
            if refusal := api_auth.refusal_to_listen(host, ctx.options.polar_control_token or None, "the gateway", "polar_control_token"):
                log.error(refusal)
                return  # errorcheck stops the gateway, before the store is opened
        model = None
        if self.engine is None:
            log.warning("polar: no polar_upstream set; model calls will be answered 503")
        else:
            try:
                model = await self.engine.discover()
                if self.tokens is not None and await self.tokens.in_use():
                    renderer = await self.tokens.renderer()  # now rather than in the first exchange (seconds)
                    log.info(f"polar: tokens mode renders with the chat template of {renderer.source} (tool parser {self.tokens.tool_format})")
            except RenderError as error:  # kept: every model call is answered with it
                log.warning(f"polar: tokens mode: {error.message}")
            except EngineError as error:
                if error.status_class == "engine_url_wrong":
                    # the engine is there but this is not its API root: every call would fail the same way
                    log.error(f"--upstream {self.engine.base_url}: {error.message}")
                    return  # errorcheck stops the gateway, before the store is opened
                # not fatal: the engine may come up later; each call retries discovery. Unreachable is said by
                # _engine_changed (once, and again when it answers)
                if error.status_class != "engine_unreachable":
                    log.warning(f"polar: {error.message}")
        # off the event loop: opening may wait for a reader's lock (open_when_readers_leave) while mitmproxy listens
        await asyncio.to_thread(self._open_store)
        if self.store is None:
            return  # errorcheck stops the gateway with the logged cause
        await self.streams.start()
        self._trim_heap()
        self.started.set()
        self._announce()
        # everything alive now (mitmproxy, its certificates, our modules) lives as long as the proxy: out of the
        # collector's view, a full collection no longer walks it; those had paused the event loop for 50-90 ms
        gc.freeze()
        engine = f"{self.engine.kind} {self.engine.base_url} serving {model!r}" if self.engine and model else (f"{self.engine.kind} {self.engine.base_url} (not answering yet)" if self.engine else "none")
        # printed, not logged: without -v this is the one line that says the gateway is up
        print(f"polar-mitm gateway: listening on {self.proxy_url()}, store {Path(ctx.options.polar_db).resolve()}, engine {engine}, render {self._render_said()}", file=self.start_line or sys.stdout, flush=True)

    def _trim_heap(self) -> None:
        """(Re)start the heap trimmer at polar_heap_trim_s (none at 0)."""
        if self.trimmer is not None:
            self.trimmer.stop()
            self.trimmer = None
        if ctx.options.polar_heap_trim_s > 0:
            self.trimmer = HeapTrimmer(ctx.options.polar_heap_trim_s)
            self.trimmer.start()

    def _render_said(self) -> str:
        """The render mode for the start line: as asked, and for auto the mode it chose (its reason, if chat, is the
        warning line before)."""
        asked = ctx.options.polar_render
        if asked != "auto":
            return asked
        chosen = self.tokens.chosen if self.tokens is not None else "chat"
        return f"auto: {chosen}" if chosen else "auto (tokens or chat: chosen when the engine answers)"

    def _engine_changed(self, reach: Reachability) -> None:
        """An engine URL stopped or started answering: said once per change, not per call (a harness retrying
        against a dead engine makes a row per call, minutes of them)."""
        if reach.reachable:
            self._tell(f"engine {reach.url} answers again, after {reach.down_seconds or 0:.0f}s unreachable ({reach.failed_calls} calls failed meanwhile)")
        else:
            self._tell(f"engine {reach.url} is unreachable ({reach.last_error}); model calls are answered 503 engine_unreachable until it answers")

    def _tell(self, message: str) -> None:
        """A warning a user must see: logged, and printed to stderr when nothing shows the log (without -v)."""
        log.warning(f"polar: {message}")
        if not self.log_shown:
            print(f"polar-mitm gateway: {message}", file=sys.stderr, flush=True)

    def transparent_listener(self) -> tuple[str, int] | None:
        """Where this gateway listens in transparent mode (a `transparent@...` in mitmproxy's `mode`), if it does."""
        for spec in ctx.options.mode:
            mode = ProxyMode.parse(spec)
            if isinstance(mode, TransparentMode):
                return mode.listen_host() or "127.0.0.1", mode.listen_port() or 8080
        return None

    def proxy_url(self) -> str | None:
        proxyserver = ctx.master.addons.get("proxyserver")
        transparent = self.transparent_listener()
        addresses = [a for a in (proxyserver.listen_addrs() if proxyserver else []) if transparent is None or a[1] != transparent[1]]
        if not addresses:
            return None
        host, port = addresses[0][:2]
        self.listen = (host, port)
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        return f"http://{host}:{port}"

    def _announce(self) -> None:
        """Leave the proxy URL in the confdir, so `polar-mitm run` finds this gateway without flags."""
        if url := self.proxy_url():
            transparent = self.transparent_listener()
            listener = f"{transparent[0]}:{transparent[1]}" if transparent else None
            self.announced = (routing.announce_gateway(ctx.options.confdir, url, Path(ctx.options.polar_db).resolve(), node=self.rollout_node, transparent=listener), url)

    async def done(self) -> None:
        if self.announced is not None:
            routing.withdraw_gateway(*self.announced)
        # a clean stop cancels the calls in flight (the engine aborts them) and records them gateway_shutdown
        for call in list(self.engine_calls):
            call.cancel()
        if self.stream_tasks:
            # streamed exchanges finish their rows (gateway_shutdown) and tell their clients in the stream
            await asyncio.wait(set(self.stream_tasks), timeout=SHUTDOWN_COMMIT_S)
        await self.streams.close()
        if self.open_exchanges:
            try:
                await asyncio.wait_for(self.all_committed.wait(), SHUTDOWN_COMMIT_S)
            except TimeoutError:
                log.error(f"polar: {self.open_exchanges} exchanges were not committed within {SHUTDOWN_COMMIT_S:g}s of the stop")
        await self.deliveries.settled()
        if self.engine is not None:
            await self.engine.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.trimmer is not None:
            self.trimmer.stop()
            self.trimmer = None

    # -- session attribution
    def http_connect(self, flow: http.HTTPFlow) -> None:
        credentials = session.parse_proxy_authorization(flow.request.headers.get("proxy-authorization"))
        if ctx.options.polar_require_auth and not session.credentials_valid(self.secret, credentials):
            flow.response = flows.proxy_auth_required()
            return
        self.sessions_by_connection[flow.client_conn] = credentials
        flow.request.headers.pop("proxy-authorization", None)  # read once; the session's credential stays in no flow

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.deliveries.asked(flow.client_conn.id)  # HTTP/1: the reply before this request on the connection was read
        if flow.response is not None or self._is_control(flow):
            return
        if flow.is_replay:
            # mitmproxy's replay (mitmweb's Replay, `replay.client`) re-runs this flow or a copy of it without a
            # proxy connection, so without credentials: it keeps the session in its metadata, which survives
            # copies and flow files; its row is flagged replay, which keeps it out of trajectories
            return
        if flow.client_conn not in self.sessions_by_connection and isinstance(flow.client_conn.proxy_mode, TransparentMode):
            # no proxy, no credentials: the session is what its capture namespace registered for the client's address,
            # read once per connection (a file read; the namespace outlives its connections)
            registration = capture.registered_session(ctx.options.confdir, flow.client_conn.peername[0])
            if registration is None and ctx.options.polar_require_auth:
                flow.response = flows.capture_unregistered(flow.client_conn.peername[0])
                return
            self.sessions_by_connection[flow.client_conn] = (registration.session_id, "") if registration else None
        if flow.client_conn in self.sessions_by_connection:
            credentials = self.sessions_by_connection[flow.client_conn]
        else:
            # a plain-HTTP proxied request carries its credentials itself
            credentials = session.parse_proxy_authorization(flow.request.headers.get("proxy-authorization"))
            if ctx.options.polar_require_auth and not session.credentials_valid(self.secret, credentials):
                flows.scrub_flow(flow)
                flow.response = flows.proxy_auth_required()
                return
        flow.request.headers.pop("proxy-authorization", None)
        flow.metadata["polar_session"] = credentials[0] if credentials else session.DEFAULT_SESSION

    # -- the exchange
    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        if self._is_control(flow):
            await self._answer_control(flow)
            return
        path = flow.request.path.split("?", 1)[0]
        dialect = dialects.dialect_for(flow.request.method, path)
        if dialect is None:
            self._answer_non_model(flow)
            return
        await self._exchange(flow, dialect, path)

    # -- the control API (pause/resume for weight updates; gateway/control.py)
    def _is_control(self, flow: http.HTTPFlow) -> bool:
        """A request sent to the gateway itself (not proxied, not in a tunnel) for /control/* or the dashboard (/ui)."""
        if not flow.request.path.startswith(("/control/", "/ui")) or self.listen is None or flow.client_conn in self.sessions_by_connection:
            return False
        host, port = self.listen
        return flow.request.port == port and (flow.request.host in (host, *LOOPBACK_HOSTS) or host in ANY_HOST)

    async def _answer_control(self, flow: http.HTTPFlow) -> None:
        # one token guards /control/* and the dashboard (/ui): it shows every recorded prompt
        token = ctx.options.polar_control_token
        assert self.listen is not None
        if token:
            allowed = api_auth.bearer_matches(flow.request.headers.get("authorization"), token)
            status, body = (200, {}) if allowed else (401, {"error": {"type": "unauthorized", "message": "control needs 'Authorization: Bearer <polar_control_token>'"}})
        elif not api_auth.is_loopback(self.listen[0]):
            # not started so (running() refuses), but mitmproxy listens before running(): never answer unguarded
            status, body = 403, {"error": {"type": "forbidden", "message": "this gateway listens beyond loopback: set polar_control_token (--control-token) to use /control/* and /ui"}}
        else:
            status, body = 200, {}
        if status == 200 and flow.request.path.startswith("/ui"):  # the read-only dashboard (issue 30): polar_mitm/ui/gateway.py
            from polar_mitm.ui.gateway import answer_ui

            return await answer_ui(flow, self)
        if status == 200:
            status, body = await self.control.handle(flow.request.method, flow.request.path.split("?", 1)[0], flow.request.get_content(strict=False) or b"")
        flow.response = http.Response.make(status, json.dumps(body), {"content-type": "application/json"})
        flow.metadata["polar_local"] = True

    async def _engine_serves(self, model: str) -> bool:
        if self.engine is None:
            return False
        return model in await self.engine.list_models()

    def _answer_non_model(self, flow: http.HTTPFlow) -> None:
        host = flow.request.pretty_host
        if any(fnmatch.fnmatch(host, pattern) for pattern in ctx.options.polar_passthrough):
            return  # forwarded by mitmproxy as usual
        flows.scrub_flow(flow)  # answered here: the key it carries (GET /v1/models, say) stays out of saved flows
        body = {"error": {"message": f"polar-mitm answers only model API calls; {flow.request.method} {host}{flow.request.path.split('?')[0]} was not forwarded", "type": "not_found"}}
        flow.response = http.Response.make(404, json.dumps(body), {"content-type": "application/json"})
        flow.metadata["polar_local"] = True

    async def _exchange(self, flow: http.HTTPFlow, dialect: Dialect, path: str) -> None:
        # mitmproxy listens before running(): a call that early waits for the store
        await self.started.wait()
        assert self.store is not None
        self._opened()
        self.deliveries.opened(flow)
        try:
            await self._exchange_committed(flow, dialect, path)
        except Exception as error:  # noqa: BLE001 - a bug of ours before the row was made (fuzz over the wire found one)
            # answered here in the provider's shape: mitmproxy would forward a flow its hook left unanswered
            # upstream, to the real provider, with the harness's key
            reply = flows.error_reply(dialect, self._outcome(error, flow).answer_or_raise())
            flow.response = http.Response.make(reply.status, reply.body, {"content-type": reply.content_type})
        finally:
            self._closed()

    def _opened(self) -> None:
        self.open_exchanges += 1
        self.all_committed.clear()

    def _closed(self) -> None:
        self.open_exchanges -= 1
        if not self.open_exchanges:
            self.all_committed.set()

    async def _exchange_committed(self, flow: http.HTTPFlow, dialect: Dialect, path: str) -> None:
        assert self.store is not None
        session_id = flow.metadata.get("polar_session") or session.DEFAULT_SESSION
        CURRENT_SESSION.set(session_id)  # an EngineRouter keeps the session on one engine
        row, raw_body = flows.request_row(flow, dialect.API, path, session_id, self.store.next_seq(session_id), self.engine.kind if self.engine else None)
        record = EngineRecord()
        reply: flows.HTTPReply | None = None
        failure: Exception | None = None
        try:
            parsed = dialect.parse(raw_body, path, dict(flow.request.query.items(multi=True)))
            row["model_requested"], row["stream"], row["action"] = parsed.model, parsed.stream, parsed.action
            row["ignored_fields"], row["normalizations"] = parsed.ignored, parsed.normalizations
            if parsed.stream and parsed.action == "generate" and self.streams.running:
                if await self._stream(flow, parsed, dialect, row, record):
                    return  # the reply streams on; its task commits the row
                # the engine failed at once: answered below with the provider's HTTP error
            reply = await self._while_client_waits(flow, self._serve(parsed, dialect, row, record))
        except Exception as error:  # noqa: BLE001 - every failure is recorded and answered in the provider's shape (outcome_of)
            failure = error
        outcome = self._outcome(failure, flow)
        if outcome.answer is not None:
            reply = flows.error_reply(dialect, outcome.answer)
        assert reply is not None  # without a failure, the reply was made
        if "model_requested" not in row:
            row["model_requested"] = flows.peek_model(raw_body, path)
        settle(row, record, outcome, http_status=reply.status, response_body=reply.body_json, response_stream=reply.stream_text, ended_at=now())
        try:
            await self.store.commit_exchange(row)
        except Exception as error:  # noqa: BLE001 - never reply without a committed row
            reply = flows.error_reply(dialect, self._outcome(CommitFailed(error), flow).answer_or_raise())
        else:
            self.deliveries.committed(flow, row["exchange_id"], row["status"], streamed=False)
        flow.response = http.Response.make(reply.status, reply.body, flows.reply_headers(reply.content_type, row, dialect))

    def _outcome(self, failure: Exception | None, flow: http.HTTPFlow) -> Outcome:
        """outcome_of for this flow; a bug of ours is logged with its traceback, then every failure's is dropped."""
        if isinstance(failure, CommitFailed):
            pass  # the store said so, once for the whole episode (its report)
        elif failure is not None and not isinstance(failure, PolarError):
            log.error("polar: internal error", exc_info=failure)
        forget_tracebacks(failure)
        return outcome_of(failure, self.deliveries.gone(flow))

    async def _while_client_waits(self, flow: http.HTTPFlow, call: Awaitable[T]) -> T:
        """Await `call` (the engine's part of an exchange) while its client still waits for the answer.

        When the client goes away (its connection closed, or the flow killed in mitmweb), or the gateway stops,
        the call is cancelled, which closes its engine connection: vLLM and SGLang abort a request whose
        connection closed. Raises CallAbandoned saying which; the row keeps what the call had recorded so far."""
        task = asyncio.ensure_future(call)
        self.engine_calls.add(task)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=CLIENT_CHECK_S)
                if not task.done() and (gone := self.deliveries.gone(flow)):
                    task.cancel()
                    await asyncio.wait({task})
                    raise CallAbandoned("client_disconnected", f"{gone}; the engine call was cancelled")
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self.engine_calls.discard(task)
        if task.cancelled():  # only done() cancels it: a clean stop
            raise CallAbandoned("gateway_shutdown", "the gateway was stopped while the engine worked on this call; the engine call was cancelled")
        return task.result()

    async def _serve(self, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow, record: EngineRecord) -> flows.HTTPReply:
        """The engine's part of a JSON reply (or of a stream made in one piece), recorded in `record`."""
        side = self._engine_side()
        engine_model = row["model_engine"] = await side.model_for(parsed.model)
        if parsed.action == "count_tokens":
            assert isinstance(dialect, CountsTokens), "only a dialect with a count endpoint parses a count_tokens request"
            counted = dialect.render_count_tokens(parsed, await side.count(parsed, engine_model, record))
            return flows.HTTPReply(200, "application/json", json.dumps(counted).encode(), counted)
        completion = (await side.generate(parsed, engine_model, row, record, None if parsed.stream else unstreamed_timeout(row.get("harness"), ctx.options.polar_engine_timeout))).completion
        assert completion is not None
        body_json = dialect.render_body(parsed, completion)
        if parsed.stream:
            stream = dialect.render_stream(parsed, completion)
            return flows.HTTPReply(200, dialect.STREAM_CONTENT_TYPE, stream, body_json, stream.decode("utf-8", "replace"))
        return flows.HTTPReply(200, "application/json", json.dumps(body_json, ensure_ascii=False).encode(), body_json)

    async def _mark(self, exchange_id: str, status: str, error: str) -> None:
        assert self.store is not None
        await self.store.commit_mark(exchange_id, status, error)

    def _engine_side(self) -> EngineSide:
        assert self.store is not None
        return EngineSide(self.engine, self.control, self.store, self.tokens, self.engine_hook, self.model_map)

    async def _stream(self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow, record: EngineRecord) -> bool:
        """Start a streamed reply: False if the engine call failed within STREAM_HOLD_S (the caller answers with
        the provider's HTTP error); else the headers and opening events go out now, keepalives follow until the
        reply is ready, and a task of its own finishes and commits the exchange."""
        side = self._engine_side()
        engine_model = row["model_engine"] = await side.model_for(parsed.model)
        call = asyncio.ensure_future(self._while_client_waits(flow, side.generate(parsed, engine_model, row, record)))
        done, _ = await asyncio.wait({call}, timeout=STREAM_HOLD_S)
        if done and call.exception() is not None:
            call.result()  # raises: answered as a non-streamed failure
        state = StreamState(id=f"chatcmpl-{row['exchange_id'].replace('-', '')}", created=int(time.time()))
        reply = StreamedReply(
            flows.reply_headers(dialect.STREAM_CONTENT_TYPE, row, dialect), dialect.stream_opening(parsed, state),
            lambda: dialect.stream_keepalive(parsed, state), ctx.options.polar_keepalive_interval,
        )
        self.streams.route(flow, reply)
        self._opened()  # until the task has committed the row
        task = asyncio.get_running_loop().create_task(self._finish_stream(flow, parsed, dialect, row, record, call, state, reply))
        self.stream_tasks.add(task)
        task.add_done_callback(self.stream_tasks.discard)
        return True

    async def _finish_stream(
        self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow, record: EngineRecord,
        call: asyncio.Future[EngineRecord], state: StreamState, reply: StreamedReply,
    ) -> None:
        """The engine call's outcome, then the row committed, then the reply's last events (or an in-stream error:
        the headers said 200 already, so the row's http_status is 200 whatever the outcome)."""
        assert self.store is not None
        try:
            failure: Exception | None = None
            try:
                await call
            except Exception as error:  # noqa: BLE001 - recorded and told to the client in its grammar (outcome_of)
                failure = error
            sent = reply.hold()
            numbered = state.events
            body_json: Any = None
            rest = b""
            if failure is None:
                try:
                    assert record.completion is not None
                    completion = dataclasses.replace(record.completion, id=state.id, created=state.created)  # as the opening said
                    body_json = dialect.render_body(parsed, completion)
                    rest = dialect.stream_body(parsed, state, completion)
                except Exception as error:  # noqa: BLE001 - a rendering bug: told in the stream, recorded
                    failure = error
            outcome = self._outcome(failure, flow)
            if outcome.answer is not None:
                state.events = numbered
                body_json, rest = dialect.error_body(outcome.answer), dialect.stream_error(parsed, state, outcome.answer)
            settle(row, record, outcome, http_status=200, response_body=body_json, response_stream=(sent + rest).decode("utf-8", "replace"), ended_at=now())
            try:
                await self.store.commit_exchange(row)
            except Exception as error:  # noqa: BLE001 - the client must not take an unrecorded reply for a recorded one
                state.events = numbered
                rest = dialect.stream_error(parsed, state, self._outcome(CommitFailed(error), flow).answer_or_raise())
            else:
                self.deliveries.committed(flow, row["exchange_id"], row["status"], streamed=True)
            flow.metadata["polar_stream_sent"] = sent + rest
            reply.finish(rest)
        finally:
            self._closed()

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if self.streams.restore(flow) and flow.response is not None:
            flow.response.stream = True  # relay the loopback server's chunks as they come

    async def response(self, flow: http.HTTPFlow) -> None:
        sent = flow.metadata.pop("polar_stream_sent", None)
        if sent is not None and flow.response is not None:
            flow.response.content = sent  # for mitmweb and flow files; the client has had it already
        await self.deliveries.response(flow)  # was the reply written to a client that is still there?

    def error(self, flow: http.HTTPFlow) -> None:
        self.streams.restore(flow)  # a route the client left before it was taken
        self.deliveries.error(flow)  # a stream its client left before its end

    def client_disconnected(self, client: connection.Client) -> None:
        self.deliveries.left(client.id)  # reset with a JSON reply unread?


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ANY_HOST = ("", "0.0.0.0", "::")
