#!/usr/bin/env bash
# Start a private Docker engine for the rollout server's docker runtime (and its tests).
#
#   sandboxes/docker/dockerd.sh            # prints DOCKER_HOST=unix://... on its last line
#   export "$(sandboxes/docker/dockerd.sh | tail -1)"
#   sandboxes/docker/dockerd.sh stop       # ends the engine this script started (its images stay for the next start)
#
# Installs docker.io with apt when `dockerd` is missing (root only). The engine is started with no iptables
# and no bridge (`--iptables=false --bridge=none`): it needs no network setup, and containers run either with
# no network at all (the rollout default: they reach only the gateway, through a relayed socket) or with
# `--network host`. Its data root (images) is kept under ${POLAR_MITM_HOME:-~/.cache/polar-mitm}/docker, so an
# image built once is there on the next start. Idempotent: an engine already answering on the socket is reused.
set -euo pipefail

root="${POLAR_MITM_HOME:-$HOME/.cache/polar-mitm}/docker"
sock="$root/docker.sock"
host="unix://$sock"
mkdir -p "$root/data" "$root/exec"

answers() { DOCKER_HOST="$host" timeout 5 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if [[ "${1:-}" == stop ]]; then
  pid="$(cat "$root/dockerd.pid" 2>/dev/null || true)"
  if [[ -z "$pid" ]] || ! kill -0 "$pid" 2>/dev/null; then
    echo "dockerd.sh: no dockerd of ours is running"
    exit 0
  fi
  kill "$pid"
  for _ in $(seq 1 150); do
    kill -0 "$pid" 2>/dev/null || { echo "dockerd.sh: stopped dockerd (pid $pid)"; exit 0; }
    sleep 0.2
  done
  kill -9 "$pid" 2>/dev/null || true
  echo "dockerd.sh: dockerd (pid $pid) did not stop within 30 s; killed it"
  exit 0
fi

if answers; then
  echo "DOCKER_HOST=$host"
  exit 0
fi

if ! command -v dockerd >/dev/null; then
  if [[ "$(id -u)" != 0 ]]; then
    echo "dockerd.sh: dockerd is not installed and this is not root; install docker.io (or docker-ce) first" >&2
    exit 1
  fi
  echo "dockerd.sh: installing docker.io" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends docker.io >&2 || { apt-get update >&2 && apt-get install -y --no-install-recommends docker.io >&2; }
fi
command -v docker >/dev/null || { echo "dockerd.sh: the docker client is missing" >&2; exit 1; }

# overlay2 needs the kernel's overlay filesystem; vfs always works but copies the rootfs per container
driver=vfs
grep -qw overlay /proc/filesystems && driver=overlay2
rm -f "$sock" "$root/exec/docker.pid" "$root/dockerd.pid"
nohup dockerd --storage-driver="$driver" --iptables=false --ip6tables=false --bridge=none \
  --data-root "$root/data" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" -H "$host" \
  >"$root/dockerd.log" 2>&1 &

for _ in $(seq 1 100); do
  if answers; then
    echo "dockerd.sh: started dockerd (pid $(cat "$root/dockerd.pid")); \`sandboxes/docker/dockerd.sh stop\` ends it" >&2
    echo "DOCKER_HOST=$host"
    exit 0
  fi
  sleep 0.2
done
echo "dockerd.sh: dockerd did not answer on $sock within 20 s; its log ($root/dockerd.log) ends:" >&2
tail -20 "$root/dockerd.log" >&2
exit 1
