/* furlong-owner: file ownership as Docker's root sees it, for the verifier's commands only.
 *
 * The verifier runs as root of a user namespace of its own where the agent's uid 0 (owner of the image's
 * files and of everything the agent made) appears as AGENT, 65533 (docs/sandboxes.md, "The verifier's own
 * identity"). Tools that trust only what root or their own uid owns (git's safe.directory, ssh's
 * StrictModes, sudo's check of /etc/sudoers, a database's data directory) would refuse all of it. The
 * init puts this library on LD_PRELOAD for verifier commands, and every stat-family call then reports
 * uid and gid AGENT as 0. Nothing else changes: the kernel still checks the real ids (the verifier's
 * capabilities cover the agent's files), chown(f, 0) still gives f to the verifier's own uid, and a
 * program that makes the system call itself (static or Go binaries, libuv) sees AGENT.
 *
 * Freestanding (no libc: raw system calls, errno through a weak __errno_location, unversioned symbols),
 * so one build loads into glibc processes of any version and into musl processes. On x86_64 and aarch64
 * the kernel's struct stat is the C libraries' own, so the buffer the kernel fills is the caller's.
 */
#include <asm/stat.h>
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/stat.h>

#include "shim_sys.h"

#define AGENT 65533u /* furlong.sandbox.runtime.idmap.VERIFIER_UID: the agent's root in the verifier's namespace */

static unsigned as_root(unsigned id) { return id == AGENT ? 0 : id; }

static int seen(long r, struct stat *st) {
  if (r < 0) return fail(r);
  st->st_uid = as_root(st->st_uid);
  st->st_gid = as_root(st->st_gid);
  return 0;
}

static int at(int fd, const char *path, struct stat *st, int flags) {
  return seen(sys5(__NR_newfstatat, fd, (long)path, (long)st, flags, 0), st);
}

static int of_fd(int fd, struct stat *st) { return seen(sys5(__NR_fstat, fd, (long)st, 0, 0, 0), st); }

API int fstatat(int fd, const char *path, struct stat *st, int flags) { return at(fd, path, st, flags); }
API int fstatat64(int fd, const char *path, struct stat *st, int flags) { return at(fd, path, st, flags); }
API int stat(const char *path, struct stat *st) { return at(AT_FDCWD, path, st, 0); }
API int stat64(const char *path, struct stat *st) { return at(AT_FDCWD, path, st, 0); }
API int lstat(const char *path, struct stat *st) { return at(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW); }
API int lstat64(const char *path, struct stat *st) { return at(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW); }
API int fstat(int fd, struct stat *st) { return of_fd(fd, st); }
API int fstat64(int fd, struct stat *st) { return of_fd(fd, st); }

/* glibc before 2.33: programs built against it call these (the version argument picks a layout that is
 * the kernel's on these architectures) */
API int __xstat(int ver, const char *path, struct stat *st) { (void)ver; return at(AT_FDCWD, path, st, 0); }
API int __xstat64(int ver, const char *path, struct stat *st) { (void)ver; return at(AT_FDCWD, path, st, 0); }
API int __lxstat(int ver, const char *path, struct stat *st) {
  (void)ver;
  return at(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW);
}
API int __lxstat64(int ver, const char *path, struct stat *st) {
  (void)ver;
  return at(AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW);
}
API int __fxstat(int ver, int fd, struct stat *st) { (void)ver; return of_fd(fd, st); }
API int __fxstat64(int ver, int fd, struct stat *st) { (void)ver; return of_fd(fd, st); }
API int __fxstatat(int ver, int fd, const char *path, struct stat *st, int flags) {
  (void)ver;
  return at(fd, path, st, flags);
}
API int __fxstatat64(int ver, int fd, const char *path, struct stat *st, int flags) {
  (void)ver;
  return at(fd, path, st, flags);
}

/* AddressSanitizer's shared runtime insists on being the first library loaded, and a preloaded one always
 * comes before it: its defaults are asked for here (a program's own definition, or ASAN_OPTIONS naming
 * verify_asan_link_order, still wins), so instrumented test programs run, with every check of theirs. */
API const char *__asan_default_options(void) { return "verify_asan_link_order=0"; }

API int statx(int fd, const char *path, int flags, unsigned mask, struct statx *sx) {
  long r = sys5(__NR_statx, fd, (long)path, flags, mask, (long)sx);
  if (r < 0) return fail(r);
  sx->stx_uid = as_root(sx->stx_uid);
  sx->stx_gid = as_root(sx->stx_gid);
  return 0;
}
