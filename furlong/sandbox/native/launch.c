/* furlong-launch: puts one sandbox's bwrap into its limits, then execs it.
 *
 * One small exec instead of sh + prlimit + setpriv, and the steps those could not do:
 *   --cgroup FILE      join a cgroup (write our pid to FILE), before anything else, so every process
 *                      the sandbox ever makes is born inside its limits (repeatable: v1 has one per controller)
 *   --oom-adj N        our oom_score_adj, inherited by bwrap and the sandbox's init (root can lower it,
 *                      which keeps the OOM killer on agent processes, which the init sets to 1000)
 *   --upper DIR SIZE   a private mount namespace with a tmpfs of SIZE bytes at DIR holding DIR/u and DIR/w:
 *                      the sandbox's writable layer, capped so a disk fill hits ENOSPC instead of the
 *                      memory limit (where it would take the init down with it). As non-root this first
 *                      enters a user namespace mapping only our own uid, which may mount a tmpfs.
 *   --uid N            as root: drop to uid/gid N (no supplementary groups) before exec
 *   --rlimit-as B / --rlimit-nproc N   rlimits, where no cgroup could be made
 *   -- ARGV...         what to exec (bwrap)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static void die(const char *what, const char *arg) {
  fprintf(stderr, "furlong-launch: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
  _exit(125);
}

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) die("open", path);
  ssize_t n = (ssize_t)strlen(text);
  if (write(fd, text, (size_t)n) != n) die("write", path);
  close(fd);
}

static void own_userns(void) {  /* non-root: a user namespace where only we exist, to mount a tmpfs */
  char map[64];
  uid_t uid = getuid();
  gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) die("unshare", "user+mount namespace");
  write_file("/proc/self/setgroups", "deny");
  snprintf(map, sizeof map, "%u %u 1\n", uid, uid);
  write_file("/proc/self/uid_map", map);
  snprintf(map, sizeof map, "%u %u 1\n", gid, gid);
  write_file("/proc/self/gid_map", map);
}

static void mount_upper(const char *dir, const char *size, long uid) {
  char opts[128], path[4096];
  if (geteuid() == 0 && getuid() == 0) {
    if (unshare(CLONE_NEWNS) < 0) die("unshare", "mount namespace");
  } else {
    own_userns();
  }
  /* our mounts must not propagate back to the host, and vanish with the last process that sees them */
  if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) die("make-rslave", "/");
  snprintf(opts, sizeof opts, "size=%s,mode=0755", size);
  if (mount("furlong-upper", dir, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) die("mount tmpfs on", dir);
  for (const char *sub = "u"; sub; sub = sub[0] == 'u' ? "w" : NULL) {
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    if (mkdir(path, 0755) < 0) die("mkdir", path);
    if (uid >= 0 && chown(path, (uid_t)uid, (gid_t)uid) < 0) die("chown", path);
  }
}

static void set_limit(int resource, const char *value) {
  struct rlimit rl;
  rl.rlim_cur = rl.rlim_max = strtoull(value, NULL, 10);
  if (setrlimit(resource, &rl) < 0) die("setrlimit", value);
}

int main(int argc, char **argv) {
  long uid = -1;
  int i = 1;
  for (; i < argc && strcmp(argv[i], "--"); i++) {
    const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (!val) { errno = EINVAL; die("missing value for", opt); }
    if (!strcmp(opt, "--cgroup")) {
      char pid[32];
      snprintf(pid, sizeof pid, "%d", getpid());
      write_file(val, pid);
    } else if (!strcmp(opt, "--oom-adj")) {  /* best effort: lowering needs CAP_SYS_RESOURCE */
      int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
      if (fd >= 0) { if (write(fd, val, strlen(val)) < 0) { /* agents still go first at 1000 */ } close(fd); }
    } else if (!strcmp(opt, "--upper")) {
      if (i + 2 >= argc) { errno = EINVAL; die("--upper takes DIR SIZE", NULL); }
      mount_upper(val, argv[i + 2], uid);
      i++;
    } else if (!strcmp(opt, "--uid")) {
      uid = strtol(val, NULL, 10);
    } else if (!strcmp(opt, "--rlimit-as")) {
      set_limit(RLIMIT_AS, val);
    } else if (!strcmp(opt, "--rlimit-nproc")) {
      set_limit(RLIMIT_NPROC, val);
    } else {
      errno = EINVAL;
      die("unknown option", opt);
    }
    i++;
  }
  if (i + 1 >= argc) { errno = EINVAL; die("nothing to exec after --", NULL); }
  if (uid >= 0 && geteuid() == 0) {
    if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
      die("drop to uid", argv[i] ? NULL : NULL);
  }
  execv(argv[i + 1], argv + i + 1);
  die("exec", argv[i + 1]);
}
