"""Provider API keys never reach the store, the logs, the engine or mitmproxy's flows.

A model call's secrets are what its request names as one (the headers and query parameters providers take keys
in, body fields named like a key) and anything in it shaped like a provider key (OpenAI / Anthropic `sk-...`,
Google `AIza...`), wherever it is, e.g. pasted into a message. The gateway scrubs them from the request before
it is parsed (so neither the engine, nor the prompt's tokens, nor the row hold them) and from the flow mitmproxy
keeps (mitmweb, `save_stream_file`, mitmdump's log).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

REDACTED = "[REDACTED]"
REDACTED_BYTES = REDACTED.encode()
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
# JSON body fields whose string value is a credential, compared without case, "-" and "_" (api_key, apiKey, x-api-key)
SECRET_BODY_FIELDS = frozenset({"apikey", "xapikey", "xgoogapikey", "authorization", "accesstoken", "authtoken", "secretkey", "clientsecret"})
# a provider key's shape: OpenAI (sk-, sk-proj-, ...), Anthropic (sk-ant-...), Google (AIza...); mixed case and a digit,
# so that words like "sk-learn-compatible-estimators" are not taken for one
# (one pattern per prefix, each starting with its literal, so re scans for it at C speed; the character before a
# match is checked apart: a leading lookbehind made re try every position, ~2 ms per 50 KB request)
# Scanned in bytes, as a request body comes (no decoding; a key's characters are ASCII, so its bytes are the same in
# any UTF-8 text); a program's output is encoded first.
_KEY_SHAPES = (re.compile(rb"sk-[A-Za-z0-9_-]{20,}"), re.compile(rb"AIza[0-9A-Za-z_-]{35}(?![A-Za-z0-9_-])"))
_KEY_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")  # iterating bytes gives ints
# a quoted JSON name that is one of those, in any case, with "-" or "_" anywhere in it: a body without one has no such
# field (JSON encoders never escape letters, "-" or "_" in a name), so it is not parsed a second time. One pass over
# the bytes (0.06 ms per 50 KB request) where lowercasing, squashing and eight `in` tests took 0.15 on bytes, and
# twice that on a str holding one character past Latin-1 (bench/requests/, measured alone)
_FIELD_NAME = re.compile(
    b'"[-_]*(?:' + b"|".join(b"[-_]*".join(re.escape(bytes([c])) for c in name.encode()) for name in sorted(SECRET_BODY_FIELDS)) + b')[-_]*"',
    re.IGNORECASE,
)
# a secret shorter than this is scrubbed from the stored request only, not from what the engine sees: placeholders such
# as "test" or "EMPTY" are words a prompt may hold; real provider keys are longer (39-100+ characters)
ENGINE_SCRUB_MIN = 16


def _looks_like_key(text: str) -> bool:
    return any(c.isdigit() for c in text) and any(c.isupper() for c in text) and any(c.islower() for c in text)


def secret_values(headers: Iterable[tuple[str, str]], query: Iterable[tuple[str, str]] = (), body: bytes = b"") -> list[str]:
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
    if body:
        found.extend(_body_field_secrets(body))
        found.extend(_key_shaped(body))
    return [s for s in found if len(s) >= 4]


def _key_shaped(data: bytes) -> list[str]:
    """Strings shaped like a provider key, not part of a longer word."""
    return [
        key
        for shape in _KEY_SHAPES
        for match in shape.finditer(data)
        if (match.start() == 0 or data[match.start() - 1] not in _KEY_BYTES) and _looks_like_key(key := match.group().decode())
    ]


def _body_field_secrets(body: bytes) -> list[str]:
    """The string values of fields named like a credential, anywhere in a JSON body."""
    if not _FIELD_NAME.search(body):
        return []
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse (the dialect refuses it with a 400)
        return []
    found: list[str] = []
    # a stack, not recursion: a body nested as deep as json parses must not stop the exchange here
    stack: list[Any] = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for name, value in node.items():
                if isinstance(value, str) and name.lower().replace("-", "").replace("_", "") in SECRET_BODY_FIELDS:
                    found.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def scrub_body(body: bytes, secrets: Iterable[str], min_length: int = ENGINE_SCRUB_MIN) -> bytes:
    """The request body (or any UTF-8 bytes) with every secret of at least `min_length` characters replaced
    (ENGINE_SCRUB_MIN: what the engine and the flow get; 1: every secret, what the row keeps). Keys are JSON-safe
    characters, so a JSON body stays JSON. Replaced in the bytes: a secret's UTF-8 bytes match only where the decoded
    text holds it."""
    strong = sorted({s for s in secrets if len(s) >= min_length}, key=len, reverse=True)
    if not strong or not body:
        return body
    scrubbed = body
    for secret in strong:
        scrubbed = scrubbed.replace(secret.encode("utf-8", "surrogateescape"), REDACTED_BYTES)
    return scrubbed  # `body` itself where nothing was replaced (bytes.replace returns its object then)


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


# environment variable names whose values are credentials (OPENAI_API_KEY, GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, ...)
_SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def env_secrets(env: Mapping[str, str]) -> list[str]:
    """The values of the variables named like a credential (at least 4 characters: shorter ones are no secret)."""
    return [value for name, value in env.items() if _SECRET_ENV_NAME.search(name) and len(value) >= 4]


def scrub_output(text: str, secrets: Iterable[str] = ()) -> str:
    """A program's output (a harness's, an evaluator's) as it may be kept and sent: `secrets` and anything shaped like
    a provider key redacted (a harness may print its environment or echo a key it was given)."""
    if not text:
        return text
    data = text.encode("utf-8", "surrogatepass")  # any str, lone surrogates included, and back unchanged
    return scrub_body(data, [*secrets, *_key_shaped(data)], min_length=1).decode("utf-8", "surrogatepass")
