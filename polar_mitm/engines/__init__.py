"""Inference engine clients: one module per engine, each a subclass of `base.Engine`; what the gateway uses of
them (and of `router.EngineRouter`, several engines behind one client) is declared by `_api.EngineClient`.

    ENGINES.get("vllm")   # the Engine class; ConfigError naming the valid engines for an unknown name
    make_engine("sglang", "http://127.0.0.1:30000/v1")
"""

from __future__ import annotations

from polar_mitm.engines._api import EngineClient, Reachability
from polar_mitm.engines.base import Engine
from polar_mitm.registry import Registry

__all__ = ["ENGINES", "Engine", "EngineClient", "Reachability", "make_engine"]

ENGINES: Registry[type[Engine]] = Registry(
    "engine",
    {"vllm": "polar_mitm.engines.vllm:VLLMEngine", "sglang": "polar_mitm.engines.sglang:SGLangEngine"},
)


def make_engine(
    kind: str, base_url: str, served_model: str | None = None, timeout: float = 600.0, split_reasoning: bool = False,
    max_model_len: int | None = None,
) -> EngineClient:
    """A client of the `kind` engine (a name in ENGINES) at `base_url`; raises ConfigError for an unknown kind.
    `base_url` with commas (several upstreams) gives a session-sticky EngineRouter over one client per URL."""
    urls = [url.strip() for url in base_url.split(",") if url.strip()]
    if len(urls) > 1:
        from polar_mitm.engines.pool import EngineRouter

        engine_class = ENGINES.get(kind)
        return EngineRouter([engine_class(url, served_model, timeout, split_reasoning, max_model_len) for url in urls])
    return ENGINES.get(kind)(base_url, served_model, timeout, split_reasoning, max_model_len)
