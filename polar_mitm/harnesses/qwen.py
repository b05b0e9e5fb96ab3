"""Qwen Code (`@qwen-code/qwen-code`): OpenAI Chat Completions, by default to DashScope's compatible endpoint.

Without OPENAI_BASE_URL it calls https://dashscope.aliyuncs.com/compatible-mode/v1/chat/completions, which the
chat dialect serves as is. `--yolo` puts the shell, edit and write tools in its tool list (absent otherwise).
Its main turns always stream; there is no switch.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

SETTINGS = {
    # the RUM usage statistics and the second "memory extraction" completion per turn
    "privacy": {"usageStatisticsEnabled": False},
    "memory": {"enableManagedAutoMemory": False},
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False},
    # the OpenAI-compatible auth (what `--auth-type openai` selects): without it a plain `qwen ...` stops at
    # "No auth type is selected"
    "security": {"auth": {"selectedType": "openai"}},
}


class Qwen(Harness):
    name = "qwen"
    api = "openai_chat"
    binary = "qwen"
    package = "@qwen-code/qwen-code@0.24.4"
    shell_tool = "run_shell_command"
    shell_argument = "command"
    # its OpenAI SDK timeout (generationConfig.timeout, QWEN_CODE_API_TIMEOUT_MS; default 120,000 ms) covers
    # connect and the reply's headers of every call
    unstreamed_timeout = 120.0
    default_model = "qwen3-coder-plus"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--auth-type", "openai", "--yolo", "--output-format", "json", *(["--model", model] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        env = {"OPENAI_API_KEY": PLACEHOLDER_API_KEY, "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}
        if model:
            env["OPENAI_MODEL"] = model
        return env

    def write_config(self, home: Path, model: str | None) -> None:
        settings = home / ".qwen" / "settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(SETTINGS, indent=2) + "\n")


HARNESS = Qwen()
