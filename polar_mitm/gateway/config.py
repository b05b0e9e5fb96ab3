"""The gateway's configuration, shared by the CLI, the rollout server and tests: one field per row of
`gateway/options.py` OPTIONS (add options there, not here)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from polar_mitm.gateway.options import DEFAULT_CONFDIR, OPTIONS, Option

__all__ = ["DEFAULT_CONFDIR", "GatewayConfig"]


def _field(option: Option) -> tuple[Any, Any]:
    # an option with choices takes only its registry's names (a Literal: refused here, listed in the JSON schema)
    kind = Literal[option.choices.names] if option.choices is not None else option.type
    if option.required:
        return kind, Field(description=option.help)
    if option.type == list[str]:
        return kind, Field(default_factory=lambda: list(option.default), description=option.help)
    return kind, Field(option.default, description=option.help)


GatewayConfig: type[BaseModel] = create_model(
    "GatewayConfig",
    __doc__="The gateway's options (gateway/options.py); choices are checked here, other values where they are used, in the addon's configure().",
    __module__=__name__,
    **{option.name: _field(option) for option in OPTIONS},
)
