#!/usr/bin/env bash
# engine tier: Compose and sparkrun. Compose for `flash export compose`'s test (tests/engine/test_export_compose.py).
# Debian 12 packages Compose v1 (docker-compose 1.29.2) only; the v2 plugin is not in its archive.
set -euo pipefail
if ! command -v docker-compose >/dev/null 2>&1; then
  . "$(dirname "$0")/apt.sh"
  apt_install tier-engine docker-compose
fi
docker-compose version | head -1 >&2

# sparkrun, for `flash export sparkrun`'s test (tests/engine/test_export_sparkrun.py): its own venv,
# because sparkrun 0.4.2 needs Python >= 3.12 and pins ~20 exact dependencies (huggingface-hub 2.2.0
# among them, against our 2.4.0), so it cannot join the project's test extra.
SPARKRUN=0.4.2
VENV=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}/sparkrun-$SPARKRUN
if [ ! -x "$VENV/bin/sparkrun" ]; then
  PY312=$(command -v python3.12 || ls -d /root/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null | head -1 || true)
  [ -n "$PY312" ] || { echo "tier-engine: no Python >= 3.12 for sparkrun $SPARKRUN" >&2; exit 1; }
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "sparkrun==$SPARKRUN"
fi
echo "tier-engine: sparkrun $SPARKRUN in $VENV" >&2
