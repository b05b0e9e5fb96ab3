#!/usr/bin/env bash
# Set up polar-mitm on a fresh machine: the project venv (.venv, Python >= 3.12) and the local engine.
#   scripts/setup.sh            project venv + local engine (vLLM CPU, Python 3.11 venv of its own)
#   scripts/setup.sh --tests    the same, plus what the test suite drives (Node 22 + pinned harnesses)
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/find-python.sh)
echo "setup: using $python ($("$python" --version))"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/polar-mitm engine build
if [ "${1:-}" = "--tests" ] && [ -x sandboxes/harnesses/install.sh ]; then
  sandboxes/harnesses/install.sh
fi
echo "setup: done"
