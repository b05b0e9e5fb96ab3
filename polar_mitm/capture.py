"""Capture without proxy settings: a network namespace whose only way out is the gateway's transparent listener.

For a program that ignores HTTPS_PROXY (Node's own fetch(), a client built with trust_env=False, a binary with its
own network stack). `polar-mitm run --capture transparent` and the rollout server's `runtime.capture: transparent`
open one namespace per session:

    namespace (10.213.X.2/30, default route via the host end)  --veth-->  host end (10.213.X.1)
      /etc/hosts: the provider hosts -> 203.0.113.1 (TEST-NET-3: never routed), resolv.conf: nobody
    host: nat PREROUTING  -i <host end> tcp dport 443, 80  DNAT 127.0.0.1:<gateway's transparent port>
          filter INPUT    -i <host end> to that port ACCEPT, anything else REJECT
          filter FORWARD  -i <host end> REJECT      (nothing from the namespace is ever routed on)

The DNAT happens in the host's namespace, where mitmproxy runs, because mitmproxy's transparent mode reads the
original destination with SO_ORIGINAL_DST from the host's connection tracking (a DNAT inside the namespace, or
TPROXY, leaves it nothing to read). `route_localnet` on the host end lets a packet from the veth reach 127.0.0.1, so
the listener stays on loopback. A capture that fails, fails locally: a refused connection or a name nobody resolves.

A connection carries no proxy credentials, so the session is named by the namespace's address: each namespace
registers `<confdir>/polar-capture/<address>.json` ({session_id, pid, netns}), which the gateway reads when a
transparent connection comes in (only processes that can write the confdir, which holds the session secret too, can
name a session this way). Needs root (CAP_NET_ADMIN) and iproute2 + iptables.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm.errors import RunError
from polar_mitm.store.by_path import pid_alive

CAPTURE_DIR = "polar-capture"
SUBNET = ipaddress.ip_network("10.213.0.0/16")  # one /30 per namespace: 16,384 at once
MAX_NAMESPACES = SUBNET.num_addresses // 4
UNROUTED = "203.0.113.1"  # TEST-NET-3 (RFC 5737): what the provider hosts resolve to inside a namespace
CAPTURED_PORTS = (443, 80)
# the hosts the agents we ship presets for call (docs/agents.md); `extra_hosts` adds more
PROVIDER_HOSTS = (
    "api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com", "dashscope.aliyuncs.com",
    "dashscope-intl.aliyuncs.com", "api.mistral.ai", "api.moonshot.ai", "api.moonshot.cn", "openrouter.ai",
    "api.deepseek.com", "api.groq.com", "api.together.xyz", "api.x.ai", "chatgpt.com",
)
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*


@dataclass(frozen=True)
class Registration:
    """Who is behind a namespace's address: what the gateway reads for a transparent connection."""

    session_id: str
    pid: int
    netns: str


def registration_path(confdir: str | Path, address: str) -> Path:
    return Path(confdir).expanduser() / CAPTURE_DIR / f"{address}.json"


def registered_session(confdir: str | Path, address: str) -> Registration | None:
    """The session registered for a client address, or None (no namespace of ours has it)."""
    try:
        data = json.loads(registration_path(confdir, address).read_text())
        return Registration(str(data["session_id"]), int(data["pid"]), str(data["netns"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class CaptureNamespace:
    """One session's namespace; `command(argv)` runs argv inside it. `close()` removes everything it set up."""

    index: int
    session_id: str
    confdir: Path
    listener: tuple[str, int] | None  # the gateway's transparent listener; None: a namespace with no way out at all
    hosts: tuple[str, ...] = PROVIDER_HOSTS
    _placed: dict[tuple[str, str], int] = field(default_factory=dict)  # rules this namespace put at each chain's top

    @property
    def name(self) -> str:
        return f"polar-cap-{self.index}"

    @property
    def host_end(self) -> str:
        return f"plrc{self.index}h"  # interface names are at most 15 characters

    @property
    def addresses(self) -> tuple[str, str]:
        """(host end, namespace end) of its /30."""
        base = SUBNET.network_address + 4 * self.index
        return str(base + 1), str(base + 2)

    @property
    def address(self) -> str:
        return self.addresses[1]

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv inside the namespace (`ip` by its full path: the command's own PATH may not have /usr/sbin)."""
        return [shutil.which("ip") or "/usr/sbin/ip", "netns", "exec", self.name, *argv]

    def open(self) -> CaptureNamespace:
        host_ip, ns_ip = self.addresses
        inner = f"plrc{self.index}n"
        try:
            _run("ip", "netns", "add", self.name)
            etc = NETNS_ETC / self.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{UNROUTED} {host}\n" for host in self.hosts))
            (etc / "resolv.conf").write_text("# polar-mitm capture namespace: no name server (provider hosts are in /etc/hosts)\nnameserver 127.0.0.1\n")
            _run("ip", "link", "add", self.host_end, "type", "veth", "peer", "name", inner, "netns", self.name)
            _run("ip", "addr", "add", f"{host_ip}/30", "dev", self.host_end)
            _run("ip", "link", "set", self.host_end, "up")
            Path(f"/proc/sys/net/ipv4/conf/{self.host_end}/route_localnet").write_text("1")
            inside = ("ip", "netns", "exec", self.name)
            _run(*inside, "ip", "addr", "add", f"{ns_ip}/30", "dev", inner)
            _run(*inside, "ip", "link", "set", inner, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", host_ip)
            with contextlib.suppress(CaptureError):  # no IPv6 inside: an AAAA answer can go nowhere
                _run(*inside, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
            tag = ("-m", "comment", "--comment", self.name)
            if self.listener is not None:
                listen_host, listen_port = self.listener
                for port in CAPTURED_PORTS:
                    self._rule("nat", "PREROUTING", "-i", self.host_end, "-p", "tcp", "--dport", str(port), *tag, "-j", "DNAT", "--to-destination", f"{listen_host}:{listen_port}")
                self._rule("filter", "INPUT", "-i", self.host_end, "-p", "tcp", "-d", listen_host, "--dport", str(listen_port), *tag, "-j", "ACCEPT")
            self._rule("filter", "INPUT", "-i", self.host_end, "-p", "tcp", *tag, "-j", "REJECT", "--reject-with", "tcp-reset")
            self._rule("filter", "INPUT", "-i", self.host_end, *tag, "-j", "REJECT")
            self._rule("filter", "FORWARD", "-i", self.host_end, *tag, "-j", "REJECT")
            path = registration_path(self.confdir, ns_ip)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"session_id": self.session_id, "pid": os.getpid(), "netns": self.name}))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Idempotent: rules, registration, namespace (its veth pair goes with it) and its /etc/netns files."""
        _purge_rules(self.name)
        with contextlib.suppress(FileNotFoundError):
            registration_path(self.confdir, self.address).unlink()
        if Path("/run/netns", self.name).exists():
            with contextlib.suppress(CaptureError):
                _run("ip", "netns", "delete", self.name)
        with contextlib.suppress(CaptureError):  # a namespace deleted while its veth was still being moved
            if Path("/sys/class/net", self.host_end).exists():
                _run("ip", "link", "delete", self.host_end)
        shutil.rmtree(NETNS_ETC / self.name, ignore_errors=True)

    def _rule(self, table: str, chain: str, *spec: str) -> None:
        # at the top, in the order given: the host's own rules (Docker's FORWARD chain) must not accept the
        # namespace's packets first
        position = self._placed.get((table, chain), 0) + 1
        _run("iptables", "-w", "-t", table, "-I", chain, str(position), *spec)
        self._placed[(table, chain)] = position


RULE_CHAINS = (("nat", "PREROUTING"), ("filter", "INPUT"), ("filter", "FORWARD"))


def _purge_rules(tag: str) -> None:
    """Delete every rule commented `tag` (also a killed run's: found by its comment, not remembered)."""
    for table, chain in RULE_CHAINS:
        try:
            listed = subprocess.run(["iptables", "-w", "-t", table, "-S", chain], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in listed.splitlines():
            words = shlex.split(line)
            if words[:1] == ["-A"] and any(pair == ("--comment", tag) for pair in itertools.pairwise(words)):
                with contextlib.suppress(CaptureError):
                    _run("iptables", "-w", "-t", table, "-D", *words[1:])


class CaptureError(RunError):
    """A namespace could not be set up (not root, no iproute2/iptables, ...)."""


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise CaptureError(f"transparent capture: {' '.join(argv[:3])} failed: {error}") from None
    if done.returncode != 0:
        raise CaptureError(f"transparent capture: `{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()} (it needs root, iproute2 and iptables)")


def check_available() -> None:
    """Fail early, with the reason, where namespaces cannot be made."""
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        raise CaptureError(f"transparent capture needs {' and '.join(missing)} on PATH (Debian: iproute2, iptables)")
    if os.geteuid() != 0:
        raise CaptureError("transparent capture makes a network namespace and iptables rules: run it as root (CAP_NET_ADMIN)")


@contextlib.contextmanager
def _allocation_lock(confdir: Path) -> Iterator[None]:
    directory = confdir / CAPTURE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def open_namespace(confdir: str | Path, session_id: str, listener: tuple[str, int] | None, extra_hosts: Sequence[str] = ()) -> CaptureNamespace:
    """A new namespace for `session_id`, routed to `listener` (host, port). A slot whose registering process is gone
    (a run that was killed) is cleaned up and reused."""
    check_available()
    root = Path(confdir).expanduser()
    hosts = tuple(dict.fromkeys((*PROVIDER_HOSTS, *extra_hosts)))
    with _allocation_lock(root):
        for index in range(MAX_NAMESPACES):
            namespace = CaptureNamespace(index, session_id, root, listener, hosts)
            taken = registered_session(root, namespace.address)
            if taken is not None and pid_alive(taken.pid):
                continue
            if Path("/run/netns", namespace.name).exists() and taken is None:
                continue  # another confdir's namespace (or one being set up without a registration yet)
            namespace.close()  # a dead run's leftovers, if any
            return namespace.open()
    raise CaptureError(f"transparent capture: all {MAX_NAMESPACES} namespaces are in use")
