#!/usr/bin/env bash
# Start a Docker Engine for the engine tier when none answers; stop only the one we started.
# Debian's docker.io, vfs storage (works inside containers), no iptables/bridge: test
# containers use --network host and listen on loopback only.
set -euo pipefail
STATE=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}/dockerd
mkdir -p "$STATE"
case "${1:-start}" in
  start)
    if docker info >/dev/null 2>&1; then echo "dockerd: already answering" >&2; exit 0; fi
    if ! command -v dockerd >/dev/null 2>&1; then
      echo "dockerd: installing docker.io from Debian's packages" >&2
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq >/dev/null && apt-get install -y -qq docker.io >/dev/null
    fi
    dockerd --storage-driver=vfs --iptables=false --ip6tables=false --bridge=none \
      --data-root "${FLASH_DOCKER_ROOT:-/var/lib/docker}" >"$STATE/dockerd.log" 2>&1 &
    echo $! >"$STATE/pid"
    for _ in $(seq 1 60); do
      docker info >/dev/null 2>&1 && { echo "dockerd: started (pid $(cat "$STATE/pid"))" >&2; exit 0; }
      sleep 1
    done
    echo "dockerd: did not answer within 60 s; log:" >&2; tail -n 30 "$STATE/dockerd.log" >&2; exit 1 ;;
  stop)
    [ -f "$STATE/pid" ] || exit 0
    pid=$(cat "$STATE/pid"); rm -f "$STATE/pid"
    kill "$pid" 2>/dev/null || exit 0
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
    kill -9 "$pid" 2>/dev/null || true ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
