"""The gateway's configuration, shared by the CLI, the rollout server and tests: one field per row of
`gateway/options.py` OPTIONS (add options there, not here)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model

from polar_mitm.gateway.options import DEFAULT_CONFDIR, OPTIONS, Option

__all__ = ["DEFAULT_CONFDIR", "GatewayConfig"]


def _field(option: Option) -> tuple[Any, Any]:
    if option.required:
        return option.type, Field(description=option.help)
    if option.type == list[str]:
        return option.type, Field(default_factory=lambda: list(option.default), description=option.help)
    return option.type, Field(option.default, description=option.help)


GatewayConfig: type[BaseModel] = create_model(
    "GatewayConfig",
    __doc__="The gateway's options (gateway/options.py); values are checked where they are used, in the addon's configure().",
    __module__=__name__,
    **{option.name: _field(option) for option in OPTIONS},
)
