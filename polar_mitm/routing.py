"""Routing a process's traffic through the gateway, as one session: `proxy_environment()`.

The process gets HTTPS_PROXY/HTTP_PROXY pointing at the gateway with the session's credentials, NO_PROXY
for loopback, and a CA bundle (the gateway's mitmproxy CA + the system CAs) in every variable runtimes read
(SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, CODEX_CA_CERTIFICATE), overriding
any already set. Model base URLs are left alone: requests go to the provider's own host, through the proxy.
Which gateway: `find_gateway()` (explicit, $POLAR_MITM_GATEWAY, the live gateways listed in their confdir's
GATEWAY_FILE, else the default port). A rollout server's own gateway nodes list themselves there too, marked
`node` (their stores are the rollout server's): default discovery leaves them out. Used by `polar-mitm run` and
`polar-mitm control`, the rollout runtimes and the gateway (GATEWAY_FILE).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from polar_mitm import session as sessions
from polar_mitm.errors import RunError
from polar_mitm.session import DEFAULT_CONFDIR
from polar_mitm.store.by_path import pid_alive

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
# each running gateway lists itself here, so that `polar-mitm run` needs no --gateway:
# {"gateways": {URL: {"pid", "db", "started_at"[, "node": true]}}, "url": the newest user gateway's URL (what older
# readers took)}; "node": a rollout server's gateway node, never picked without --gateway
GATEWAY_FILE = "polar-gateway.json"
CA_FILE = "mitmproxy-ca-cert.pem"
BUNDLE_FILE = "polar-mitm-ca-bundle.pem"
CA_VARIABLES = ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "CODEX_CA_CERTIFICATE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
LOOPBACK = "localhost,127.0.0.1,::1"
# Node's fetch() through HTTPS_PROXY (NODE_USE_ENV_PROXY, and undici's EnvHttpProxyAgent that harnesses bundle) warns
# "[UNDICI-EHPA] EnvHttpProxyAgent is experimental" 1-3 times per run; only that warning is turned off (by its code)
QUIET_PROXY_WARNING = "--disable-warning=UNDICI-EHPA"
# Node major -> the first minor release of it that accepts --disable-warning (22 and later all do); an older Node
# refuses to start with an option it does not know in NODE_OPTIONS
DISABLE_WARNING_SINCE = {20: 11, 21: 3}
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ssl/cert.pem",  # macOS, BSD
)


def gateway_url(confdir: str | Path, explicit: str | None = None) -> str:
    """--gateway, else $POLAR_MITM_GATEWAY, else the newest live gateway listed in the confdir, else the default."""
    return find_gateway(confdir, explicit)[0]


def find_gateway(confdir: str | Path, explicit: str | None = None) -> tuple[str, str]:
    """(the gateway URL, where it came from), as `gateway_url()` picks it. A rollout server's gateway nodes listed
    in the confdir are never picked (their stores are the rollout server's); the reason names them."""
    if explicit:
        return explicit, "--gateway"
    if env := os.environ.get("POLAR_MITM_GATEWAY"):
        return env, "$POLAR_MITM_GATEWAY"
    marker = Path(confdir).expanduser() / GATEWAY_FILE
    live = live_gateways(confdir)
    nodes = sorted(url for url, entry in live.items() if entry.get("node"))
    left_out = f"; left out: rollout server gateway node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} (pass --gateway to use one)" if nodes else ""
    users = {url: entry for url, entry in live.items() if not entry.get("node")}
    if not users:
        return DEFAULT_GATEWAY, f"the default (no live gateway listed in {marker}){left_out}"
    newest = _newest(users)
    others = f"; also live there: {', '.join(sorted(set(users) - {newest}))}" if len(users) > 1 else ""
    return newest, f"the newest live gateway in {marker} (pid {users[newest].get('pid')}, store {users[newest].get('db')}){others}{left_out}"


def _newest(gateways: dict[str, dict]) -> str:
    return max(gateways, key=lambda url: gateways[url].get("started_at", 0))


def live_gateways(confdir: str | Path) -> dict[str, dict]:
    """The gateways listed in the confdir's GATEWAY_FILE whose process is alive: URL -> {pid, db, started_at, and
    node: true for a rollout server's gateway node}."""
    return _live_gateways(_read_gateways(Path(confdir).expanduser() / GATEWAY_FILE))


def announce_gateway(confdir: str | Path, url: str, db: Path, node: bool = False, transparent: str | None = None) -> Path:
    """List a running gateway (this process) in its confdir's GATEWAY_FILE, beside the other live ones. `node`: it
    is a rollout server's gateway node, which `find_gateway()` leaves out (only --gateway reaches it). `transparent`:
    its transparent listener ("HOST:PORT"), where capture namespaces (capture.py) send their connections."""
    marker = Path(confdir).expanduser() / GATEWAY_FILE
    with _locked(marker):
        gateways = _live_gateways(_read_gateways(marker))
        extra = {**({"node": True} if node else {}), **({"transparent": transparent} if transparent else {})}
        gateways[url] = {"pid": os.getpid(), "db": str(db), "started_at": time.time(), **extra}
        _write_gateways(marker, gateways)
    return marker


def withdraw_gateway(marker: Path, url: str) -> None:
    """Take one gateway out of the file again; the others stay listed."""
    with _locked(marker):
        gateways = _live_gateways(_read_gateways(marker))
        gateways.pop(url, None)
        _write_gateways(marker, gateways)


@contextlib.contextmanager
def _locked(marker: Path) -> Iterator[None]:
    with open(marker.with_name(marker.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_gateways(marker: Path) -> dict[str, dict]:
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as error:
        raise RunError(f"{marker} is not a gateway file: {error}") from error
    if not isinstance(data, dict):
        raise RunError(f"{marker} is not a gateway file")
    gateways = data.get("gateways")
    if isinstance(gateways, dict):
        return gateways
    # the older one-gateway file
    return {data["url"]: {"pid": data.get("pid"), "db": data.get("db")}} if isinstance(data.get("url"), str) else {}


def _write_gateways(marker: Path, gateways: dict[str, dict]) -> None:
    if not gateways:
        marker.unlink(missing_ok=True)
        return
    # "url" is what older readers take as the one gateway: a user gateway's while there is one
    users = {url: entry for url, entry in gateways.items() if not entry.get("node")}
    newest = _newest(users or gateways)
    with tempfile.NamedTemporaryFile("w", dir=marker.parent, prefix=".gateways-", delete=False) as tmp:
        json.dump({"url": newest, "gateways": gateways}, tmp)
    os.replace(tmp.name, marker)


def _live_gateways(gateways: dict[str, dict]) -> dict[str, dict]:
    return {url: entry for url, entry in gateways.items() if _alive(entry.get("pid"))}


def _alive(pid: object) -> bool:
    return not isinstance(pid, int) or pid_alive(pid)  # an older file without a pid: trusted


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


def check_listening(gateway: str, timeout: float = 5.0) -> None:
    """RunError unless something accepts connections at the gateway URL."""
    import socket

    parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout):
            pass
    except OSError as error:
        raise RunError(f"no gateway listening at {gateway} ({error}); start `polar-mitm gateway` or pass --gateway") from error


def check_gateway(proxy: str, timeout: float = 5.0) -> None:
    """Ask the gateway to open a tunnel with these proxy credentials, as a harness's first request would; RunError
    says why it would not serve them (nothing listening, or a 407: credentials of another confdir's secret)."""
    import base64
    import socket

    parts = urlsplit(proxy)
    credentials = base64.b64encode(f"{parts.username}:{parts.password}".encode()).decode()
    request = f"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\nProxy-Authorization: Basic {credentials}\r\n\r\n"
    where = f"http://{parts.hostname}:{parts.port}"
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout) as connection:
            connection.sendall(request.encode())
            status_line = connection.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
    except OSError as error:
        raise RunError(f"could not ask the gateway at {where} to open a tunnel: {error}") from error
    status = status_line.split(" ")[1] if status_line.count(" ") >= 1 else ""
    if status == "407":
        raise RunError(
            f"the gateway at {where} refused this session's credentials (407): it runs with --require-auth and another "
            f"session secret; pass the --confdir that gateway uses (its {sessions.SECRET_FILE})"
        )
    if status != "200":
        raise RunError(f"{where} did not answer like a polar-mitm gateway: {status_line!r}")


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
    options = env.get("NODE_OPTIONS", "")
    if QUIET_PROXY_WARNING not in options.split() and node_accepts_disable_warning(shutil.which("node", path=env.get("PATH"))):
        env["NODE_OPTIONS"] = f"{options} {QUIET_PROXY_WARNING}".strip()
    return env


def capture_environment(session_id: str, confdir: str | Path = DEFAULT_CONFDIR, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) for a command in a capture namespace (capture.py): no proxy settings at all (it
    is captured without them), only the gateway's CA trusted, in every variable runtimes read."""
    env = dict(os.environ if base is None else base)
    for key in (*PROXY_VARIABLES, "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy", "NODE_USE_ENV_PROXY"):
        env.pop(key, None)
    bundle = str(ca_bundle(confdir, env))
    env.update({key: bundle for key in CA_VARIABLES}, POLAR_MITM_SESSION=session_id)
    return env


def transparent_listener(confdir: str | Path, gateway: str) -> tuple[str, int]:
    """The transparent listener ("HOST:PORT") the live gateway at `gateway` announced in the confdir's GATEWAY_FILE;
    RunError when it has none (started without --transparent-port) or is not listed there."""
    entry = live_gateways(confdir).get(gateway.rstrip("/"))
    if entry is None:
        raise RunError(f"the gateway at {gateway} is not listed in {Path(confdir).expanduser() / GATEWAY_FILE}: transparent capture needs a gateway started with this confdir")
    listener = entry.get("transparent")
    if not listener:
        raise RunError(f"the gateway at {gateway} has no transparent listener: start it with --transparent-port PORT for --capture transparent")
    host, _, port = str(listener).rpartition(":")
    return host, int(port)


@functools.cache
def node_accepts_disable_warning(node: str | None) -> bool:
    """Whether the `node` on the command's PATH starts with --disable-warning in NODE_OPTIONS (Node >= 20.11 or
    21.3; an older one refuses to start with an option it does not know). No node there: True (a harness preset
    puts its own Node >= 22 first on PATH)."""
    if node is None:
        return True
    try:
        done = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
        major, minor = (int(part) for part in done.stdout.strip().lstrip("v").split(".")[:2])
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
    return major > max(DISABLE_WARNING_SINCE) or minor >= DISABLE_WARNING_SINCE.get(major, 1 << 30)
