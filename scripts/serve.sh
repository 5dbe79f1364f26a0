#!/usr/bin/env bash
# Start the server from environment variables alone, as the upstream recipe's serve.sh did:
#   MODE=hybrid YARN=1 CTX=500000 scripts/serve.sh
#   DRY=1 MODE=hybrid scripts/serve.sh          # print the docker run line, run nothing
# Every variable of docs/SETTINGS.md is honoured (defaults < environment); typos in KEY=VALUE
# arguments are refused. The same Python as `flash serve` does the work.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=(serve --no-profile)
case "${DRY:-0}" in 1|true|yes) args+=(--dry-run) ;; 0|false|no|"") ;; *) echo "DRY must be 0 or 1, got '$DRY'" >&2; exit 2 ;; esac
exec "$ROOT/flash" "${args[@]}" "$@"
