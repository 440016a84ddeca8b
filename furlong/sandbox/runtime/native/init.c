/* furlong-init: the first process (pid 1) of every sandbox.
 *
 * Why compiled: it starts in well under a millisecond, depends on nothing in the image (static, no
 * interpreter), and closes the host's file descriptors before any code the image controls can run.
 * Why pid 1: the kernel drops SIGKILL/SIGSTOP (and every signal without a handler) sent to a pid
 * namespace's init from inside the namespace, so `kill -9 -1` or `kill -STOP 1` cannot stop it.
 * It is non-dumpable, so agent processes (same uid, no capabilities) can neither ptrace it nor open
 * /proc/1/fd or /proc/1/mem.
 *
 * Identities (argv, from the host): `--agent UID:GID` runs agent commands as that uid with no
 * capabilities at all (bounding set emptied, no_new_privs), or, with `--build-caps 1` (a build's RUN
 * steps, never an agent's), with BUILD_CAPS in the sandbox's user namespace, and moves each into the agent cgroup
 * (`--agent-procs FD`, repeatable: cgroup.procs files the host opened) whose pids limit leaves the init
 * and the verifier room; `--verifier UID` hands that uid the /tests and /logs mounts the host made, and
 * runs verifier commands as it: inside the namespace at `--verifier-ns FD` (furlong-launch made it: there
 * UID is root and the agent's uid 0 is UID) as root with VERIFIER_CAPS, so the tests install packages and
 * read everything as root would in Docker, while agent processes cannot write, signal or trace any of it.
 * `--verifier-preload PATH` (the ownership shim, owner.c, at a path the agent cannot touch) goes on the
 * LD_PRELOAD of verifier commands there, so the agent's uid, 65533 in that namespace, shows as root's.
 * `--seccomp FD` is the compiled filter every command gets, applied here after the identity is taken
 * (setns is one of the calls it refuses). The init keeps only the capabilities it needs (bwrap's
 * --cap-add list) and is non-dumpable.
 *
 * Protocol (stdin: requests, stdout: replies), every frame is u32 little-endian length + payload.
 *   handshake: the host's first 32 bytes on stdin are the per-sandbox secret.
 *   request:   id[16] op[1] role[1] body   (role 0: as the agent, 1: as the verifier)
 *   reply:     secret[32] id[16] status[1] (0 ok, 1 error: body is the message, 2 chunk) body
 * Ops (body layouts; "str" is u32 length + bytes):
 *   EXEC  u32 timeout_ms, u32 cap, str script, str env ("K=V\0K=V\0..." overriding the init's env)
 *         -> i32 exit_code, u8 timed_out, u8 truncated, u64 duration_ns, str stdout, str stderr
 *   EXEC_STREAM  as EXEC, and while the command runs, chunk replies (status 2) come before its final one:
 *         u8 stream (0 stdout, 1 stderr), then at least one byte, as one read() returned them; at most `cap`
 *         bytes per stream in all (the final reply still carries the capped output), none after the final
 *   READ  str path -> the file's bytes (regular files only, at most READ_MAX)
 *   PUT   entries of: u8 kind (0 dir, 1 file, 2 symlink), u32 mode, str path, str data-or-target
 *   PING  -> u32 pid
 * Requests run concurrently: EXEC returns when its command exits (or is killed at its timeout);
 * output of background processes it left behind is drained and dropped so they never block.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/fsuid.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SECRET_LEN 32
#define ID_LEN 16
#define FRAME_MAX (512u << 20)
#define READ_MAX (256u << 20)
#define MAX_JOBS 1024
#define DRAIN_MAX 4096
#define MARKER "\n[... furlong: %llu bytes truncated ...]\n"

enum { OP_EXEC = 1, OP_READ = 2, OP_PUT = 3, OP_PING = 4, OP_EXEC_STREAM = 5 };
enum { STATUS_OK = 0, STATUS_ERROR = 1, STATUS_CHUNK = 2 };
enum { ROLE_AGENT = 0, ROLE_VERIFIER = 1 };
#define CAPBIT(c) (1ull << (c))
/* What the tests get, as root would have them for installing and checking: never ptrace, mounts, admin. */
#define VERIFIER_CAPS (CAPBIT(CAP_CHOWN) | CAPBIT(CAP_DAC_OVERRIDE) | CAPBIT(CAP_DAC_READ_SEARCH) | \
  CAPBIT(CAP_FOWNER) | CAPBIT(CAP_FSETID) | CAPBIT(CAP_KILL) | CAPBIT(CAP_SETGID) | CAPBIT(CAP_SETUID) | \
  CAPBIT(CAP_NET_BIND_SERVICE))
/* A build's RUN steps, as Docker's RUN has them: useradd, chown to the image's other uids, files of theirs.
 * Only ever capabilities over the sandbox's own user namespace, whose ids are the subordinate range. */
#define BUILD_CAPS (CAPBIT(CAP_CHOWN) | CAPBIT(CAP_DAC_OVERRIDE) | CAPBIT(CAP_FOWNER) | CAPBIT(CAP_FSETID) | \
  CAPBIT(CAP_SETGID) | CAPBIT(CAP_SETUID))
#define MAX_AGENT_PROCS 8

typedef struct { unsigned char *p; size_t len, cap; } buf_t;

typedef struct {  /* keeps the first and last half of a stream, counting what fell in between */
  size_t half, total;
  buf_t head;
  unsigned char *ring;  /* the last `half` bytes, circular */
  size_t ring_pos, ring_len;
} capped_t;

typedef struct {
  unsigned char id[ID_LEN];
  pid_t pid;
  int fds[2];
  capped_t out[2];
  int stream;  /* EXEC_STREAM: send chunks while it runs, until `cap` bytes of a stream were sent */
  size_t cap, streamed[2];
  uint64_t start_ns, deadline_ns;
  int timed_out, exited, status;
} job_t;

static unsigned char secret[SECRET_LEN];
static job_t *jobs[MAX_JOBS];
static int drains[DRAIN_MAX];
static int epfd, sigfd;
static char **base_env;
static long agent_uid = 0, agent_gid = 0, verifier_uid = -1, init_uid = -1;
static int build_caps = 0;  /* --build-caps 1: agent commands are a build's RUN steps (BUILD_CAPS) */
static uid_t init_fsuid = 0;  /* the init's file uid between ops done as a role */
/* A kernel without setfsuid (gVisor's runsc 2022): a role's file ops take its ids as the init's effective ids
 * instead (its real and saved uid stay the init's, so no agent process can signal it meanwhile), with
 * PR_SET_KEEPCAPS kept on so the switch back keeps the init's permitted capabilities. */
static int no_setfsuid = 0;
static int keep_shell_state = 0;  /* a sandbox restored from a snapshot keeps the shell state it carries */
static int parent_fd = -1;  /* the read end of bwrap's status pipe, which only bwrap's monitor keeps open */
static int agent_procs[MAX_AGENT_PROCS], n_agent_procs, verifier_ns = -1, seccomp_fd = -1;
#define MAX_AGENT_GROUPS 64
static gid_t agent_groups[MAX_AGENT_GROUPS];  /* the image USER's supplementary groups */
static int n_agent_groups;
static struct sock_fprog seccomp_prog;
static const char *verifier_preload;  /* --verifier-preload: the ownership shim's path (see with_shim) */
static uint64_t own_caps;  /* the init's permitted set, restored after an op done as a role */

static void die(const char *what) { fprintf(stderr, "furlong-init: %s: %s\n", what, strerror(errno)); _exit(111); }

/* close_range(from, to), or each fd up to the fd limit where the kernel refuses it: gVisor (runsc 2022)
 * answers EINVAL for a `to` past INT_MAX, and older kernels have no close_range at all. */
static int close_fds(unsigned int from, unsigned int to) {
  if (close_range(from, to, 0) == 0) return 0;
  if (errno == EINVAL && to > INT32_MAX && close_range(from, INT32_MAX, 0) == 0) return 0;
  if (errno != EINVAL && errno != ENOSYS) return -1;
  struct rlimit lim;
  unsigned int top = getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_max < (1u << 20) ? (unsigned int)lim.rlim_max : 1u << 20;
  for (unsigned int fd = from; fd <= to && fd < top; fd++) close((int)fd);
  return 0;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void buf_put(buf_t *b, const void *data, size_t n) {
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p) die("realloc");
    b->cap = cap;
  }
  memcpy(b->p + b->len, data, n);
  b->len += n;
}
static void buf_u32(buf_t *b, uint32_t v) { buf_put(b, &v, 4); }

/* ---- output ---------------------------------------------------------------------------------- */

static void write_all(int fd, const void *data, size_t n) {
  const unsigned char *p = data;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) _exit(0);  /* the host is gone: so is the sandbox */
    p += w, n -= (size_t)w;
  }
}

static void reply_head(const unsigned char *id, int status, size_t n) {  /* n: the body's length */
  uint32_t len = (uint32_t)(SECRET_LEN + ID_LEN + 1 + n);
  unsigned char hdr[4 + SECRET_LEN + ID_LEN + 1];
  memcpy(hdr, &len, 4);
  memcpy(hdr + 4, secret, SECRET_LEN);
  memcpy(hdr + 4 + SECRET_LEN, id, ID_LEN);
  hdr[4 + SECRET_LEN + ID_LEN] = (unsigned char)status;
  write_all(1, hdr, sizeof hdr);
}

static void reply(const unsigned char *id, int status, const void *body, size_t n) {
  reply_head(id, status, n);
  if (n) write_all(1, body, n);
}

static void reply_chunk(const unsigned char *id, int stream, const void *data, size_t n) {
  unsigned char s = (unsigned char)stream;
  reply_head(id, STATUS_CHUNK, 1 + n);
  write_all(1, &s, 1);
  write_all(1, data, n);
}

static void reply_error(const unsigned char *id, const char *what, int err) {
  char msg[512];
  int n = snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
  reply(id, STATUS_ERROR, msg, (size_t)(n < 0 ? 0 : n >= (int)sizeof msg ? (int)sizeof msg - 1 : n));
}

/* ---- capped buffers --------------------------------------------------------------------------- */

static void capped_add(capped_t *c, const unsigned char *data, size_t n) {
  c->total += n;
  size_t room = c->half > c->head.len ? c->half - c->head.len : 0;
  size_t take = n < room ? n : room;
  buf_put(&c->head, data, take);
  data += take, n -= take;
  if (n > c->half) data += n - c->half, n = c->half;  /* only the last `half` bytes can survive */
  while (n) {  /* append at the ring's end, overwriting its oldest bytes when full */
    size_t end = (c->ring_pos + c->ring_len) % c->half;
    size_t run = c->half - end < n ? c->half - end : n;
    memcpy(c->ring + end, data, run);
    data += run, n -= run;
    size_t grow = c->half - c->ring_len < run ? c->half - c->ring_len : run;
    c->ring_len += grow;
    c->ring_pos = (c->ring_pos + (run - grow)) % c->half;
  }
}

static int capped_emit(capped_t *c, buf_t *out) {  /* str field; returns 1 when bytes were dropped */
  unsigned long long dropped = c->total - c->head.len - c->ring_len;
  char marker[96];
  int m = dropped ? snprintf(marker, sizeof marker, MARKER, dropped) : 0;
  buf_u32(out, (uint32_t)(c->head.len + (size_t)m + c->ring_len));
  buf_put(out, c->head.p, c->head.len);
  buf_put(out, marker, (size_t)m);
  size_t first = c->half - c->ring_pos < c->ring_len ? c->half - c->ring_pos : c->ring_len;
  buf_put(out, c->ring + c->ring_pos, first);
  buf_put(out, c->ring, c->ring_len - first);
  return dropped > 0;
}

static void capped_init(capped_t *c, size_t cap) {
  memset(c, 0, sizeof *c);
  c->half = cap / 2 ? cap / 2 : 1;
  c->ring = malloc(c->half);
  if (!c->ring) die("malloc");
}

static void capped_free(capped_t *c) { free(c->head.p); free(c->ring); }

/* ---- requests ------------------------------------------------------------------------------- */

typedef struct { const unsigned char *p; size_t left; int bad; } cursor_t;

static uint32_t take_u32(cursor_t *c) {
  uint32_t v = 0;
  if (c->left < 4) { c->bad = 1; return 0; }
  memcpy(&v, c->p, 4);
  c->p += 4, c->left -= 4;
  return v;
}

static const unsigned char *take_str(cursor_t *c, uint32_t *n) {
  *n = take_u32(c);
  if (c->bad || c->left < *n) { c->bad = 1; *n = 0; return NULL; }
  const unsigned char *s = c->p;
  c->p += *n, c->left -= *n;
  return s;
}

static char *cstr(const unsigned char *s, uint32_t n) {  /* a NUL-terminated copy; NUL inside: NULL */
  if (memchr(s, 0, n)) return NULL;
  char *out = malloc(n + 1);
  if (!out) die("malloc");
  memcpy(out, s, n);
  out[n] = 0;
  return out;
}

static char **make_env(const unsigned char *blob, uint32_t n) {
  size_t count = 0, extra = 0;
  while (base_env[count]) count++;
  for (uint32_t i = 0; i < n; i++) extra += blob[i] == 0;
  char **env = calloc(count + extra + 1, sizeof *env);
  if (!env) die("calloc");
  memcpy(env, base_env, count * sizeof *env);
  for (const unsigned char *p = blob, *end = blob + n; p < end;) {
    const char *kv = (const char *)p;
    size_t len = strnlen(kv, (size_t)(end - p));
    const char *eq = memchr(kv, '=', len);
    p += len + 1;
    if (!eq || eq == kv) continue;
    size_t key = (size_t)(eq - kv), i = 0;
    for (; i < count; i++)
      if (!strncmp(env[i], kv, key + 1)) break;
    env[i] = (char *)kv;  /* the blob outlives the fork that uses it */
    if (i == count) count++;
  }
  return env;
}

/* ---- identities ------------------------------------------------------------------------------ */

static int set_caps(uint64_t eff, uint64_t perm, uint64_t inh) {
  struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct d[2] = {{(uint32_t)eff, (uint32_t)perm, (uint32_t)inh},
                                        {(uint32_t)(eff >> 32), (uint32_t)(perm >> 32), (uint32_t)(inh >> 32)}};
  return (int)syscall(SYS_capset, &h, d);
}

static uint64_t get_permitted(void) {
  struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct d[2];
  if (syscall(SYS_capget, &h, d) < 0) die("capget");
  return (uint64_t)d[0].permitted | ((uint64_t)d[1].permitted << 32);
}

static int is_verifier(int role) { return role == ROLE_VERIFIER && verifier_uid >= 0; }

static int apply_seccomp(void) {
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
  return seccomp_prog.len ? prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &seccomp_prog, 0, 0) : 0;
}

static void load_seccomp(void) {  /* the whole program, read once: an array of struct sock_filter */
  buf_t b = {0};
  unsigned char chunk[4096];
  ssize_t r;
  while ((r = read(seccomp_fd, chunk, sizeof chunk)) > 0) buf_put(&b, chunk, (size_t)r);
  if (r < 0 || b.len == 0 || b.len % sizeof(struct sock_filter) || b.len / sizeof(struct sock_filter) > 0xffff) {
    errno = EINVAL;
    die("seccomp program");
  }
  seccomp_prog.len = (unsigned short)(b.len / sizeof(struct sock_filter));
  seccomp_prog.filter = (struct sock_filter *)b.p;
  close(seccomp_fd);
  seccomp_fd = -1;
}

/* In a command's child, before exec: who it runs as, with which capabilities, in which cgroup. */
static int become(int role) {
  int verifier = is_verifier(role);
  uint64_t keep = verifier ? VERIFIER_CAPS & own_caps : build_caps ? BUILD_CAPS & own_caps : 0;
  uid_t uid = verifier ? (uid_t)verifier_uid : (uid_t)agent_uid;
  gid_t gid = verifier ? (gid_t)verifier_uid : (gid_t)agent_gid;
  if (verifier && verifier_ns >= 0) {  /* root there (full capabilities in it), trimmed to `keep` below */
    if (setns(verifier_ns, CLONE_NEWUSER) < 0) return -1;
    uid = 0, gid = 0, keep = VERIFIER_CAPS;
  }
  /* The kernel lets the host's fd move a process whose uid is the opener's (an ordinary user's furlong):
   * the sandbox's root, not the init's uid. This child is the agent's command already, so it is the agent's. */
  if (!verifier && init_uid >= 0 && n_agent_procs && setresuid(0, 0, 0) < 0) return -1;
  if (!verifier)
    for (int i = 0; i < n_agent_procs; i++)
      if (write(agent_procs[i], "0", 1) != 1) return -1;  /* fail closed: never outside the agent's limits */
  if (!own_caps) return apply_seccomp();  /* one uid, no capabilities (bwrap's own user namespace) */
  for (int cap = 0; cap < 64; cap++)
    if (!(keep & CAPBIT(cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) return -1;
  /* EINVAL: a kernel without ambient capabilities (gVisor's runsc 2022), so there are none to clear */
  if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) return -1;
  if (prctl(PR_SET_KEEPCAPS, keep != 0, 0, 0, 0) < 0) return -1;
  int ngroups = verifier ? 0 : n_agent_groups;
  if (setgroups((size_t)ngroups, agent_groups) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
    return -1;
  if (set_caps(keep, keep, keep) < 0) return -1;
  for (int cap = 0; cap < 64; cap++)
    if (uid != 0 && (keep & CAPBIT(cap)) && prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) < 0) return -1;
  return apply_seccomp();
}

/* File ops of a request done with the role's file ids and no capability, then back to the init's. */
static void fs_as(int role) {
  if (!own_caps) return;
  uid_t uid = is_verifier(role) ? (uid_t)verifier_uid : (uid_t)agent_uid;
  gid_t gid = is_verifier(role) ? (gid_t)verifier_uid : (gid_t)agent_gid;
  if (no_setfsuid) {
    if (setresgid((gid_t)-1, gid, (gid_t)-1) < 0 || setresuid((uid_t)-1, uid, (uid_t)-1) < 0) die("file ids");
  } else {
    setfsgid(gid);
    setfsuid(uid);
  }
  if (set_caps(0, own_caps, 0) < 0) die("capset");
}

static void fs_restore(void) {
  if (!own_caps) return;
  if (no_setfsuid) {
    if (setresuid((uid_t)-1, init_fsuid, (uid_t)-1) < 0 || setresgid((gid_t)-1, 0, (gid_t)-1) < 0) die("file ids");
  } else {
    setfsuid(init_fsuid);
    setfsgid(0);
  }
  if (set_caps(own_caps, own_caps, 0) < 0) die("capset");
}

/* A command's child: its own session, stdio on its pipes, the role's identity (or exit 126 saying why). */
static void child_prepare(int out, int err, int role) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  signal(SIGPIPE, SIG_DFL);
  setsid();  /* its own process group: a timeout kills the whole group */
  int fd = open("/proc/self/oom_score_adj", O_WRONLY);
  if (fd >= 0) { write_all(fd, "1000", 4); close(fd); }  /* the OOM killer picks agents, never init */
  int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null < 0 || dup2(null, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) _exit(126);
  if (become(role) < 0) {
    char msg[160];
    int n = snprintf(msg, sizeof msg, "furlong-init: cannot take the command's identity: %s\n", strerror(errno));
    if (n > 0 && write(2, msg, (size_t)n) < 0) { /* nothing more to say */ }
    _exit(126);
  }
}

/* A verifier command's environment with the ownership shim (owner.c) last on LD_PRELOAD, after any the
 * request or the image names (theirs keep precedence). Only where the verifier's namespace swaps the
 * agent's uid with its own. In the command's child: what it allocates goes with the exec. */
static char **with_shim(char **env) {
  size_t n = 0, at = (size_t)-1;
  for (; env[n]; n++)
    if (at == (size_t)-1 && !strncmp(env[n], "LD_PRELOAD=", 11)) at = n;
  const char *old = at == (size_t)-1 ? "" : env[at] + 11;
  size_t len = 11 + strlen(old) + 1 + strlen(verifier_preload) + 1;
  char *kv = malloc(len), **out = calloc(n + 2, sizeof *out);
  if (!kv || !out) _exit(126);
  snprintf(kv, len, "LD_PRELOAD=%s%s%s", old, *old ? ":" : "", verifier_preload);
  memcpy(out, env, n * sizeof *out);
  out[at == (size_t)-1 ? n : at] = kv;
  return out;
}

static void child_exec(const char *script, char **env, int out, int err, int role) {
  child_prepare(out, err, role);
  if (is_verifier(role) && verifier_ns >= 0 && verifier_preload) env = with_shim(env);
  char *argv[] = {"bash", "-c", (char *)script, NULL};
  execve("/bin/bash", argv, env);
  _exit(127);
}

/* ---- the waiting agent child ------------------------------------------------------------------
 * An agent command moves into the agent's cgroup, and on cgroup v1 the first move after a quiet spell
 * waits out an RCU grace period (about 7 ms, on the command's path). So one agent child is forked ahead,
 * moved and given the agent's identity while nothing waits for it (the first with the init's own start,
 * right after the launcher's moves, when a move is cheap), and it waits on a pipe for its command. */
typedef struct { pid_t pid; int out, err, ctl; } zygote_t;
static zygote_t zygote = {-1, -1, -1, -1};
#define ZYGOTE_REQUEST_MAX 65536u  /* a request that fits the pipe at once: the init never blocks on it */

static void zygote_main(int out, int err, int ctl) {
  child_prepare(out, err, ROLE_AGENT);
  if (dup2(ctl, 3) < 0 || close_fds(4, ~0u) < 0) _exit(126);  /* nothing of the init's stays open */
  buf_t b = {0};
  unsigned char chunk[4096];
  ssize_t r;
  while ((r = read(3, chunk, sizeof chunk)) > 0 || (r < 0 && errno == EINTR))
    if (r > 0) buf_put(&b, chunk, (size_t)r);
  uint32_t n;
  if (b.len < 4 || (memcpy(&n, b.p, 4), n > b.len - 4)) _exit(0);  /* the init never sent a command */
  char *script = cstr(b.p + 4, n);
  char **env = make_env(b.p + 4 + n, (uint32_t)(b.len - 4 - n));
  if (!script) _exit(126);
  close(3);
  char *argv[] = {"bash", "-c", script, NULL};
  execve("/bin/bash", argv, env);
  _exit(127);
}

static void zygote_start(void) {
  if (!n_agent_procs || zygote.pid > 0) return;
  int out[2], err[2], ctl[2];
  if (pipe2(out, O_CLOEXEC) < 0) return;
  if (pipe2(err, O_CLOEXEC) < 0) { close(out[0]), close(out[1]); return; }
  if (pipe2(ctl, O_CLOEXEC) < 0) { close(out[0]), close(out[1]), close(err[0]), close(err[1]); return; }
  pid_t pid = fork();
  if (pid == 0) zygote_main(out[1], err[1], ctl[0]);
  close(out[1]), close(err[1]), close(ctl[0]);
  if (pid < 0) { close(out[0]), close(err[0]), close(ctl[1]); return; }
  fcntl(ctl[1], F_SETFL, O_NONBLOCK);
  zygote = (zygote_t){pid, out[0], err[0], ctl[1]};
}

/* Whether the waiting child can still run a command. An agent's `kill -9 -1` reaches it too, and the kill
 * may still be pending (the child not yet scheduled to die) when the next request arrives: handed a command
 * then, it would die with it and the command would seem to have run with no output. So a child with any
 * signal pending, or stopped, or gone, is not used. */
static int zygote_usable(pid_t pid) {
  char path[48], buf[4096];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char *state = strstr(buf, "\nState:\t"), *shd = strstr(buf, "\nShdPnd:\t"), *own = strstr(buf, "\nSigPnd:\t");
  if (!state || !shd || !own || !state[8] || !strchr("RSD", state[8])) return 0;
  return strtoull(shd + 9, NULL, 16) == 0 && strtoull(own + 9, NULL, 16) == 0;
}

/* Hands the request to the waiting child: its pid (its pipes in out/err), or -1 to fork one as before. */
static pid_t zygote_take(const char *script, uint32_t nscript, const unsigned char *env, uint32_t nenv,
                         int *out, int *err) {
  if (zygote.pid <= 0 || 4ull + nscript + nenv > ZYGOTE_REQUEST_MAX) return -1;
  if (!zygote_usable(zygote.pid)) {  /* doomed or stopped: end it; reap() forgets it, a new one starts later */
    kill(zygote.pid, SIGKILL);
    return -1;
  }
  buf_t b = {0};
  buf_u32(&b, nscript);
  buf_put(&b, script, nscript);
  buf_put(&b, env, nenv);
  ssize_t w = write(zygote.ctl, b.p, b.len);  /* one write into an empty pipe: all of it, or it is gone */
  free(b.p);
  pid_t pid = zygote.pid;
  close(zygote.ctl);
  *out = zygote.out, *err = zygote.err;
  zygote = (zygote_t){-1, -1, -1, -1};
  if (w != (ssize_t)(4 + nscript + nenv)) {  /* it died (the agent killed it): its end is a failed run */
    kill(pid, SIGKILL);
    close(*out), close(*err);
    return -1;
  }
  return pid;
}

static void watch(int fd, uint64_t tag) {
  struct epoll_event ev = {.events = EPOLLIN, .data.u64 = tag};
  if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0) die("epoll_ctl");
}

#define TAG_STDIN 1ull
#define TAG_SIGNAL 2ull
#define TAG_PARENT 5ull
#define TAG_JOB(slot, stream) ((3ull << 32) | ((uint64_t)(slot) << 1) | (stream))
#define TAG_DRAIN(fd) ((4ull << 32) | (uint64_t)(fd))

static void op_exec(const unsigned char *id, cursor_t *c, int role, int stream) {
  uint32_t timeout_ms = take_u32(c), cap = take_u32(c), nscript, nenv;
  const unsigned char *script_raw = take_str(c, &nscript), *env_raw = take_str(c, &nenv);
  char *script = c->bad || c->left ? NULL : cstr(script_raw, nscript);
  if (!script || cap < 2 || (nenv && env_raw[nenv - 1] != 0)) { errno = EINVAL; reply_error(id, "exec: malformed request", errno); free(script); return; }
  int slot = 0;
  while (slot < MAX_JOBS && jobs[slot]) slot++;
  int out[2], err[2];
  if (slot == MAX_JOBS) { errno = EAGAIN; reply_error(id, "exec: too many running commands", errno); free(script); return; }
  pid_t pid = is_verifier(role) ? -1 : zygote_take(script, nscript, env_raw, nenv, &out[0], &err[0]);
  if (pid < 0) {
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) { reply_error(id, "exec: pipe", errno); free(script); return; }
    char **env = make_env(env_raw, nenv);
    pid = fork();
    if (pid == 0) child_exec(script, env, out[1], err[1], role);
    int fork_errno = errno;
    free(env), close(out[1]), close(err[1]);
    if (pid < 0) { close(out[0]), close(err[0]); free(script); reply_error(id, "exec: fork", fork_errno); return; }
  }
  free(script);
  if (!is_verifier(role)) zygote_start();  /* the next agent command's child */
  job_t *j = calloc(1, sizeof *j);
  if (!j) die("calloc");
  memcpy(j->id, id, ID_LEN);
  j->pid = pid, j->fds[0] = out[0], j->fds[1] = err[0];
  j->stream = stream, j->cap = cap;
  j->start_ns = now_ns(), j->deadline_ns = j->start_ns + (uint64_t)timeout_ms * 1000000ull;
  for (int s = 0; s < 2; s++) {
    capped_init(&j->out[s], cap);
    fcntl(j->fds[s], F_SETFL, O_NONBLOCK);
    watch(j->fds[s], TAG_JOB(slot, s));
  }
  jobs[slot] = j;
}

static void op_read(const unsigned char *id, cursor_t *c) {  /* as a role: see dispatch */
  uint32_t n;
  const unsigned char *raw = take_str(c, &n);
  char *path = c->bad || c->left ? NULL : cstr(raw, n);
  if (!path) { reply_error(id, "read: malformed request", EINVAL); return; }
  /* O_NONBLOCK: a FIFO planted at the path must not stall the init */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) { reply_error(id, path, errno); free(path); if (fd >= 0) close(fd); return; }
  if (!S_ISREG(st.st_mode) || st.st_size > READ_MAX) {
    reply_error(id, path, S_ISREG(st.st_mode) ? EFBIG : EINVAL);
    free(path), close(fd);
    return;
  }
  buf_t b = {0};
  unsigned char chunk[65536];
  ssize_t r;
  while ((r = read(fd, chunk, sizeof chunk)) > 0 && b.len + (size_t)r <= READ_MAX) buf_put(&b, chunk, (size_t)r);
  if (r < 0) reply_error(id, path, errno);
  else reply(id, STATUS_OK, b.p, b.len);
  free(b.p), free(path), close(fd);
}

static int mkdirs(char *path, mode_t mode) {  /* mkdir -p of every parent of path */
  for (char *p = path + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    int r = mkdir(path, mode);
    int e = errno;
    *p = '/';
    if (r < 0 && e != EEXIST) { errno = e; return -1; }
  }
  return 0;
}

static int put_file(const char *path, uint32_t mode, const unsigned char *data, uint32_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0600);
  struct stat st;
  if (fd < 0) return -1;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { close(fd); errno = EINVAL; return -1; }
  size_t done = 0;
  while (done < n) {
    ssize_t w = write(fd, data + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) { int e = errno; close(fd); errno = e; return -1; }
    done += (size_t)w;
  }
  if (fchmod(fd, (mode_t)(mode & 07777)) < 0) { int e = errno; close(fd); errno = e; return -1; }
  return close(fd);
}

static void op_put(const unsigned char *id, cursor_t *c) {
  while (c->left) {
    if (c->left < 1) break;
    unsigned char kind = *c->p;
    c->p++, c->left--;
    uint32_t mode = take_u32(c), npath, ndata;
    const unsigned char *raw = take_str(c, &npath), *data = take_str(c, &ndata);
    char *path = c->bad ? NULL : cstr(raw, npath);
    if (!path || path[0] != '/' || kind > 2) { free(path); reply_error(id, "put: malformed request", EINVAL); return; }
    int r = mkdirs(path, 0755);
    if (r == 0 && kind == 0) {
      r = mkdir(path, (mode_t)(mode & 07777));
      if (r < 0 && errno == EEXIST) r = 0;
      if (r == 0) r = chmod(path, (mode_t)(mode & 07777));
    } else if (r == 0 && kind == 1) {
      r = put_file(path, mode, data, ndata);
    } else if (r == 0) {
      char *target = cstr(data, ndata);
      unlink(path);
      r = target ? symlink(target, path) : (errno = EINVAL, -1);
      free(target);
    }
    if (r < 0) { reply_error(id, path, errno); free(path); return; }
    free(path);
  }
  reply(id, STATUS_OK, NULL, 0);
}

static void dispatch(const unsigned char *frame, uint32_t n) {
  unsigned char id[ID_LEN] = {0};
  if (n < ID_LEN + 2) { reply_error(id, "malformed frame", EINVAL); return; }
  memcpy(id, frame, ID_LEN);
  int role = frame[ID_LEN + 1];
  if (role != ROLE_AGENT && role != ROLE_VERIFIER) { reply_error(id, "unknown role", EINVAL); return; }
  cursor_t c = {frame + ID_LEN + 2, n - ID_LEN - 2, 0};
  switch (frame[ID_LEN]) {
    case OP_EXEC: op_exec(id, &c, role, 0); break;
    case OP_EXEC_STREAM: op_exec(id, &c, role, 1); break;
    case OP_READ: fs_as(role); op_read(id, &c); fs_restore(); break;
    case OP_PUT: fs_as(role); op_put(id, &c); fs_restore(); break;
    case OP_PING: { uint32_t pid = (uint32_t)getpid(); reply(id, STATUS_OK, &pid, 4); break; }
    default: reply_error(id, "unknown op", EINVAL);
  }
}

/* ---- jobs ----------------------------------------------------------------------------------- */

static void add_drain(int fd) {  /* background processes still hold the pipe: read and drop */
  for (int i = 0; i < DRAIN_MAX; i++)
    if (!drains[i]) {
      struct epoll_event ev = {.events = EPOLLIN, .data.u64 = TAG_DRAIN(fd)};
      epoll_ctl(epfd, EPOLL_CTL_MOD, fd, &ev);
      drains[i] = fd;
      return;
    }
  close(fd);  /* table full: the writers get SIGPIPE, as they would with a closed terminal */
}

static void job_output(job_t *j, int s, const unsigned char *data, size_t n) {
  capped_add(&j->out[s], data, n);
  if (!j->stream || j->streamed[s] >= j->cap) return;  /* a flood streams no more than the reply would carry */
  size_t send = n < j->cap - j->streamed[s] ? n : j->cap - j->streamed[s];
  reply_chunk(j->id, s, data, send);
  j->streamed[s] += send;
}

static int pump(job_t *j, int s, int until_empty) {  /* 0 at EOF */
  unsigned char chunk[65536];
  for (int rounds = 0; rounds < 64; rounds++) {
    ssize_t r = read(j->fds[s], chunk, sizeof chunk);
    if (r > 0) { job_output(j, s, chunk, (size_t)r); if (!until_empty) return 1; continue; }
    if (r == 0) return 0;
    return 1;  /* EAGAIN (or EINTR): nothing more for now */
  }
  return 1;
}

static void finish(int slot) {
  job_t *j = jobs[slot];
  buf_t b = {0};
  int code = WIFEXITED(j->status) ? WEXITSTATUS(j->status) : 128 + WTERMSIG(j->status);
  if (j->timed_out) code = 124;
  uint64_t dur = now_ns() - j->start_ns;
  int truncated = 0;
  unsigned char flags[2];
  for (int s = 0; s < 2; s++) {
    if (j->fds[s] >= 0 && pump(j, s, 1) == 0) { epoll_ctl(epfd, EPOLL_CTL_DEL, j->fds[s], NULL); close(j->fds[s]); }
    else if (j->fds[s] >= 0) add_drain(j->fds[s]);
  }
  buf_put(&b, &code, 4);
  flags[0] = (unsigned char)j->timed_out;
  buf_put(&b, flags, 1);
  size_t flag_at = b.len;
  flags[1] = 0;
  buf_put(&b, &flags[1], 1);
  buf_put(&b, &dur, 8);
  for (int s = 0; s < 2; s++) truncated |= capped_emit(&j->out[s], &b);
  b.p[flag_at] = (unsigned char)truncated;
  reply(j->id, STATUS_OK, b.p, b.len);
  free(b.p);
  capped_free(&j->out[0]), capped_free(&j->out[1]);
  free(j);
  jobs[slot] = NULL;
}

static void reap(void) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (pid == zygote.pid) {  /* killed while it waited: the next agent command forks as before */
      close(zygote.out), close(zygote.err), close(zygote.ctl);
      zygote = (zygote_t){-1, -1, -1, -1};
      continue;
    }
    for (int i = 0; i < MAX_JOBS; i++)
      if (jobs[i] && jobs[i]->pid == pid) { jobs[i]->status = status; jobs[i]->exited = 1; break; }
  }
  for (int i = 0; i < MAX_JOBS; i++)
    if (jobs[i] && jobs[i]->exited) finish(i);
}

static int next_timeout_ms(void) {
  uint64_t now = now_ns(), soonest = UINT64_MAX;
  for (int i = 0; i < MAX_JOBS; i++) {
    job_t *j = jobs[i];
    if (!j || j->timed_out) continue;
    if (j->deadline_ns <= now) { j->timed_out = 1; kill(-j->pid, SIGKILL); kill(j->pid, SIGKILL); continue; }
    if (j->deadline_ns < soonest) soonest = j->deadline_ns;
  }
  return soonest == UINT64_MAX ? -1 : (int)((soonest - now) / 1000000ull + 1);
}

/* ---- main loop ------------------------------------------------------------------------------ */

static buf_t inbox;

static void read_requests(void) {
  unsigned char chunk[65536];
  ssize_t r = read(0, chunk, sizeof chunk);
  if (r == 0) _exit(0);  /* the host closed the channel: the sandbox ends with its init */
  if (r < 0) { if (errno == EINTR || errno == EAGAIN) return; die("read stdin"); }
  buf_put(&inbox, chunk, (size_t)r);
  size_t at = 0;
  while (inbox.len - at >= 4) {
    uint32_t n;
    memcpy(&n, inbox.p + at, 4);
    if (n > FRAME_MAX) { fprintf(stderr, "furlong-init: frame of %u bytes refused\n", n); _exit(112); }
    if (inbox.len - at - 4 < n) break;
    dispatch(inbox.p + at + 4, n);
    at += 4 + (size_t)n;
  }
  memmove(inbox.p, inbox.p + at, inbox.len - at);
  inbox.len -= at;
}

static void on_event(uint64_t tag) {
  if (tag == TAG_STDIN) { read_requests(); return; }
  if (tag == TAG_PARENT) {  /* bwrap's status lines are dropped; at the pipe's end bwrap is gone, and so is the sandbox */
    char chunk[512];
    ssize_t r = read(parent_fd, chunk, sizeof chunk);
    if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) _exit(0);
    return;
  }
  if (tag == TAG_SIGNAL) {
    struct signalfd_siginfo si;
    while (read(sigfd, &si, sizeof si) == sizeof si) {}
    reap();
    return;
  }
  if ((tag >> 32) == 4) {
    int fd = (int)(tag & 0xffffffffu);
    unsigned char chunk[65536];
    if (read(fd, chunk, sizeof chunk) == 0) {
      epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL);
      close(fd);
      for (int i = 0; i < DRAIN_MAX; i++) if (drains[i] == fd) drains[i] = 0;
    }
    return;
  }
  int slot = (int)((tag & 0xffffffffu) >> 1), s = (int)(tag & 1);
  job_t *j = jobs[slot];
  if (j && j->fds[s] >= 0 && pump(j, s, 0) == 0) {
    epoll_ctl(epfd, EPOLL_CTL_DEL, j->fds[s], NULL);
    close(j->fds[s]);
    j->fds[s] = -1;
  }
}

static void parse_args(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *opt = argv[i], *val = argv[i + 1];
    if (!strcmp(opt, "--agent") && sscanf(val, "%ld:%ld", &agent_uid, &agent_gid) == 2) continue;
    if (!strcmp(opt, "--verifier") && sscanf(val, "%ld", &verifier_uid) == 1) continue;
    if (!strcmp(opt, "--init-uid") && sscanf(val, "%ld", &init_uid) == 1) continue;
    if (!strcmp(opt, "--parent-fd") && sscanf(val, "%d", &parent_fd) == 1) continue;
    if (!strcmp(opt, "--verifier-ns") && sscanf(val, "%d", &verifier_ns) == 1) continue;
    if (!strcmp(opt, "--seccomp") && sscanf(val, "%d", &seccomp_fd) == 1) continue;
    if (!strcmp(opt, "--build-caps") && sscanf(val, "%d", &build_caps) == 1) continue;
    if (!strcmp(opt, "--keep-shell-state") && sscanf(val, "%d", &keep_shell_state) == 1) continue;
    if (!strcmp(opt, "--verifier-preload") && val[0] == '/' && !strpbrk(val, ": ")) {
      verifier_preload = val;
      continue;
    }
    if (!strcmp(opt, "--agent-group") && n_agent_groups < MAX_AGENT_GROUPS) {
      agent_groups[n_agent_groups++] = (gid_t)atol(val);
      continue;
    }
    if (!strcmp(opt, "--agent-procs") && n_agent_procs < MAX_AGENT_PROCS) {
      agent_procs[n_agent_procs++] = atoi(val);
      continue;
    }
    errno = EINVAL;
    die(opt);
  }
  if (argc % 2 == 0) { errno = EINVAL; die("odd argument list"); }
}

/* Every fd but 0-2 and the agent cgroup's procs files (kept close-on-exec) is closed. */
static void close_host_fds(void) {
  unsigned int from = 3;
  int keep[MAX_AGENT_PROCS + 3], n = 0;
  for (int i = 0; i < n_agent_procs; i++) keep[n++] = agent_procs[i];
  if (verifier_ns >= 0) keep[n++] = verifier_ns;
  if (parent_fd >= 0) keep[n++] = parent_fd;
  if (seccomp_fd >= 0) keep[n++] = seccomp_fd;
  for (;;) {
    unsigned int next = ~0u;
    for (int i = 0; i < n; i++)
      if ((unsigned int)keep[i] >= from && (unsigned int)keep[i] < next) next = (unsigned int)keep[i];
    if (next > from && close_fds(from, next == ~0u ? ~0u : next - 1) < 0) die("close_range");
    if (next == ~0u) break;
    if (fcntl((int)next, F_SETFD, FD_CLOEXEC) < 0) die("kept fd");
    from = next + 1;
  }
}

static void own(const char *path, mode_t mode, long uid, long gid) {
  if (mkdir(path, mode) < 0 && errno != EEXIST) die(path);
  if (chown(path, (uid_t)uid, (gid_t)gid) < 0 || chmod(path, mode) < 0) die(path);
}

/* The init keeps its capabilities but leaves uid 0, the agent's uid when the image's USER is root: a
 * command's child runs as the init until become(), and an agent looping on `kill -9 -1` could otherwise
 * kill a verifier command in that window. The uid change resets the dumpable flag (set again), and
 * bwrap's parent-death signal could no longer reach a process of another uid: the end of bwrap's
 * status pipe (`--parent-fd`) tells the init instead that bwrap is gone. */
static void leave_uid_0(void) {
  if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) < 0 || setresuid((uid_t)init_uid, (uid_t)init_uid, (uid_t)init_uid) < 0)
    die("init uid");
  if (set_caps(own_caps, own_caps, 0) < 0) die("capset");
  if (prctl(PR_SET_KEEPCAPS, no_setfsuid, 0, 0, 0) < 0 || prctl(PR_SET_DUMPABLE, 0) < 0) die("prctl");
  init_fsuid = (uid_t)init_uid;
  if (!no_setfsuid) setfsuid(init_fsuid);
}

int main(int argc, char **argv) {
  extern char **environ;
  parse_args(argc, argv);
  /* First, before anything else: the host's fds (image layers) must never reach an agent process. */
  close_host_fds();
  if (prctl(PR_SET_DUMPABLE, 0) < 0) die("prctl");
  if (seccomp_fd >= 0) load_seccomp();
  own_caps = get_permitted();
  errno = 0;  /* setfsuid(-1) changes nothing and answers the file uid, or -1 and ENOSYS where it is missing */
  if ((int)setfsuid((uid_t)-1) == -1 && errno == ENOSYS) no_setfsuid = 1;
  size_t got = 0;
  while (got < SECRET_LEN) {
    ssize_t r = read(0, secret + got, SECRET_LEN - got);
    if (r <= 0) { if (r < 0 && errno == EINTR) continue; _exit(0); }
    got += (size_t)r;
  }
  base_env = environ;
  signal(SIGPIPE, SIG_IGN);
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, NULL);
  if ((sigfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) die("signalfd");
  if ((epfd = epoll_create1(EPOLL_CLOEXEC)) < 0) die("epoll_create1");
  watch(0, TAG_STDIN);
  watch(sigfd, TAG_SIGNAL);
  if (parent_fd >= 0) {
    fcntl(parent_fd, F_SETFL, O_NONBLOCK);
    watch(parent_fd, TAG_PARENT);
  }
  /* The shell state dir (the host wraps commands to use it). Every sandbox starts with none: a state
   * file an image happens to carry (e.g. left by a build step) must not set its first cwd or PATH. A
   * sandbox restored from a snapshot (--keep-shell-state 1) goes on with the state its agent left. */
  mkdir("/run", 0755);  /* an imported image may lack it; without the state dir, cd and export just do not persist */
  if (mkdir("/run/furlong-shell", 0755) == 0 || errno == EEXIST) {
    if (chown("/run/furlong-shell", (uid_t)agent_uid, (gid_t)agent_gid) < 0) { /* one uid: it is ours already */ }
  }
  if (!keep_shell_state) unlink("/run/furlong-shell/state");
  if (verifier_uid >= 0) {  /* the host mounted both: mount points the agent can neither rename nor write */
    /* not listable; the verifier puts its files there owner-only: its expected answers stay its own, and
     * an agent's `pytest` run from / (which looks for /tests/conftest.py) finds nothing rather than EACCES */
    own("/tests", 0711, verifier_uid, verifier_uid);
    own("/logs", 0755, verifier_uid, verifier_uid);
    own("/logs/verifier", 0755, verifier_uid, verifier_uid);
    own("/logs/agent", 0755, agent_uid, agent_gid);
    /* Harbor's convention dir, whose contents a separate verifier receives: the agent's to fill */
    own("/logs/artifacts", 0755, agent_uid, agent_gid);
    /* The agent is root of the user namespace owning the sandbox's IPC namespace, and an IPC sysctl is its
     * root's to write: read-only, so the launcher's limits (launch.c --ipc: shm_rmid_forced) hold. */
    if (mount("/proc/sys", "/proc/sys", NULL, MS_BIND | MS_REC, NULL) < 0 ||
        mount(NULL, "/proc/sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
      die("/proc/sys read-only");
  }
  if (init_uid >= 0 && own_caps) leave_uid_0();
  zygote_start();
  for (;;) {
    struct epoll_event evs[64];
    int n = epoll_wait(epfd, evs, 64, next_timeout_ms());
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < n; i++) on_event(evs[i].data.u64);
    reap();
  }
}
