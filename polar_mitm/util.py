"""Small helpers with no home of their own; any layer may use them (they import only polar_mitm.errors)."""

from __future__ import annotations

import importlib
import importlib.util
import socket
from collections.abc import Callable
from typing import Any

from polar_mitm.errors import ConfigError


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


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by 'module:name' or 'path/to/file.py:name' (engine hooks, Python evaluators).

    Raises ConfigError for a malformed spec or a name that is not callable; the module's own import errors pass."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"must be 'module:function' or 'file.py:function', got {spec!r}")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"polar_hook_{abs(hash(target))}", target)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"cannot load file {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{spec!r} is not a function")
    return function
