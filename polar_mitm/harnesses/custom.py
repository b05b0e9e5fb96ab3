"""`polar-mitm run --harness custom -- ANY COMMAND`: an agent we ship no preset for, with the part every preset shares.

That part is `Harness.environment()` and `prepare_home()` with nothing of an agent's own: a private HOME and XDG
dirs (temporary, or `--home DIR`, where the caller puts the agent's config files), the base-URL variables
removed, the pinned install's bin and Node >= 22 first on PATH, update notifiers and colour off. The command is
the caller's, run as given. What a preset adds on top (headless flags, its provider's model, telemetry off, a
user agent of its own, ...) is listed in docs/agents.md. Not in the HARNESSES registry: it has no command, no
API of its own and no shell tool, so the rollout server cannot run it.
"""

from __future__ import annotations

from polar_mitm.errors import ConfigError
from polar_mitm.harnesses import Harness

NAME = "custom"


class Custom(Harness):
    name = NAME
    needs_node = False

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        raise ConfigError("the custom harness has no command of its own: polar-mitm run --harness custom -- COMMAND ARGS...")


HARNESS = Custom()
