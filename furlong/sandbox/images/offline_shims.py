"""The verifier toolchain's stand-ins for what Terminal-Bench 2's tests fetch: first on the verifier's PATH
(only there, never on the agent's), in every network mode.

Terminal-Bench 2's tests begin with `apt-get install -y curl` and `curl -LsSf https://astral.sh/uv/X/install.sh
| sh`, often under `set -e`. Offline both fail, and online astral.sh may be out of reach (or out of a
restricted mode's allowlist), so:

- `curl`/`wget` asked for uv's installer (astral.sh/uv/[VERSION/]install.sh, or a release's
  uv-installer.sh) hand out INSTALLER, which links the toolchain's uv where uv's installer would put it
  and writes its `env` script; it never fetches. Any other call goes to the image's own curl/wget (the
  next on PATH), or fails as a missing command (127) where the image has none.
- Offline only (FURLONG_OFFLINE=1 in the verifier's environment): `apt-get install`/`apt install` of packages
  that are all installed already, or curl, succeed without fetching (curl is then the one above, for uv's
  installer only). Any other call, and every call where the phase has network, is the image's apt-get.
"""

from __future__ import annotations

HOME = "/opt/furlong/toolchain"  # the verifier toolchain's (toolchain.py)
DIR = f"{HOME}/offline"
UV_BIN = f"{HOME}/bin"  # the toolchain's uv and uvx, which INSTALLER links
COMMANDS = ("curl", "wget", "apt-get", "apt")

SHIM = r"""#!/bin/sh
# furlong's verifier toolchain, first on the verifier's PATH (furlong/sandbox/images/offline_shims.py)
tool=${0##*/}
shims=DIR

image_own() {  # the image's own $tool: the next one on PATH after this directory
    IFS=:
    for dir in $PATH; do
        if [ "$dir" != "$shims" ] && [ -x "$dir/$tool" ]; then unset IFS; exec "$dir/$tool" "$@"; fi
    done
    unset IFS
    echo "$tool: not installed in this image (furlong's verifier toolchain answers only uv's installer)" >&2
    exit 127
}

uv_installer() {  # the output curl or wget would write it to: curl's stdout, wget's remote name, or -o/-O FILE
    dest=-; [ "$tool" = wget ] && dest=install.sh
    url=; next=
    for arg; do
        if [ -n "$next" ]; then dest=$arg; next=; continue; fi
        case "$tool $arg" in
            "curl -o"|"curl --output"|"wget -O"|"wget --output-document") next=1 ;;
            "curl -o"*) dest=${arg#-o} ;;
            "wget -O"*) dest=${arg#-O} ;;
            "curl --output="*|"wget --output-document="*) dest=${arg#*=} ;;
            "curl -O"|"curl --remote-name") dest=install.sh ;;
            "curl -"[!-]*o) next=1 ;;
            "curl -"[!-]*O*) dest=install.sh ;;
            "wget -"[!-]*O) next=1 ;;
            "wget -"[!-]*O*) dest=${arg#*O} ;;
            *astral.sh/uv/install.sh|*astral.sh/uv/*/install.sh|*/astral-sh/uv/releases/*/uv-installer.sh) url=$arg ;;
        esac
    done
    [ -n "$url" ] || return 1
    [ "$url" = "${url%uv-installer.sh}" ] || [ "$dest" != install.sh ] || dest=uv-installer.sh
    if [ "$dest" = - ]; then cat "$shims/uv-installer.sh"; else cp "$shims/uv-installer.sh" "$dest"; fi
    exit 0
}

apt_nothing_to_fetch() {  # `install` of packages all installed, or curl (this directory's)
    command=; wanted=; skip=
    for arg; do
        if [ -n "$skip" ]; then skip=; continue; fi
        case $arg in
            -o|-c|-t|--option|--config-file|--target-release) skip=1 ;;
            -*) ;;
            *) if [ -z "$command" ]; then command=$arg
               elif [ "$arg" != curl ] && ! dpkg-query -W -f='${Status}' "$arg" 2>/dev/null | grep -q 'ok installed'
               then return 1
               else wanted="$wanted $arg"; fi ;;
        esac
    done
    [ "$command" = install ] && [ -n "$wanted" ] || return 1
    echo "furlong verifier toolchain (no network):$wanted: installed already, or curl answering uv's installer only" >&2
    exit 0
}

case $tool in
    curl|wget) uv_installer "$@" ;;
    apt-get|apt) [ "${FURLONG_OFFLINE:-}" = 1 ] && apt_nothing_to_fetch "$@" ;;
esac
image_own "$@"
"""

INSTALLER = r"""#!/bin/sh
# Handed out by furlong's verifier toolchain in place of uv's installer (astral.sh was not asked): uv
# VERSION is installed already; it is linked where the installer puts uv.
dir=${UV_INSTALL_DIR:-${XDG_BIN_HOME:-${HOME:?}/.local/bin}}
mkdir -p "$dir" || exit 1
for name in uv uvx; do
    [ "$(readlink "$dir/$name")" = "UV_BIN/$name" ] || ln -sf "UV_BIN/$name" "$dir/$name" || exit 1
done
[ -e "$dir/env" ] || printf '#!/bin/sh\ncase ":${PATH}:" in\n    *:"%s":*) ;;\n    *) export PATH="%s:$PATH" ;;\nesac\n' \
    "$dir" "$dir" > "$dir/env" || exit 1
echo "uv VERSION (furlong's verifier toolchain) is in $dir; astral.sh was not asked"
"""


def shim() -> str:
    return SHIM.replace("shims=DIR", f"shims={DIR}")


# What INSTALLER says of itself, does at test time (links to the toolchain's uv, which every sandbox stacks)
# and prints: copy_from (images.offline_uv, furlong/sandbox/images/offline_uv.py) swaps these lines, as a build
# step must leave real files in the image, not links to a mount gone after the build.
_LINES = INSTALLER.splitlines(keepends=True)
BUILD_TIME = (
    (
        "".join(_LINES[1:3]),
        (
            "# Handed out by furlong (images.offline_uv) in place of uv's installer in a build step: it\n"
            "# copies uv VERSION from furlong's verifier toolchain where the installer puts uv.\n"
        ),
    ),
    (next(ln for ln in _LINES if "ln -sf" in ln), '    rm -f "$dir/$name" && cp "FROM/$name" "$dir/$name" || exit 1\n'),
    (
        _LINES[-1],
        (
            "echo \"uv VERSION (furlong's verifier toolchain, images.offline_uv) copied to $dir in place of "
            "uv's installer; astral.sh was not asked\"\n"
        ),
    ),
)


def installer(uv_version: str, copy_from: str | None = None) -> str:
    """INSTALLER for uv `uv_version`; with `copy_from`, the build steps' one, copying uv and uvx from there."""
    text = INSTALLER
    for old, new in BUILD_TIME if copy_from is not None else ():
        text = text.replace(old, new.replace("FROM", copy_from or ""))  # never None here (the loop's guard)
    return text.replace("VERSION", uv_version).replace("UV_BIN", UV_BIN)
