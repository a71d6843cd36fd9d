// Waiting on other processes through shared memory: futexes that work across processes,
// a polite spin, and whether a peer process still lives. Shared by the shared-memory
// transport (shm.cpp) and the GPU proxy (gpu_proxy.cpp).
#pragma once

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace commlib {

// A futex in memory shared between processes (so not FUTEX_PRIVATE).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long nanoseconds) {
  timespec timeout{0, nanoseconds};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr,
          0);
}

inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// A process that has exited, including one its parent has not reaped yet (a zombie
// still answers kill(pid, 0)).
inline bool process_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[32], stat[256];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY);
  if (fd < 0) return errno != ENOENT;
  ssize_t n = read(fd, stat, sizeof(stat) - 1);
  close(fd);
  if (n <= 0) return true;
  stat[n] = 0;
  const char* end = std::strrchr(stat, ')');  // the state follows the command name
  return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

// Asks the scheduler for slices of `nanoseconds` for the calling thread (Linux 6.12+'s
// EEVDF: sched_setattr's sched_runtime for a normal thread; no privilege needed). Woken on
// a core that another thread computes on, a thread with a short slice runs at once rather
// than at the end of that thread's slice (about 3 ms): a progress thread woken by the
// network moves the next bytes within microseconds. Where the kernel does not take it,
// nothing changes: false.
inline bool request_slice(uint64_t nanoseconds) {
  struct {  // the kernel's struct sched_attr (its header clashes with glibc's sched.h)
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
    uint32_t sched_util_min, sched_util_max;
  } attr{};
  if (syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) != 0 || attr.sched_policy != 0)
    return false;  // (a thread the user scheduled otherwise keeps it: only SCHED_NORMAL's)
  attr.size = sizeof(attr);
  attr.sched_flags = 0;
  attr.sched_runtime = nanoseconds;  // (its nice stays)
  return syscall(SYS_sched_setattr, 0, &attr, 0) == 0;
}

}  // namespace commlib
