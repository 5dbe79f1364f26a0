#!/usr/bin/env bash
# vllm tier setup (tests/run runs it when the tier is selected). Idempotent: builds or reuses,
# under $FLASH_TEST_CACHE/vllm, one CPU venv per torch pin (0.29-0.32 share torch 2.13.0+cpu;
# 0.33 gets torch 2.14.1) and each release's wheel installed --no-deps beside it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
start=$(date +%s)
python3 "$ROOT/tools/check_vllm_release.py" --setup 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0
echo "tier-vllm: environments ready in $(( $(date +%s) - start ))s" >&2
