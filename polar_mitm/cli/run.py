"""`polar-mitm run`: run any command with its traffic routed through the gateway, as one session.

    polar-mitm run [--gateway URL] [--session ID] [--harness NAME] [--confdir DIR] -- CMD ARGS...

The command gets HTTPS_PROXY/HTTP_PROXY pointing at the gateway with the session's credentials, NO_PROXY
for loopback, and a CA bundle (the gateway's mitmproxy CA + the system CAs) in every variable runtimes read
(SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, CODEX_CA_CERTIFICATE), overriding
any already set. Model base URLs are left alone: requests go to the provider's own host, through the proxy.
With --harness, the harness preset is applied too (its env, config files in a private HOME).
`polar_mitm.routing.proxy_environment()` is the same routing for Python callers (the rollout server).
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from polar_mitm.errors import RunError
from polar_mitm.gateway.options import DEFAULT_CONFDIR
from polar_mitm.routing import DEFAULT_GATEWAY, GATEWAY_FILE, gateway_url, proxy_environment

SESSION_ID = re.compile(r"[A-Za-z0-9._~+=-]{1,200}")


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
