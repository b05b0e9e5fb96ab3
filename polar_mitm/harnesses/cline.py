"""Cline CLI (`cline` 3.x): Anthropic Messages, through its `anthropic` provider (`POST api.anthropic.com/v1/messages`).

`cline --json "task"` runs one task headless with tools auto-approved (its default). The provider comes from
`~/.cline/data/settings/providers.json`, as `cline auth anthropic` writes it, without a base URL: the
provider's own host. A Bun binary behind a Node launcher (the launcher adds the OS trust store to
NODE_EXTRA_CA_CERTS, which Bun reads); Bun's fetch honours HTTPS_PROXY and NO_PROXY.

What the preset adds:
- CLINE_SESSION_BACKEND_MODE=local: the task runs in this process. By default a run also starts a hub daemon in
  a session of its own, which outlives the run (escaping its process group) on a fixed port, keeps the first
  run's proxy credentials and serves later runs' sessions.
- its Vercel ai-sdk clients send a generic user agent (`ai-sdk/anthropic/<v> ... runtime/bun/<v>`): the provider
  settings add `User-Agent: Cline/<version>`, the one Cline sends to its own API, which ai-sdk extends with its
  own (`Cline/3.0.65 ai-sdk/anthropic/...`), so the gateway can tell its calls apart.
- telemetry (otel.cline.bot) and auto-update off in its global settings. Its feature-flag fetch and
  recommended-model lookup still get the gateway's local 404, which it tolerates.
Its shell tool, `run_commands`, takes a list of commands. Its turns always stream.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

PROVIDER = "anthropic"
VERSION = "3.0.65"


class Cline(Harness):
    name = "cline"
    api = "anthropic_messages"
    binary = "cline"
    package = f"cline@{VERSION}"
    shell_tool = "run_commands"
    shell_argument = "commands"  # a list of command strings
    default_model = "claude-sonnet-4-5"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--json", instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"CLINE_SESSION_BACKEND_MODE": "local", "CLINE_NO_AUTO_UPDATE": "1"}

    def write_config(self, home: Path, model: str | None) -> None:
        settings = home / ".cline" / "data" / "settings"
        settings.mkdir(parents=True, exist_ok=True)
        provider: dict[str, object] = {"provider": PROVIDER, "apiKey": PLACEHOLDER_API_KEY, "headers": {"User-Agent": f"Cline/{VERSION}"}}
        if model:
            provider["model"] = model
        providers = {
            "version": 1, "lastUsedProvider": PROVIDER, "modes": {},
            # updatedAt is required: a file without it is dropped for the default provider (Cline's own API)
            "providers": {PROVIDER: {"settings": provider, "updatedAt": "2026-01-01T00:00:00.000Z", "tokenSource": "manual"}},
        }
        (settings / "providers.json").write_text(json.dumps(providers, indent=2) + "\n")
        (settings / "global-settings.json").write_text(json.dumps({"telemetryOptOut": True, "autoUpdateEnabled": False}, indent=2) + "\n")


HARNESS = Cline()
