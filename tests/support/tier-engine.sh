#!/usr/bin/env bash
# engine tier: Compose, for `flash export compose`'s test (tests/engine/test_export_compose.py).
# Debian 12 packages Compose v1 (docker-compose 1.29.2) only; the v2 plugin is not in its archive.
set -euo pipefail
command -v docker-compose >/dev/null 2>&1 && { echo "tier-engine: docker-compose present" >&2; exit 0; }
. "$(dirname "$0")/apt.sh"
apt_install tier-engine docker-compose
docker-compose version | head -1 >&2
