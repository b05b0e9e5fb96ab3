"""Kimi CLI (PyPI `kimi-cli`): OpenAI Chat Completions (its kosong `kimi` provider, the openai SDK), streamed.

`kimi --print -p INSTRUCTION` (print mode: non-interactive, tool calls approved) calls
https://api.moonshot.ai/v1/chat/completions. Kimi CLI has no provider until one is configured (`/login` writes
one), so the preset's `~/.kimi/config.toml` names the Moonshot AI Open Platform as its login does: provider type
`kimi`, its own public URL (the one `/login` offers for moonshot.ai; not the gateway), a placeholder key (the
openai SDK's httpx client: HTTPS_PROXY and SSL_CERT_FILE honoured). It acts through a real tool call,
`Shell {"command": ...}`, and ends on a plain text reply; its user agent is its own (`KimiCLI/VERSION`).
Telemetry is off. Pinned at 1.51.0: 1.52.0, the archived package's last release, only prints a notice to install
its TypeScript successor. 1.51.0 fails to start on CPython 3.12.1 (a TypeError in its slotted generic
SlashCommand dataclass) and runs on 3.13, so install.sh gives it a 3.13.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "1.51.0"
CONFIG = """\
# written by polar-mitm's kimi preset: the Moonshot AI Open Platform, as `/login` configures it
default_model = "polar"
telemetry = false

[providers.moonshot-ai]
type = "kimi"
base_url = "https://api.moonshot.ai/v1"
api_key = "{key}"

[models.polar]
provider = "moonshot-ai"
model = "{model}"
max_context_size = 262144
"""


class Kimi(PythonAgent):
    name = "kimi"
    api = "openai_chat"
    binary = "kimi"
    package = f"kimi-cli=={VERSION}"
    shell_tool = "Shell"
    shell_argument = "command"
    default_model = "kimi-k2-turbo-preview"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--print", "-p", instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"KIMI_SHARE_DIR": str(home / ".kimi")}

    def write_config(self, home: Path, model: str | None) -> None:
        path = home / ".kimi" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(CONFIG.format(key=PLACEHOLDER_API_KEY, model=model or self.default_model))


HARNESS = Kimi()
