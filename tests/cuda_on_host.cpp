// commlib/cuda/kernels.cu and wire.cu compiled for the CPU, so that machines without a GPU run the
// kernels' own code: indexing, 16-byte vectors and their tails, alignment, every op and
// dtype. Each CUDA thread of a grid runs in turn (cuda_on_host.py sets the indices and
// calls the kernel); the kernels are grid-stride loops with no shared memory or barriers,
// so running the threads one after another computes what the GPU computes.
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline

struct Index { unsigned x; };
// cuda_on_host.py sets them by name; the simulated GPU (simulated_gpu.cpp) runs kernels on
// several stream threads at once, each with its own
#ifdef COMMLIB_THREAD_INDICES
thread_local Index blockIdx, threadIdx, blockDim, gridDim;
#else
extern "C" { Index blockIdx, threadIdx, blockDim, gridDim; }
#endif

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// The device's correctly rounded operations (wire.cu spells them so that nothing contracts
// to an FMA): plain ones here, where nothing does (-O2 for baseline x86-64 has no FMA).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float v) { return int(__builtin_rintf(v)); }  // nearest-even

// The device converts float16 with PTX cvt (round to nearest even); GCC's _Float16 does the same.
#define COMMLIB_KERNELS_ON_HOST
namespace commlib_cuda {
inline float f16_to_float(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return float(x); }
inline unsigned short float_to_f16(float f) {
  _Float16 x = _Float16(f);
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}
}  // namespace commlib_cuda

#include "../commlib/cuda/kernels.cu"
#include "../commlib/cuda/wire.cu"
