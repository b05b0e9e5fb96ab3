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

PROVIDER = "alibaba"  # the catalog's DashScope (international) provider; its key is DASHSCOPE_API_KEY
QUIET = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev: the catalog bundled in the binary is used
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}


def qualified(model: str) -> str:
    """`provider/model` as OpenCode (and Kilo Code) name models; a bare name is the preset provider's."""
    return model if "/" in model else f"{PROVIDER}/{model}"


class OpenCode(Harness):
    name = "opencode"
    api = "openai_chat"
    binary = "opencode"
    package = "opencode-ai@1.18.33"
    shell_tool = "bash"
    shell_argument = "command"
    default_model = "qwen3-coder-plus"
    needs_node = False  # a Bun binary

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["run", "--format", "json", "--auto", "--title", "polar-mitm", *(["--model", qualified(model)] if model else []), instruction]

    def environment(self, home: str | Path, model: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = super().environment(home, model, base)
        # `run` works in $PWD before its cwd: a caller's stale PWD (a process started with another cwd) would be
        # the project its tools write into
        env.pop("PWD", None)
        return env

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {"DASHSCOPE_API_KEY": PLACEHOLDER_API_KEY, **QUIET}

    def write_config(self, home: Path, model: str | None) -> None:
        config: dict[str, object] = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled"}
        if model:
            config.update(model=qualified(model), small_model=qualified(model))
        path = home / ".config" / "opencode" / "opencode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")


HARNESS = OpenCode()
