"""Inference engine clients: one module per engine, the same small surface each."""

from __future__ import annotations

from polar_mitm.engines.base import Engine


def make_engine(kind: str, base_url: str, served_model: str | None = None, timeout: float = 600.0, split_reasoning: bool = False) -> Engine:
    """One engine client; `base_url` with commas (several upstreams) gives a session-sticky EngineRouter over them."""
    urls = [url.strip() for url in base_url.split(",") if url.strip()]
    if len(urls) > 1:
        from polar_mitm.engines.router import EngineRouter

        return EngineRouter([make_engine(kind, url, served_model, timeout, split_reasoning) for url in urls])  # type: ignore[return-value]
    if kind == "vllm":
        from polar_mitm.engines.vllm import VLLMEngine

        return VLLMEngine(base_url, served_model, timeout, split_reasoning)
    if kind == "sglang":
        from polar_mitm.engines.sglang import SGLangEngine

        return SGLangEngine(base_url, served_model, timeout, split_reasoning)
    raise ValueError(f"unknown engine kind {kind!r} (vllm or sglang)")
