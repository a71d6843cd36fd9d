// CUDA IPC for commlib/transports/cuda_ipc.py: device memory that peer processes map once per
// communicator, and whether one device can reach another's memory. Handles travel as bytes.
#include <pybind11/pybind11.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include "device.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace py = pybind11;
using commlib_cuda_host::check;
using commlib_cuda_host::OnDevice;
using commlib_cuda_host::WithoutGil;
using commlib_cuda_host::without_gil;

void bind_ipc(py::module_& m) {
  m.def("device_alloc", [](size_t nbytes, int device) {
    OnDevice on(device);
    void* p = nullptr;
    check(cudaMalloc(&p, nbytes), "cudaMalloc of " + std::to_string(nbytes) + " bytes");
    return reinterpret_cast<uintptr_t>(p);
  }, WithoutGil(), py::arg("nbytes"), py::arg("device"), "Device memory that peers may map (ipc_handle)");
  m.def("device_free", [](uintptr_t p, int device) {
    OnDevice on(device);
    check(cudaFree(reinterpret_cast<void*>(p)), "cudaFree");
  }, WithoutGil(), py::arg("ptr"), py::arg("device"));

  m.def("address_range", [](uintptr_t p, int device) {
    using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static AddressRange entry = reinterpret_cast<AddressRange>(
        commlib_cuda_host::driver_entry("cuMemGetAddressRange", "registering memory"));
    OnDevice on(device);
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult status = entry(&base, &size, static_cast<CUdeviceptr>(p));
    if (status != CUDA_SUCCESS)
      throw std::runtime_error("cuMemGetAddressRange failed with CUresult " + std::to_string(status) +
                               " (not device memory from cudaMalloc?)");
    return std::make_pair(static_cast<uintptr_t>(base), size);
  }, WithoutGil(), py::arg("ptr"), py::arg("device"),
     "(base, size) of the allocation that holds `ptr`: what ipc_handle shares");

  m.def("ipc_handle", [](uintptr_t p, int device) {
    cudaIpcMemHandle_t handle = without_gil([&] {
      OnDevice on(device);
      cudaIpcMemHandle_t made;
      check(cudaIpcGetMemHandle(&made, reinterpret_cast<void*>(p)), "cudaIpcGetMemHandle");
      return made;
    });
    return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }, py::arg("ptr"), py::arg("device"), "The handle a peer process maps `ptr` with (device_alloc's)");
  m.def("ipc_open", [](py::bytes handle_bytes, int device) {
    std::string raw = handle_bytes;
    cudaIpcMemHandle_t handle;
    if (raw.size() != sizeof(handle)) throw std::invalid_argument("not a CUDA IPC memory handle");
    std::memcpy(&handle, raw.data(), sizeof(handle));
    return without_gil([&] {
      OnDevice on(device);
      void* p = nullptr;
      check(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle (a peer's workspace)");
      return reinterpret_cast<uintptr_t>(p);
    });
  }, py::arg("handle"), py::arg("device"), "A peer's memory, mapped into this process on `device`");
  m.def("ipc_close", [](uintptr_t p, int device) {
    OnDevice on(device);
    check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(p)), "cudaIpcCloseMemHandle");
  }, WithoutGil(), py::arg("ptr"), py::arg("device"));

  m.def("can_access", [](int device, int peer) {
    if (device == peer) return true;
    int can = 0;
    check(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
    return can != 0;
  }, WithoutGil(), py::arg("device"), py::arg("peer"),
     "Whether kernels on `device` can read `peer`'s memory");

  m.def("device_uuid", [](int device) {
    cudaDeviceProp prop = without_gil([&] {
      cudaDeviceProp read;
      check(cudaGetDeviceProperties(&read, device), "cudaGetDeviceProperties");
      return read;
    });
    return py::bytes(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  }, py::arg("device"), "The device's UUID: ranks compare them (device indices are per process)");
}
