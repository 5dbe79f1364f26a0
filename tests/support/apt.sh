# Sourced by the tier hooks (not a hook itself: tests/run runs only tier-*.sh).
# apt_install WHO PKG...: install Debian packages quietly, with services kept from starting
# (a policy-rc.d that says 101, removed again if we put it there), retrying once after
# `apt-get update`. Returns non-zero when the packages could not be installed.
apt_install() {
  local who=$1; shift
  echo "$who: installing $* from Debian's packages" >&2
  local blocker=/usr/sbin/policy-rc.d added=0 rc=0
  if [ ! -e "$blocker" ]; then printf '#!/bin/sh\nexit 101\n' >"$blocker"; chmod +x "$blocker"; added=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || rc=$?
  if [ $added -eq 1 ]; then rm -f "$blocker"; fi
  return $rc
}
