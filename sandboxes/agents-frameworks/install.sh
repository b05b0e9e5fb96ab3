#!/usr/bin/env bash
# Install the three agent frameworks of examples/agents/ (OpenAI Agents SDK, pydantic-ai, smolagents) into one venv
# of their own, beside the PyPI coding agents:
#
#   sandboxes/agents-frameworks/install.sh
#   -> ${POLAR_MITM_HOME:-~/.cache/polar-mitm}/harnesses/py/frameworks/   (a venv; its python runs the examples)
#
# The venv installs exactly requirements.txt, a lock of every package and version (regenerated from
# requirements.in by `pip freeze` in a fresh venv). A venv of its own: the frameworks pin openai, pydantic and
# httpx differently from the project's .venv. Idempotent: when the lock, this script and the Python are unchanged,
# it returns at once. Prints the venv on its last line; polar_mitm.harnesses.frameworks finds it there.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${POLAR_MITM_HOME:-$HOME/.cache/polar-mitm}/harnesses/py/frameworks"
python="$("$here/../agents-py/find-python.sh" 3.12 3.14)"
want="$(cat "$here/install.sh" "$here/requirements.txt" | sha256sum | cut -d' ' -f1) $("$python" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
if [[ "$(cat "$venv/.polar-mitm-stamp" 2>/dev/null)" != "$want" ]]; then
  echo "install.sh: installing the agent frameworks into $venv ($python)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -r "$here/requirements.txt" > "$venv/install.log" 2>&1 \
      || ! "$venv/bin/python" -m pip check >> "$venv/install.log" 2>&1; then
    tail -n 30 "$venv/install.log" >&2
    echo "install.sh: installing the agent frameworks failed (log above)" >&2
    rm -rf "$venv"
    exit 1
  fi
  echo "$want" > "$venv/.polar-mitm-stamp"
fi
echo "$venv"
