#!/usr/bin/env bash
# Build the rollout sandbox base image without any registry: a debootstrap rootfs, then `docker import`.
#
#   export "$(sandboxes/docker/dockerd.sh | tail -1)"
#   sandboxes/docker/build-image.sh [TAG]          # default polar-mitm/sandbox:bookworm; prints TAG last
#
# The image holds Debian bookworm (minbase) with bash, python3, ca-certificates, procps and git; no Node and no
# harness. The docker runtime bind-mounts the host's pinned install (sandboxes/harnesses/install.sh: Node 22 +
# the harnesses, ~1 GB) read-only at the same path, so one install serves every container and images stay
# small. Dockerfile.harnesses is the registry-based alternative with everything baked in.
# Idempotent: an existing TAG is kept (pass --rebuild to replace it). Needs root (debootstrap) and apt access.
set -euo pipefail

rebuild=0
if [[ "${1:-}" == "--rebuild" ]]; then rebuild=1; shift; fi
tag="${1:-polar-mitm/sandbox:bookworm}"
suite="${POLAR_MITM_SUITE:-bookworm}"
mirror="${POLAR_MITM_MIRROR:-http://deb.debian.org/debian}"

if [[ "$rebuild" == 0 ]] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  echo "build-image.sh: installing debootstrap" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >&2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "build-image.sh: debootstrap $suite into $work/rootfs" >&2
debootstrap --variant=minbase --include=bash,python3,ca-certificates,procps,git "$suite" "$work/rootfs" "$mirror" >&2
# a smaller image: no apt lists or caches, no docs
rm -rf "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/cache/apt/*.bin "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/*
mkdir -p "$work/rootfs/workspace"
tar -C "$work/rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /workspace' \
  --change 'CMD ["/bin/bash"]' \
  - "$tag" >&2
echo "$tag"
