// Elementwise reduction kernels for commlib._C.
//
// Vocabulary (used throughout csrc/):
//   dtype    element type code; values match _C.DTYPES (enum DType below).
//   op       binary reduction operator code; values match _C.OPS (enum Op).
//   count    number of elements (never bytes; only copy() takes nbytes).
//   storage  type of an element in memory. float16/bfloat16 are stored as raw
//            16-bit patterns (structs f16/bf16) because C++17 has no portable
//            type for them.
//   compute  type the arithmetic runs in: float for f16/bf16 (convert, apply,
//            round to nearest-even), the type itself otherwise. Integer
//            sum/prod go through unsigned arithmetic so overflow wraps like
//            numpy instead of being undefined behaviour.
//   block    float16 only: a short run of elements converted to float32
//            scratch, reduced there, converted back (reduce_half).
//   reduce   dst[i] = a[i] op b[i]; dst may be exactly a or b (in-place),
//            no other overlap.
//
// Everything here is header-only and force-inlined so that kernels.cpp can
// stamp the same source out once per instruction set (baseline, avx2).
// Results are bit-identical across instruction sets (NaN payloads aside).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace commlib {

enum DType : int { F16 = 0, BF16 = 1, F32 = 2, F64 = 3, I8 = 4, U8 = 5, I32 = 6, I64 = 7 };
// AVG reduces exactly as SUM (the caller scales the result); it has its own code so that
// ranks that disagree about sum and avg are caught (agreement.h).
// BAND, BOR and BXOR (bitwise and, or, xor) take integer dtypes only.
enum Op : int { SUM = 0, PROD = 1, MIN = 2, MAX = 3, AVG = 4, BAND = 5, BOR = 6, BXOR = 7 };
inline constexpr int kLastOp = BXOR;
inline constexpr const char* kOpNames[] = {"sum",  "prod", "min", "max",
                                           "avg",  "band", "bor", "bxor"};  // by code
inline constexpr bool bitwise(int op) { return op >= BAND && op <= BXOR; }

#define COMMLIB_INLINE inline __attribute__((always_inline))
// Exact aliasing (dst == a) is harmless for an elementwise loop, so tell the
// vectoriser not to emit runtime overlap checks.
#if defined(__clang__)
#define COMMLIB_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#else
#define COMMLIB_IVDEP _Pragma("GCC ivdep")
#endif

namespace detail {

COMMLIB_INLINE uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
COMMLIB_INLINE float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Branch-free so loops vectorise: every case is computed, then selected.
// (GCC only if-converts the float op in the unselected arm when built with
// -fno-trapping-math, which setup.py passes.)
COMMLIB_INLINE float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  int32_t em = h & 0x7fff;  // exponent+mantissa
  uint32_t normal = (uint32_t(em) << 13) + ((127 - 15) << 23);  // rebias exponent
  uint32_t infnan = (uint32_t(em) << 13) | 0x7f800000;        // keep payload
  uint32_t sub = bits(float(em) * 0x1p-24f);  // subnormal/zero: exact in float
  uint32_t r = em >= 0x7c00 ? infnan : (em < 0x0400 ? sub : normal);
  return from_bits(r | sign);
}

COMMLIB_INLINE uint16_t float_to_half(float f) {
  uint32_t u = bits(f);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t a = int32_t(u & 0x7fffffff);
  // Normal: rebias, then round-to-nearest-even on the 13 dropped bits (a carry
  // into the exponent is correct, up to and including overflow to inf).
  uint32_t normal = (uint32_t(a) - ((127 - 15) << 23) + 0xfff + ((a >> 13) & 1)) >> 13;
  // Below 2^-14: adding 0.5 makes the FPU round x to a multiple of 2^-24,
  // i.e. the half subnormal mantissa, which lands in the low bits.
  uint32_t sub = bits(from_bits(uint32_t(a)) + 0.5f) - bits(0.5f);
  uint32_t r = a < 0x38800000 ? sub : normal;
  r = a >= 0x47800000 ? 0x7c00u : r;                              // >= 65536: inf
  r = a > 0x7f800000 ? (0x7e00u | ((uint32_t(a) >> 13) & 0x3ff)) : r;  // quiet NaN
  return uint16_t(r | sign);
}

COMMLIB_INLINE float bf16_to_float(uint16_t h) { return from_bits(uint32_t(h) << 16); }

COMMLIB_INLINE uint16_t float_to_bf16(float f) {
  uint32_t u = bits(f);
  // NaN: set the quiet bit and clear the bits rounding would carry out of.
  uint32_t nan = (u | 0x400000) & 0xffff0000;
  u = (u & 0x7fffffff) > 0x7f800000 ? nan : u;
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);  // RNE; overflow -> inf
}

}  // namespace detail

struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

// load/store convert between storage and compute type (float16 has its own
// path, reduce_half below).
template <class T> struct Elem {
  using compute = T;
  static COMMLIB_INLINE T load(T x) { return x; }
  static COMMLIB_INLINE T store(T x) { return x; }
};
template <> struct Elem<bf16> {
  using compute = float;
  static COMMLIB_INLINE float load(bf16 x) { return detail::bf16_to_float(x.bits); }
  static COMMLIB_INLINE bf16 store(float x) { return {detail::float_to_bf16(x)}; }
};

// Unsigned type wide enough that the C++ promotions never produce a signed
// int that could overflow (e.g. uint8*uint8 would otherwise promote to int).
template <class T>
using wrap_t = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

struct Sum {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return T(wrap_t<T>(a) + wrap_t<T>(b));
    else return a + b;
  }
};
struct Prod {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return T(wrap_t<T>(a) * wrap_t<T>(b));
    else return a * b;
  }
};
// Like np.minimum/np.maximum: a NaN in either operand propagates.
struct Min {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) { return (a < b || a != a) ? a : b; }
};
struct Max {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) { return (a > b || a != a) ? a : b; }
};
// Bitwise ops: integer types only (the callers refuse the others, for which these are
// never called; they still compile for every type the dispatch instantiates).
struct BitAnd {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return T(a & b);
    else return a;
  }
};
struct BitOr {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return T(a | b);
    else return a;
  }
};
struct BitXor {
  template <class T> static COMMLIB_INLINE T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return T(a ^ b);
    else return a;
  }
};

template <class O, class T>
COMMLIB_INLINE void reduce_loop(T* dst, const T* a, const T* b, size_t n) {
  using E = Elem<T>;
  COMMLIB_IVDEP
  for (size_t i = 0; i < n; ++i) dst[i] = E::store(O::template apply<typename E::compute>(E::load(a[i]), E::load(b[i])));
}

template <class T>
COMMLIB_INLINE void scale_loop(T* dst, size_t n, typename Elem<T>::compute factor) {
  using E = Elem<T>;
  for (size_t i = 0; i < n; ++i) dst[i] = E::store(E::load(dst[i]) * factor);
}

// float16 runs through float32 blocks: the conversions become separate simple
// loops that kernels.cpp can swap for hardware ones (x86 F16C converts 8
// halves per instruction, several times faster than the bit manipulation).
// HalfCvt is the portable converter; any type with the same two functions works.
struct HalfCvt {
  static COMMLIB_INLINE void to_float(float* out, const f16* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = detail::half_to_float(in[i].bits);
  }
  static COMMLIB_INLINE void from_float(f16* out, const float* in, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i].bits = detail::float_to_half(in[i]);
  }
};
constexpr size_t kHalfBlock = 256;  // two float blocks: 2 KiB, stays in L1

template <class O, class Cvt>
COMMLIB_INLINE void reduce_half(f16* dst, const f16* a, const f16* b, size_t n) {
  float x[kHalfBlock], y[kHalfBlock];
  for (size_t i = 0; i < n; i += kHalfBlock) {
    size_t m = n - i < kHalfBlock ? n - i : kHalfBlock;
    Cvt::to_float(x, a + i, m);  // both operands read before dst is written: aliasing is fine
    Cvt::to_float(y, b + i, m);
    reduce_loop<O>(x, x, y, m);
    Cvt::from_float(dst + i, x, m);
  }
}

template <class Cvt>
COMMLIB_INLINE void scale_half(f16* dst, size_t n, float factor) {
  float x[kHalfBlock];
  for (size_t i = 0; i < n; i += kHalfBlock) {
    size_t m = n - i < kHalfBlock ? n - i : kHalfBlock;
    Cvt::to_float(x, dst + i, m);
    scale_loop(x, m, factor);
    Cvt::from_float(dst + i, x, m);
  }
}

// The dtypes by code (enum DType): the one C++ table of their names, sizes and kinds
// (_C.DTYPES exports it; Python's commlib/dtypes.py builds on that). numpy_kind is
// numpy's dtype.kind for the same type, 0 where numpy has none (bfloat16).
struct DTypeInfo {
  const char* name;
  int64_t itemsize;
  bool floating;
  char numpy_kind;
};
inline constexpr DTypeInfo kDTypes[] = {
    {"float16", 2, true, 'f'}, {"bfloat16", 2, true, 0}, {"float32", 4, true, 'f'},
    {"float64", 8, true, 'f'}, {"int8", 1, false, 'i'},  {"uint8", 1, false, 'u'},
    {"int32", 4, false, 'i'},  {"int64", 8, false, 'i'}};
inline constexpr int kNumDTypes = int(sizeof(kDTypes) / sizeof(kDTypes[0]));

// The dtype's row; throws std::invalid_argument for an unknown code.
inline const DTypeInfo& dtype_info(int dtype) {
  if (dtype < 0 || dtype >= kNumDTypes)
    throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
  return kDTypes[dtype];
}
inline int64_t itemsize(int dtype) { return dtype_info(dtype).itemsize; }

// Entry points (kernels.cpp). Arguments are validated there; they throw
// std::invalid_argument, which pybind11 turns into ValueError.
void reduce(void* dst, const void* a, const void* b, int64_t count, int dtype, int op);
void scale(void* dst, int64_t count, int dtype, double factor);
void copy(void* dst, const void* src, int64_t nbytes);  // memmove
// Whether `rep movsb` (glibc's memmove from a few KiB, the kernel's copies to and from user
// memory) runs slow from `src` to `dst`: some 3-20x on AMD Zen where the destination lies
// 1-31 bytes past the source modulo 4 KiB (each load waits on a store 4 KiB before it).
inline bool rep_movsb_aliases(const void* dst, const void* src) {
  uintptr_t gap = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  return gap != 0 && gap < 32;
}
void copy_streaming(void* dst, const void* src, int64_t nbytes);  // no overlap; bypasses cache

struct BuildInfo {
  const char* compiler;
  const char* cxx_flags;
  const char* simd;  // code path the dispatcher picked on this CPU
};
BuildInfo build_info();

}  // namespace commlib
