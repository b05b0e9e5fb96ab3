"""Continue CLI (`@continuedev/cli`, command `cn`): OpenAI Chat Completions (`POST api.openai.com/v1/chat/completions`).

`cn -p --auto` runs headless with every tool allowed, from the local `~/.continue/config.yaml` (no Continue Hub
login): one model of provider `openai`, no `apiBase`, so the provider's own URL. A Node program: its fetch goes
through its own proxy agent from HTTPS_PROXY and trusts NODE_EXTRA_CA_CERTS.

What the preset adds: telemetry and metrics off; and since its bundled OpenAI SDK sends a generic user agent
(`<minified>/JS <version>`), the model's `requestOptions.headers` set `User-Agent: Continue-CLI/<version>` so
the gateway can tell its calls apart. Its version check (`GET api.continue.dev/cn/info`) gets the gateway's local
404, which it tolerates. It sends no `max_tokens`: the engine's budget applies. Its turns always stream.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

VERSION = "1.5.47"


class ContinueCli(Harness):
    name = "continue-cli"
    api = "openai_chat"
    binary = "cn"
    package = f"@continuedev/cli@{VERSION}"
    shell_tool = "Bash"
    shell_argument = "command"
    default_model = "gpt-4.1"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["-p", "--auto", instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"CONTINUE_GLOBAL_DIR": str(home / ".continue"), "CONTINUE_CLI_ENABLE_TELEMETRY": "0", "CONTINUE_METRICS_ENABLED": "0"}

    def write_config(self, home: Path, model: str | None) -> None:
        entry = {
            "name": "polar-mitm", "provider": "openai", "model": model or self.default_model, "apiKey": PLACEHOLDER_API_KEY,
            "roles": ["chat", "edit", "apply"], "requestOptions": {"headers": {"User-Agent": f"Continue-CLI/{VERSION}"}},
        }
        config = {"name": "polar-mitm", "version": "1.0.0", "schema": "v1", "models": [entry]}
        path = home / ".continue" / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML


HARNESS = ContinueCli()
