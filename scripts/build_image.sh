#!/usr/bin/env bash
# Builds tandem's container image with or without a registry, and prints its size.
#
#   scripts/build_image.sh                 # tandem:latest on tandem-base:bookworm (made here if absent)
#   BASE_IMAGE=python:3.11-slim scripts/build_image.sh      # a registry base instead
#
# 1. The engine: $TANDEM_ENGINE, else podman, else docker where its daemon answers.
# 2. The base: $BASE_IMAGE if set (pulled by the engine as usual); otherwise tandem-base:bookworm,
#    which, when the engine lacks it, is made here: `debootstrap --variant=minbase bookworm` into
#    $TANDEM_ROOTFS_DIR (root only; deb.debian.org or $DEBIAN_MIRROR) and `import`ed as an image.
# 3. torch: the host's CPU wheel ($TORCH_WHEEL, else torch-$TORCH_VERSION*cpu*.whl in pip's
#    find-links dirs, /opt/wheels, ~/.cache/pip) is copied into .image-inputs/ and installed from
#    there, its dependencies and tandem's from PyPI. PyPI's own torch for Linux is the multi-GB CUDA
#    build, so without a local wheel torch comes from torch's CPU index (the Dockerfile's default).
#    Behind a TLS-intercepting proxy pip needs its CA: $PIP_CERT (or pip's `global.cert`), when set,
#    is copied to .image-inputs/pip-ca-bundle.crt, which only the builder stage sees.
# 4. `<engine> build -f deploy/Dockerfile -t $TANDEM_IMAGE .`: layers are cached, so a second run
#    with nothing changed takes seconds.
# Exit codes: 0 built; 3 a prerequisite is missing (no engine, no base and no debootstrap/root);
# anything else: the build failed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${TANDEM_IMAGE:-tandem:latest}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LOCAL_BASE=tandem-base:bookworm
ROOTFS=${TANDEM_ROOTFS_DIR:-/var/tmp/tandem-rootfs-bookworm}   # outside the repo: not build context
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
INPUTS=$ROOT/.image-inputs   # the build's local inputs (gitignored but for its README)

say() { echo "build_image: $*" >&2; }
missing() { say "cannot build: $*"; exit 3; }

engine=${TANDEM_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v podman >/dev/null 2>&1; then engine=podman
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then engine=docker
  else missing "no container engine (install podman, or docker with a running daemon)"
  fi
fi
# `podman info` fails where podman's runtime or storage cannot start: point at the fix now instead of
# failing later inside the build.
"$engine" info >/dev/null 2>&1 || missing "'$engine info' fails; for podman see deploy/README.md (containers.conf: runc)"

base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
  base=$LOCAL_BASE
  if ! "$engine" image inspect "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null 2>&1 || missing "no $base image and no debootstrap (apt-get install debootstrap), or set BASE_IMAGE"
    [ "$(id -u)" = 0 ] || missing "debootstrap needs root to make $base; run as root or set BASE_IMAGE"
    say "making $base: debootstrap bookworm into $ROOTFS from $MIRROR"
    t0=$SECONDS
    rm -rf "$ROOTFS"
    debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
      || { tail -20 "$ROOTFS.log" >&2; missing "debootstrap failed (log: $ROOTFS.log)"; }
    # apt's caches are not part of an image; the Dockerfile runs apt-get update where it installs.
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
    rm -rf "$ROOTFS"
    say "made $base in $((SECONDS - t0)) s"
  fi
fi

# The local CPU wheel (the last match by name). `pip config list` shows the find-links dirs.
wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ]; then
  dirs=(/opt/wheels "$HOME/.cache/pip/wheels")
  for d in ${PIP_FIND_LINKS:-}; do dirs+=("${d#file://}"); done
  for d in "${dirs[*]}" "$INPUTS"; do  # the host's wheels first, then a previous run's copy
    # shellcheck disable=SC2086  # $d: the host's directories, one word each
    wheel=$(find $d -maxdepth 3 -name "torch-${TORCH_VERSION}*cpu*-cp311-*x86_64.whl" 2>/dev/null \
            | sort | tail -1 || true)
    [ -n "$wheel" ] && break
  done
fi
args=(--build-arg "BASE_IMAGE=$base")
find "$INPUTS" -maxdepth 1 -name 'torch-*.whl' ! -name "$(basename "${wheel:-none}")" -delete
if [ -n "$wheel" ]; then
  [ "$wheel" -ef "$INPUTS/$(basename "$wheel")" ] || cp -u "$wheel" "$INPUTS/"
  # The wheel's own version (2.13.0+cpu): only .image-inputs/ has it, so pip cannot take PyPI's CUDA torch.
  version=$(basename "$wheel" | cut -d- -f2)
  args+=(--build-arg "TORCH_VERSION=$version" --build-arg "TORCH_INDEX_URL=")
  say "torch from $wheel"
else
  say "no local torch ${TORCH_VERSION} CPU wheel: torch comes from the Dockerfile's TORCH_INDEX_URL"
fi

cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  cp "$cert" "$INPUTS/pip-ca-bundle.crt"
  say "pip in the build trusts $cert (PIP_CERT)"
else
  rm -f "$INPUTS/pip-ca-bundle.crt"
fi

say "building $IMAGE with $engine on $base"
t0=$SECONDS
# The builder stage is tagged too (BUILDER), built first: the full build reuses its layers. Untagged,
# each code change left the last builder image behind (1.5 GB with its venv, ~47 GB after a day of CI).
BUILDER=${IMAGE%%:*}-builder:latest
previous=$("$engine" image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)
previous_builder=$("$engine" image inspect "$BUILDER" --format '{{.Id}}' 2>/dev/null || true)
"$engine" build -f "$ROOT/deploy/Dockerfile" --target builder -t "$BUILDER" "${args[@]}" "$ROOT"
"$engine" build -f "$ROOT/deploy/Dockerfile" -t "$IMAGE" "${args[@]}" "$ROOT"
# The images this build replaced are untagged now; each holds its own ~1 GB copy of the venv, so a
# rebuild per code change would fill the disk. rmi refuses (harmlessly) while a container uses one.
drop_replaced() {  # drop_replaced OLD_ID TAG
  local current
  current=$("$engine" image inspect "$2" --format '{{.Id}}')
  if [ -n "$1" ] && [ "$1" != "$current" ]; then
    "$engine" rmi "$1" >/dev/null 2>&1 && say "removed the image it replaced (${1:0:12})" || true
  fi
}
drop_replaced "$previous" "$IMAGE"
drop_replaced "$previous_builder" "$BUILDER"
size=$("$engine" image inspect "$IMAGE" --format '{{.Size}}')
say "built $IMAGE in $((SECONDS - t0)) s; size $((size / 1000000)) MB"
echo "$IMAGE $size"
