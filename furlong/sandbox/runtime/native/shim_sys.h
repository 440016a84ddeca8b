/* What furlong's preloaded shims (owner.c, statx.c) share: raw system calls and errno without a libc
 * (freestanding: one build loads into glibc processes of any version and into musl processes). */
#define API __attribute__((visibility("default")))

extern int *__errno_location(void) __attribute__((weak));

#if defined(__x86_64__)
static long sys5(long n, long a, long b, long c, long d, long e) {
  long ret;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8) : "rcx", "r11", "memory");
  return ret;
}
#elif defined(__aarch64__)
static long sys5(long n, long a, long b, long c, long d, long e) {
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  register long x4 __asm__("x4") = e;
  __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4) : "memory");
  return x0;
}
#else
#error "furlong's preloaded shims support x86_64 and aarch64 (furlong.sandbox.runtime.native.SHIM_ARCHES)"
#endif

static int fail(long r) {
  if (__errno_location) *__errno_location() = (int)-r;
  return -1;
}
