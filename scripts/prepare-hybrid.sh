#!/usr/bin/env bash
# Build <snapshot>-fp8hybrid/ (fp8 side layers, docs/decisions/hybrid-convention.md) next to the
# snapshot in the HF cache; a second run on a prepared snapshot returns in seconds.
#   MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4 HF_CACHE=/data/hf scripts/prepare-hybrid.sh
#   DRY=1 scripts/prepare-hybrid.sh               # plan: files, bytes, disk; write nothing
# Honours MODEL, REVISION, HF_CACHE and every variable of docs/SETTINGS.md.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=(prepare hybrid --no-profile)
case "${DRY:-0}" in 1|true|yes) args+=(--dry-run) ;; 0|false|no|"") ;; *) echo "DRY must be 0 or 1, got '$DRY'" >&2; exit 2 ;; esac
exec "$ROOT/flash" "${args[@]}" "$@"
