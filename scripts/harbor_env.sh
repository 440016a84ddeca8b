#!/usr/bin/env bash
# harbor (docs/harbor.md) where this machine's Python is older than harbor's 3.12: a Debian trixie root
# filesystem (Python 3.13) with harbor in a venv, cached under furlong's cache dir, and a way to run in it.
#
#   bash scripts/harbor_env.sh setup                          build it (about 2 minutes once; then instant)
#   bash scripts/harbor_env.sh path                           print its directory; exit 1 if not built
#   bash scripts/harbor_env.sh run [--bind DIR]... [--] CMD   run CMD in it (harbor is on PATH)
#
# `run` enters private mount and pid namespaces and chroots: /proc, /dev, /sys and /tmp are this machine's,
# this checkout is mounted read-only at its own path and is on PYTHONPATH (so
# furlong.build.harbor_environment imports with harbor's own dependencies, no torch), and each --bind DIR
# is mounted read-write at its own path. The network namespace is this machine's, so sandboxes come from a
# `furlong sandbox serve` on 127.0.0.1 (sandbox.backend=remote): nothing sandboxes inside the chroot.
# Both commands need root (mmdebstrap --mode=root, mounts).
set -euo pipefail
CHECKOUT="$(cd "$(dirname "$0")/.." && pwd)"
SUITE=trixie
PACKAGES=python3,python3-venv,ca-certificates
MIRROR="${FURLONG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HARBOR="$(grep -o 'harbor==[0-9][0-9.]*' "$CHECKOUT/pyproject.toml" | head -n 1)"  # the test extra's pin
# furlong's own imports on the harbor path, named so a harbor release that drops one does not break it
CLIENT_DEPS=(pydantic pyyaml rich httpx)
FORMAT=1  # bump when the steps below change what a built tree holds

say() { echo "harbor_env: $*" >&2; }
die() { say "$*"; exit 1; }

cache_dir() {  # furlong.paths.cache_dir
  if [ -n "${FURLONG_CACHE:-}" ]; then echo "$FURLONG_CACHE"
  elif [ "$(id -u)" -eq 0 ]; then echo /var/cache/furlong
  else echo "$HOME/.cache/furlong"; fi
}

tree_dir() {  # one directory per recipe, so a new pin or suite builds beside the old one
  local key
  key=$(printf '%s\n' "$FORMAT" "$SUITE" "$PACKAGES" "$MIRROR" "$HARBOR" "${CLIENT_DEPS[*]}" | sha256sum | cut -c1-16)
  echo "$(cache_dir)/harbor/root-$key"
}

host_ca() {  # the bundle this machine trusts: it may hold a CA (a TLS-inspecting proxy's) the chroot lacks
  local f
  for f in "${SSL_CERT_FILE:-}" "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$f" ] && [ -f "$f" ]; then echo "$f"; return; fi
  done
}

# Runs in the new namespaces: mount what the chroot sees, then chroot. Arguments: ROOT CA CWD BIND... -- CMD...
# /tmp and /dev are recursive binds of this machine's; the checkout goes read-only after its bind.
INNER='
set -euo pipefail
root=$1 ca=$2 cwd=$3; shift 3
binds=(); while [ "$1" != -- ]; do binds+=("$1"); shift; done; shift
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount --rbind /tmp "$root/tmp"
mount -t tmpfs -o mode=755 tmpfs "$root/run"
mount --bind -o ro /etc/resolv.conf "$root/etc/resolv.conf"
env=(PATH=/opt/harbor/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 PYTHONPATH="$CHECKOUT"
     LITELLM_LOCAL_MODEL_COST_MAP=True)  # else litellm (harbor imports it) fetches a price table at start
if [ -n "$ca" ]; then
  touch "$root/run/host-ca.crt" && mount --bind -o ro "$ca" "$root/run/host-ca.crt"
  env+=(SSL_CERT_FILE=/run/host-ca.crt PIP_CERT=/run/host-ca.crt)
fi
for d in "$CHECKOUT" "${binds[@]}"; do mkdir -p "$root$d" && mount --rbind "$d" "$root$d"; done
mount -o remount,bind,ro "$root$CHECKOUT"
for v in TERM COLUMNS http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [ -n "${!v:-}" ]; then env+=("$v=${!v}"); fi
done
exec chroot "$root" /usr/bin/env -i "${env[@]}" /bin/sh -c "cd \"\$0\" 2>/dev/null || cd /; exec \"\$@\"" "$cwd" "$@"
'

enter() {  # ROOT BIND... -- CMD...: --kill-child, so a killed caller takes the whole namespace with it
  local root=$1; shift
  CHECKOUT="$CHECKOUT" unshare --mount --pid --fork --kill-child --propagation private \
    bash -c "$INNER" inner "$root" "$(host_ca)" "$PWD" "$@"
}

need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap --mode=root and mount namespaces)"; }

build() {  # TMP: the whole tree, built in TMP
  local tmp=$1
  say "mmdebstrap $SUITE ($PACKAGES) from $MIRROR into $tmp (about a minute)"
  mmdebstrap --mode=root --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp" "$MIRROR"
  say "venv /opt/harbor: pip install $HARBOR ${CLIENT_DEPS[*]} from PyPI (about a minute)"
  enter "$tmp" -- python3 -m venv /opt/harbor
  enter "$tmp" -- /opt/harbor/bin/pip install --quiet --no-cache-dir --disable-pip-version-check \
    --progress-bar off "$HARBOR" "${CLIENT_DEPS[@]}"
  say "checking that furlong's harbor environment imports there (and torch does not)"
  enter "$tmp" -- python -c 'import sys, furlong.build.harbor_environment; sys.exit("torch" in sys.modules)' \
    || die "furlong.build.harbor_environment does not import in $tmp (or imports torch)"
}

drop() {  # DIR: a tree of ours; never through a mount a killed build may have left in it
  local dir=$1
  if awk -v d="$dir/" 'index($2 "/", d) == 1 {found = 1} END {exit !found}' /proc/mounts; then
    die "$dir still has mounts (a killed build?); umount -R them, then run setup again"
  fi
  rm -rf --one-file-system "$dir"
}

setup() {
  need_root
  local dir base started tmp old
  dir=$(tree_dir)
  base=$(dirname "$dir")
  [ -f "$dir/.furlong-ready" ] && { say "ready: $dir"; return; }
  mkdir -p "$base"
  exec 9>"$base/.lock"
  flock 9  # one build at a time; a second caller finds the first's tree ready
  [ -f "$dir/.furlong-ready" ] && { say "ready: $dir"; return; }
  for old in "$base"/building-*; do [ -e "$old" ] && drop "$old"; done
  started=$SECONDS
  tmp="$base/building-$$"
  build "$tmp"
  touch "$tmp/.furlong-ready"
  mv "$tmp" "$dir"
  for old in "$base"/root-*; do [ "$old" != "$dir" ] && [ -e "$old" ] && drop "$old"; done
  say "ready: $dir ($((SECONDS - started)) s, $(du -sh "$dir" | cut -f1))"
}

run() {
  need_root
  local dir binds=()
  dir=$(tree_dir)
  [ -f "$dir/.furlong-ready" ] || die "not built: run 'bash scripts/harbor_env.sh setup' (or install.sh --harbor)"
  while [ $# -gt 0 ]; do
    case "$1" in
      --bind) [ -d "${2:-}" ] || die "--bind ${2:-}: not a directory"; binds+=("$(cd "$2" && pwd)"); shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  [ $# -gt 0 ] || die "run: no command"
  enter "$dir" "${binds[@]}" -- "$@"
}

case "${1:-}" in
  setup) setup ;;
  path) dir=$(tree_dir); [ -f "$dir/.furlong-ready" ] && echo "$dir" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
