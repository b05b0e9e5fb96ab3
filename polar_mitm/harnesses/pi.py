"""Pi (`@earendil-works/pi-coding-agent`, renamed from `@mariozechner/pi-coding-agent` at 0.74): OpenAI Responses.

`pi -p` headless with the built-in `openai` provider (`openai/<model>` of pi-ai's bundled catalog): it calls
https://api.openai.com/v1/responses, streamed; no models.json and no base URL. pi-ai's fetch honours HTTPS_PROXY
(undici's EnvHttpProxyAgent, since pi-ai 0.50) and Node's NODE_EXTRA_CA_CERTS. It has no permission prompts:
its four tools (read, bash, edit, write) run as asked. Its user agent is `pi/<version> (<os>; node/...; <arch>)`.

What the preset adds: PI_OFFLINE (no startup network operations: update and catalog checks) and no install
telemetry. Its catalog's models mark their tools `strict` (a structured-output constraint of their own on
engines that honour it). Its turns always stream.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses import PLACEHOLDER_API_KEY, Harness

PROVIDER = "openai"


class Pi(Harness):
    name = "pi"
    api = "openai_responses"
    binary = "pi"
    package = "@earendil-works/pi-coding-agent@1.6.0"
    shell_tool = "bash"
    shell_argument = "command"
    # a model of its catalog without reasoning: an unknown name is refused ("Unknown model")
    default_model = "gpt-4.1"

    def arguments(self, instruction: str, model: str | None) -> list[str]:
        return ["-p", *(["--model", model if "/" in model else f"{PROVIDER}/{model}"] if model else []), instruction]

    def preset_environment(self, home: Path, model: str | None) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": PLACEHOLDER_API_KEY,
            "PI_CODING_AGENT_DIR": str(home / ".pi" / "agent"),
            "PI_OFFLINE": "1",
            "PI_TELEMETRY": "0",
        }


HARNESS = Pi()
