#!/usr/bin/env bash
# obs tier: Prometheus (promtool + server) and node-exporter from Debian's packages, installed
# only when missing. Debian's postinst may try to start services: policy-rc.d blocks that, the
# tier starts its own throwaway instances on free loopback ports.
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-node-exporter >/dev/null 2>&1 || need+=(prometheus-node-exporter)
[ ${#need[@]} -eq 0 ] && { echo "tier-obs: promtool, prometheus, node-exporter present" >&2; exit 0; }
echo "tier-obs: installing ${need[*]} from Debian's packages" >&2
export DEBIAN_FRONTEND=noninteractive
blocker=/usr/sbin/policy-rc.d
added=0
if [ ! -e "$blocker" ]; then printf '#!/bin/sh\nexit 101\n' >"$blocker"; chmod +x "$blocker"; added=1; fi
trap 'if [ $added -eq 1 ]; then rm -f "$blocker"; fi' EXIT
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
promtool --version | head -1 >&2
