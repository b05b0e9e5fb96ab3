"""The example agents on agent frameworks (examples/agents/): presets, so the rollout server can run them.

    openai-agents-facts   the OpenAI Agents SDK (`openai-agents`): looks facts up in local files  (Responses API)
    pydantic-ai-form      pydantic-ai: fills a typed form from a document                          (Chat Completions)
    smolagents-planner    smolagents' ToolCallingAgent: plans a budget with a calculator tool      (Chat Completions)

Each is a small script, `examples/agents/<agent>/agent.py INSTRUCTION`, run by the frameworks' venv
(sandboxes/agents-frameworks/install.sh, under `install_prefix()/py/frameworks`) in the sandbox's workdir. The
scripts use their framework's normal OpenAI client (the openai SDK on httpx2: HTTPS_PROXY and the CA bundle in
SSL_CERT_FILE honoured), so routing needs nothing here; a preset adds only the placeholder key the clients
require and drops the caller's PYTHONPATH/VIRTUAL_ENV. Outside the rollout server,
`polar-mitm run -- PYTHON examples/agents/...` runs them the same way. The scripts are the checkout's (an
editable install); without them the preset is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from polar_mitm.errors import HarnessNotInstalled
from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness, install_prefix
from polar_mitm.harnesses.python_agents import PYTHON_VARIABLES

INSTALL_SCRIPT = "sandboxes/agents-frameworks/install.sh"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


def frameworks_python() -> Path:
    """The frameworks' venv interpreter, as install.sh leaves it."""
    return install_prefix() / "py" / "frameworks" / "bin" / "python"


class FrameworkAgent(Harness):
    """One example agent: `example` is its folder under examples/agents/."""

    needs_node = False
    example = ""

    def __init__(self, name: str, api: str, example: str, package: str) -> None:
        self.name, self.api, self.example, self.package = name, api, example, package

    def script(self) -> Path:
        return EXAMPLES / self.example / "agent.py"

    def executable(self) -> Path:
        if not self.script().is_file():
            raise HarnessNotInstalled(f"{self.name}: its script {self.script()} is missing (it ships in the polar-mitm checkout)")
        if not frameworks_python().exists():
            raise HarnessNotInstalled(f"{self.package} is not installed at {frameworks_python().parent.parent}; run {INSTALL_SCRIPT}")
        return frameworks_python()

    def command(self, instruction: str, model: str | None = None) -> list[str]:
        return [str(self.executable()), str(self.script()), instruction]

    def environment(self, home: str | Path, model: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in super().environment(home, model, base).items() if k not in PYTHON_VARIABLES}
        env.setdefault("OPENAI_API_KEY", PLACEHOLDER_API_KEY)  # required by the clients; never forwarded
        if model:
            env["POLAR_AGENT_MODEL"] = model
        return env


OPENAI_AGENTS_FACTS = FrameworkAgent("openai-agents-facts", "openai_responses", "facts", "openai-agents==0.24.0")
PYDANTIC_AI_FORM = FrameworkAgent("pydantic-ai-form", "openai_chat", "form", "pydantic-ai-slim==2.68.0")
SMOLAGENTS_PLANNER = FrameworkAgent("smolagents-planner", "openai_chat", "planner", "smolagents==1.26.0")
