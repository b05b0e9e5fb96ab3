"""Kilo Code CLI (`@kilocode/cli`, an OpenCode fork): Google's generateContent, through its built-in `google` provider.

`kilo run` headless with `google/<model>` of the catalog bundled in the binary: `@ai-sdk/google` calls
https://generativelanguage.googleapis.com/v1beta/models/<model>:streamGenerateContent?alt=sse; no base URL is set.
A Bun binary (behind a Node launcher): HTTPS_PROXY, NO_PROXY and NODE_EXTRA_CA_CERTS as for OpenCode. Its user
agent is `Kilo-Code/<version> ai-sdk/...` for this provider. 7.7.7 is pinned: 7.8.1, the newest, was published
without its `@kilocode/cli-linux-x64*` binary packages, so it cannot install on Linux.

What the preset adds: the catalog fetch, auto-update, PostHog telemetry, session ingest, codebase indexing, the
background daemon and sharing off; `small_model` pinned to the same model; `--auto` approves its tools; `--title`
names the session (no title-generation side call). Its Kilo-provider model list fetch (api.kilo.ai) gets the
gateway's local 404, which it tolerates. Its bash tool runs in its own bundled bubblewrap sandbox. Its turns
always stream.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harnesses.opencode import OpenCode

QUIET = {
    "KILO_DISABLE_MODELS_FETCH": "1",
    "KILO_DISABLE_AUTOUPDATE": "1",
    "KILO_TELEMETRY_LEVEL": "off",  # PostHog is on only for "all"
    "KILO_DISABLE_SESSION_INGEST": "1",
    "KILO_DISABLE_CODEBASE_INDEXING": "1",
    "KILO_DISABLE_LSP_DOWNLOAD": "1",
    "KILO_DISABLE_SHARE": "1",
    "KILO_NO_DAEMON": "1",
}


class Kilo(OpenCode):
    name = "kilo"
    api = "gemini"
    binary = "kilo"
    package = "@kilocode/cli@7.7.7"
    default_model = "gemini-2.5-flash"
    needs_node = True  # a Node launcher in front of its Bun binary
    provider = "google"
    api_key_variable = "GOOGLE_GENERATIVE_AI_API_KEY"
    config_schema = "https://app.kilo.ai/config.json"
    config_file = Path(".config") / "kilo" / "kilo.json"
    quiet = QUIET


HARNESS = Kilo()
