#!/usr/bin/env bash
# The smoke test people already run by hand, now a gate: exits 1 when a required check fails.
#   scripts/smoke-test.sh                  # the running flash container (found by label)
#   scripts/smoke-test.sh localhost:18300  # any server (host:port or a URL)
#   scripts/smoke-test.sh localhost:18300 --json TEST_MIN_DECODE_TPS=20
# Same Python as `flash test`; TEST_* variables in the environment set the thresholds.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=(test)
if [ $# -gt 0 ] && [[ "$1" != -* ]] && [[ "$1" != *=* ]]; then
  case "$1" in http://*|https://*) url=$1 ;; *) url="http://$1" ;; esac
  args+=(--url "$url"); shift
fi
exec "$ROOT/flash" "${args[@]}" "$@"
