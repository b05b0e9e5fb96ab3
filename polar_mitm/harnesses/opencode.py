"""OpenCode (`opencode-ai`): OpenAI Chat Completions, through its built-in `alibaba` provider (DashScope).

`opencode run` headless, with the model `alibaba/<model>` of the catalog bundled in the binary: the provider's own
URL, https://dashscope-intl.aliyuncs.com/compatible-mode/v1/chat/completions (`@ai-sdk/openai-compatible`), which
the chat dialect serves as is; no base URL is set anywhere. OpenCode is a Bun binary: Bun's fetch honours
HTTPS_PROXY and NO_PROXY (`polar-mitm run` sets loopback there, which its own local server needs) and trusts only
NODE_EXTRA_CA_CERTS (not SSL_CERT_FILE). Its user agent is `opencode/<version> ai-sdk/...`.

What the preset adds: the models.dev catalog fetch, auto-update, LSP downloads and sharing off; `small_model`
pinned to the same model (else side calls would pick a hosted model); `--auto` approves its tools; `--title`
names the session, so no title-generation side call races the first turn. Its turns always stream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

QUIET = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev: the catalog bundled in the binary is used
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}


class OpenCode(Harness):
    name = "opencode"
    api = "openai_chat"
    binary = "opencode"
    package = "opencode-ai@1.18.33"
    shell_tool = "bash"
    shell_argument = "command"
    default_model = "qwen3-coder-plus"
    needs_node = False  # a Bun binary
    # what its fork Kilo Code (kilo.py) names differently
    provider = "alibaba"  # the catalog's DashScope (international) provider; its key is DASHSCOPE_API_KEY
    api_key_variable = "DASHSCOPE_API_KEY"
    config_schema = "https://opencode.ai/config.json"
    config_file = Path(".config") / "opencode" / "opencode.json"
    quiet: Mapping[str, str] = QUIET

    def qualified(self, model: str) -> str:
        """`provider/model` as OpenCode (and Kilo Code) name models; a bare name is the preset provider's."""
        return model if "/" in model else f"{self.provider}/{model}"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["run", "--format", "json", "--auto", "--title", "polar-mitm", *(["--model", self.qualified(model)] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {self.api_key_variable: PLACEHOLDER_API_KEY, **self.quiet}

    def write_config(self, home: Path, model: str | None) -> None:
        config: dict[str, object] = {"$schema": self.config_schema, "autoupdate": False, "share": "disabled"}
        if model:
            config.update(model=self.qualified(model), small_model=self.qualified(model))
        path = home / self.config_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")


HARNESS = OpenCode()
