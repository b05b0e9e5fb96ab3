"""Gemini CLI (`@google/gemini-cli`): Google's generateContent API at generativelanguage.googleapis.com.

Headless (`-p`) it refuses an untrusted folder (exit 55) unless GEMINI_CLI_TRUST_WORKSPACE=true. With its
default model ("auto") a router first asks a small model for a JSON complexity verdict with a non-streaming
`generateContent`, then runs the turn with `streamGenerateContent?alt=sse`; with an explicit model the
router is skipped. Its telemetry (`POST play.googleapis.com/log`) is turned off here and would get the
gateway's local 404 anyway. `--yolo` auto-approves the shell tool. The turn always streams; no switch.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

SETTINGS = {
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    # the interactive shell needs node-pty, a native add-on install.sh leaves unbuilt
    "tools": {"shell": {"enableInteractiveShell": False}},
}


class Gemini(Harness):
    name = "gemini"
    api = "gemini"
    binary = "gemini"
    package = "@google/gemini-cli@0.61.0"
    shell_tool = "run_shell_command"
    shell_argument = "command"
    # its fetch dispatcher (undici Agent/EnvHttpProxyAgent) has headersTimeout 60 s (`defaultHeadersTimeout = 6e4`
    # in 0.61.0's bundle; only the DEFAULT_REQUEST_TIMEOUT experiment flag changes it, from Google's server or a file
    # named by GEMINI_EXP): the model router's generateContent. Streams: bodyTimeout 300 s, no setting
    unstreamed_timeout = 60.0

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--yolo", "--output-format", "json", *(["--model", model] if model else []), "--prompt", instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"GEMINI_API_KEY": PLACEHOLDER_API_KEY, "GEMINI_CLI_TRUST_WORKSPACE": "true"}

    def write_config(self, home: Path, model: str | None) -> None:
        settings = home / ".gemini" / "settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(SETTINGS, indent=2) + "\n")


HARNESS = Gemini()
