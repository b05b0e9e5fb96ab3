"""Small helpers with no home of their own (no polar_mitm imports: any layer may use them)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS's pick); another process may take it before it is bound."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def listening(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket() as probe:
        probe.settimeout(timeout)
        return probe.connect_ex((host, port)) == 0
