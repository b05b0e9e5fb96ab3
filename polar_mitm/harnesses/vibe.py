"""Mistral Vibe (PyPI `mistral-vibe`): Mistral's Chat Completions (the Mistral SDK), streamed, to api.mistral.ai.

`vibe -p INSTRUCTION --auto-approve --trust` (headless: one prompt, tool calls approved, the folder trusted for
this run) calls https://api.mistral.ai/v1/chat/completions, the `mistral` provider's own URL (httpx: HTTPS_PROXY
honoured; SSL_CERT_FILE added to its certifi roots). Mistral's wire format is OpenAI Chat's, except that its SDK
requires every streamed tool-call delta to carry the function name: the chat dialect sends each call whole in
one delta. It acts through a real tool call, `bash {"command": ...}`, and ends on a plain text reply. Its SDK
rewrites any user agent to `mistral-client-python/...` (any Mistral SDK client's), so the preset's
`~/.vibe/config.toml` names it in the provider's `extra_headers` as `X-Title: mistral-vibe` (the gateway reads
it, polar_mitm/session.py); that provider entry repeats the built-in one (same URL, key variable and backend),
since a provider is configured whole. Telemetry and update checks are off; its other start-up calls (identity,
connector catalog, experiments) get the gateway's local 404, which it tolerates.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "3.0.2"  # 3.0.3 pins certifi==2026.10.19, which PyPI does not serve (only 2026.10.19.post1)
CONFIG = """\
# written by polar-mitm's vibe preset
enable_telemetry = false
enable_update_checks = false
enable_auto_update = false
{active_model}
[[providers]]
name = "mistral"
api_base = "https://api.mistral.ai/v1"
api_key_env_var = "MISTRAL_API_KEY"
backend = "mistral"
extra_headers = {{ "X-Title" = "mistral-vibe" }}
"""


class Vibe(PythonAgent):
    name = "vibe"
    api = "openai_chat"
    binary = "vibe"
    package = f"mistral-vibe=={VERSION}"
    shell_tool = "bash"
    shell_argument = "command"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["-p", instruction, "--auto-approve", "--trust"]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"MISTRAL_API_KEY": PLACEHOLDER_API_KEY, "VIBE_HOME": str(home / ".vibe")}

    def write_config(self, home: Path, model: str | None) -> None:
        path = home / ".vibe" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(CONFIG.format(active_model=f'active_model = "{model}"\n' if model else ""))


HARNESS = Vibe()
