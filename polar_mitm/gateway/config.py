"""The gateway's configuration, shared by the CLI, the rollout server and tests."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

DEFAULT_CONFDIR = "~/.mitmproxy"


class GatewayConfig(BaseModel):
    port: int = Field(8080, ge=0, le=65535, description="Proxy port on the listen host.")
    host: str = Field("127.0.0.1", description="Listen address; loopback by default.")
    upstream: str = Field(description="The engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8011/v1.")
    db: Path = Field(Path("polar.duckdb"), description="DuckDB store.")
    confdir: str = Field(DEFAULT_CONFDIR, description="mitmproxy confdir: its CA and the session secret live here.")
    engine: str = Field("vllm", pattern="^(vllm|sglang)$")
    engine_model: str | None = None
    engine_timeout: float = Field(600.0, gt=0)
    keepalive_interval: float = Field(5.0, ge=0, description="Seconds between keepalive events on a streamed reply while the engine works; 0: none (headers and opening events still go out at once).")
    split_reasoning: bool = Field(False, description="Split inline <think>...</think> from the engine's content into reasoning.")
    model_map: list[str] = Field(default_factory=list)
    require_auth: bool = False
    passthrough: list[str] = Field(default_factory=list)
    engine_hook: str = Field("", description="'module:function' or 'file.py:function' applied to each engine request.")
    sql_port: int = 0
    web: bool = False
    web_port: int = 8081
    verbose: bool = False
