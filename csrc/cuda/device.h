// What the host code of commlib._cuda (csrc/cuda/*.cu) shares: CUDA errors as exceptions,
// and calls made on a given device.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace commlib_cuda_host {

// The GIL is let go during every binding whose CUDA call can block (a full launch queue,
// an implicit device synchronisation, a wait): a stream may be waiting for a counter that
// the communicator's engine thread raises, and the engine needs the GIL to do it. Holding
// it would close a circle: the caller waits for the GPU, the GPU for the engine, the
// engine for the caller.
// A binding that must build Python objects from what CUDA gave (bytes) lets the GIL go
// around the CUDA calls only: without_gil([&] { ... }). tests/test_cuda.py checks that
// every binding of csrc/cuda does one or the other.
using WithoutGil = pybind11::call_guard<pybind11::gil_scoped_release>;

template <class Calls>
auto without_gil(Calls calls) {
  pybind11::gil_scoped_release released;
  return calls();
}

inline void check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it, so the next call does not report it again
    throw std::runtime_error(what + ": " + cudaGetErrorString(status));
  }
}

// A driver function found through the runtime (_cuda links no libcuda), in its CUDA 12
// version; `why` says what needs it, for the error where the driver lacks it.
inline void* driver_entry(const char* name, const std::string& why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  check(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found),
        std::string("looking up ") + name);
  if (fn == nullptr || found != cudaDriverEntryPointSuccess)
    throw std::runtime_error(std::string("this CUDA driver has no ") + name + " (" + why +
                             "); update the driver to CUDA 12 or newer");
  return fn;
}

// Runs on `device`, and leaves the caller's current device as it was. cudaSetDevice even
// where `device` is current already: it also makes the device's primary context current on
// this thread, which a driver call (cuMemGetAddressRange) needs on a thread that has made no
// runtime call yet, such as a communicator's engine thread.
struct OnDevice {
  int previous = 0, device;
  explicit OnDevice(int device) : device(device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~OnDevice() {
    if (previous != device) cudaSetDevice(previous);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
};

}  // namespace commlib_cuda_host
