"""The polar addon: serve model calls from the training engine and commit each exchange before replying.

One exchange, top to bottom: session (proxy credentials) -> dialect (parse) -> engine (one non-streaming
call, token ids + logprobs) -> store (committed) -> dialect (the provider's JSON or SSE stream).
"""

from __future__ import annotations

import fnmatch
import gc
import json
import logging
import os
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

from polar_mitm import dialects, redact, session
from polar_mitm.dialects import CountsTokens, Dialect
from polar_mitm.engines import ENGINES, make_engine
from polar_mitm.engines.base import Engine
from polar_mitm.engines.router import CURRENT_SESSION
from polar_mitm.errors import ConfigError
from polar_mitm.exchange import DialectError, EngineError, ParsedRequest
from polar_mitm.gateway import options
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

    def load(self, loader: Any) -> None:
        options.declare(loader)  # polar_<name> for each row of gateway/options.py

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # eager would resolve provider hostnames on CONNECT, before any hook; offline that is a 502
            ctx.options.connection_strategy = "lazy"
        if "polar_upstream" in updated or "polar_engine" in updated or "polar_engine_model" in updated or "polar_engine_timeout" in updated or "polar_split_reasoning" in updated:
            upstream = ctx.options.polar_upstream
            if upstream and not all(url.strip().startswith(("http://", "https://")) for url in upstream.split(",")):
                raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL (or several, comma-separated), got {upstream!r}")
            if ctx.options.polar_engine not in ENGINES:
                raise exceptions.OptionsError(f"polar_engine must be one of {', '.join(ENGINES.names())}, got {ctx.options.polar_engine!r}")
            if ctx.options.polar_engine_timeout <= 0:
                raise exceptions.OptionsError("polar_engine_timeout must be positive")
            self.engine = make_engine(ctx.options.polar_engine, upstream, ctx.options.polar_engine_model or None, ctx.options.polar_engine_timeout, ctx.options.polar_split_reasoning) if upstream else None
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

    async def running(self) -> None:
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
            status_code, content_type, body, body_json = await self._serve(parsed, dialect, row)
        except DialectError as error:
            row.update(status="bad_request" if error.status < 500 else "internal_error", error=error.message)
            status_code, content_type, body, body_json = self._error(dialect, error)
        except EngineError as error:
            row.update(status=error.status_class, error=error.message, engine_response=error.engine_body)
            status_code, content_type, body, body_json = self._error(dialect, DialectError(error.http_status, error.status_class, error.message))
        except Exception as error:  # noqa: BLE001 - a bug must still answer in the provider's shape, and be recorded
            log.exception("polar: internal error")
            row.update(status="internal_error", error=f"{type(error).__name__}: {error}")
            status_code, content_type, body, body_json = self._error(dialect, DialectError(500, "internal_error", f"polar-mitm internal error: {type(error).__name__}: {error}"))
        if parsed is None and "model_requested" not in row:
            row["model_requested"] = _peek_model(raw_body, path)
        row.update(http_status=status_code, response_body=body_json, ended_at=now())
        row.setdefault("status", "ok")
        try:
            await self.store.commit_exchange(row)
        except Exception as error:  # noqa: BLE001 - never reply without a committed row
            log.exception("polar: could not commit exchange")
            status_code, content_type, body, _ = self._error(dialect, DialectError(500, "store_error", f"polar-mitm could not record the exchange: {error}"))
        flow.response = http.Response.make(
            status_code,
            body,
            {"content-type": content_type, "x-polar-exchange-id": row["exchange_id"], "x-polar-session-id": session_id, **({"cache-control": "no-cache"} if content_type.startswith("text/event-stream") else {})},
        )

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
        engine_request = self.engine.build_request(parsed.chat, engine_model)
        if self.engine_hook is not None:
            context = {key: row.get(key) for key in ("session_id", "seq", "api", "model_requested", "harness", "path")}
            engine_request = self.engine_hook(engine_request, context) or engine_request
        row["engine_request"] = engine_request
        row["engine_started_at"] = now()
        try:
            sent, raw, completion = await self.engine.complete(engine_request)
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
        body_json = dialect.render_body(parsed, completion)
        if parsed.stream:
            stream = dialect.render_stream(parsed, completion)
            row["response_stream"] = stream.decode("utf-8", "replace")
            return 200, dialect.STREAM_CONTENT_TYPE, stream, body_json
        return 200, "application/json", json.dumps(body_json, ensure_ascii=False).encode(), body_json

    async def _engine_model(self, requested: str) -> str:
        assert self.engine is not None
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
