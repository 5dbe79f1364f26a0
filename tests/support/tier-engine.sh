#!/usr/bin/env bash
# engine tier setup (tests/run runs it when the tier is selected): OpenSSH's server and client from
# Debian's packages, installed only when missing, for tests/engine/test_ssh_engine.py, which drives a
# second Docker Engine over ssh:// through a real sshd on loopback (the test starts its own sshd on a
# free port with its own keys; the package's own service is never started: policy-rc.d blocks it).
# Fails loudly when they cannot be installed: the ssh test then fails rather than skipping.
set -euo pipefail
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
if [ ${#need[@]} -eq 0 ]; then echo "tier-engine: $(ssh -V 2>&1) present" >&2; exit 0; fi
. "$(dirname "$0")/apt.sh"
apt_install tier-engine "${need[@]}" || {
  echo "tier-engine: FAILED to install ${need[*]}; the engine tier cannot test ssh:// engines" >&2
  exit 1; }
ssh -V >&2
