/* furlong-statx: statx() without AT_NO_AUTOMOUNT, preloaded in gVisor sandboxes (sandbox.backend=gvisor).
 *
 * gVisor's runsc of Debian 12 (0.0~20221219) refuses statx with AT_NO_AUTOMOUNT (EINVAL), which coreutils 9
 * (`ls -l`, `stat`, `cp -a`) always passes: every such command fails with "Invalid argument". Nothing
 * automounts inside a sandbox, so the flag changes nothing there; this drops it. A program that makes the
 * system call itself (static or Go binaries) still meets the refusal (docs/sandboxes.md, gvisor).
 */
#include <asm/unistd.h>
#include <linux/fcntl.h>

#include "shim_sys.h"

struct statx;

API int statx(int fd, const char *path, int flags, unsigned mask, struct statx *sx) {
  long r = sys5(__NR_statx, fd, (long)path, flags & ~AT_NO_AUTOMOUNT, mask, (long)sx);
  return r < 0 ? fail(r) : 0;
}
