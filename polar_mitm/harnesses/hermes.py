"""Hermes Agent (PyPI `hermes-agent`): OpenAI Chat Completions (the openai SDK), streamed, to OpenRouter.

`hermes -z INSTRUCTION --provider openrouter -m MODEL` (one-shot mode: one instruction, approvals bypassed, only
the final reply on stdout) calls https://openrouter.ai/api/v1/chat/completions, its built-in provider's own URL
(the openai SDK's httpx client: HTTPS_PROXY and SSL_CERT_FILE honoured; no base URL set). It acts through a real
tool call, `terminal {"command": ...}`, and ends on a plain text reply. Its user agent is the openai SDK's
generic one; the preset's `~/.hermes/config.yaml` sets `model.default_headers` (Hermes's own setting for
OpenAI-compatible clients) to a `hermes-agent/VERSION` user agent.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "0.19.0"
PROVIDER = "openrouter"


class Hermes(PythonAgent):
    name = "hermes"
    api = "openai_chat"
    binary = "hermes"
    package = f"hermes-agent=={VERSION}"
    shell_tool = "terminal"
    shell_argument = "command"
    default_model = "qwen/qwen3-coder"  # an OpenRouter model name

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["-z", instruction, "--provider", PROVIDER, *(["-m", model] if model else []), "--yolo"]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"OPENROUTER_API_KEY": PLACEHOLDER_API_KEY, "HERMES_HOME": str(home / ".hermes")}

    def write_config(self, home: Path, model: str | None) -> None:
        config = {"model": {"provider": PROVIDER, **({"default": model} if model else {}), "default_headers": {"User-Agent": f"hermes-agent/{VERSION}"}}}
        path = home / ".hermes" / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML


HARNESS = Hermes()
