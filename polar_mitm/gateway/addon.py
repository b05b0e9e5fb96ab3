"""The polar addon: serve model calls from the training engine and commit each exchange before replying.

One exchange, top to bottom: session (proxy credentials) -> dialect (parse) -> engine (one non-streaming
call, token ids + logprobs) -> store (committed) -> dialect (the provider's JSON or SSE stream).

A streamed request gets its status, headers and opening events at once, keepalive events while the engine
works, and its reply's events once the row is committed (gateway/streaming.py); a failure after the headers is
an error event in the provider's in-stream grammar, and a row like any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import gc
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

from polar_mitm import dialects, harnesses, redact, session
from polar_mitm.dialects import CountsTokens, Dialect
from polar_mitm.engines import ENGINES, make_engine
from polar_mitm.engines.base import Engine
from polar_mitm.errors import ConfigError
from polar_mitm.exchange import Completion, DialectError, EngineError, ParsedRequest, StreamState
from polar_mitm.gateway import options
from polar_mitm.gateway.streaming import LoopbackStreams, StreamedReply
from polar_mitm.routing import GATEWAY_FILE
from polar_mitm.store import ExchangeRow, Store, now
from polar_mitm.util import load_function

log = logging.getLogger("polar_mitm.gateway")



class PolarAddon:
    def __init__(self) -> None:
        self.store: Store | None = None
        self.engine: Engine | None = None
        self.secret: bytes = b""
        self.sessions_by_connection: weakref.WeakKeyDictionary[Any, tuple[str, str] | None] = weakref.WeakKeyDictionary()
        self.model_map: list[tuple[str, str | None]] = []
        self.announced: Path | None = None
        self.engine_hook: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None] | None = None
        self.streams = LoopbackStreams()
        self.stream_tasks: set[asyncio.Task[None]] = set()

    def load(self, loader: Any) -> None:
        options.declare(loader)  # polar_<name> for each row of gateway/options.py

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # eager would resolve provider hostnames on CONNECT, before any hook; offline that is a 502
            ctx.options.connection_strategy = "lazy"
        engine_options = ("polar_upstream", "polar_engine", "polar_engine_model", "polar_engine_timeout", "polar_split_reasoning", "polar_engine_max_model_len")
        if updated.intersection(engine_options):
            upstream = ctx.options.polar_upstream
            if upstream and not upstream.startswith(("http://", "https://")):
                raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL, got {upstream!r}")
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
        if "polar_db" in updated or self.store is None:
            if self.store is not None:
                self.store.close()
            self.store = Store(ctx.options.polar_db)
            self.store.serve_sql(ctx.options.polar_sql_port)
        if "confdir" in updated or not self.secret:
            self.secret = session.load_secret(ctx.options.confdir)
        if "polar_keepalive_interval" in updated and ctx.options.polar_keepalive_interval < 0:
            raise exceptions.OptionsError("polar_keepalive_interval must be 0 (off) or positive")

    async def running(self) -> None:
        await self.streams.start()
        self._announce()
        # everything alive now (mitmproxy, its certificates, our modules) lives as long as the proxy: out of the
        # collector's view, a full collection no longer walks it; those had paused the event loop for 50-90 ms
        gc.freeze()
        if self.engine is None:
            log.warning("polar: no polar_upstream set; model calls will be answered 503")
            return
        try:
            model = await self.engine.discover()
            log.info(f"polar: engine {self.engine.base_url} serves {model!r}")
        except EngineError as error:
            # not fatal: the engine may come up later; each call retries discovery
            log.warning(f"polar: {error.message}")

    def _announce(self) -> None:
        """Leave the proxy URL in the confdir, so `polar-mitm run` finds this gateway without flags."""
        proxyserver = ctx.master.addons.get("proxyserver")
        addresses = proxyserver.listen_addrs() if proxyserver else []
        if not addresses:
            return
        host, port = addresses[0][:2]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        path = Path(ctx.options.confdir).expanduser() / GATEWAY_FILE
        path.write_text(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid(), "db": str(Path(ctx.options.polar_db).resolve())}))
        self.announced = path

    async def done(self) -> None:
        await self.streams.close()
        if self.stream_tasks:
            # streamed exchanges still waiting for the engine: their rows are committed before the store closes
            await asyncio.gather(*self.stream_tasks, return_exceptions=True)
        if self.announced is not None:
            self.announced.unlink(missing_ok=True)
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
        if flow.response is not None:
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
        path = flow.request.path.split("?", 1)[0]
        dialect = dialects.dialect_for(flow.request.method, path)
        if dialect is None:
            self._answer_non_model(flow)
            return
        await self._exchange(flow, dialect, path)

    def _answer_non_model(self, flow: http.HTTPFlow) -> None:
        host = flow.request.pretty_host
        if any(fnmatch.fnmatch(host, pattern) for pattern in ctx.options.polar_passthrough):
            return  # forwarded by mitmproxy as usual
        body = {"error": {"message": f"polar-mitm answers only model API calls; {flow.request.method} {host}{flow.request.path.split('?')[0]} was not forwarded", "type": "not_found"}}
        flow.response = http.Response.make(404, json.dumps(body), {"content-type": "application/json"})
        flow.metadata["polar_local"] = True

    async def _exchange(self, flow: http.HTTPFlow, dialect: Dialect, path: str) -> None:
        assert self.store is not None
        session_id = flow.metadata.get("polar_session") or session.DEFAULT_SESSION
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
                await self._start_stream(flow, parsed, dialect, row)
                return
            status_code, content_type, body, body_json = await self._serve(parsed, dialect, row)
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
        flow.response = http.Response.make(status_code, body, _reply_headers(content_type, row))

    async def _serve(self, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow) -> tuple[int, str, bytes, Any]:
        engine_model = row["model_engine"] = await self._engine_model(parsed.model)
        if parsed.action == "count_tokens":
            assert self.engine is not None
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
        Whatever it awaits, a streamed reply's keepalives go on meanwhile: a gate that holds calls (a paused
        gateway) belongs here, before `engine.complete`."""
        assert self.engine is not None
        engine_request = self.engine.build_request(parsed.chat, engine_model)
        if self.engine_hook is not None:
            context = {key: row.get(key) for key in ("session_id", "seq", "api", "model_requested", "harness", "path")}
            engine_request = self.engine_hook(engine_request, context) or engine_request
        row["engine_request"] = engine_request
        row["engine_started_at"] = now()
        try:
            sent, raw, completion = await self.engine.complete(engine_request, parsed.notes, timeout)
        finally:
            row["engine_ended_at"] = now()
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

    async def _start_stream(self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow) -> None:
        """Answer a streamed request at once and finish it in a task of its own. What can still fail as an HTTP
        status (no engine, an unserved model) fails here, before the headers."""
        engine_model = row["model_engine"] = await self._engine_model(parsed.model)
        state = StreamState(id=f"chatcmpl-{row['exchange_id'].replace('-', '')}", created=int(time.time()))
        reply = StreamedReply(_reply_headers(dialect.STREAM_CONTENT_TYPE, row), dialect.stream_opening(parsed, state), lambda: dialect.stream_keepalive(parsed, state), ctx.options.polar_keepalive_interval)
        self.streams.route(flow, reply)
        task = asyncio.get_running_loop().create_task(self._finish_stream(flow, parsed, dialect, row, engine_model, state, reply))
        self.stream_tasks.add(task)
        task.add_done_callback(self.stream_tasks.discard)

    async def _finish_stream(self, flow: http.HTTPFlow, parsed: ParsedRequest, dialect: Dialect, row: ExchangeRow, engine_model: str, state: StreamState, reply: StreamedReply) -> None:
        """Engine call, then the row committed, then the reply's last events (or an in-stream error) sent."""
        assert self.store is not None
        error: DialectError | None = None
        try:
            completion = await self._generate(parsed, engine_model, row)
        except EngineError as failure:
            row.update(status=failure.status_class, error=failure.message, engine_response=failure.engine_body)
            error = failure.for_client()
        except Exception as failure:  # noqa: BLE001 - recorded and told to the client in its grammar
            error = _internal_error(row, failure)
        sent = reply.hold()
        numbered = state.events
        if error is None:
            try:
                completion = dataclasses.replace(completion, id=state.id, created=state.created)  # the ids the opening announced
                body_json = dialect.render_body(parsed, completion)
                rest = dialect.stream_body(parsed, state, completion)
            except Exception as failure:  # noqa: BLE001 - a rendering bug: told in the stream, recorded
                error = _internal_error(row, failure)
        if error is not None:
            state.events = numbered
            body_json, rest = dialect.error_body(error), dialect.stream_error(parsed, state, error)
        if flow.error is not None and "status" not in row:
            # the client left while the engine worked (its idle timeout, a kill): it never saw these tokens, and a
            # retry of it is an exchange of its own; kept for the record, not for training
            row.update(status="client_closed", error=f"the client left before the reply was complete: {flow.error.msg}")
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


def _reply_headers(content_type: str, row: ExchangeRow) -> dict[str, str]:
    headers = {"content-type": content_type, "x-polar-exchange-id": row["exchange_id"], "x-polar-session-id": row["session_id"]}
    if content_type.startswith("text/event-stream"):
        headers["cache-control"] = "no-cache"
    return headers


def _proxy_auth_required() -> http.Response:
    body = json.dumps({"error": {"message": "polar-mitm: proxy credentials missing or invalid; use http://SESSION:TOKEN@host:port (see `polar-mitm run`)", "type": "proxy_authentication_required"}})
    return http.Response.make(407, body, {"Proxy-Authenticate": 'Basic realm="polar-mitm"', "content-type": "application/json"})


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
