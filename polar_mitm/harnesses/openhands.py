"""OpenHands SDK (PyPI `openhands-sdk` + `openhands-tools`): OpenAI Chat Completions through LiteLLM, non-streamed.

The SDK is a library with no command line of its own; install.sh installs sandboxes/agents-py/runners/
openhands.py as the venv's `openhands-run`: the SDK's default agent (`get_default_agent`: terminal, file editor,
task tracker, its default condenser; no browser) in the working directory on one instruction, exiting 0 once the
conversation finished. With `openai/MODEL` LiteLLM calls https://api.openai.com/v1/chat/completions (the openai
SDK's httpx client: HTTPS_PROXY and SSL_CERT_FILE honoured; no base URL set), without streaming (the LLM's
`stream` is off by default). It acts through a real tool call, `terminal {"command": ...}`, and finishes on a
plain text reply (or its `finish` tool). Its condenser would rewrite the history once it grows past its limit
(a new lineage; not reached in a short run). Its user agent is the openai SDK's: the runner passes
OPENHANDS_USER_AGENT as the LLM's `extra_headers` (its own setting).
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "1.58.2"


class OpenHands(PythonAgent):
    name = "openhands"
    api = "openai_chat"
    binary = "openhands-run"
    package = f"openhands-sdk=={VERSION}"
    shell_tool = "terminal"
    shell_argument = "command"
    default_model = "openai/qwen3-coder-plus"  # a LiteLLM model name: the provider prefix picks the API
    unstreamed_timeout = 300.0  # the LLM's `timeout`, per attempt (it then retries)

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return [*(["--model", model] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {
            "LLM_API_KEY": PLACEHOLDER_API_KEY,
            "OPENHANDS_USER_AGENT": f"openhands-sdk/{VERSION}",
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }


HARNESS = OpenHands()
