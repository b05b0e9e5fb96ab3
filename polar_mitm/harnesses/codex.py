"""Codex CLI (`@openai/codex`): OpenAI Responses only (`POST https://api.openai.com/v1/responses`, streamed).

Its built-in provider first tries a WebSocket (`GET /v1/responses` + Upgrade) six times and calls
chatgpt.com / api.github.com for plugins and telemetry. A custom provider on the same host with websockets
off sends exactly the model calls, still to api.openai.com, so the proxy sees the provider's own URL.
Model names matter: for one it does not know (the default here) it sends a plain `tools` list with
`exec_command {"cmd": ...}`; for its own newest models a "responses-lite" shape. Streaming has no switch.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

PROVIDER = "polar_openai"


def _toml(value: object) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


class Codex(Harness):
    name = "codex"
    api = "openai_responses"
    binary = "codex"
    package = "@openai/codex@0.171.0"
    shell_tool = "exec_command"
    shell_argument = "cmd"
    default_model = "qwen3-coder-plus"
    needs_node = False  # a launcher script for a static binary; any Node runs it

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        # stdin is read and appended when it is not a TTY: callers pass /dev/null
        return ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json", *(["--model", model] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"OPENAI_API_KEY": PLACEHOLDER_API_KEY, "CODEX_HOME": str(home / ".codex")}

    def write_config(self, home: Path, model: str | None) -> None:
        top = {"model_provider": PROVIDER, "approval_policy": "never", "sandbox_mode": "danger-full-access", "check_for_update_on_startup": False}
        if model:
            top["model"] = model
        tables = {
            "analytics": {"enabled": False},
            "features": {"plugins": False, "remote_plugin": False, "in_app_updates": False},
            f"model_providers.{PROVIDER}": {
                "name": "OpenAI", "base_url": "https://api.openai.com/v1", "env_key": "OPENAI_API_KEY",
                "wire_api": "responses", "supports_websockets": False,
            },
        }
        lines = [f"{key} = {_toml(value)}" for key, value in top.items()]
        for table, values in tables.items():
            lines += ["", f"[{table}]", *(f"{key} = {_toml(value)}" for key, value in values.items())]
        config = home / ".codex" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text("\n".join(lines) + "\n")


HARNESS = Codex()
