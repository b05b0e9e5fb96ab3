"""The addon's edge with mitmproxy's flows: the row a model call starts, its reply and reply headers, and whether
its client still waits. Plain functions over `http.HTTPFlow`; the addon (gateway/addon.py) calls them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from mitmproxy import http
from mitmproxy.connection import ConnectionState

from polar_mitm import redact, session
from polar_mitm.dialects import Dialect
from polar_mitm.exchange import DialectError
from polar_mitm.store import ExchangeRow, now


class HTTPReply(NamedTuple):
    """A JSON reply (or a stream made in one piece): status, content type, the bytes, the body as the row keeps
    it, and for a stream its text (the row's response_stream)."""

    status: int
    content_type: str
    body: bytes
    body_json: Any
    stream_text: str | None = None


def error_reply(dialect: Dialect, error: DialectError) -> HTTPReply:
    """The provider's error body for `error`, as a JSON reply with its status."""
    body_json = dialect.error_body(error)
    return HTTPReply(error.status, "application/json", json.dumps(body_json).encode(), body_json)


def request_row(flow: http.HTTPFlow, api: str, path: str, session_id: str, seq: int, engine_kind: str | None) -> tuple[ExchangeRow, bytes]:
    """The row of a model call as its request gives it (secrets redacted), and the request body to parse: as sent,
    but for its API keys (redact.py), which the engine and the prompt's tokens never get. The flow itself is
    scrubbed the same way (mitmweb, saved flows and mitmdump's log keep no key): a model call is never forwarded."""
    headers = list(flow.request.headers.items(multi=True))
    query = list(flow.request.query.items(multi=True))
    sent_body = flow.request.get_content(strict=False) or b""
    secrets_seen = redact.secret_values(headers, query, sent_body)
    raw_body = redact.scrub_body(sent_body, secrets_seen)
    scrub_flow(flow, raw_body if raw_body is not sent_body else None)
    header_map = {name.lower(): value for name, value in headers}
    user_agent = header_map.get("user-agent")
    row: ExchangeRow = {
        "exchange_id": str(uuid.uuid4()),
        "session_id": session_id,
        "seq": seq,
        "api": api,
        "method": flow.request.method,
        "host": flow.request.pretty_host,
        "path": path + ("?" + redact.redact_query(flow.request.url.split("?", 1)[1]) if "?" in flow.request.url else ""),
        "harness": session.harness_from_headers(header_map),
        "user_agent": user_agent,
        "lineage": session.lineage(header_map),
        "retry_count": _int_or_none(header_map.get("x-stainless-retry-count")),
        "replay": bool(flow.is_replay),
        "request_headers": redact.redact_headers(headers),
        # the secrets too short to scrub from what the engine gets (the others are gone from raw_body already)
        # its bytes, not a decoded copy held beside the flow's while the exchange runs (the store checks they are UTF-8)
        "request_body": redact.scrub_body(raw_body, [s for s in secrets_seen if len(s) < redact.ENGINE_SCRUB_MIN], min_length=1),
        "engine_kind": engine_kind,
        "started_at": now(),
    }
    return row, raw_body


def scrub_flow(flow: http.HTTPFlow, body: bytes | None = None) -> None:
    """Take a request's keys out of the flow mitmproxy keeps, for a request the gateway answers itself (never one
    forwarded): secret headers and query parameters redacted, the body replaced by `body` (None: left as it is)."""
    for name in {name.lower() for name in flow.request.headers}:
        if name in redact.SECRET_HEADERS:
            flow.request.headers[name] = redact.REDACTED
    if any(name.lower() in redact.SECRET_QUERY_KEYS for name in flow.request.query):
        flow.request.query = [(name, redact.REDACTED if name.lower() in redact.SECRET_QUERY_KEYS else value) for name, value in flow.request.query.items(multi=True)]
    if body is not None:
        flow.request.content = body


def reply_headers(content_type: str, row: ExchangeRow, dialect: Dialect) -> dict[str, str]:
    """A reply's headers: the exchange and session ids, and the provider's own request id header if it has one."""
    headers = {"content-type": content_type, "x-polar-exchange-id": row["exchange_id"], "x-polar-session-id": row["session_id"]}
    if request_id_header := getattr(dialect, "REQUEST_ID_HEADER", None):  # as the provider names its requests
        headers[request_id_header] = "req_" + row["exchange_id"].replace("-", "")
    if content_type.startswith("text/event-stream"):
        headers["cache-control"] = "no-cache"
    return headers


def proxy_auth_required() -> http.Response:
    body = json.dumps({"error": {"message": "polar-mitm: proxy credentials missing or invalid; use http://SESSION:TOKEN@host:port (see `polar-mitm run`)", "type": "proxy_authentication_required"}})
    return http.Response.make(407, body, {"Proxy-Authenticate": 'Basic realm="polar-mitm"', "content-type": "application/json"})


def capture_unregistered(address: str) -> http.Response:
    """A transparent connection from an address no capture namespace registered, on a gateway that requires auth."""
    body = json.dumps({"error": {"message": f"polar-mitm: {address} is not a capture namespace of this gateway's confdir (polar-mitm run --capture transparent)", "type": "permission_denied"}})
    return http.Response.make(403, body, {"content-type": "application/json"})


def client_gone(flow: http.HTTPFlow) -> str | None:
    """Why nobody will read this flow's response any more, or None while its client still waits."""
    if flow.error is not None:
        return f"the flow was ended by the proxy: {flow.error.msg}"
    if flow.is_replay:
        return None  # mitmproxy's own replay (mitmweb's Replay) has no client connection to watch
    if not flow.client_conn.state & ConnectionState.CAN_READ:
        # mitmproxy stops reading a client connection only when the client closed it
        return "the client closed its connection before the reply"
    return None


def peek_model(body: bytes, path: str) -> str | None:
    """The model a request names (Gemini: in its path), for a row whose request did not parse."""
    if ":" in path and "/models/" in path:
        return path.rsplit("/models/", 1)[1].split(":", 1)[0]
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested deeper than json parses
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
