// commlib._cuda: launches the kernels of commlib/cuda/kernels.cu on the caller's stream.
// Built by setup.py where nvcc is found; without it, commlib/cuda/runtime.py compiles the
// same kernels at run time. Pointers and streams arrive as integers (data_ptr(),
// cuda_stream), with the index of the device the arrays live on; every launch returns at
// once, ordered on that stream like NCCL's calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include "device.h"

#include <mutex>  // call_once
#include <stdexcept>
#include <string>
#include <vector>

#include "../../commlib/cuda/kernels.cu"
#include "../../commlib/cuda/wire.cu"

namespace py = pybind11;
using commlib_cuda_host::check;
using commlib_cuda_host::OnDevice;
using commlib_cuda_host::WithoutGil;

void bind_streams(py::module_& m);  // streams.cu
void bind_ipc(py::module_& m);      // ipc.cu

namespace {

using Kernel = const void*;

// Codes as in csrc/kernels.h (_C.DTYPES, _C.OPS).
enum DType { F16, BF16, F32, F64, I8, U8, I32, I64, NDTYPES };
enum Op { SUM, PROD, MIN, MAX, AVG, NOPS };

#define COMMLIB_ROW(name)                                                                   \
  {(Kernel)commlib_reduce_##name##_sum, (Kernel)commlib_reduce_##name##_prod,              \
   (Kernel)commlib_reduce_##name##_min, (Kernel)commlib_reduce_##name##_max,               \
   (Kernel)commlib_reduce_##name##_sum}
const Kernel kReduce[NDTYPES][NOPS] = {COMMLIB_ROW(f16), COMMLIB_ROW(bf16), COMMLIB_ROW(f32),
                                       COMMLIB_ROW(f64), COMMLIB_ROW(i8),   COMMLIB_ROW(u8),
                                       COMMLIB_ROW(i32), COMMLIB_ROW(i64)};
#undef COMMLIB_ROW
#define COMMLIB_ROW(name)                                                                   \
  {(Kernel)commlib_reduce_n_##name##_sum, (Kernel)commlib_reduce_n_##name##_prod,          \
   (Kernel)commlib_reduce_n_##name##_min, (Kernel)commlib_reduce_n_##name##_max,           \
   (Kernel)commlib_reduce_n_##name##_sum}
const Kernel kReduceN[NDTYPES][NOPS] = {COMMLIB_ROW(f16), COMMLIB_ROW(bf16), COMMLIB_ROW(f32),
                                        COMMLIB_ROW(f64), COMMLIB_ROW(i8),   COMMLIB_ROW(u8),
                                        COMMLIB_ROW(i32), COMMLIB_ROW(i64)};
#undef COMMLIB_ROW
const Kernel kScale[] = {(Kernel)commlib_scale_f16, (Kernel)commlib_scale_bf16,
                         (Kernel)commlib_scale_f32, (Kernel)commlib_scale_f64};
#define COMMLIB_ROW(s)                                                                      \
  {(Kernel)commlib_cast_##s##_f16, (Kernel)commlib_cast_##s##_bf16,                        \
   (Kernel)commlib_cast_##s##_f32, (Kernel)commlib_cast_##s##_f64}
const Kernel kCast[4][4] = {COMMLIB_ROW(f16), COMMLIB_ROW(bf16), COMMLIB_ROW(f32), COMMLIB_ROW(f64)};
#undef COMMLIB_ROW

// wire.cu's, by format code (csrc/wire.h's Format)
#define COMMLIB_ROW(name)                                                                   \
  {(Kernel)commlib_wire_encode_##name, (Kernel)commlib_wire_decode_sum_##name,             \
   (Kernel)commlib_wire_sum_encode_##name}
enum WireKernel { ENCODE, DECODE_SUM, SUM_ENCODE, NWIRE_KERNELS };
constexpr int kWireFormats = 5;
const Kernel kWire[kWireFormats][NWIRE_KERNELS] = {COMMLIB_ROW(bf16), COMMLIB_ROW(fp16),
                                                   COMMLIB_ROW(int8), COMMLIB_ROW(fp8_e4m3),
                                                   COMMLIB_ROW(fp8_e5m2)};
#undef COMMLIB_ROW

const int kItemsize[NDTYPES] = {2, 2, 4, 8, 1, 1, 4, 8};
constexpr int kThreads = 256;

void check_dtype(int dtype, int limit, const char* what) {
  if (dtype < 0 || dtype >= limit)
    throw std::invalid_argument(std::string(what) + ": unsupported dtype code " + std::to_string(dtype));
}

// A grid-stride loop needs no more blocks than the device keeps resident at once.
int blocks_for(int device, long long work) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  long long wanted = (work + kThreads - 1) / kThreads;
  long long most = 8LL * sms;
  return int(wanted < 1 ? 1 : (wanted < most ? wanted : most));
}

// Under lazy loading (CUDA's default) a kernel's first launch loads it, which may wait for
// the device to go idle; behind a stream that waits for the host's counter (a staged or an
// IPC call) that wait lasts until the engine thread gets to the call, which may be the very
// call being enqueued (seen on an H200: the first IPC all_reduce hung in its reduce_n
// launch). So load_kernels loads every kernel on a device at once; the collectives call it
// before they enqueue any wait, and the first launch calls it too.
constexpr int kMostDevices = 64;

void load_every_kernel(int device) {
  static std::once_flag loaded[kMostDevices];
  if (device < 0 || device >= kMostDevices)
    throw std::invalid_argument("device " + std::to_string(device) + " is beyond the " +
                                std::to_string(kMostDevices) + " commlib handles");
  std::call_once(loaded[device], [] {
    cudaFuncAttributes attributes;
    auto load = [&](Kernel kernel) { check(cudaFuncGetAttributes(&attributes, kernel), "loading the kernels"); };
    for (const auto& row : kReduce) for (Kernel kernel : row) load(kernel);
    for (const auto& row : kReduceN) for (Kernel kernel : row) load(kernel);
    for (const auto& row : kCast) for (Kernel kernel : row) load(kernel);
    for (Kernel kernel : kScale) load(kernel);
    for (const auto& row : kWire) for (Kernel kernel : row) load(kernel);
    load((Kernel)commlib_copy);
    load((Kernel)commlib_wait_counter);
    load((Kernel)commlib_write_counter);
  });
}

// `kernel` on `blocks` x `threads` on `device`'s `stream`.
void launch_grid(Kernel kernel, int blocks, int threads, void** args, int device, uintptr_t stream,
                 const char* what) {
  OnDevice on(device);
  load_every_kernel(device);
  check(cudaLaunchKernel(kernel, dim3(blocks), dim3(threads), args, 0,
                         reinterpret_cast<cudaStream_t>(stream)),
        what);
}

// A grid-stride kernel over `work` items.
void launch(Kernel kernel, long long work, void** args, int device, uintptr_t stream,
            const char* what) {
  if (work <= 0) return;
  launch_grid(kernel, blocks_for(device, work), kThreads, args, device, stream, what);
}

long long vectors(long long count, int itemsize) { return (count * itemsize + 15) / 16; }

// A wire kernel's threads: a block each for a scaled format's encoding, else an element.
long long wire_work(int format, long long count, int block, int kernel, const char* what) {
  if (format < 0 || format >= kWireFormats)
    throw std::invalid_argument(std::string(what) + ": unknown wire format code " + std::to_string(format));
  const bool scaled = format >= commlib_cuda::kINT8;
  if (scaled && block != 32 && block != 64 && block != 128 && block != 256)
    throw std::invalid_argument(std::string(what) + ": block must be 32, 64, 128 or 256 elements, not " +
                                std::to_string(block));
  return scaled && kernel != DECODE_SUM ? (count + block - 1) / block : count;
}

commlib_cuda::Sources packet_sources(const std::vector<uintptr_t>& packets, const char* what) {
  const size_t most = commlib_cuda::kMaxPointers;
  if (packets.empty() || packets.size() > most)
    throw std::invalid_argument(std::string(what) + ": 1 to " + std::to_string(most) + " packets, got " +
                                std::to_string(packets.size()));
  commlib_cuda::Sources src{};
  for (size_t k = 0; k < packets.size(); ++k) src.p[k] = reinterpret_cast<const void*>(packets[k]);
  return src;
}

}  // namespace

// streams.cu's wait_value, by a kernel (COMMLIB_CUDA_WAIT=kernel); `counter` as the device
// sees it.
void launch_wait_counter(void* counter, unsigned value, int device, uintptr_t stream) {
  void* args[] = {&counter, &value};
  launch_grid((Kernel)commlib_wait_counter, 1, 1, args, device, stream, "wait kernel");
}

// streams.cu's write_value, by a kernel (COMMLIB_CUDA_WAIT=kernel).
void launch_write_counter(void* counter, unsigned value, int device, uintptr_t stream) {
  void* args[] = {&counter, &value};
  launch_grid((Kernel)commlib_write_counter, 1, 1, args, device, stream, "write kernel");
}

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "commlib's CUDA kernels (commlib/cuda/kernels.cu), launched on a given stream";

  m.def("reduce", [](uintptr_t dst, uintptr_t a, uintptr_t b, long long count, int dtype, int op,
                     int device, uintptr_t stream) {
    check_dtype(dtype, NDTYPES, "reduce");
    if (op < 0 || op >= NOPS) throw std::invalid_argument("reduce: unknown op code " + std::to_string(op));
    void* args[] = {&dst, &a, &b, &count};
    launch(kReduce[dtype][op], vectors(count, kItemsize[dtype]), args, device, stream, "reduce kernel");
  }, WithoutGil(), py::arg("dst"), py::arg("a"), py::arg("b"), py::arg("count"), py::arg("dtype"),
     py::arg("op"), py::arg("device"), py::arg("stream"));

  m.def("reduce_n", [](std::vector<uintptr_t> targets, std::vector<uintptr_t> sources,
                       long long count, int dtype, int op, int device, uintptr_t stream) {
    check_dtype(dtype, NDTYPES, "reduce_n");
    if (op < 0 || op >= NOPS) throw std::invalid_argument("reduce_n: unknown op code " + std::to_string(op));
    const size_t most = commlib_cuda::kMaxPointers;
    if (targets.empty() || targets.size() > most || sources.empty() || sources.size() > most)
      throw std::invalid_argument("reduce_n: 1 to " + std::to_string(most) + " targets and sources, got " +
                                  std::to_string(targets.size()) + " and " + std::to_string(sources.size()));
    commlib_cuda::Targets dst{};
    commlib_cuda::Sources src{};
    for (size_t k = 0; k < targets.size(); ++k) dst.p[k] = reinterpret_cast<void*>(targets[k]);
    for (size_t k = 0; k < sources.size(); ++k) src.p[k] = reinterpret_cast<const void*>(sources[k]);
    int m = int(targets.size()), n = int(sources.size());
    void* args[] = {&dst, &m, &src, &n, &count};
    launch(kReduceN[dtype][op], vectors(count, kItemsize[dtype]), args, device, stream, "reduce_n kernel");
  }, WithoutGil(), py::arg("targets"), py::arg("sources"), py::arg("count"), py::arg("dtype"), py::arg("op"),
     py::arg("device"), py::arg("stream"),
     "every target = sources[0] op ... op sources[n-1] elementwise (1 to 16 of each; a target "
     "may be a source)");

  m.def("scale", [](uintptr_t x, double factor, long long count, int dtype, int device, uintptr_t stream) {
    check_dtype(dtype, 4, "scale (floating dtypes only)");
    void* args[] = {&x, &factor, &count};
    launch(kScale[dtype], vectors(count, kItemsize[dtype]), args, device, stream, "scale kernel");
  }, WithoutGil(), py::arg("x"), py::arg("factor"), py::arg("count"), py::arg("dtype"), py::arg("device"), py::arg("stream"));

  m.def("cast", [](uintptr_t dst, uintptr_t src, long long count, int src_dtype, int dst_dtype,
                   int device, uintptr_t stream) {
    check_dtype(src_dtype, 4, "cast (floating dtypes only)");
    check_dtype(dst_dtype, 4, "cast (floating dtypes only)");
    void* args[] = {&dst, &src, &count};
    const int wider = kItemsize[src_dtype] > kItemsize[dst_dtype] ? kItemsize[src_dtype] : kItemsize[dst_dtype];
    launch(kCast[src_dtype][dst_dtype], vectors(count, wider), args, device, stream, "cast kernel");
  }, WithoutGil(), py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("src_dtype"),
     py::arg("dst_dtype"), py::arg("device"), py::arg("stream"));

  m.def("copy", [](uintptr_t dst, uintptr_t src, long long nbytes, int device, uintptr_t stream) {
    void* args[] = {&dst, &src, &nbytes};
    launch((Kernel)commlib_copy, (nbytes + 15) / 16, args, device, stream, "copy kernel");
  }, WithoutGil(), py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("stream"));

  m.def("wire_encode", [](uintptr_t data, uintptr_t residual, uintptr_t packet, long long count,
                          int format, int block, int device, uintptr_t stream) {
    const long long work = wire_work(format, count, block, ENCODE, "wire_encode");
    void* args[] = {&data, &residual, &packet, &count, &block};
    launch(kWire[format][ENCODE], work, args, device, stream, "wire encode kernel");
  }, WithoutGil(), py::arg("data"), py::arg("residual"), py::arg("packet"), py::arg("count"),
     py::arg("format"), py::arg("block"), py::arg("device"), py::arg("stream"),
     "packet <- data (+ residual, where not 0), the residual <- what the packet lost (csrc/wire.h)");

  m.def("wire_decode_sum", [](uintptr_t out, std::vector<uintptr_t> packets, long long count,
                              int format, int block, float factor, int device, uintptr_t stream) {
    const long long work = wire_work(format, count, block, DECODE_SUM, "wire_decode_sum");
    commlib_cuda::Sources src = packet_sources(packets, "wire_decode_sum");
    int n = int(packets.size());
    void* args[] = {&out, &src, &n, &count, &block, &factor};
    launch(kWire[format][DECODE_SUM], work, args, device, stream, "wire decode kernel");
  }, WithoutGil(), py::arg("out"), py::arg("packets"), py::arg("count"), py::arg("format"),
     py::arg("block"), py::arg("factor"), py::arg("device"), py::arg("stream"),
     "out <- factor x the sum of 1 to 16 packets' values, in their order, in float32");

  m.def("wire_sum_encode", [](uintptr_t packet, uintptr_t residual, std::vector<uintptr_t> packets,
                              long long count, int format, int block, float factor, int device,
                              uintptr_t stream) {
    const long long work = wire_work(format, count, block, SUM_ENCODE, "wire_sum_encode");
    commlib_cuda::Sources src = packet_sources(packets, "wire_sum_encode");
    int n = int(packets.size());
    void* args[] = {&packet, &residual, &src, &n, &count, &block, &factor};
    launch(kWire[format][SUM_ENCODE], work, args, device, stream, "wire sum-encode kernel");
  }, WithoutGil(), py::arg("packet"), py::arg("residual"), py::arg("packets"), py::arg("count"),
     py::arg("format"), py::arg("block"), py::arg("factor"), py::arg("device"), py::arg("stream"),
     "packet <- the encoded factor x sum of 1 to 16 packets (+ residual, where not 0), one pass");

  m.def("load_kernels", [](int device) {
    OnDevice on(device);
    load_every_kernel(device);
  }, WithoutGil(), py::arg("device"),
     "Load every kernel on `device` now (once): call before enqueuing a wait for the host");

  m.def("device_count", [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {  // no driver or no device: none to use
      cudaGetLastError();
      return 0;
    }
    return n;
  }, WithoutGil(), "CUDA devices this process sees (0 without a driver or a device)");

  bind_streams(m);
  bind_ipc(m);

  py::dict info;
  info["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." +
                         std::to_string(CUDART_VERSION % 1000 / 10);
  info["nvcc_flags"] = COMMLIB_NVCC_FLAGS;
  m.attr("BUILD_INFO") = info;
}
