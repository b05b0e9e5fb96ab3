#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (mitmproxy 12 needs it; on 3.11 pip silently installs mitmproxy 7).
# Looks at $POLAR_PYTHON, python3.13/python3.12/python3 on PATH, pyenv's versions, uv's pythons; else explains.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
[ -n "${POLAR_PYTHON:-}" ] && candidates+=("$POLAR_PYTHON")
for name in python3.14 python3.13 python3.12 python3; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do candidates+=("$p"); done
fi
for p in $(ls -d "$HOME"/.local/share/uv/python/cpython-3.1[2-9]*/bin/python3 /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9] 2>/dev/null | sort -rV); do
  candidates+=("$p")
done
for p in "${candidates[@]}"; do
  if ok "$p"; then echo "$p"; exit 0; fi
done
echo "polar-mitm needs Python >= 3.12 (mitmproxy 12); none found among: ${candidates[*]:-nothing}." >&2
echo "Install one (e.g. 'pyenv install 3.12', 'apt-get install python3.12', or 'uv python install 3.12') or set POLAR_PYTHON=/path/to/python3.12." >&2
exit 1
