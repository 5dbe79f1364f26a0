#!/usr/bin/env bash
# RadixArk only: graft Inferact's NVFP4 MTP experts (pinned revision + sha256) onto the fp8 hybrid:
# <snapshot>-fp8hybrid-mtpnvfp4/. Needs the hybrid (scripts/prepare-hybrid.sh) first.
#   MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4 HF_CACHE=/data/hf scripts/prepare-mtp-graft.sh
#   DRY=1 scripts/prepare-mtp-graft.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=(prepare graft --no-profile)
case "${DRY:-0}" in 1|true|yes) args+=(--dry-run) ;; 0|false|no|"") ;; *) echo "DRY must be 0 or 1, got '$DRY'" >&2; exit 2 ;; esac
exec "$ROOT/flash" "${args[@]}" "$@"
