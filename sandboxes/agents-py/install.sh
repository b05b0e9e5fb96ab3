#!/usr/bin/env bash
# Install the pinned PyPI coding agents, each into a venv of its own, under the harnesses' cached prefix.
#
#   sandboxes/agents-py/install.sh                  # every agent below
#   sandboxes/agents-py/install.sh aider gptme      # just these
#   -> ${POLAR_MITM_HOME:-~/.cache/polar-mitm}/harnesses/py/<agent>/   (a venv), py/bin/<entry point> (links)
#
# Each venv installs exactly requirements/<agent>.txt, a lock of every package and version (regenerate one with
# lock.sh after changing requirements/<agent>.in). Their pins conflict (litellm, openai, pydantic, rich, ...),
# hence one venv each. Idempotent: an agent whose lock, runner, Python and entry points are unchanged is skipped
# (a second run takes about a second: finding the Pythons). Prints the prefix on its last line;
# polar_mitm.harnesses finds the agents there (PythonAgent.executable).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="${POLAR_MITM_HOME:-$HOME/.cache/polar-mitm}/harnesses/py"
mkdir -p "$prefix/bin"

# agent -> the Python versions it supports, [min, max) (each one's Requires-Python, narrowed to what ran here)
declare -A python_range=(
  [mini-swe-agent]="3.12 3.14"
  [aider]="3.12 3.13"       # aider-chat 0.86.2: Requires-Python <3.13
  [openhands]="3.12 3.14"   # openhands-sdk: >=3.12
  [hermes]="3.12 3.14"      # hermes-agent: <3.14
  [gptme]="3.12 3.14"
  [vibe]="3.12 3.14"        # mistral-vibe: a cp312 abi3 wheel
  [kimi]="3.13 3.14"        # kimi-cli: >=3.12; 1.51.0 fails to start on CPython 3.12.1 (TypeError in a dataclass)
)
# agent -> its entry points, linked into py/bin (the agent's console scripts; OpenHands SDK has none: a runner)
declare -A entry_points=(
  [mini-swe-agent]="mini"
  [aider]="aider"
  [openhands]="openhands-run"
  [hermes]="hermes"
  [gptme]="gptme"
  [vibe]="vibe"
  [kimi]="kimi"
)
order=(mini-swe-agent aider openhands hermes gptme vibe kimi)
LAYOUT=1

declare -A python_for=()  # range -> the Python find-python.sh picked for it, once per run
agents=("$@")
[[ ${#agents[@]} -eq 0 ]] && agents=("${order[@]}")

for agent in "${agents[@]}"; do
  [[ -n "${python_range[$agent]:-}" ]] || { echo "install.sh: unknown agent '$agent'; known: ${order[*]}" >&2; exit 2; }
  lock="$here/requirements/$agent.txt"
  venv="$prefix/$agent"
  range="${python_range[$agent]}"
  # shellcheck disable=SC2086
  [[ -n "${python_for[$range]:-}" ]] || python_for[$range]="$("$here/find-python.sh" $range)"
  python="${python_for[$range]}"
  inputs=("$lock")
  [[ -f "$here/runners/$agent.py" ]] && inputs+=("$here/runners/$agent.py")
  # what the venv is made of: its lock, its runner, its Python, its entry points and how this script builds it
  # (LAYOUT: bump it when the steps below change), not this script's other lines
  want="layout$LAYOUT $(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1) $("$python" -c 'import sys; print("python%d.%d" % sys.version_info[:2])') ${entry_points[$agent]}"
  if [[ "$(cat "$venv/.polar-mitm-stamp" 2>/dev/null)" != "$want" ]]; then
    echo "install.sh: installing $agent into $venv ($python)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -r "$lock" > "$venv/install.log" 2>&1 \
        || ! "$venv/bin/python" -m pip check >> "$venv/install.log" 2>&1; then
      tail -n 30 "$venv/install.log" >&2
      echo "install.sh: installing $agent failed (log above)" >&2
      rm -rf "$venv"
      exit 1
    fi
    if [[ -f "$here/runners/$agent.py" ]]; then
      # an agent shipped as a library only (OpenHands SDK): its runner script is its entry point
      { echo "#!$venv/bin/python"; cat "$here/runners/$agent.py"; } > "$venv/bin/${entry_points[$agent]}"
      chmod +x "$venv/bin/${entry_points[$agent]}"
    fi
    echo "$want" > "$venv/.polar-mitm-stamp"
  fi
  for bin in ${entry_points[$agent]}; do
    [[ -x "$venv/bin/$bin" ]] || { echo "install.sh: $agent: $bin missing after install" >&2; exit 1; }
    ln -sfn "../$agent/bin/$bin" "$prefix/bin/$bin"
  done
done
echo "$prefix"
