#!/usr/bin/env bash
# Print the path of a Python whose version is in [MIN, MAX) (e.g. `find-python.sh 3.12 3.13`), searching the places
# scripts/find-python.sh searches: $POLAR_AGENTS_PYTHON, pythonX.Y / python3 on PATH, pyenv's versions, uv's
# pythons, /usr/bin and /usr/local/bin. The lowest minor version in range comes first: the lock files in
# requirements/ were resolved on it. Else explains, exit 1.
set -u
min="$1" max="$2"
ok() {
  "$1" -c "import sys; lo = tuple(map(int, '$min'.split('.'))); hi = tuple(map(int, '$max'.split('.'))); sys.exit(0 if lo <= sys.version_info[:2] < hi else 1)" >/dev/null 2>&1
}
candidates=()
[ -n "${POLAR_AGENTS_PYTHON:-}" ] && candidates+=("$POLAR_AGENTS_PYTHON")
for name in python3.12 python3.13 python3.14 python3; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do candidates+=("$p"); done
fi
for p in $(ls -d "$HOME"/.local/share/uv/python/cpython-3.1[2-9]*/bin/python3 /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9] 2>/dev/null | sort -V); do
  candidates+=("$p")
done
for p in "${candidates[@]}"; do
  # a pyenv shim for a version pyenv has not selected fails here and is skipped
  if ok "$p"; then "$p" -c 'import sys; print(sys.executable)'; exit 0; fi
done
echo "find-python.sh: no Python >= $min and < $max among: ${candidates[*]:-nothing}." >&2
echo "Install one (e.g. 'pyenv install $min' or 'uv python install $min') or set POLAR_AGENTS_PYTHON=/path/to/python$min." >&2
exit 1
