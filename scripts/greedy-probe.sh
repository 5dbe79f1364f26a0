#!/usr/bin/env bash
# The greedy probe behind layout changes (e.g. hybrid vs hybrid-mtp):
#   scripts/greedy-probe.sh hybrid [host:port]      # writes <state>/probes/hybrid.json
#   scripts/greedy-probe.sh --diff hybrid hybrid-mtp  # exit 1 at the first byte that differs
# Same Python as `flash probe`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--diff" ]; then exec "$ROOT/flash" probe "$@"; fi
[ $# -ge 1 ] || { echo "usage: $0 LABEL [host:port]  |  $0 --diff A B" >&2; exit 2; }
label=$1; shift
args=(probe "$label")
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
  case "$1" in http://*|https://*) url=$1 ;; *) url="http://$1" ;; esac
  args+=(--url "$url"); shift
fi
exec "$ROOT/flash" "${args[@]}" "$@"
