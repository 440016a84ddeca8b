#!/usr/bin/env bash
# Installs everything furlong needs on a fresh Debian 12 machine; safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")"

# mmdebstrap builds the base image (as root, or as an ordinary user with uidmap's newuidmap/newgidmap and
# a subuid range); util-linux has setpriv and unshare; passt/slirp4netns give networked sandboxes
# user-mode networking. These are the only steps that need root: everything after works as a user.
need_apt=()
command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
command -v newuidmap >/dev/null || need_apt+=(uidmap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
command -v pasta >/dev/null || need_apt+=(passt)
command -v slirp4netns >/dev/null || need_apt+=(slirp4netns)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing ${need_apt[*]}; install them as root (apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# torch first, pinned: otherwise a later dependency pulls a multi-GB CUDA build.
pip_quiet=(--quiet --disable-pip-version-check --root-user-action=ignore)
python3 -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
  || python3 -m pip install "${pip_quiet[@]}" torch==2.13.0
python3 -m pip install "${pip_quiet[@]}" -c constraints.txt -e '.[test]'
echo "install.sh: ready ($(python3 -m pip show furlong 2>/dev/null | grep ^Version))"
