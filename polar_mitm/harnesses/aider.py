"""Aider (PyPI `aider-chat`): OpenAI Chat Completions through LiteLLM, streamed.

`aider --model openai/MODEL --message ...` sends one chat completion per message to
https://api.openai.com/v1/chat/completions (LiteLLM's openai provider, the openai SDK's httpx client:
HTTPS_PROXY and SSL_CERT_FILE honoured; no base URL set) and exits. Aider has no tool calls: it acts through
an edit format in its reply text, and a model it does not know gets the `whole` format (the file's name on a
line, then its whole content in a fenced block), which aider writes to disk itself; so "the action really
runs" means the edited file exists with that content. Shell commands a reply suggests need an explicit yes,
which `--yes-always` does not give: they never run. Its user agent is the openai SDK's generic one; the preset's
`~/.aider.model.settings.yml` (aider's own model settings, `aider/extra_params` applying to every model) sets
`extra_headers: {User-Agent: aider/VERSION}`. Git, analytics, the update check and the history files in the
workspace are off; LiteLLM's cost-map download is skipped (LITELLM_LOCAL_MODEL_COST_MAP).
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "0.86.2"
MODEL_SETTINGS = f"""\
# written by polar-mitm's aider preset: a user agent of aider's own on every model call
- name: aider/extra_params
  extra_params:
    extra_headers:
      User-Agent: aider/{VERSION}
"""


class Aider(PythonAgent):
    name = "aider"
    api = "openai_chat"
    binary = "aider"
    package = f"aider-chat=={VERSION}"
    shell_tool = ""  # none: edits in its reply text
    default_model = "openai/qwen3-coder-plus"  # a LiteLLM model name: the provider prefix picks the API

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return [
            *(["--model", model] if model else []), "--message", instruction, "--yes-always", "--no-git",
            "--no-check-update", "--analytics-disable", "--no-show-model-warnings", "--no-show-release-notes",
            "--no-pretty", "--no-fancy-input",
        ]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        history = home / ".aider" / "history"
        return {
            "OPENAI_API_KEY": PLACEHOLDER_API_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            # aider reads its options from AIDER_* variables too: its history files go to HOME, not the workspace
            "AIDER_INPUT_HISTORY_FILE": str(history / "input.history"),
            "AIDER_CHAT_HISTORY_FILE": str(history / "chat.history.md"),
        }

    def write_config(self, home: Path, model: str | None) -> None:
        (home / ".aider" / "history").mkdir(parents=True, exist_ok=True)
        (home / ".aider.model.settings.yml").write_text(MODEL_SETTINGS)


HARNESS = Aider()
