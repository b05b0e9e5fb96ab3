"""gptme (PyPI `gptme`): OpenAI Responses (the openai SDK), streamed, to api.openai.com.

`gptme -n -m openai/MODEL INSTRUCTION` (non-interactive: no confirmations) calls
https://api.openai.com/v1/responses, the openai provider's own URL (the openai SDK's httpx client: HTTPS_PROXY
and SSL_CERT_FILE honoured; no base URL set); for OpenAI models it prefers the Responses API, Chat Completions
only with GPTME_OPENAI_RESPONSES_API=0. Its tools go as native function tools: it acts through a real tool call,
`shell {"command": ...}`, and ends the session with its `complete` tool (a reply without a tool call gets two
"did you mean to finish?" nudges first). Besides the agent turns it asks once, without streaming and tools,
for a conversation title. Its user agent is the openai SDK's generic one and it has no header setting; the
SDK's own OPENAI_CUSTOM_HEADERS variable sets a `gptme/VERSION` user agent. Its tiktoken download (a 404 at the
gateway) falls back to approximate token counts.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent

VERSION = "0.35.1"


class Gptme(PythonAgent):
    name = "gptme"
    api = "openai_responses"
    binary = "gptme"
    package = f"gptme=={VERSION}"
    shell_tool = "shell"
    shell_argument = "command"
    default_model = "openai/qwen3-coder-plus"  # provider/model: the provider picks the client and API

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--non-interactive", *(["--model", model] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"OPENAI_API_KEY": PLACEHOLDER_API_KEY, "OPENAI_CUSTOM_HEADERS": f"User-Agent: gptme/{VERSION}"}


HARNESS = Gptme()
