#!/usr/bin/env bash
# engine tier setup (tests/run runs it when the tier is selected), each part installed only when
# missing and failing loudly when it cannot be (the tests that need it then fail rather than skip):
# 1. OpenSSH's server and client from Debian's packages, for tests/engine/test_ssh_engine.py, which
#    drives a second Docker Engine over ssh:// through a real sshd on loopback (the test starts its
#    own sshd on a free port with its own keys; the package's own service is never started:
#    policy-rc.d blocks it).
# 2. Compose, for `flash export compose`'s test (tests/engine/test_export_compose.py). Debian 12
#    packages Compose v1 (docker-compose 1.29.2) only; the v2 plugin is not in its archive.
# 3. sparkrun, for `flash export sparkrun`'s test (tests/engine/test_export_sparkrun.py): its own
#    venv, because sparkrun 0.4.2 needs Python >= 3.12 and pins ~20 exact dependencies
#    (huggingface-hub 2.2.0 among them, against our 2.4.0), so it cannot join the test extra.
set -euo pipefail
. "$(dirname "$0")/apt.sh"

need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
  apt_install tier-engine "${need[@]}" || {
    echo "tier-engine: FAILED to install ${need[*]}; the engine tier cannot test ssh:// engines or compose" >&2
    exit 1; }
fi
echo "tier-engine: $(ssh -V 2>&1); $(docker-compose version | head -1)" >&2

SPARKRUN=0.4.2
VENV=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}/sparkrun-$SPARKRUN
if [ ! -x "$VENV/bin/sparkrun" ]; then
  PY312=""
  # Debian 12's python3 is 3.11: a newer one from PATH, else from pyenv where the machine has one
  for py in python3 python3.13 python3.12 /root/.pyenv/versions/3.1[2-9]*/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      PY312=$(command -v "$py"); break
    fi
  done
  if [ -z "$PY312" ]; then  # none here (Debian 12): uv fetches a standalone CPython 3.12 (from GitHub)
    UV=${FLASH_TEST_CACHE:-$HOME/.cache/flash-tests}/uv-0.13.9
    [ -x "$UV/bin/uv" ] || { python3 -m venv "$UV" && "$UV/bin/pip" install --quiet --disable-pip-version-check uv==0.13.9; }
    PY312=$("$UV/bin/uv" python find 3.12 2>/dev/null || { "$UV/bin/uv" python install 3.12 >&2 && "$UV/bin/uv" python find 3.12; }) || PY312=""
  fi
  [ -n "$PY312" ] || { echo "tier-engine: no Python >= 3.12 for sparkrun $SPARKRUN (python3 is $(python3 --version 2>&1); uv could not install one)" >&2; exit 1; }
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "sparkrun==$SPARKRUN"
fi
echo "tier-engine: sparkrun $SPARKRUN in $VENV" >&2
