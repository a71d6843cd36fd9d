// Device kernels of commlib's GPU path: elementwise reduce (of two arrays, or of up to 16
// peers' arrays read through CUDA IPC, into up to 16 destinations), scale, copy and cast.
//
// One source, two compilers: nvcc builds it into commlib._cuda (csrc/cuda/launch.cu
// includes it), and where commlib was built without CUDA, commlib/cuda/runtime.py compiles
// it at run time with NVRTC through CuPy. So it includes no header: NVRTC has no host
// standard library.
//
// Vocabulary (as in csrc/kernels.h):
//   dtype    element type; the kernel names spell it (f16 bf16 f32 f64 i8 u8 i32 i64).
//   op       sum, prod, min, max (avg reduces as sum, then the caller scales).
//   storage  f16/bf16 are raw 16-bit patterns; the arithmetic runs in float for them
//            (convert, apply, round to nearest-even), in the type itself otherwise.
//            Integer sum/prod go through unsigned arithmetic, so overflow wraps as on the
//            CPU; min/max propagate NaN like np.minimum/np.maximum.
//   vector   16 bytes: a thread loads, combines and stores one vector per step (a cast:
//            16 bytes of its wider side). Elements past the last whole vector, or all of
//            them where a pointer is not aligned for it, go one at a time.
// Kernels are extern "C", named commlib_<kernel>_<dtype>[_<op or dtype>], so that NVRTC's
// module finds them by name.

namespace commlib_cuda {

typedef long long i64;
typedef unsigned long long u64;

struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

#ifndef COMMLIB_KERNELS_ON_HOST  // tests/cuda_on_host.cpp brings its own
__device__ __forceinline__ float f16_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short float_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u | 0x400000u) >> 16));  // quiet NaN
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // nearest even
}

// Elem<T>: C the type arithmetic runs in, W the type sums and products wrap in.
template <class T> struct Elem {
  typedef T C;
  typedef T W;
  __device__ static C load(T x) { return x; }
  __device__ static T store(C x) { return x; }
};
template <> struct Elem<f16> {
  typedef float C;
  typedef float W;
  __device__ static float load(f16 x) { return f16_to_float(x.bits); }
  __device__ static f16 store(float x) { f16 r; r.bits = float_to_f16(x); return r; }
};
template <> struct Elem<bf16> {
  typedef float C;
  typedef float W;
  __device__ static float load(bf16 x) { return __uint_as_float((unsigned)x.bits << 16); }
  __device__ static bf16 store(float x) { bf16 r; r.bits = float_to_bf16(x); return r; }
};
#define COMMLIB_WRAPPING(T, U)                       \
  template <> struct Elem<T> {                       \
    typedef T C;                                     \
    typedef U W;                                     \
    __device__ static C load(T x) { return x; }      \
    __device__ static T store(C x) { return x; }     \
  };
COMMLIB_WRAPPING(signed char, unsigned)
COMMLIB_WRAPPING(unsigned char, unsigned)
COMMLIB_WRAPPING(int, unsigned)
COMMLIB_WRAPPING(i64, u64)
#undef COMMLIB_WRAPPING

struct Sum {
  template <class E> __device__ static typename E::C apply(typename E::C a, typename E::C b) {
    return typename E::C(typename E::W(a) + typename E::W(b));
  }
};
struct Prod {
  template <class E> __device__ static typename E::C apply(typename E::C a, typename E::C b) {
    return typename E::C(typename E::W(a) * typename E::W(b));
  }
};
struct Min {
  template <class E> __device__ static typename E::C apply(typename E::C a, typename E::C b) {
    return (a < b || a != a) ? a : b;
  }
};
struct Max {
  template <class E> __device__ static typename E::C apply(typename E::C a, typename E::C b) {
    return (a > b || a != a) ? a : b;
  }
};

struct alignas(16) Vector { unsigned w[4]; };

// A loaded vector (or Raw-sized group) seen as its elements. Through a union: reading it
// through a cast element pointer breaks C++'s aliasing rule, and GCC then reads stale
// bytes (tests/cuda_on_host.cpp caught it); GCC, Clang and NVCC define reads through a union.
template <class Raw, class T> union Pack {
  Raw raw;
  T e[sizeof(Raw) / sizeof(T)];
};

__device__ __forceinline__ bool aligned(const void* p) { return ((u64)p & 15) == 0; }
__device__ __forceinline__ i64 first_index() { return blockIdx.x * (i64)blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 stride() { return (i64)gridDim.x * blockDim.x; }

// dst[i] = a[i] op b[i]; dst may be a or b.
template <class T, class Op>
__device__ void reduce(T* dst, const T* a, const T* b, i64 n) {
  typedef Elem<T> E;
  const int per = sizeof(Vector) / sizeof(T);
  const i64 vectors = aligned(dst) && aligned(a) && aligned(b) ? n / per : 0;
  for (i64 v = first_index(); v < vectors; v += stride()) {
    Pack<Vector, T> x, y, z;
    x.raw = reinterpret_cast<const Vector*>(a)[v];
    y.raw = reinterpret_cast<const Vector*>(b)[v];
#pragma unroll
    for (int i = 0; i < per; ++i) z.e[i] = E::store(Op::template apply<E>(E::load(x.e[i]), E::load(y.e[i])));
    reinterpret_cast<Vector*>(dst)[v] = z.raw;
  }
  for (i64 i = vectors * per + first_index(); i < n; i += stride())
    dst[i] = E::store(Op::template apply<E>(E::load(a[i]), E::load(b[i])));
}

// Up to kMaxPointers arrays, passed by value (a kernel parameter, no device array to fill).
constexpr int kMaxPointers = 16;
struct Sources { const void* p[kMaxPointers]; };
struct Targets { void* p[kMaxPointers]; };

// dst[d][i] = src[0][i] op src[1][i] op ... op src[n-1][i] for each of the m destinations,
// the sources in rank order (so every rank computes the same bits). A destination may be a
// source: a thread reads every source's element (or vector) before it writes any. Writing
// every destination from the registers costs one read of each source, where a reduce and
// then copies would read the result again.
template <class T, class Op>
__device__ void reduce_n(Targets dst, int m, Sources src, int n, i64 count) {
  typedef Elem<T> E;
  const int per = sizeof(Vector) / sizeof(T);
  bool all_aligned = true;
  for (int k = 0; k < n; ++k) all_aligned = all_aligned && aligned(src.p[k]);
  for (int d = 0; d < m; ++d) all_aligned = all_aligned && aligned(dst.p[d]);
  const i64 vectors = all_aligned ? count / per : 0;
  for (i64 v = first_index(); v < vectors; v += stride()) {
    Pack<Vector, T> x;
    x.raw = reinterpret_cast<const Vector*>(src.p[0])[v];
    typename E::C acc[sizeof(Vector) / sizeof(T)];
#pragma unroll
    for (int i = 0; i < per; ++i) acc[i] = E::load(x.e[i]);
    for (int k = 1; k < n; ++k) {
      x.raw = reinterpret_cast<const Vector*>(src.p[k])[v];
#pragma unroll
      for (int i = 0; i < per; ++i) acc[i] = Op::template apply<E>(acc[i], E::load(x.e[i]));
    }
#pragma unroll
    for (int i = 0; i < per; ++i) x.e[i] = E::store(acc[i]);
    for (int d = 0; d < m; ++d) reinterpret_cast<Vector*>(dst.p[d])[v] = x.raw;
  }
  for (i64 i = vectors * per + first_index(); i < count; i += stride()) {
    typename E::C acc = E::load(static_cast<const T*>(src.p[0])[i]);
    for (int k = 1; k < n; ++k) acc = Op::template apply<E>(acc, E::load(static_cast<const T*>(src.p[k])[i]));
    const T result = E::store(acc);
    for (int d = 0; d < m; ++d) static_cast<T*>(dst.p[d])[i] = result;
  }
}

// x[i] *= factor (avg: the sum divided by the number of ranks).
template <class T>
__device__ void scale(T* x, double factor, i64 n) {
  typedef Elem<T> E;
  const typename E::C f = typename E::C(factor);
  const int per = sizeof(Vector) / sizeof(T);
  const i64 vectors = aligned(x) ? n / per : 0;
  for (i64 v = first_index(); v < vectors; v += stride()) {
    Pack<Vector, T> y;
    y.raw = reinterpret_cast<const Vector*>(x)[v];
#pragma unroll
    for (int i = 0; i < per; ++i) y.e[i] = E::store(E::load(y.e[i]) * f);
    reinterpret_cast<Vector*>(x)[v] = y.raw;
  }
  for (i64 i = vectors * per + first_index(); i < n; i += stride()) x[i] = E::store(E::load(x[i]) * f);
}

// N bytes moved as one load or store (N = 4, 8 or 16, the pointer aligned to N). Words, as
// Vector: with a char array NVCC stored a bf16 -> f32 group as one 16-byte store patched by
// eight narrower ones (2.5 times the time on an H200).
template <int N> struct alignas(N) Bytes { unsigned w[N / 4]; };

// dst[i] = src[i] converted. A step converts as many elements as fill 16 bytes of the
// wider type: one vector of that side, a narrower load or store of the other.
template <class S, class D>
__device__ void cast(D* dst, const S* src, i64 n) {
  const int per = sizeof(Vector) / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  typedef Bytes<per * sizeof(S)> In;
  typedef Bytes<per * sizeof(D)> Out;
  const bool whole = ((u64)src % sizeof(In)) == 0 && ((u64)dst % sizeof(Out)) == 0;
  const i64 groups = whole ? n / per : 0;
  for (i64 g = first_index(); g < groups; g += stride()) {
    Pack<In, S> in;
    Pack<Out, D> out;
    in.raw = reinterpret_cast<const In*>(src)[g];
#pragma unroll
    for (int i = 0; i < per; ++i) out.e[i] = Elem<D>::store(typename Elem<D>::C(Elem<S>::load(in.e[i])));
    reinterpret_cast<Out*>(dst)[g] = out.raw;
  }
  for (i64 i = groups * per + first_index(); i < n; i += stride())
    dst[i] = Elem<D>::store(typename Elem<D>::C(Elem<S>::load(src[i])));
}

__device__ void copy(char* dst, const char* src, i64 nbytes) {
  const i64 vectors = aligned(dst) && aligned(src) ? nbytes / (i64)sizeof(Vector) : 0;
  for (i64 v = first_index(); v < vectors; v += stride())
    reinterpret_cast<Vector*>(dst)[v] = reinterpret_cast<const Vector*>(src)[v];
  for (i64 i = vectors * (i64)sizeof(Vector) + first_index(); i < nbytes; i += stride())
    dst[i] = src[i];
}

}  // namespace commlib_cuda

// The entry points, one per dtype (and op, or target dtype).
#define COMMLIB_REDUCE(name, T, op, Op)                                                     \
  extern "C" __global__ void commlib_reduce_##name##_##op(T* d, const T* a, const T* b,    \
                                                          long long n) {                    \
    commlib_cuda::reduce<T, commlib_cuda::Op>(d, a, b, n);                                  \
  }
#define COMMLIB_REDUCE_N(name, T, op, Op)                                                   \
  extern "C" __global__ void commlib_reduce_n_##name##_##op(                                \
      commlib_cuda::Targets d, int m, commlib_cuda::Sources s, int n, long long count) {    \
    commlib_cuda::reduce_n<T, commlib_cuda::Op>(d, m, s, n, count);                         \
  }
#define COMMLIB_DTYPE(name, T)                                                              \
  COMMLIB_REDUCE(name, T, sum, Sum)                                                         \
  COMMLIB_REDUCE(name, T, prod, Prod)                                                       \
  COMMLIB_REDUCE(name, T, min, Min)                                                         \
  COMMLIB_REDUCE(name, T, max, Max)                                                         \
  COMMLIB_REDUCE_N(name, T, sum, Sum)                                                       \
  COMMLIB_REDUCE_N(name, T, prod, Prod)                                                     \
  COMMLIB_REDUCE_N(name, T, min, Min)                                                       \
  COMMLIB_REDUCE_N(name, T, max, Max)
COMMLIB_DTYPE(f16, commlib_cuda::f16)
COMMLIB_DTYPE(bf16, commlib_cuda::bf16)
COMMLIB_DTYPE(f32, float)
COMMLIB_DTYPE(f64, double)
COMMLIB_DTYPE(i8, signed char)
COMMLIB_DTYPE(u8, unsigned char)
COMMLIB_DTYPE(i32, int)
COMMLIB_DTYPE(i64, long long)
#undef COMMLIB_DTYPE
#undef COMMLIB_REDUCE_N
#undef COMMLIB_REDUCE

// Scaling (avg) and casts, between the floating types (mixed-precision communication).
#define COMMLIB_SCALE(name, T)                                                              \
  extern "C" __global__ void commlib_scale_##name(T* x, double f, long long n) {           \
    commlib_cuda::scale<T>(x, f, n);                                                        \
  }
COMMLIB_SCALE(f16, commlib_cuda::f16)
COMMLIB_SCALE(bf16, commlib_cuda::bf16)
COMMLIB_SCALE(f32, float)
COMMLIB_SCALE(f64, double)
#undef COMMLIB_SCALE

#define COMMLIB_CAST(sname, S, dname, D)                                                    \
  extern "C" __global__ void commlib_cast_##sname##_##dname(D* d, const S* s, long long n) { \
    commlib_cuda::cast<S, D>(d, s, n);                                                      \
  }
#define COMMLIB_CASTS_FROM(sname, S)                                                        \
  COMMLIB_CAST(sname, S, f16, commlib_cuda::f16)                                            \
  COMMLIB_CAST(sname, S, bf16, commlib_cuda::bf16)                                          \
  COMMLIB_CAST(sname, S, f32, float)                                                        \
  COMMLIB_CAST(sname, S, f64, double)
COMMLIB_CASTS_FROM(f16, commlib_cuda::f16)
COMMLIB_CASTS_FROM(bf16, commlib_cuda::bf16)
COMMLIB_CASTS_FROM(f32, float)
COMMLIB_CASTS_FROM(f64, double)
#undef COMMLIB_CASTS_FROM
#undef COMMLIB_CAST

extern "C" __global__ void commlib_copy(char* d, const char* s, long long nbytes) {
  commlib_cuda::copy(d, s, nbytes);
}

// A stream's wait for a counter in pinned host memory that the host raises, by a kernel:
// one thread reads it until it reaches `value` (a cyclic >=, as cuStreamWaitValue32's),
// then the stream goes on. The other way to wait (COMMLIB_CUDA_WAIT=kernel), for a driver
// whose stream memory operations do not see the host's writes.
extern "C" __global__ void commlib_wait_counter(const volatile unsigned* counter, unsigned value) {
  while (static_cast<int>(*counter - value) < 0) {
#ifndef COMMLIB_KERNELS_ON_HOST
    __nanosleep(200);
#endif
  }
}

// A stream's arrival at a meeting, by a kernel (COMMLIB_CUDA_WAIT=kernel), as
// cuStreamWriteValue32 marks it: once the work before it on the stream is done, one thread
// stores `value` into the word in pinned host memory that the GPU proxy watches.
extern "C" __global__ void commlib_write_counter(volatile unsigned* counter, unsigned value) {
#ifndef COMMLIB_KERNELS_ON_HOST
  __threadfence_system();  // what the stream wrote before is visible first
#endif
  *counter = value;
}
