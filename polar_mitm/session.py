"""Who is calling: session ids from proxy credentials, and the harness's own lineage headers.

A session is named by the user part of the proxy URL (`http://SESSION:TOKEN@127.0.0.1:P`). The token is
an HMAC of the session id under a secret kept in the gateway's confdir, so any process that can read the
confdir (`polar-mitm run`, the rollout server) can mint credentials without talking to the gateway.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from pathlib import Path

DEFAULT_SESSION = "default"
# the gateway's confdir (mitmproxy's): its CA, the session secret, the gateway file (routing.GATEWAY_FILE); here, at the
# bottom of the layers, so that the gateway's options and the routing of its clients name the same default
DEFAULT_CONFDIR = "~/.mitmproxy"
SECRET_FILE = "polar-session-secret"

# headers harnesses send that tie requests into conversations, sub-agents and retries
LINEAGE_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "thread-id",
    "conversation-id",
    "conversation_id",
    "x-stainless-retry-count",
    "x-client-request-id",
    "x-request-id",
    "x-dashscope-session-id",
    "x-gemini-api-privileged-user-id",
    "anthropic-beta",
)

HARNESS_USER_AGENTS = (
    ("claude-cli", "claude"),
    ("claude-code", "claude"),
    ("codex", "codex"),
    ("qwencode", "qwen"),
    ("qwen-code", "qwen"),
    ("geminicli", "gemini"),
    ("gemini-cli", "gemini"),
    # the PyPI agents: user agents their presets set where the client's own is a generic OpenAI/Python one
    ("mini-swe-agent", "mini-swe-agent"),
    ("aider", "aider"),
    ("openhands", "openhands"),
    ("hermes-agent", "hermes"),
    ("gptme", "gptme"),
    ("kimicli", "kimi"),
    # the npm agents (docs/agents.md): their own user agents, or ones their presets set (Cline, Continue CLI, OpenClaw)
    ("opencode/", "opencode"),
    ("kilo-code/", "kilo"),
    ("kilo/", "kilo"),
    ("cline/", "cline"),
    ("continue-cli/", "continue-cli"),
    ("openclaw/", "openclaw"),
)
# user agents told apart only by how they start (Pi's `pi/<version> (...)`: "pi/" inside would match "api/...")
HARNESS_USER_AGENT_PREFIXES = (("pi/", "pi"),)
# an agent whose client rewrites any user agent its config sets (Mistral Vibe: the Mistral SDK's) names itself in
# an X-Title header (OpenRouter's app-attribution header) its preset sets instead; exact titles only
HARNESS_TITLES = (("mistral-vibe", "vibe"),)


def load_secret(confdir: str | Path) -> bytes:
    path = Path(confdir).expanduser() / SECRET_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip().encode()


def session_token(secret: bytes, session_id: str) -> str:
    return hmac.new(secret, session_id.encode(), hashlib.sha256).hexdigest()[:32]


def parse_proxy_authorization(value: str | None) -> tuple[str, str] | None:
    """(user, password) from a `Basic` Proxy-Authorization header, or None."""
    if not value:
        return None
    scheme, _, encoded = value.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None
    try:
        user, sep, password = base64.b64decode(encoded.strip()).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not sep or not user:
        return None
    return user, password


def credentials_valid(secret: bytes, credentials: tuple[str, str] | None) -> bool:
    if credentials is None:
        return False
    user, password = credentials
    return hmac.compare_digest(session_token(secret, user), password)


def lineage(headers: dict[str, str]) -> dict[str, str]:
    return {name: headers[name] for name in LINEAGE_HEADERS if name in headers}


def harness_from_user_agent(user_agent: str | None) -> str | None:
    lowered = (user_agent or "").lower().replace(" ", "")
    for needle, harness in HARNESS_USER_AGENTS:
        if needle in lowered:
            return harness
    for prefix, harness in HARNESS_USER_AGENT_PREFIXES:
        if lowered.startswith(prefix):
            return harness
    return None


def harness_from_headers(headers: dict[str, str]) -> str | None:
    """The harness a request's headers (lower-cased names) name: by its user agent, else by its X-Title."""
    title = (headers.get("x-title") or "").strip().lower()
    return harness_from_user_agent(headers.get("user-agent")) or next((h for t, h in HARNESS_TITLES if t == title), None)
