"""mini-swe-agent (PyPI `mini-swe-agent`): OpenAI Chat Completions through LiteLLM, non-streamed.

`mini -m openai/MODEL` calls https://api.openai.com/v1/chat/completions (LiteLLM's openai provider, the openai
SDK's httpx client: HTTPS_PROXY and SSL_CERT_FILE honoured; no base URL set). Since 2.0 its default config
(`mini.yaml`) acts through a real tool call, `bash {"command": ...}`; the text-based variant
(`mini_textbased.yaml`, bash blocks in the reply) is not what runs here. It ends when a command's output starts
with COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT (the prompt tells the model to `echo` it), so its last turn is a
tool call too, never a plain text. Its requests carry `OpenAI/Python x.y`: the preset sets
`model.model_kwargs.extra_headers` (its own config, passed on by LiteLLM) to a `mini-swe-agent/VERSION` user
agent. Cost tracking of a model LiteLLM does not know would stop it (MSWEA_COST_TRACKING=ignore_errors), and
LiteLLM's cost-map download is skipped (LITELLM_LOCAL_MODEL_COST_MAP).
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY
from polar_mitm.harnesses.python_agents import PythonAgent, agents_prefix

VERSION = "2.4.6"


class MiniSweAgent(PythonAgent):
    name = "mini-swe-agent"
    api = "openai_chat"
    binary = "mini"
    package = f"mini-swe-agent=={VERSION}"
    shell_tool = "bash"
    shell_argument = "command"
    default_model = "openai/qwen3-coder-plus"  # a LiteLLM model name: the provider prefix picks the API
    unstreamed_timeout = 600.0  # LiteLLM's completion timeout when none is configured

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        # `-c` replaces the default config, so the built-in mini.yaml is named by path (a bare `mini.yaml` would
        # be looked up in the working directory first)
        [builtin] = sorted(agents_prefix().glob(f"{self.name}/lib/python3*/site-packages/minisweagent/config/mini.yaml"))
        headers = json.dumps({"User-Agent": f"mini-swe-agent/{VERSION}"})
        return [
            "-c", str(builtin), "-c", f"model.model_kwargs.extra_headers={headers}",
            *(["-m", model] if model else []), "-t", instruction, "--yolo", "--exit-immediately",
        ]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": PLACEHOLDER_API_KEY,
            "MSWEA_CONFIGURED": "1",  # else a first run asks for a model and key on the terminal
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }


HARNESS = MiniSweAgent()
