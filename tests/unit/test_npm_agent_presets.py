"""The npm agents' presets without their binaries: the gateway tells their real user agents apart, and the config
files they write name only the provider's own host (tests/integration/test_agents_npm.py runs the agents)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from polar_mitm import harnesses
from polar_mitm.session import harness_from_user_agent

# user agents as the pinned agents sent them through the gateway (with the presets' settings)
SEEN = {
    "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14": "opencode",
    "pi/1.6.0 (linux; node/v22.23.5; x64)": "pi",
    "Cline/3.0.65 ai-sdk/anthropic/4.0.42 ai-sdk/provider-utils/5.0.30 runtime/bun/1.3.13": "cline",
    "Kilo-Code/7.7.7 ai-sdk/provider-utils/4.0.27 runtime/bun/1.3.14": "kilo",  # its google provider
    "kilo/latest/7.7.7/cli ai-sdk/provider-utils/4.0.27 runtime/bun/1.3.14": "kilo",  # its anthropic provider
    "Continue-CLI/1.5.47": "continue-cli",
    "OpenClaw/2026.9.6": "openclaw",
    # what they send without the presets' user agents: nothing to tell them by
    "ai-sdk/anthropic/4.0.42 ai-sdk/provider-utils/5.0.30 runtime/bun/1.3.13": None,
    "ls/JS 5.23.2": None,
    "OpenAI/JS 7.15.0": None,
    # "pi/" inside another user agent is not Pi
    "google-api-nodejs-client/9.15.1 api/1": None,
}
NPM_AGENTS = ("opencode", "pi", "cline", "kilo", "continue-cli", "openclaw")
PROVIDER_HOSTS = {"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com", "dashscope-intl.aliyuncs.com"}


@pytest.mark.parametrize("user_agent", list(SEEN))
def test_the_gateway_tells_the_npm_agents_apart_by_user_agent(user_agent: str) -> None:
    assert harness_from_user_agent(user_agent) == SEEN[user_agent]


@pytest.mark.parametrize("name", NPM_AGENTS)
def test_npm_presets_write_configs_naming_only_provider_hosts(name: str, tmp_path: Path) -> None:
    harness = harnesses.get(name)
    assert name in harnesses.NAMES and harness.api and harness.shell_tool
    harness.prepare_home(tmp_path, harness.default_model)
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    for path in written:
        json.loads(path.read_text())  # every config file is JSON (Continue's YAML too)
    hosts = {m.group(1) for path in written for m in re.finditer(r"https?://([^/\"]+)", path.read_text())}
    hosts -= {"opencode.ai", "app.kilo.ai"}  # the $schema of OpenCode's and Kilo Code's config
    assert hosts <= PROVIDER_HOSTS, (name, hosts)


def test_custom_harness_is_the_shared_part_only(tmp_path: Path) -> None:
    from polar_mitm.harnesses import custom

    env = custom.HARNESS.environment(tmp_path, None, base={"PATH": "/usr/bin", "OPENAI_BASE_URL": "http://elsewhere", "KEEP": "1"})
    assert env["HOME"] == str(tmp_path) and env["KEEP"] == "1" and "OPENAI_BASE_URL" not in env
    assert env["PATH"].split(":")[-1] == "/usr/bin" and str(harnesses.install_prefix() / "node_modules" / ".bin") in env["PATH"]
    custom.HARNESS.prepare_home(tmp_path / "home")
    assert list((tmp_path / "home").iterdir()) == []  # no config of any agent's
    assert custom.NAME not in harnesses.NAMES  # no command of its own: not a rollout harness
