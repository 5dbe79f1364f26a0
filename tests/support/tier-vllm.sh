#!/usr/bin/env bash
# vllm tier setup (tests/run runs it when the tier is selected). Idempotent: builds or reuses,
# under $FLASH_TEST_CACHE/vllm, one CPU venv per torch pin and each release's wheel installed
# --no-deps beside it, for every release in the catalogue (src/flash_common/releases.py): adding
# a release there adds it here. `--list` prints those versions, one a line, and sets up nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# flash_common imports only the standard library: any python3 reads the catalogue.
versions=$(PYTHONPATH="$ROOT/src" python3 -c \
  'from flash_common import releases; print("\n".join(r.version for r in releases.RELEASES))')
if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "$versions"
  exit 0
fi
[ $# -eq 0 ] || { echo "tier-vllm.sh: unknown argument $1 (accepted: --list)" >&2; exit 2; }
start=$(date +%s)
# shellcheck disable=SC2086  # one version per word
python3 "$ROOT/tools/check_vllm_release.py" --setup $versions
echo "tier-vllm: environments ready in $(( $(date +%s) - start ))s" >&2
