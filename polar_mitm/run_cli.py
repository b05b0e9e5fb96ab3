"""`polar-mitm run`: run any command with its traffic routed through the gateway, as one session.

    polar-mitm run [--gateway URL] [--session ID] [--harness NAME] [--confdir DIR] -- CMD ARGS...

The command gets HTTPS_PROXY/HTTP_PROXY pointing at the gateway with the session's credentials, NO_PROXY
for loopback, and a CA bundle (the gateway's mitmproxy CA + the system CAs) in every variable runtimes read
(SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, CODEX_CA_CERTIFICATE), overriding
any already set. Model base URLs are left alone: requests go to the provider's own host, through the proxy.
With --harness, the harness preset is applied too (its env, config files in a private HOME).
`proxy_environment()` is the same routing for Python callers (the rollout server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from polar_mitm import session as sessions
from polar_mitm.errors import RunError
from polar_mitm.gateway.config import DEFAULT_CONFDIR

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
# a gateway may leave its URL here so that `polar-mitm run` needs no --gateway
GATEWAY_FILE = "polar-gateway.json"
CA_FILE = "mitmproxy-ca-cert.pem"
BUNDLE_FILE = "polar-mitm-ca-bundle.pem"
CA_VARIABLES = ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "CODEX_CA_CERTIFICATE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
LOOPBACK = "localhost,127.0.0.1,::1"
SESSION_ID = re.compile(r"[A-Za-z0-9._~+=-]{1,200}")
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


def _check_listening(gateway: str) -> None:
    parts = urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=2):
            pass
    except OSError as error:
        raise RunError(f"no gateway listening at {gateway} ({error}); start `polar-mitm gateway` or pass --gateway") from error


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command (e.g. an agent harness) with its traffic routed through the gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gateway", help=f"gateway URL (default: $POLAR_MITM_GATEWAY, <confdir>/{GATEWAY_FILE}, else {DEFAULT_GATEWAY})")
    parser.add_argument("--session", help="session id the exchanges are recorded under (default: a new one)")
    parser.add_argument("--harness", choices=["codex", "claude", "qwen", "gemini"], help="apply this harness's preset (env, config files in a private HOME)")
    parser.add_argument("--model", help="with --harness: the model name the harness asks for (default: the preset's)")
    parser.add_argument("--home", type=Path, help="with --harness: the HOME to prepare and keep (default: a temporary one, removed afterwards)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, help=f"the gateway's confdir: its CA and session secret (default {DEFAULT_CONFDIR})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("polar-mitm run: no command given (polar-mitm run [options] -- CMD ARGS...)", file=sys.stderr)
        return 2
    session_id = args.session or f"run-{uuid.uuid4().hex[:12]}"
    if not SESSION_ID.fullmatch(session_id):
        print(f"polar-mitm run: a session id is letters, digits and . _ ~ + = - only (it is a proxy URL's user name), got {session_id!r}", file=sys.stderr)
        return 2
    temporary_home: str | None = None
    try:
        gateway = gateway_url(args.confdir, args.gateway)
        _check_listening(gateway)
        env = proxy_environment(session_id, args.confdir, gateway)
        if args.harness:
            from polar_mitm import harnesses

            harness = harnesses.get(args.harness)
            home = args.home or Path(temporary_home := tempfile.mkdtemp(prefix=f"polar-{args.harness}-home-"))
            harness.prepare_home(home, args.model)
            # its PATH leads with the pinned install: `-- qwen ...` runs that one, not the caller's `qwen`
            env = harness.environment(home, args.model, base=env)
    except RunError as error:
        print(f"polar-mitm run: {error}", file=sys.stderr)
        return 2
    print(f"polar-mitm run: session {session_id}", file=sys.stderr, flush=True)
    try:
        return _run_child(command, env)
    finally:
        if temporary_home:
            shutil.rmtree(temporary_home, ignore_errors=True)


def _run_child(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as error:
        print(f"polar-mitm run: cannot start {command[0]!r}: {error}", file=sys.stderr)
        return 127
    # pass termination on to the child and report its own exit status
    forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
