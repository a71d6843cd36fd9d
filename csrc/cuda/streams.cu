// Stream ordering for collectives whose data passes through the host (commlib/cuda/staging.py):
// pinned host memory, asynchronous copies, events, new streams, and a stream that waits
// for a counter in pinned memory which the host raises (cuStreamWaitValue32). That last
// one is what lets a collective be enqueued on the caller's stream and return at once:
// the copies back to the device wait on the stream for the host's part to finish, and no
// thread of ours blocks on the GPU, nor the GPU on a kernel of ours spinning.
#include <pybind11/pybind11.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include "device.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using commlib_cuda_host::check;
using commlib_cuda_host::OnDevice;
using commlib_cuda_host::WithoutGil;

namespace {

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// COMMLIB_CUDA_WAIT=kernel: streams wait for counters, and write arrivals, by kernels of ours
bool wait_by_kernel() {
  static const bool by_kernel = [] {
    const char* how = std::getenv("COMMLIB_CUDA_WAIT");
    return how != nullptr && std::string(how) == "kernel";
  }();
  return by_kernel;
}

StreamValue32 write_value_entry() {
  static StreamValue32 entry = reinterpret_cast<StreamValue32>(
      commlib_cuda_host::driver_entry("cuStreamWriteValue32", "stream memory operations"));
  return entry;
}

// `counter` (pinned, from host_alloc) as the device addresses it.
void* on_device(uintptr_t counter) {
  void* address = nullptr;
  check(cudaHostGetDevicePointer(&address, reinterpret_cast<void*>(counter), 0),
        "cudaHostGetDevicePointer (the counter must be from host_alloc)");
  return address;
}

StreamValue32 wait_value_entry() {
  static StreamValue32 entry = reinterpret_cast<StreamValue32>(
      commlib_cuda_host::driver_entry("cuStreamWaitValue32", "stream memory operations"));
  return entry;
}

// CUDA events are recycled, never destroyed: Python frees an Event on whichever thread drops
// it last (a communicator's engine, say), and a CUDA call there may block while the caller
// waits in a synchronous copy behind a stream that waits for that engine (a cudaMemcpyAsync
// did, on an H200). Taking one from the pool and giving it back call no CUDA at all.
class EventPool {
 public:
  cudaEvent_t take(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& spare = spare_[device];
      if (!spare.empty()) {
        cudaEvent_t event = spare.back();
        spare.pop_back();
        return event;
      }
    }
    OnDevice on(device);
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    return event;
  }
  void give(int device, cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    spare_[device].push_back(event);  // re-recording a pending event is allowed
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<cudaEvent_t>> spare_;
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool;  // never destroyed: Events may outlive statics
  return *pool;
}

class Event {
 public:
  explicit Event(int device) : device_(device), event_(event_pool().take(device)) {}
  ~Event() { event_pool().give(device_, event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(uintptr_t stream) {
    OnDevice on(device_);
    check(cudaEventRecord(event_, as_stream(stream)), "cudaEventRecord");
  }
  // True once everything the stream held at record() has run (also if never recorded).
  bool query() {
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    check(status, "cudaEventQuery");
    return true;
  }
  // Work enqueued on `stream` from now on waits for this event.
  void wait(uintptr_t stream) {
    OnDevice on(device_);
    check(cudaStreamWaitEvent(as_stream(stream), event_, 0), "cudaStreamWaitEvent");
  }
  void synchronize() {
    check(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  int device_;
  cudaEvent_t event_;
};

}  // namespace

void launch_wait_counter(void* counter, unsigned value, int device, uintptr_t stream);   // launch.cu
void launch_write_counter(void* counter, unsigned value, int device, uintptr_t stream);  // launch.cu

namespace {

// A stream memory operation on the word at `counter` (pinned): the driver's `op` with
// `flags`, or, under COMMLIB_CUDA_WAIT=kernel, our kernel that does the same.
void stream_value(uintptr_t stream, int device, uintptr_t counter, uint32_t value,
                  StreamValue32 op, unsigned flags,
                  void (*by_kernel)(void*, unsigned, int, uintptr_t), const char* what) {
  OnDevice on(device);
  void* word = on_device(counter);
  if (wait_by_kernel()) return by_kernel(word, value, device, stream);
  CUresult status = op(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word),
                       value, flags);
  if (status != CUDA_SUCCESS)
    throw std::runtime_error(std::string(what) + " failed with CUresult " + std::to_string(status));
}

}  // namespace

void bind_streams(py::module_& m) {
  py::class_<Event>(m, "Event", "A CUDA event on one device (timing disabled)")
      .def(py::init<int>(), WithoutGil(), py::arg("device"))
      .def("record", &Event::record, WithoutGil(), py::arg("stream"))
      .def("query", &Event::query, WithoutGil())
      .def("wait", &Event::wait, WithoutGil(), py::arg("stream"))
      .def("synchronize", &Event::synchronize, WithoutGil());

  m.def("host_alloc", [](size_t nbytes) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocPortable | cudaHostAllocMapped),
          "cudaHostAlloc of " + std::to_string(nbytes) + " pinned bytes");
    return reinterpret_cast<uintptr_t>(p);
  }, WithoutGil(), py::arg("nbytes"), "Pinned host memory, mapped into every device's address space");
  m.def("host_free", [](uintptr_t p) {
    check(cudaFreeHost(reinterpret_cast<void*>(p)), "cudaFreeHost");
  }, WithoutGil(), py::arg("ptr"));
  m.def("host_register", [](uintptr_t p, size_t nbytes) {
    check(cudaHostRegister(reinterpret_cast<void*>(p), nbytes,
                           cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister of " + std::to_string(nbytes) + " bytes");
  }, WithoutGil(), py::arg("ptr"), py::arg("nbytes"),
     "Host memory of our own (shared with other processes, say) pinned and mapped into every "
     "device's address space, as host_alloc's");
  m.def("host_unregister", [](uintptr_t p) {
    check(cudaHostUnregister(reinterpret_cast<void*>(p)), "cudaHostUnregister");
  }, WithoutGil(), py::arg("ptr"));


  m.def("copy_async", [](uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream) {
    if (nbytes == 0) return;
    OnDevice on(device);
    check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                          cudaMemcpyDefault, as_stream(stream)),
          "cudaMemcpyAsync");
  }, WithoutGil(), py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("stream"),
     "Copy between any two of host and device memory, ordered on `stream`");

  m.def("stream_create", [](int device) {
    OnDevice on(device);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    return reinterpret_cast<uintptr_t>(s);
  }, WithoutGil(), py::arg("device"), "A new stream that does not synchronise with the legacy default one");
  m.def("stream_synchronize", [](uintptr_t stream, int device) {
    OnDevice on(device);
    check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
  }, WithoutGil(), py::arg("stream"), py::arg("device"));

  m.def("wait_value", [](uintptr_t stream, int device, uintptr_t counter, uint32_t value) {
    stream_value(stream, device, counter, value, wait_value_entry(), CU_STREAM_WAIT_VALUE_GEQ,
                 launch_wait_counter, "cuStreamWaitValue32");
  }, WithoutGil(), py::arg("stream"), py::arg("device"), py::arg("counter"), py::arg("value"),
     "Work enqueued on `stream` from now on waits until the uint32 at `counter` (pinned, "
     "from host_alloc) reaches `value` (a cyclic >=)");
  m.def("write_value", [](uintptr_t stream, int device, uintptr_t counter, uint32_t value) {
    // the default flags order the write after the stream's earlier work and its memory
    stream_value(stream, device, counter, value, write_value_entry(),
                 CU_STREAM_WRITE_VALUE_DEFAULT, launch_write_counter, "cuStreamWriteValue32");
  }, WithoutGil(), py::arg("stream"), py::arg("device"), py::arg("counter"), py::arg("value"),
     "Once `stream` gets here (its earlier work done), the uint32 at `counter` (pinned, from "
     "host_alloc) becomes `value`: how a stream tells the GPU proxy where it is");
  m.def("store_counter", [](uintptr_t counter, uint32_t value) {
    // release: what the host wrote before (the staged results) is visible first
    reinterpret_cast<std::atomic<uint32_t>*>(counter)->store(value, std::memory_order_release);
  }, py::arg("counter"), py::arg("value"));

  m.def("device_of", [](uintptr_t p) {
    cudaPointerAttributes attributes;
    check(cudaPointerGetAttributes(&attributes, reinterpret_cast<void*>(p)),
          "cudaPointerGetAttributes");
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
      throw std::invalid_argument("the pointer is not device memory");
    return attributes.device;
  }, WithoutGil(), py::arg("ptr"), "The device that holds this device pointer");
}
