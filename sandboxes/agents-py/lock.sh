#!/usr/bin/env bash
# Re-resolve one agent's lock: requirements/<agent>.in (its top-level pins) -> requirements/<agent>.txt (every
# package and version, as install.sh installs them), in a throwaway venv on the Python install.sh would use.
#
#   sandboxes/agents-py/lock.sh aider
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
agent="$1"
range="$(sed -n "s/^  \[$agent\]=\"\([0-9.]* [0-9.]*\)\".*/\1/p" "$here/install.sh")"
[[ -n "$range" ]] || { echo "lock.sh: unknown agent '$agent'" >&2; exit 2; }
# shellcheck disable=SC2086
python="$("$here/find-python.sh" $range)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$python" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements/$agent.in"
{
  echo "# the lock of requirements/$agent.in: written by lock.sh ($("$python" --version)), installed by install.sh"
  "$scratch/venv/bin/python" -m pip freeze --all --exclude pip --exclude setuptools --exclude wheel
} > "$here/requirements/$agent.txt"
echo "$here/requirements/$agent.txt"
