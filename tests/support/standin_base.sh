#!/usr/bin/env bash
# Build the engine tier's base image without any registry: a Debian bookworm rootfs from
# debootstrap (minbase + python3), imported with `docker import` as flash-test-base:bookworm.
# The rootfs tarball is cached under $FLASH_TEST_CACHE, so later runs only re-import it.
set -euo pipefail
IMAGE=${1:-flash-test-base:bookworm}
CACHE=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}
TAR=$CACHE/rootfs-bookworm-python3.tar
if docker image inspect "$IMAGE" >/dev/null 2>&1; then exit 0; fi
if [ ! -s "$TAR" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  ROOT=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$ROOT"' EXIT
  echo "standin-base: debootstrap bookworm (minbase + python3), a few minutes once" >&2
  debootstrap --variant=minbase --include=python3 bookworm "$ROOT" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
  tar -C "$ROOT" -cf "$TAR.tmp" . && mv "$TAR.tmp" "$TAR"
fi
docker import --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "$TAR" "$IMAGE" >/dev/null
echo "standin-base: imported $IMAGE" >&2
