#!/usr/bin/env bash
# Set up polar-mitm on a fresh machine (idempotent; later runs take seconds):
#   - the project venv .venv with a Python >= 3.12 (scripts/find-python.sh says where it looked, or why not),
#   - the local engine: vLLM for CPU in a Python 3.11 venv of its own, plus the tiny test model (cached),
#   - Node 22 and the pinned harnesses (Codex CLI, Claude Code, Qwen Code, Gemini CLI) from the npm registry.
# The Docker sandbox tests start their own dockerd (sandboxes/docker/dockerd.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/find-python.sh)
echo "setup: using $python ($("$python" --version))"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e '.[test,notebooks]'
.venv/bin/polar-mitm engine build
sandboxes/harnesses/install.sh
sandboxes/agents-py/install.sh  # the PyPI coding agents (mini-swe-agent, Aider, OpenHands SDK, Hermes Agent, gptme, ...): a pinned venv each
sandboxes/agents-frameworks/install.sh  # the agent frameworks of examples/agents/ (OpenAI Agents SDK, pydantic-ai, smolagents), a venv of their own
# iproute2 and iptables for the transparent-capture tests (tests/integration/test_transparent_capture.py, as root: CI);
# Docker's package brings iptables too, but only once the Docker tests start, after pytest has skipped those
command -v iptables >/dev/null && command -v ip >/dev/null || { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get install -y -q iptables iproute2 >/dev/null; } || echo "setup: no iptables/iproute2 (apt-get install iptables iproute2, as root): the transparent-capture tests will skip"
# headless Chromium (Debian's package) for the dashboard's browser tests, tests/integration/test_ui.py (as root: CI)
command -v chromium >/dev/null || { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || echo "setup: no chromium (apt-get install chromium, as root): the dashboard's browser tests will skip"
echo "setup: done"
