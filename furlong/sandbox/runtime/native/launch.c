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
 *   --subids U G N     a user namespace of our own mapping 0 to our uid/gid (N's, as root) and 1..N to the
 *                      subordinate ranges starting at host uid U / gid G, entered before --upper's mount
 *                      (which it then owns), so bwrap runs in it as root and the sandbox has many uids: the
 *                      verifier's apart from the agent's. A forked helper writes the maps, since the
 *                      process that unshares cannot: directly as root, through newuidmap/newgidmap (setuid
 *                      helpers that check /etc/subuid and /etc/subgid) as an ordinary user.
 *   --verifier-ns FD V with --subids: a second user namespace, owned by uid V of the first, where V is
 *                      root and the first's root (the agent, owner of the image's files) is V: the swap
 *                      gives the verifier root's powers over every file (dpkg, apt and the tests run as
 *                      uid 0, as in Docker) while its processes stay a uid the agent cannot signal or trace,
 *                      and the agent holds no capability over the namespace. Put at FD (which the host
 *                      reserved) for the init, which enters it for each verifier command.
 *   --ipc              a new IPC namespace for the sandbox (bwrap then makes none), its SysV limits set
 *                      here, where /proc/sys is still writable (bwrap mounts it read-only): shm_rmid_forced,
 *                      so a shared memory segment goes as soon as no process has it attached, and memory it
 *                      held is memory the OOM killer frees by killing the agent's processes (the verifier's
 *                      share); and caps on semaphores and message queues, kernel memory no kill frees (IPC_LIMITS)
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
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

static void mount_upper(const char *dir, const char *size, long uid, int in_userns) {
  char opts[128], path[4096];
  if (in_userns) {
    /* already in a user + mount namespace of our own (--subids) */
  } else if (geteuid() == 0 && getuid() == 0) {
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

/* What an agent may hold in SysV semaphores and message queues, which outlive every process: about 2 MiB of
 * semaphores (32000 at 64 bytes) and 16 queues of at most 16384 messages (kmalloc-64 each): 16 MiB. */
static const char *const IPC_LIMITS[][2] = {
  {"/proc/sys/kernel/shm_rmid_forced", "1"},
  {"/proc/sys/kernel/sem", "32000 32000 500 1024"},  /* SEMMSL SEMMNS SEMOPM SEMMNI */
  {"/proc/sys/kernel/msgmni", "16"},
};

/* The sysctls of an IPC namespace are its own, and whoever made it (root of its user namespace) sets them. */
static void own_ipc(int in_userns) {
  if (!in_userns && geteuid() != 0) own_userns();
  if (unshare(CLONE_NEWIPC) < 0) die("unshare", "ipc namespace");
  for (size_t k = 0; k < sizeof IPC_LIMITS / sizeof IPC_LIMITS[0]; k++) write_file(IPC_LIMITS[k][0], IPC_LIMITS[k][1]);
}

static void set_limit(int resource, const char *value) {
  struct rlimit rl;
  rl.rlim_cur = rl.rlim_max = strtoull(value, NULL, 10);
  if (setrlimit(resource, &rl) < 0) die("setrlimit", value);
}

static void drop_to(long uid) {
  if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
      setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
    die("drop to uid", NULL);
}

static int run_map_tool(const char *tool, pid_t pid, unsigned long id, const char *start, const char *count) {
  char spid[32], sid[32];
  snprintf(spid, sizeof spid, "%d", (int)pid);
  snprintf(sid, sizeof sid, "%lu", id);
  pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    execlp(tool, tool, spid, "0", sid, "1", "1", start, count, (char *)NULL);
    fprintf(stderr, "furlong-launch: exec %s: %s (apt-get install uidmap)\n", tool, strerror(errno));
    _exit(127);
  }
  int status;
  if (waitpid(child, &status, 0) < 0) return -1;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

static int write_map(pid_t pid, const char *kind, unsigned long id, const char *start, const char *count) {
  char path[64], map[160];
  snprintf(path, sizeof path, "/proc/%d/%s_map", (int)pid, kind);
  int n = snprintf(map, sizeof map, "0 %lu 1\n1 %s %s\n", id, start, count);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int ok = write(fd, map, (size_t)n) == n;
  close(fd);
  return ok ? 0 : -1;
}

/* Enters a new user + mount namespace whose uid/gid maps a forked helper writes (see --subids). */
static void mapped_userns(long as_uid, const char *ustart, const char *gstart, const char *count) {
  int go[2];
  char c = 0;
  pid_t self = getpid();
  int root = geteuid() == 0;
  unsigned long uid = root ? (unsigned long)as_uid : getuid(), gid = root ? (unsigned long)as_uid : getgid();
  if (pipe2(go, O_CLOEXEC) < 0) die("pipe", NULL);
  pid_t helper = fork();
  if (helper < 0) die("fork", NULL);
  if (helper == 0) {  /* still in the caller's namespaces, and as root still root */
    close(go[1]);
    if (read(go[0], &c, 1) != 1) _exit(1);
    int r = root ? write_map(self, "uid", uid, ustart, count) | write_map(self, "gid", gid, gstart, count)
                 : run_map_tool("newuidmap", self, uid, ustart, count) | run_map_tool("newgidmap", self, gid, gstart, count);
    _exit(r ? 1 : 0);
  }
  close(go[0]);
  if (root) drop_to(as_uid);  /* the namespace's owner, and its root, is the sandbox uid */
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) die("unshare", "user+mount namespace");
  if (write(go[1], &c, 1) != 1) die("signal the id-map helper", NULL);
  close(go[1]);
  int status;
  if (waitpid(helper, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    errno = EPERM;
    die("mapping the sandbox's uids and gids", root ? NULL : "(newuidmap/newgidmap and /etc/subuid, /etc/subgid)");
  }
  if (setgroups(0, NULL) < 0) die("setgroups", NULL);
}

/* As root of the sandbox's user namespace: the verifier's namespace (see --verifier-ns), at fd `at`. */
static void verifier_userns(int at, long v, long count) {
  int go[2], ready[2];
  char c = 0, map[256], path[64];
  if (pipe2(go, O_CLOEXEC) < 0 || pipe2(ready, O_CLOEXEC) < 0) die("pipe", NULL);
  pid_t child = fork();
  if (child < 0) die("fork", NULL);
  if (child == 0) {  /* the namespace's owner: uid v, so the agent (uid 0, no capability) has no say in it */
    close(go[1]), close(ready[0]);
    if (setresgid((gid_t)v, (gid_t)v, (gid_t)v) < 0 || setresuid((uid_t)v, (uid_t)v, (uid_t)v) < 0) _exit(1);
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);  /* a uid change cleared it: the parent must open our /proc files */
    if (unshare(CLONE_NEWUSER) < 0) _exit(2);
    if (write(ready[1], &c, 1) != 1) _exit(3);
    if (read(go[0], &c, 1) < 0) _exit(4);  /* until the maps are written and the fd taken: EOF */
    _exit(0);
  }
  close(go[0]), close(ready[1]);
  if (read(ready[0], &c, 1) != 1) { errno = ECHILD; die("making the verifier's user namespace", NULL); }
  close(ready[0]);
  int n = snprintf(map, sizeof map, "0 %ld 1\n%ld 0 1\n1 1 %ld\n", v, v, v - 1);
  if (v < count) n += snprintf(map + n, sizeof map - (size_t)n, "%ld %ld %ld\n", v + 1, v + 1, count - v);
  for (const char *kind = "uid"; kind; kind = kind[0] == 'u' ? "gid" : NULL) {
    snprintf(path, sizeof path, "/proc/%d/%s_map", (int)child, kind);
    write_file(path, map);
  }
  snprintf(path, sizeof path, "/proc/%d/ns/user", (int)child);
  int fd = open(path, O_RDONLY);
  if (fd < 0) die("open", path);
  if (dup2(fd, at) < 0) die("dup2", "verifier namespace");
  if (fd != at) close(fd);
  close(go[1]);
  int status;
  waitpid(child, &status, 0);
}

int main(int argc, char **argv) {
  long uid = -1, vns_fd = -1, vns_uid = -1;
  const char *upper = NULL, *upper_size = NULL, *sub[3] = {NULL, NULL, NULL};
  int i = 1, ipc = 0;
  for (; i < argc && strcmp(argv[i], "--"); i++) {
    const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(opt, "--ipc")) { ipc = 1; continue; }  /* the one option without a value */
    if (!val) { errno = EINVAL; die("missing value for", opt); }
    if (!strcmp(opt, "--cgroup")) {  /* at once: every later step, and every process, is inside */
      char pid[32];
      snprintf(pid, sizeof pid, "%d", getpid());
      write_file(val, pid);
    } else if (!strcmp(opt, "--oom-adj")) {  /* best effort: lowering needs CAP_SYS_RESOURCE */
      int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
      if (fd >= 0) { if (write(fd, val, strlen(val)) < 0) { /* agents still go first at 1000 */ } close(fd); }
    } else if (!strcmp(opt, "--upper")) {
      if (i + 2 >= argc) { errno = EINVAL; die("--upper takes DIR SIZE", NULL); }
      upper = val, upper_size = argv[i + 2];
      i++;
    } else if (!strcmp(opt, "--subids")) {
      if (i + 3 >= argc) { errno = EINVAL; die("--subids takes UID_START GID_START COUNT", NULL); }
      sub[0] = val, sub[1] = argv[i + 2], sub[2] = argv[i + 3];
      i += 2;
    } else if (!strcmp(opt, "--verifier-ns")) {
      if (i + 2 >= argc) { errno = EINVAL; die("--verifier-ns takes FD UID", NULL); }
      vns_fd = strtol(val, NULL, 10), vns_uid = strtol(argv[i + 2], NULL, 10);
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
  if (sub[0]) {
    if (geteuid() == 0 && uid < 0) { errno = EINVAL; die("--subids as root needs --uid", NULL); }
    mapped_userns(uid, sub[0], sub[1], sub[2]);
    if (vns_fd >= 0) verifier_userns((int)vns_fd, vns_uid, strtol(sub[2], NULL, 10));
    if (upper) mount_upper(upper, upper_size, -1, 1);
    if (ipc) own_ipc(1);
  } else {
    if (upper) mount_upper(upper, upper_size, uid, 0);
    if (ipc) own_ipc(upper && geteuid() != 0);  /* as a user, --upper's mount entered a namespace of ours */
    if (uid >= 0 && geteuid() == 0) drop_to(uid);
  }
  execv(argv[i + 1], argv + i + 1);
  die("exec", argv[i + 1]);
}
