"""The PyPI coding agents' common preset part: each agent in a venv of its own, from sandboxes/agents-py/install.sh.

An agent lives in `install_prefix()/py/<name>/` (one venv each: their pins of litellm, openai, pydantic and rich
conflict), its entry points linked into `install_prefix()/py/bin`. That folder, not the venv's own `bin`, leads
the child's PATH, so a shell tool's `python` or `pip` stays the caller's. The caller's PYTHONPATH, PYTHONHOME
and VIRTUAL_ENV are dropped: the agent's interpreter imports only its own venv.

Routing needs nothing per agent: their HTTP clients (httpx under the openai SDK and LiteLLM, requests, aiohttp
with trust_env) read HTTPS_PROXY and the CA bundle in SSL_CERT_FILE / REQUESTS_CA_BUNDLE that `polar-mitm run`
sets. What a preset adds is headless flags, telemetry and update checks off, and a user agent (or header) of
the agent's own where its client sends a generic `OpenAI/Python` one, set through the agent's own config.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from polar_mitm.errors import HarnessNotInstalled
from polar_mitm.harnesses import Harness, install_prefix

INSTALL_SCRIPT = "sandboxes/agents-py/install.sh"
# what would make the agent's venv interpreter import the caller's packages
PYTHON_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE")


def agents_prefix() -> Path:
    """Where install.sh puts the agents' venvs (`<name>/`) and the links to their entry points (`bin/`)."""
    return install_prefix() / "py"


class PythonAgent(Harness):
    """A preset for an agent installed from PyPI. `package` is its pin as in sandboxes/agents-py/requirements/."""

    needs_node = False

    def executable(self) -> Path:
        path = agents_prefix() / self.name / "bin" / self.binary
        if not path.exists():
            raise HarnessNotInstalled(f"{self.package} is not installed at {path}; run {INSTALL_SCRIPT} {self.name}")
        return path

    def environment(self, home: str | Path, model: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in super().environment(home, model, base).items() if k not in PYTHON_VARIABLES}
        env["PATH"] = f"{agents_prefix() / 'bin'}:{env['PATH']}"
        return env
