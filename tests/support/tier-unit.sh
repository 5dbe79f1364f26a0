#!/usr/bin/env bash
# unit tier setup (tests/run runs it when the tier is selected): `systemd-analyze`, which checks
# the units `flash service install` writes (tests/unit/test_service.py), from Debian's systemd
# package, installed only when missing. Fails loudly when it cannot be installed: the tier then
# fails rather than skipping the check. (Installing the package does not start systemd.)
set -euo pipefail
if command -v systemd-analyze >/dev/null 2>&1; then
  echo "tier-unit: $(systemd-analyze --version | head -1) present" >&2
  exit 0
fi
. "$(dirname "$0")/apt.sh"
apt_install tier-unit systemd || {
  echo "tier-unit: FAILED to install systemd (systemd-analyze); the unit tier cannot check service units" >&2
  exit 1; }
systemd-analyze --version | head -1 >&2
