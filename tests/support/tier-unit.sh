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
echo "tier-unit: installing Debian's systemd package (for systemd-analyze verify)" >&2
export DEBIAN_FRONTEND=noninteractive
blocker=/usr/sbin/policy-rc.d
added=0
if [ ! -e "$blocker" ]; then printf '#!/bin/sh\nexit 101\n' >"$blocker"; chmod +x "$blocker"; added=1; fi
trap 'if [ $added -eq 1 ]; then rm -f "$blocker"; fi' EXIT
apt-get install -y -qq --no-install-recommends systemd >/dev/null 2>&1 || {
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends systemd >/dev/null; } || {
  echo "tier-unit: FAILED to install systemd (systemd-analyze); the unit tier cannot check service units" >&2
  exit 1; }
systemd-analyze --version | head -1 >&2
