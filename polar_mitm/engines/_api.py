"""The declared surface of an inference engine client (as `dialects/_api.py` declares a dialect's).

The gateway addon and the tokens-mode path (`render/serve.py`, `render/token_engine.py`) use an engine only
through `EngineClient`. `base.Engine` and its subclasses (`vllm`, `sglang`) satisfy it for one engine URL,
`router.EngineRouter` for several; tests/unit/engines/test_engine_protocol.py has a type checker verify each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from polar_mitm.exchange import Completion, Notes


@dataclass
class Reachability:
    """Whether one engine URL answered its last HTTP call (any answer, an HTTP error included), and since when.

    `reachable` is None until the first call. `on_change` (set by the gateway, which says so in its log) is
    called on each transition only, never per call: an engine down for minutes is one line, its return another.
    """

    url: str
    reachable: bool | None = None
    since: float | None = None  # wall-clock time of the last change
    last_error: str | None = None  # why the last unreachable call failed
    failed_calls: int = 0  # calls that found it unreachable, in its current (or last) time down
    down_seconds: float | None = None  # how long its last time down lasted, once it answers again
    on_change: Callable[[Reachability], None] | None = field(default=None, repr=False, compare=False)

    def answered(self) -> None:
        if self.reachable is True:
            return
        was_down, now = self.reachable is False, time.time()
        if was_down and self.since is not None:
            self.down_seconds = now - self.since
        self.reachable, self.since = True, now
        if was_down and self.on_change is not None:
            self.on_change(self)

    def unreachable(self, error: str) -> None:
        self.last_error = error
        went_down = self.reachable is not False
        if went_down:
            self.reachable, self.since, self.failed_calls = False, time.time(), 0
        self.failed_calls += 1
        if went_down and self.on_change is not None:
            self.on_change(self)


@runtime_checkable
class EngineClient(Protocol):
    """One inference engine (or a router over several serving the same model), called non-streaming.

    Every call raises `EngineError` on failure; its `status_class` is what the exchange row records.
    """

    @property
    def kind(self) -> str:
        """The `exchanges.engine_kind` value and the engine's token API: "vllm", "sglang" (or "openai": chat only)."""
        ...

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API root (".../v1"); a router: its engines' roots, comma-separated."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """The context length (prompt + output), configured or read by `discover`; None: unknown."""
        ...

    async def discover(self) -> str:
        """The served model's name (configured, else the first of /models); reads the context length on the way."""
        ...

    async def list_models(self) -> list[str]:
        """Every model name served now (the base model and any loaded LoRA adapters)."""
        ...

    async def models(self) -> list[dict[str, Any]]:
        """The engine's /models entries as it lists them (vLLM's carry `root`, the directory it loaded)."""
        ...

    def build_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        """The exact chat body sent to the engine: never streaming, always token ids and logprobs."""
        ...

    async def complete(self, engine_request: dict[str, Any], notes: Notes | None = None, timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any], Completion]:
        """One chat call: (the request as finally sent, the raw reply, the parsed completion); `timeout`: seconds
        for this call instead of the engine's own. The output budget is fitted to the context (noted in `notes`)."""
        ...

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        """One token-in call (tokens mode; the body from `render.token_engine.encode_request`): the raw reply."""
        ...

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        """The exact body `count_tokens` sends for this prompt (recorded as the row's engine_request)."""
        ...

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        """The rendered prompt's length in tokens."""
        ...

    def reachability(self) -> list[Reachability]:
        """One entry per engine URL, in `base_url` order."""
        ...

    async def close(self) -> None:
        """Close the HTTP connections (the gateway's last step)."""
        ...
