"""One registry style for every kind of plug-in (dialects, engines, trajectory builders, harnesses, sandbox
runtimes): a read-only name -> plug-in mapping whose `get(name)` names the valid choices when it fails.

    ENGINES = Registry[type[Engine]]("engine", {"vllm": "polar_mitm.engines.vllm:VLLMEngine", ...})
    ENGINES.get("vllm")       # imported on first use; ConfigError("unknown engine 'x'; valid: sglang, vllm")

An entry is the plug-in itself, or "module" / "module:attribute" to import it on first use (a plug-in whose
module pulls in heavy or optional dependencies). Registration is static: adding a plug-in is one module that
satisfies its kind's declared interface plus one line in its package's registry. This module sits at the
bottom of the import graph (it imports only errors).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from polar_mitm.errors import ConfigError


class Registry[T]:
    """Read-only and ordered like a dict of name -> plug-in (iteration gives the names in declaration order)."""

    def __init__(self, kind: str, entries: Mapping[str, T | str]):
        self.kind = kind  # what an entry is, for error messages ("engine", "builder", ...)
        self._entries: dict[str, Any] = dict(entries)

    def get(self, name: str) -> T:
        """The plug-in called `name`; raises ConfigError (a ValueError) listing the valid names."""
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {', '.join(self._entries)}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, _, attribute = entry.partition(":")
            module = importlib.import_module(module_name)
            entry = self._entries[name] = getattr(module, attribute) if attribute else module
        return entry  # type: ignore[no-any-return]

    def __getitem__(self, name: str) -> T:
        try:
            return self.get(name)
        except ConfigError as error:
            raise KeyError(name) from error

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def values(self) -> list[T]:
        """Every plug-in (imports the lazy ones)."""
        return [self.get(name) for name in self._entries]
