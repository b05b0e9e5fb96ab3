"""Provider API keys never reach the store or the logs."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

REDACTED = "[REDACTED]"
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "x-goog-api-key",
        "cookie",
        "set-cookie",
        "x-dashscope-api-key",
    }
)
SECRET_QUERY_KEYS = frozenset({"key", "api_key", "api-key"})


def secret_values(headers: Iterable[tuple[str, str]], query: Iterable[tuple[str, str]] = ()) -> list[str]:
    """The secret strings in a request, so they can also be scrubbed from its body."""
    found = []
    for name, value in headers:
        if name.lower() in SECRET_HEADERS and value:
            found.append(value)
            # "Bearer sk-..." : the bare key may appear in bodies too
            scheme, _, token = value.partition(" ")
            if token:
                found.append(token)
    for name, value in query:
        if name.lower() in SECRET_QUERY_KEYS and value:
            found.append(value)
    return [s for s in found if len(s) >= 4]


def redact_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        out[name.lower()] = REDACTED if name.lower() in SECRET_HEADERS else value
    return out


def redact_query(query: str) -> str:
    if not query:
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    return urlencode([(k, REDACTED if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs])


def redact_text(text: str, secrets: Iterable[str]) -> str:
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
