#!/usr/bin/env bash
# Download the checkpoint into the host's Hugging Face cache, as the upstream script did, but on the
# host with huggingface_hub + hf_xet (no container). Resumable: run it again after an interruption.
#   MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4 HF_CACHE=/data/hf scripts/download-weights.sh
#   REVISION=<sha> EXCLUDE='*.complete.json qualification-notes.md' MAX_WORKERS=8 XET=1 scripts/download-weights.sh
#   DRY=1 scripts/download-weights.sh             # list files and exact bytes, download nothing
# Token: HF_TOKEN (or HUGGING_FACE_HUB_TOKEN, or $HF_CACHE/token from `hf auth login`). Every
# variable of docs/SETTINGS.md is honoured (defaults < environment < KEY=VALUE arguments).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
args=(download --no-profile)
case "${DRY:-0}" in 1|true|yes) args+=(--dry-run) ;; 0|false|no|"") ;; *) echo "DRY must be 0 or 1, got '$DRY'" >&2; exit 2 ;; esac
exec "$ROOT/flash" "${args[@]}" "$@"
