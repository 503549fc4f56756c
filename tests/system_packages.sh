#!/usr/bin/env bash
# What the suite needs from the system's package manager (PyPI cannot give it), in one list.
# `make test` runs this before the suite and `.ci/run` only calls `make test`, so a fresh machine
# gets the same packages whichever way the suite is started.
#
#   bash tests/system_packages.sh   installs what is missing (as root, or with sudo that asks no
#                                   password); otherwise names every missing package and the
#                                   command that installs it, and exits 1 so the suite never starts
#                                   half-equipped.
#
# Who needs what:
#   iproute2, util-linux      network, process and mount namespaces: the rehearsed cloud and the
#                             code tenant's lane (ip, unshare, nsenter, setpriv)
#   python3-venv              the rehearsed cloud's node venvs on Debian's /usr/bin/python3
#   openssh-server, rsync     `ray up` with the local provider (tests/e2e/test_ray_up.py)
#   prometheus                the metrics test scrapes a real Prometheus
#   chromium                  the job page, its security and observability tests, in a real browser
# Only bash builtins are used to decide, so it also runs with a bare PATH.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

missing=()
have ip || missing+=(iproute2)
{ have unshare && have nsenter && have setpriv; } || missing+=(util-linux)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
have rsync || missing+=(rsync)
have prometheus || missing+=(prometheus)
have chromium || missing+=(chromium)

[ ${#missing[@]} -eq 0 ] && exit 0

install_cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "${EUID}" -eq 0 ]; then
  sudo=()
elif have sudo && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  sudo=(none)
fi

if ! have apt-get || [ "${sudo[*]-}" = none ]; then
  if ! have apt-get; then
    why="apt-get is not on this machine's PATH"
    how="install these (Debian's names; your package manager may call them otherwise):"
    fix="  $install_cmd"
  else
    why="this is not root and sudo cannot run without a password"
    how="install them as root, then run make test again:"
    fix="  sudo apt-get update && sudo $install_cmd"
  fi
  {
    echo "The test suite needs system packages that are missing: ${missing[*]}"
    echo "They cannot be installed from here: $why."
    echo "$how"
    echo "$fix"
    echo "The suite was not started."
  } >&2
  exit 1
fi

echo "Installing the system packages the test suite needs: ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "Installed: ${missing[*]}"
