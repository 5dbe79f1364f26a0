#!/usr/bin/env bash
# obs tier: Prometheus (promtool + server) and node-exporter from Debian's packages, installed
# only when missing. Debian's postinst may try to start services: policy-rc.d blocks that, the
# tier starts its own throwaway instances on free loopback ports.
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-node-exporter >/dev/null 2>&1 || need+=(prometheus-node-exporter)
[ ${#need[@]} -eq 0 ] && { echo "tier-obs: promtool, prometheus, node-exporter present" >&2; exit 0; }
. "$(dirname "$0")/apt.sh"
apt_install tier-obs "${need[@]}"
promtool --version | head -1 >&2
