"""Routing a process's traffic through the gateway, as one session: `proxy_environment()`.

The process gets HTTPS_PROXY/HTTP_PROXY pointing at the gateway with the session's credentials, NO_PROXY
for loopback, and a CA bundle (the gateway's mitmproxy CA + the system CAs) in every variable runtimes read
(SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, CODEX_CA_CERTIFICATE), overriding
any already set. Model base URLs are left alone: requests go to the provider's own host, through the proxy.
Which gateway: `gateway_url()` (explicit, $POLAR_MITM_GATEWAY, the file a running gateway leaves in its
confdir, else the default port). Used by `polar-mitm run`, the rollout runtimes and the gateway (GATEWAY_FILE).
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from polar_mitm import session as sessions
from polar_mitm.errors import RunError
from polar_mitm.gateway.options import DEFAULT_CONFDIR

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
# a gateway may leave its URL here so that `polar-mitm run` needs no --gateway
GATEWAY_FILE = "polar-gateway.json"
CA_FILE = "mitmproxy-ca-cert.pem"
BUNDLE_FILE = "polar-mitm-ca-bundle.pem"
CA_VARIABLES = ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "CODEX_CA_CERTIFICATE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
LOOPBACK = "localhost,127.0.0.1,::1"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ssl/cert.pem",  # macOS, BSD
)


def gateway_url(confdir: str | Path, explicit: str | None = None) -> str:
    """--gateway, else $POLAR_MITM_GATEWAY, else the URL the gateway left in its confdir, else the default port."""
    if explicit:
        return explicit
    if env := os.environ.get("POLAR_MITM_GATEWAY"):
        return env
    marker = Path(confdir).expanduser() / GATEWAY_FILE
    if marker.exists():
        try:
            return json.loads(marker.read_text())["url"]
        except (ValueError, KeyError, TypeError) as error:
            raise RunError(f"{marker} is not a gateway file with a 'url': {error}") from error
    return DEFAULT_GATEWAY


def system_ca_bundle(env: Mapping[str, str] | None = None) -> Path | None:
    """The machine's CA bundle: a pre-set SSL_CERT_FILE (unless it is one of ours), OpenSSL's, or a usual path."""
    env = os.environ if env is None else env
    candidates = [env.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().openssl_cafile, *SYSTEM_BUNDLES]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and Path(candidate).name != BUNDLE_FILE:
            return Path(candidate)
    try:
        import certifi

        return Path(certifi.where())
    except ImportError:
        return None


def ca_bundle(confdir: str | Path, env: Mapping[str, str] | None = None) -> Path:
    """Write (atomically, when changed) the gateway's CA followed by the system CAs into the confdir."""
    confdir = Path(confdir).expanduser()
    ca = confdir / CA_FILE
    if not ca.is_file():
        raise RunError(f"no mitmproxy CA at {ca}: start the gateway with this confdir first, or pass --confdir")
    system = system_ca_bundle(env)
    content = ca.read_text().rstrip() + "\n" + (system.read_text() if system else "")
    bundle = confdir / BUNDLE_FILE
    if not bundle.exists() or bundle.read_text() != content:
        with tempfile.NamedTemporaryFile("w", dir=confdir, prefix=".bundle-", delete=False) as tmp:
            tmp.write(content)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, bundle)
    return bundle


def proxy_url(gateway: str, confdir: str | Path, session_id: str) -> str:
    parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    if parts.scheme != "http" or not parts.hostname or parts.username:
        raise RunError(f"--gateway must look like http://127.0.0.1:PORT, got {gateway!r}")
    token = sessions.session_token(sessions.load_secret(Path(confdir).expanduser()), session_id)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{session_id}:{token}@{host}:{parts.port or 80}"


def proxy_environment(session_id: str, confdir: str | Path = DEFAULT_CONFDIR, gateway: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) routed through the gateway as `session_id`, the gateway's CA trusted."""
    env = dict(os.environ if base is None else base)
    bundle = str(ca_bundle(confdir, env))
    url = proxy_url(gateway_url(confdir, gateway), confdir, session_id)
    for key in ("ALL_PROXY", "all_proxy"):
        env.pop(key, None)
    env.update({key: url for key in PROXY_VARIABLES})
    env.update(NO_PROXY=LOOPBACK, no_proxy=LOOPBACK, POLAR_MITM_SESSION=session_id)
    env.update({key: bundle for key in CA_VARIABLES})
    # Node's own fetch() ignores HTTPS_PROXY unless asked (Node >= 22.21 / 24)
    env["NODE_USE_ENV_PROXY"] = "1"
    return env
