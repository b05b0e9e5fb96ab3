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
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from polar_mitm.capture import CaptureNamespace, open_namespace
from polar_mitm.errors import RunError
from polar_mitm.gateway.options import DEFAULT_CONFDIR
from polar_mitm.routing import (
    DEFAULT_GATEWAY,
    GATEWAY_FILE,
    capture_environment,
    check_gateway,
    check_listening,
    find_gateway,
    proxy_environment,
    transparent_listener,
)

SESSION_ID = re.compile(r"[A-Za-z0-9._~+=-]{1,200}")
CAPTURE_MODES = ("proxy", "transparent")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command (e.g. an agent harness) with its traffic routed through the gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gateway", help=f"gateway URL (default: $POLAR_MITM_GATEWAY, <confdir>/{GATEWAY_FILE}, else {DEFAULT_GATEWAY})")
    parser.add_argument("--session", help="session id the exchanges are recorded under (default: a new one)")
    from polar_mitm.harnesses import NAMES as HARNESS_NAMES  # the registry: every preset, npm and PyPI
    from polar_mitm.harnesses.custom import NAME as CUSTOM  # no preset: only the part every preset shares

    parser.add_argument("--harness", choices=[*HARNESS_NAMES, CUSTOM], help=f"apply this harness's preset (env, config files in a private HOME); {CUSTOM}: an agent without one, only what every preset shares (docs/agents.md)")
    parser.add_argument("--model", help="with --harness: the model name the harness asks for (default: the preset's)")
    parser.add_argument("--home", type=Path, help="with --harness: the HOME to prepare and keep (default: a temporary one, removed afterwards)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, help=f"the gateway's confdir: its CA and session secret (default {DEFAULT_CONFDIR})")
    parser.add_argument(
        "--capture", choices=CAPTURE_MODES, default="proxy",
        help="proxy (default): HTTPS_PROXY with the session's credentials; transparent: for a command that ignores proxy settings, run it in a network namespace whose HTTPS goes to the gateway's transparent listener (root; the gateway started with --transparent-port)",
    )
    parser.add_argument("--capture-host", action="append", default=[], metavar="HOST", help="with --capture transparent: another provider host the command calls (the known ones are built in)")
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
    namespace: CaptureNamespace | None = None
    try:
        gateway, picked = find_gateway(args.confdir, args.gateway)
        check_listening(gateway)  # before anything is written to the confdir
        env = proxy_environment(session_id, args.confdir, gateway)
        # before the harness starts: a harness shows a bare 407 or a connection error badly, or not at all
        check_gateway(env["HTTPS_PROXY"])
        if args.capture == "transparent":
            listener = transparent_listener(args.confdir, gateway)
            env = capture_environment(session_id, args.confdir)
            namespace = open_namespace(args.confdir, session_id, listener, args.capture_host)
            command = namespace.command(command)
        if args.harness:
            from polar_mitm import harnesses
            from polar_mitm.harnesses import custom

            harness = custom.HARNESS if args.harness == custom.NAME else harnesses.get(args.harness)
            home = args.home or Path(temporary_home := tempfile.mkdtemp(prefix=f"polar-{args.harness}-home-"))
            harness.prepare_home(home, args.model)
            # its PATH leads with the pinned install: `-- qwen ...` runs that one, not the caller's `qwen`
            env = harness.environment(home, args.model, base=env)
    except RunError as error:
        if namespace is not None:
            namespace.close()
        print(f"polar-mitm run: {error}", file=sys.stderr)
        return 2
    how = f", captured transparently in network namespace {namespace.name} ({namespace.address})" if namespace else ""
    print(f"polar-mitm run: session {session_id} via gateway {gateway} ({picked}){how}", file=sys.stderr, flush=True)
    try:
        return _run_child(command, env)
    finally:
        if namespace is not None:
            namespace.close()
        if temporary_home:
            shutil.rmtree(temporary_home, ignore_errors=True)


# how long a harness's other processes get to finish (flush their session records) once its main process has exited
# or been signalled, before the group is killed; the temporary HOME is removed only after that
GROUP_GRACE_SECONDS = 10.0


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Run `command` in a process group of its own and return its exit status (128 + N for signal N). A signal to
    this command (SIGINT, SIGTERM, SIGHUP) goes to the whole group: a harness that re-executes itself (Qwen Code's
    launcher waits for its `node --expose-gc` child) ends whole, not just its launcher. Returns only once every
    process of the group has exited (SIGKILL after GROUP_GRACE_SECONDS), so nothing still writes into the HOME the
    caller removes next. On a terminal the group is made its foreground group: keys and Ctrl-C reach the harness."""
    terminal = _foreground_terminal()
    try:
        child = subprocess.Popen(command, env=env, process_group=0, preexec_fn=(lambda: _take_terminal(terminal)) if terminal is not None else None)
    except OSError as error:
        print(f"polar-mitm run: cannot start {command[0]!r}: {error}", file=sys.stderr)
        return 127
    forward = lambda signum, _frame: _signal_group(child.pid, signum)  # noqa: E731
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        child.returncode = code = _wait_for_exit(child.pid)
        _wait_for_group(child.pid, GROUP_GRACE_SECONDS)
    finally:
        _reclaim_terminal(child.pid)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _wait_for_exit(pid: int) -> int:
    """The child's exit code (-N: signal N). When it is stopped (Ctrl-Z on the terminal reaches its group only), this
    process stops too, so the shell sees its job stopped; continued (`fg`, `bg`), it continues the child, handing it
    the terminal when this process holds it."""
    while True:
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            return os.waitstatus_to_exitcode(status)
        _reclaim_terminal(pid)
        os.kill(os.getpid(), signal.SIGSTOP)
        if (terminal := _foreground_terminal()) is not None:
            _hand_terminal(terminal, pid)
        _signal_group(pid, signal.SIGCONT)


def _foreground_terminal() -> int | None:
    """The fd of our controlling terminal when our process group is its foreground group (an interactive shell
    started us), else None (a pipe, a script, a background job)."""
    return _terminal_held_by(os.getpgrp())


def _terminal_held_by(pgid: int) -> int | None:
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == pgid:
                return fd
        except OSError:
            continue
    return None


def _reclaim_terminal(child_pgid: int) -> None:
    """Take the terminal back from the child's group, if it holds it."""
    if (terminal := _terminal_held_by(child_pgid)) is not None:
        _hand_terminal(terminal, os.getpgrp())


def _take_terminal(fd: int) -> None:
    """In the child, before exec: its new group becomes the terminal's foreground group, as a shell does for a job."""
    _hand_terminal(fd, os.getpgrp())


def _hand_terminal(fd: int, pgid: int) -> None:
    """Make `pgid` the terminal's foreground group. A background group doing so gets SIGTTOU, hence ignored for the
    call (and restored: an ignored signal would stay ignored across exec)."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:  # the terminal is gone (hung up)
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _wait_for_group(pgid: int, grace: float) -> None:
    """Until no process of group `pgid` is left: `grace` seconds, then SIGKILL to the group (and a moment for the
    kernel to reap it)."""
    deadline = time.monotonic() + grace
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            print(f"polar-mitm run: processes of the command still ran {grace:.0f}s after it ended; killed them", file=sys.stderr, flush=True)
            _signal_group(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 2.0
            while _group_alive(pgid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
            return
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed its user: still there
        return True
    return True
