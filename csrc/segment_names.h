// Named shared-memory segments as the shm transport and the GPU proxies make them (in
// /dev/shm): names no other user or job can guess or create first, and errors that say
// which call failed and why.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

namespace commlib {

// "what: strerror(errno)", for a failed system call
inline std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// "/commlib-<kind><uid>-<pid><tag>-<serial>-<64 random bits>": unique in this process
// (serial), unguessable by other users (the random bits), and found by the tests' leak
// checks (the "commlib-" prefix)
inline std::string unique_segment_name(const std::string& kind, const std::string& tag) {
  static std::atomic<uint64_t> serial{0};
  std::random_device entropy;
  char secret[17];
  std::snprintf(secret, sizeof(secret), "%08x%08x", entropy(), entropy());
  return "/commlib-" + kind + std::to_string(getuid()) + "-" + std::to_string(getpid()) + tag +
         "-" + std::to_string(serial++) + "-" + secret;
}

}  // namespace commlib
