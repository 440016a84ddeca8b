"""What a tool call runs: the user's command inside bash, with the sandbox's shell state around it.

Commands run through bash with the shell state (cwd and exported variables) restored before and saved
after, so `cd` and `export` persist between tool calls as in a terminal, while each command still costs
only a fork+exec instead of a sandbox start. The init runs the script as given; all of this is built
here on the host.
"""

from __future__ import annotations

STATE_DIR = "/run/furlong-shell"


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def wrap(cmd: str, cwd: str | None, env: dict[str, str]) -> str:
    """With an explicit cwd the command runs there and leaves the saved state alone (verifier, builds)."""
    if cwd is not None:  # the request's env reaches the process directly
        return f"cd -- {shell_quote(cwd)} || exit 1\n" + cmd
    # One state file, sourced with a builtin: every fork and file here is paid on every tool call.
    restore = f"[ -f {STATE_DIR}/state ] && . {STATE_DIR}/state\n"
    # Variables passed with this request win over the saved shell state.
    overrides = "".join(f"export {k}={shell_quote(v)}\n" for k, v in env.items())
    save = f"{{ export -p; printf 'cd -- %q 2>/dev/null\\n' \"$PWD\"; }} > {STATE_DIR}/state 2>/dev/null"
    # Saved after the command, or from an EXIT trap for a command that ends the shell itself (`cd /srv &&
    # exit 3`, `set -e` and a failure); saving after the command also keeps the state of one that set an EXIT
    # trap of its own. __furlong_saved: the trap does not write the file a second time.
    # eval keeps a syntax error in the user's command from skipping the state save.
    on_exit = '__rc=$?; [ -n "${__furlong_saved-}" ] || ' + save + "; exit $__rc"
    trap = f"trap {shell_quote(on_exit)} EXIT\n"
    after = f"\n__rc=$?; {save}; __furlong_saved=1; exit $__rc"
    return restore + overrides + trap + "eval " + shell_quote(cmd) + after
