"""The polar addon: serve model calls from the training engine and commit each exchange before replying.

One exchange, top to bottom: session (proxy credentials) -> dialect (parse) -> engine (one non-streaming
call, token ids + logprobs) -> store (committed) -> dialect (the provider's JSON or SSE stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import gc
import hmac
import json
import logging
import sys
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

import duckdb
from mitmproxy import ctx, exceptions, http
from mitmproxy.connection import ConnectionState

from polar_mitm import dialects, harnesses, redact, routing, session
from polar_mitm.dialects import CountsTokens, Dialect
from polar_mitm.engines import ENGINES, make_engine
from polar_mitm.engines.base import Engine
from polar_mitm.engines.router import CURRENT_SESSION
from polar_mitm.errors import CallAbandoned, ConfigError, RenderError
from polar_mitm.exchange import Completion, DialectError, EngineError, ParsedRequest, StreamState
from polar_mitm.gateway import options
from polar_mitm.gateway.control import EngineCallAborted, PolicyControl
from polar_mitm.gateway.streaming import LoopbackStreams, StreamedReply
from polar_mitm.render.serve import RENDER_MODES, TokenPath
from polar_mitm.store import ExchangeRow, Store, now
from polar_mitm.store.client import live_endpoint
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
    def __init__(self, start_line: TextIO | None = None) -> None:
        # where the one 'listening on ...' line goes: stdout for `polar-mitm gateway`; a rollout node's in-process
        # gateway sends it to stderr, so the command's own output (its results table) stays clean
        self.start_line = start_line
        self.store: Store | None = None
        self.engine: Engine | None = None
        self.secret: bytes = b""
        self.sessions_by_connection: weakref.WeakKeyDictionary[Any, tuple[str, str] | None] = weakref.WeakKeyDictionary()
        self.model_map: list[tuple[str, str | None]] = []
        self.announced: tuple[Path, str] | None = None  # GATEWAY_FILE and our entry in it
        self.engine_hook: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None] | None = None
        self.engine_calls: set[asyncio.Future[Any]] = set()  # in flight; cancelled at a clean stop
        self.open_exchanges = 0  # started and not yet committed
        self.all_committed = asyncio.Event()  # set while open_exchanges is 0
        self.all_committed.set()
        self.started = asyncio.Event()  # the store is open: running() is through
        self.tokens: TokenPath | None = None  # --render tokens
        self.streams = LoopbackStreams()  # streamed replies leave through a loopback server (gateway/streaming.py)
        self.stream_tasks: set[asyncio.Task[None]] = set()
        self.control = PolicyControl(model_exists=self._engine_serves)
        self.listen: tuple[str, int] | None = None

    def load(self, loader: Any) -> None:
        options.declare(loader)  # polar_<name> for each row of gateway/options.py

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # eager would resolve provider hostnames on CONNECT, before any hook; offline that is a 502
            ctx.options.connection_strategy = "lazy"
        engine_options = ("polar_upstream", "polar_engine", "polar_engine_model", "polar_engine_timeout", "polar_split_reasoning", "polar_engine_max_model_len")
        if updated.intersection(engine_options):
            upstream = ctx.options.polar_upstream
            if upstream and not all(url.strip().startswith(("http://", "https://")) for url in upstream.split(",")):
                raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL (or several, comma-separated), got {upstream!r}")
            if ctx.options.polar_engine not in ENGINES:
                raise exceptions.OptionsError(f"polar_engine must be one of {', '.join(ENGINES.names())}, got {ctx.options.polar_engine!r}")
            if ctx.options.polar_engine_timeout <= 0:
                raise exceptions.OptionsError("polar_engine_timeout must be positive")
            if ctx.options.polar_engine_max_model_len < 0:
                raise exceptions.OptionsError("polar_engine_max_model_len must be 0 (from /models) or positive")
            self.engine = make_engine(
                ctx.options.polar_engine, upstream, ctx.options.polar_engine_model or None, ctx.options.polar_engine_timeout,
                ctx.options.polar_split_reasoning, ctx.options.polar_engine_max_model_len or None,
            ) if upstream else None
        if updated & {"polar_upstream", "polar_engine", "polar_engine_model", "polar_engine_timeout", "polar_split_reasoning", "polar_engine_max_model_len", "polar_render", "polar_render_model", "polar_tool_parser"}:
            if ctx.options.polar_render not in RENDER_MODES:
                raise exceptions.OptionsError(f"polar_render must be one of {', '.join(RENDER_MODES)}, got {ctx.options.polar_render!r}")
            if ctx.options.polar_render == "tokens" and "," in ctx.options.polar_upstream:
                raise exceptions.OptionsError("polar_render tokens works with one upstream engine; several are routed in chat mode only")
            try:
                tokens = ctx.options.polar_render == "tokens" and self.engine is not None
                self.tokens = TokenPath(self.engine, ctx.options.polar_render_model or None, ctx.options.polar_tool_parser) if tokens else None
            except ValueError as error:
                raise exceptions.OptionsError(f"polar_tool_parser: {error}") from error
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

    def _open_store(self) -> None:
        db = Path(ctx.options.polar_db)
        try:
            self.store = _open_when_readers_leave(db)
            self.store.serve_sql(ctx.options.polar_sql_port)
        except Exception as error:  # noqa: BLE001 - a startup failure, told in one line (errorcheck exits)
            if self.store is not None:
                self.store.close()
                self.store = None
            log.error(f"cannot open the store {db.resolve()}: {_one_line(error)}")

    async def running(self) -> None:
        model = None
        if self.engine is None:
            log.warning("polar: no polar_upstream set; model calls will be answered 503")
        else:
            try:
                model = await self.engine.discover()
                if self.tokens is not None:
                    renderer = await self.tokens.renderer()  # now rather than in the first exchange (seconds)
                    log.info(f"polar: tokens mode renders with the chat template of {renderer.source}")
            except RenderError as error:  # kept: every model call is answered with it
                log.warning(f"polar: tokens mode: {error.message}")
            except EngineError as error:
                if error.status_class == "engine_url_wrong":
                    # the engine is there but this is not its API root: every call would fail the same way
                    log.error(f"--upstream {self.engine.base_url}: {error.message}")
                    return  # errorcheck stops the gateway, before the store is opened
                # not fatal: the engine may come up later; each call retries discovery
                log.warning(f"polar: {error.message}")
        # off the event loop: opening may wait for a reader's lock (_open_when_readers_leave) while mitmproxy listens
        await asyncio.to_thread(self._open_store)
        if self.store is None:
            return  # errorcheck stops the gateway with the logged cause
        await self.streams.start()
        self.started.set()
        self._announce()
        # everything alive now (mitmproxy, its certificates, our modules) lives as long as the proxy: out of the
        # collector's view, a full collection no longer walks it; those had paused the event loop for 50-90 ms
        gc.freeze()
        engine = f"{self.engine.kind} {self.engine.base_url} serving {model!r}" if self.engine and model else (f"{self.engine.kind} {self.engine.base_url} (not answering yet)" if self.engine else "none")
        # printed, not logged: without -v this is the one line that says the gateway is up
        print(f"polar-mitm gateway: listening on {self.proxy_url()}, store {Path(ctx.options.polar_db).resolve()}, engine {engine}", file=self.start_line or sys.stdout, flush=True)

    def proxy_url(self) -> str | None:
        proxyserver = ctx.master.addons.get("proxyserver")
        addresses = proxyserver.listen_addrs() if proxyserver else []
        if not addresses:
            return None
        host, port = addresses[0][:2]
        self.listen = (host, port)
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        return f"http://{host}:{port}"

    def _announce(self) -> None:
        """Leave the proxy URL in the confdir, so `polar-mitm run` finds this gateway without flags."""
        if url := self.proxy_url():
            self.announced = (routing.announce_gateway(ctx.options.confdir, url, Path(ctx.options.polar_db).resolve()), url)

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
        if self.engine is not None:
            await self.engine.close()
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- session attribution
    def http_connect(self, flow: http.HTTPFlow) -> None:
        credentials = session.parse_proxy_authorization(flow.request.headers.get("proxy-authorization"))
        if ctx.options.polar_require_auth and not session.credentials_valid(self.secret, credentials):
            flow.response = _proxy_auth_required()
            return
        self.sessions_by_connection[flow.client_conn] = credentials

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or self._is_control(flow):
            return
        if flow.is_replay:
            # mitmproxy's replay (mitmweb's Replay, `replay.client`) re-runs this flow or a copy of it without a
            # proxy connection, so without credentials: it keeps the session in its metadata, which survives
            # copies and flow files; its row is flagged replay, which keeps it out of trajectories
            return
        if flow.client_conn in self.sessions_by_connection:
            credentials = self.sessions_by_connection[flow.client_conn]
        else:
            # a plain-HTTP proxied request carries its credentials itself
            credentials = session.parse_proxy_authorization(flow.request.headers.get("proxy-authorization"))
            if ctx.options.polar_require_auth and not session.credentials_valid(self.secret, credentials):
                flow.response = _proxy_auth_required()
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
        """A request sent to the gateway itself (not proxied, not in a tunnel) for /control/*."""
        if not flow.request.path.startswith("/control/") or self.listen is None or flow.client_conn in self.sessions_by_connection:
            return False
        host, port = self.listen
        return flow.request.port == port and (flow.request.host in (host, *LOOPBACK_HOSTS) or host in ANY_HOST)

    async def _answer_control(self, flow: http.HTTPFlow) -> None:
        token = ctx.options.polar_control_token
        assert self.listen is not None
        if token:
            given = flow.request.headers.get("authorization", "")
            allowed = hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
            status, body = (200, {}) if allowed else (401, {"error": {"type": "unauthorized", "message": "control needs 'Authorization: Bearer <polar_control_token>'"}})
        elif self.listen[0] not in LOOPBACK_HOSTS:
            status, body = 403, {"error": {"type": "forbidden", "message": "this gateway listens beyond loopback: set polar_control_token (--control-token) to use /control/*"}}
        else:
            status, body = 200, {}
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
        body = {"error": {"message": f"polar-mitm answers only model API calls; {flow.request.method} {host}{flow.request.path.split('?')[0]} was not forwarded", "type": "not_found"}}
        flow.response = http.Response.make(404, json.dumps(body), {"content-type": "application/json"})
        flow.metadata["polar_local"] = True

    async def _exchange(self, flow: http.HTTPFlow, dialect: Dialect, path: str) -> None:
        # mitmproxy listens before running(): a call that early waits for the store
        await self.started.wait()
        assert self.store is not None
        self._opened()
        try:
            await self._exchange_committed(flow, dialect, path)
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
        headers = list(flow.request.headers.items(multi=True))
        query = list(flow.request.query.items(multi=True))
        secrets_seen = redact.secret_values(headers, query)
        header_map = {name.lower(): value for name, value in headers}
        user_agent = header_map.get("user-agent")
        raw_body = flow.request.get_content(strict=False) or b""
        row: ExchangeRow = {
            "exchange_id": str(uuid.uuid4()),
            "session_id": session_id,
            "seq": self.store.next_seq(session_id),
            "api": dialect.API,
            "method": flow.request.method,
            "host": flow.request.pretty_host,
            "path": path + ("?" + redact.redact_query(flow.request.url.split("?", 1)[1]) if "?" in flow.request.url else ""),
            "harness": session.harness_from_user_agent(user_agent),
            "user_agent": user_agent,
            "lineage": session.lineage(header_map),
            "retry_count": _int_or_none(header_map.get("x-stainless-retry-count")),
            "replay": bool(flow.is_replay),
            "request_headers": redact.redact_headers(headers),
            "request_body": redact.redact_text(raw_body.decode("utf-8", "replace"), secrets_seen),
            "engine_kind": self.engine.kind if self.engine else None,
            "started_at": now(),
        }
        parsed: ParsedRequest | None = None
        try:
            parsed = dialect.parse(raw_body, path, dict(query))
            row.update(model_requested=parsed.model, stream=parsed.stream, ignored_fields=parsed.ignored, normalizations=parsed.normalizations, action=parsed.action)
            if parsed.stream and parsed.action == "generate" and self.streams.running:
                if await self._stream(flow, parsed, dialect, row):
                    return  # the reply streams on; its task commits the row
                # the engine failed at once: answered below with the provider's HTTP error
            status_code, content_type, body, body_json = await self._while_client_waits(flow, self._serve(parsed, dialect, row))
            if gone := _client_gone(flow):
                # the reply came back too late for its client: kept, but it never reached the harness
                row.update(status="client_disconnected", error=gone)
        except CallAbandoned as error:
            row.update(status=error.status_class, error=error.message)
            http_status = 499 if error.status_class == "client_disconnected" else 503
            status_code, content_type, body, body_json = self._error(dialect, DialectError(http_status, error.status_class, error.message))
        except RenderError as error:
            row.update(status="render_error", error=error.message)
            status_code, content_type, body, body_json = self._error(dialect, error)
        except DialectError as error:
            row.update(status="bad_request" if error.status < 500 else "internal_error", error=error.message)
            status_code, content_type, body, body_json = self._error(dialect, error)
        except EngineError as error:
            row.update(status=error.status_class, error=error.message, engine_response=error.engine_body)
            status_code, content_type, body, body_json = self._error(dialect, error.for_client())
        except Exception as error:  # noqa: BLE001 - a bug must still answer in the provider's shape, and be recorded
            status_code, content_type, body, body_json = self._error(dialect, _internal_error(row, error))
        if parsed is None and "model_requested" not in row:
            row["model_requested"] = _peek_model(raw_body, path)
        row.update(http_status=status_code, response_body=body_json, ended_at=now())
        row.setdefault("status", "ok")
        try:
            await self.store.commit_exchange(row)
        except Exception as error:  # noqa: BLE001 - never reply without a committed row
            log.exception("polar: could not commit exchange")
            status_code, content_type, body, _ = self._error(dialect, DialectError(500, "store_error", f"polar-mitm could not record the exchange: {error}"))
        flow.response = http.Response.make(status_code, body, _reply_headers(content_type, row, dialect))

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
                if not task.done() and (gone := _client_gone(flow)):
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

    async def _serve(self, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow) -> tuple[int, str, bytes, Any]:
        if self.engine is None:
            raise EngineError("engine_unreachable", "polar-mitm has no inference engine configured (polar_upstream)", 503)
        engine_model = await self._engine_model(parsed.model)
        row["model_engine"] = engine_model
        if parsed.action == "count_tokens":
            assert isinstance(dialect, CountsTokens), "only a dialect with a count endpoint parses a count_tokens request"
            count_request = self.engine.build_count_request(parsed.chat, engine_model)
            row["engine_request"] = count_request
            row["engine_started_at"] = now()
            count = await self.engine.count_tokens(count_request)
            row["engine_ended_at"] = now()
            body_json = dialect.render_count_tokens(parsed, count)
            row["engine_response"] = {"count": count}
            return 200, "application/json", json.dumps(body_json).encode(), body_json
        completion = await self._generate(parsed, engine_model, row, None if parsed.stream else _unstreamed_timeout(row.get("harness")))
        body_json = dialect.render_body(parsed, completion)
        if parsed.stream:
            stream = dialect.render_stream(parsed, completion)
            row["response_stream"] = stream.decode("utf-8", "replace")
            return 200, dialect.STREAM_CONTENT_TYPE, stream, body_json
        return 200, "application/json", json.dumps(body_json, ensure_ascii=False).encode(), body_json

    async def _generate(self, parsed: ParsedRequest, engine_model: str, row: ExchangeRow, timeout: float | None = None) -> Completion:
        """The engine call of one exchange, recorded on its row (`timeout`: this call's limit, if not the engine's).
        Whatever it awaits (the engine, or a paused gateway in `_complete`), a streamed reply's keepalives go on."""
        assert self.engine is not None
        engine_request = self.engine.build_request(parsed.chat, engine_model)
        if self.engine_hook is not None:
            context = {key: row.get(key) for key in ("session_id", "seq", "api", "model_requested", "harness", "path")}
            engine_request = self.engine_hook(engine_request, context) or engine_request
        sent, raw, completion = await self._complete(parsed, engine_request, row, timeout)
        row.update(
            # WireJSON: the store records the texts that crossed the wire, not encoded again (100+ KB of token ids)
            engine_request=sent,
            engine_response=raw,
            prompt_token_ids=completion.prompt_token_ids,
            completion_token_ids=completion.completion_token_ids,
            completion_logprobs=completion.completion_logprobs,
            finish_reason=completion.finish_reason,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
        )
        return completion

    async def _complete(self, parsed: ParsedRequest, engine_request: dict[str, Any], row: ExchangeRow, timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """The engine call, held while the gateway is paused; an attempt aborted for a weight update is committed
        as its own untrainable row (status 'aborted') and the call is issued again after resume."""
        assert self.engine is not None and self.store is not None

        async def call(version: int, engine_model: str | None) -> Any:
            request = dict(engine_request, model=engine_model) if engine_model else engine_request
            row.update(policy_version=version, model_engine=request["model"], engine_started_at=now())
            try:
                if self.tokens is not None:
                    return await self.tokens.complete(parsed, request, request["model"], row, parsed.notes)
                row.update(engine_request=request, render_mode="chat")
                return await self.engine.complete(request, parsed.notes, timeout)
            finally:
                row["engine_ended_at"] = now()

        while True:
            try:
                _, result = await self.control.run(call)
                return result
            except EngineCallAborted as aborted:
                attempt = dict(row, exchange_id=str(uuid.uuid4()), status="aborted", ended_at=now(), error=f"{aborted}; issued again after resume as exchange {row['exchange_id']}")
                await self.store.commit_exchange(attempt)
                row["seq"] = self.store.next_seq(row["session_id"])

    async def _stream(self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow) -> bool:
        """Start a streamed reply: False if the engine call failed within STREAM_HOLD_S (the caller answers with
        the provider's HTTP error); else the headers and opening events go out now, keepalives follow until the
        reply is ready, and a task of its own finishes and commits the exchange."""
        engine_model = row["model_engine"] = await self._engine_model(parsed.model)
        call = asyncio.ensure_future(self._while_client_waits(flow, self._generate(parsed, engine_model, row)))
        done, _ = await asyncio.wait({call}, timeout=STREAM_HOLD_S)
        if done and call.exception() is not None:
            call.result()  # raises: answered as a non-streamed failure
        state = StreamState(id=f"chatcmpl-{row['exchange_id'].replace('-', '')}", created=int(time.time()))
        reply = StreamedReply(
            _reply_headers(dialect.STREAM_CONTENT_TYPE, row, dialect), dialect.stream_opening(parsed, state),
            lambda: dialect.stream_keepalive(parsed, state), ctx.options.polar_keepalive_interval,
        )
        self.streams.route(flow, reply)
        self._opened()  # until the task has committed the row
        task = asyncio.get_running_loop().create_task(self._finish_stream(flow, parsed, dialect, row, call, state, reply))
        self.stream_tasks.add(task)
        task.add_done_callback(self.stream_tasks.discard)
        return True

    async def _finish_stream(
        self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow,
        call: asyncio.Future[Completion], state: StreamState, reply: StreamedReply,
    ) -> None:
        """The engine call's outcome, then the row committed, then the reply's last events (or an in-stream error)."""
        assert self.store is not None
        try:
            error: DialectError | None = None
            try:
                completion = await call
            except CallAbandoned as failure:
                row.update(status=failure.status_class, error=failure.message)
                error = DialectError(503, failure.status_class, failure.message)
            except EngineError as failure:
                row.update(status=failure.status_class, error=failure.message, engine_response=failure.engine_body)
                error = failure.for_client()
            except DialectError as failure:  # tokens mode's render errors, an unserved adapter
                row.update(status="render_error" if isinstance(failure, RenderError) else "bad_request", error=failure.message)
                error = failure
            except Exception as failure:  # noqa: BLE001 - recorded and told to the client in its grammar
                error = _internal_error(row, failure)
            sent = reply.hold()
            numbered = state.events
            if error is None:
                try:
                    completion = dataclasses.replace(completion, id=state.id, created=state.created)  # as the opening said
                    body_json = dialect.render_body(parsed, completion)
                    rest = dialect.stream_body(parsed, state, completion)
                except Exception as failure:  # noqa: BLE001 - a rendering bug: told in the stream, recorded
                    error = _internal_error(row, failure)
            if error is not None:
                state.events = numbered
                body_json, rest = dialect.error_body(error), dialect.stream_error(parsed, state, error)
            if "status" not in row and (gone := _client_gone(flow)):
                # the reply came back too late for its client: kept, but it never reached the harness
                row.update(status="client_disconnected", error=gone)
            row.update(http_status=200, response_body=body_json, response_stream=(sent + rest).decode("utf-8", "replace"), ended_at=now())
            row.setdefault("status", "ok")
            try:
                await self.store.commit_exchange(row)
            except Exception as failure:  # noqa: BLE001 - the client must not take an unrecorded reply for a recorded one
                log.exception("polar: could not commit exchange")
                state.events = numbered
                rest = dialect.stream_error(parsed, state, DialectError(500, "store_error", f"polar-mitm could not record the exchange: {failure}"))
            flow.metadata["polar_stream_sent"] = sent + rest
            reply.finish(rest)
        finally:
            self._closed()

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if self.streams.restore(flow):
            flow.response.stream = True  # relay the loopback server's chunks as they come

    def response(self, flow: http.HTTPFlow) -> None:
        sent = flow.metadata.pop("polar_stream_sent", None)
        if sent is not None and flow.response is not None:
            flow.response.content = sent  # for mitmweb and flow files; the client has had it already

    def error(self, flow: http.HTTPFlow) -> None:
        self.streams.restore(flow)  # a route the client left before it was taken

    async def _engine_model(self, requested: str) -> str:
        if self.engine is None:
            raise EngineError("engine_unreachable", "polar-mitm has no inference engine configured (polar_upstream)", 503)
        if self.model_map:
            for pattern, target in self.model_map:
                if fnmatch.fnmatchcase(requested, pattern):
                    return target or await self.engine.discover()
            raise DialectError(404, "model_not_found", f"The model '{requested}' does not exist or is not served by this gateway", "model")
        return await self.engine.discover()

    @staticmethod
    def _error(dialect: Dialect, error: DialectError) -> tuple[int, str, bytes, Any]:
        body_json = dialect.error_body(error)
        return error.status, "application/json", json.dumps(body_json).encode(), body_json


def _internal_error(row: ExchangeRow, failure: Exception) -> DialectError:
    """A bug of ours: logged, recorded on the row, and answered in the provider's shape."""
    log.exception("polar: internal error")
    row.update(status="internal_error", error=f"{type(failure).__name__}: {failure}")
    return DialectError(500, "internal_error", f"polar-mitm internal error: {type(failure).__name__}: {failure}")


# how much sooner than the harness gives up the gateway answers a non-streamed call it cannot finish
UNSTREAMED_MARGIN_S = 5.0


def _unstreamed_timeout(harness: str | None) -> float | None:
    """A non-streamed call cannot be kept alive: when the calling harness is known to give up on one sooner than
    --engine-timeout, the engine gets until just before then, and the harness a provider-shaped 504 (recorded as
    engine_timeout) instead of a reply it would no longer read (recorded as ok, and then retried: a duplicate)."""
    limit = harnesses.get(harness).unstreamed_timeout if harness in harnesses.NAMES else None
    if limit is None or limit - UNSTREAMED_MARGIN_S >= ctx.options.polar_engine_timeout:
        return None
    return limit - UNSTREAMED_MARGIN_S


def _reply_headers(content_type: str, row: ExchangeRow, dialect: Dialect) -> dict[str, str]:
    headers = {"content-type": content_type, "x-polar-exchange-id": row["exchange_id"], "x-polar-session-id": row["session_id"]}
    if request_id_header := getattr(dialect, "REQUEST_ID_HEADER", None):  # as the provider names its requests
        headers[request_id_header] = "req_" + row["exchange_id"].replace("-", "")
    if content_type.startswith("text/event-stream"):
        headers["cache-control"] = "no-cache"
    return headers


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ANY_HOST = ("", "0.0.0.0", "::")


def _proxy_auth_required() -> http.Response:
    body = json.dumps({"error": {"message": "polar-mitm: proxy credentials missing or invalid; use http://SESSION:TOKEN@host:port (see `polar-mitm run`)", "type": "proxy_authentication_required"}})
    return http.Response.make(407, body, {"Proxy-Authenticate": 'Basic realm="polar-mitm"', "content-type": "application/json"})


def _client_gone(flow: http.HTTPFlow) -> str | None:
    """Why nobody will read this flow's response any more, or None while its client still waits."""
    if flow.error is not None:
        return f"the flow was ended by the proxy: {flow.error.msg}"
    if flow.is_replay:
        return None  # mitmproxy's own replay (mitmweb's Replay) has no client connection to watch
    if not flow.client_conn.state & ConnectionState.CAN_READ:
        # mitmproxy stops reading a client connection only when the client closed it
        return "the client closed its connection before the reply"
    return None


# A reader that found no live gateway (`polar-mitm sql`, store.query, a notebook) opens the file read-only for the
# length of its query, which DuckDB's file lock refuses a writer meanwhile; a gateway starting just then (a restart
# after a crash leaves a stale control file) waits for it. Another live gateway on the store is refused at once.
READER_LOCK_WAIT_S = 15.0


def _open_when_readers_leave(db: Path) -> Store:
    deadline = time.monotonic() + READER_LOCK_WAIT_S
    while True:
        try:
            return Store(db)
        except duckdb.IOException as error:
            if "lock" not in str(error).lower() or live_endpoint(db) is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _peek_model(body: bytes, path: str) -> str | None:
    if ":" in path and "/models/" in path:
        return path.rsplit("/models/", 1)[1].split(":", 1)[0]
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None
