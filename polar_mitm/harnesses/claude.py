"""Claude Code (`@anthropic-ai/claude-code`): Anthropic Messages (`POST api.anthropic.com/v1/messages?beta=true`).

CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC and the DISABLE_* switches leave, besides the model calls, only
GET /api/claude_code/settings and /policy_limits, which tolerate the gateway's local 404.
CLAUDE_CODE_ATTRIBUTION_HEADER=0 removes the per-turn `cch=` nonce line from the first system block, which
would otherwise break prompt prefixes between turns. Every model alias (and the small/fast model used for
side calls) is mapped to the one model name given. It streams; there is no switch (only a non-streaming
fallback after a failed stream).
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    # it refuses to skip permission checks as root unless told it runs in a sandbox
    "IS_SANDBOX": "1",
}
MODEL_VARIABLES = (
    "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL",
)


class Claude(Harness):
    name = "claude"
    api = "anthropic_messages"
    binary = "claude"
    package = "@anthropic-ai/claude-code@2.1.332"
    shell_tool = "Bash"
    shell_argument = "command"
    needs_node = False  # a native binary
    # its non-streamed requests (the fallback after a failed stream) are aborted after API_TIMEOUT_MS, default
    # 300,000 ms in 2.1.332's bundle (`nno()`: API_TIMEOUT_MS, else 120 s with CLAUDE_CODE_REMOTE, else 300 s); the
    # SDK's own 600 s default is not what limits them
    unstreamed_timeout = 300.0

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["--print", instruction, "--dangerously-skip-permissions", "--output-format", "json", *(["--model", model] if model else [])]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        env = {"ANTHROPIC_API_KEY": PLACEHOLDER_API_KEY, "CLAUDE_CONFIG_DIR": str(home / ".claude"), **QUIET}
        if model:
            env.update({name: model for name in MODEL_VARIABLES})
        return env

    def write_config(self, home: Path, model: str | None) -> None:
        config = home / ".claude"
        config.mkdir(parents=True, exist_ok=True)
        # no first-run screens, and no co-authored-by trailer text in what the agent writes
        (config / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}) + "\n")
        (config / "settings.json").write_text(json.dumps({"includeCoAuthoredBy": False}) + "\n")


HARNESS = Claude()
