// What the host code of commlib._cuda (csrc/cuda/*.cu) shares: CUDA errors as exceptions,
// and calls made on a given device.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace commlib_cuda_host {

inline void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it, so the next call does not report it again
    throw std::runtime_error(what + ": " + cudaGetErrorString(status));
  }
}

// Runs on `device`, and leaves the caller's current device as it was.
struct OnDevice {
  int previous = 0, device;
  explicit OnDevice(int device) : device(device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~OnDevice() {
    if (previous != device) cudaSetDevice(previous);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
};

}  // namespace commlib_cuda_host
