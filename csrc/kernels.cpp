// Argument checking and instruction-set dispatch for the kernels in kernels.h.
//
// The kernels are plain portable C++. On x86-64 the same source is compiled a
// second time inside a target("avx2,f16c") function and picked at run time
// with __builtin_cpu_supports, so the .so runs on any x86-64 but uses 256-bit
// vectors (and F16C float16 conversion; every AVX2 CPU has it) where
// available. Setting COMMLIB_SIMD=baseline forces the portable path (used by
// the tests to cover it on AVX2 machines).
#include "kernels.h"

#include "user_ops.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define COMMLIB_X86_DISPATCH 1
#include <immintrin.h>
#define COMMLIB_AVX2 __attribute__((target("avx2,f16c")))
#else
#define COMMLIB_X86_DISPATCH 0
#endif

#ifndef COMMLIB_CXX_FLAGS
#define COMMLIB_CXX_FLAGS "unknown"
#endif

namespace commlib {
namespace {

template <class O, class T, class Cvt>
COMMLIB_INLINE void reduce_n(T* d, const T* a, const T* b, size_t n) {
  if constexpr (std::is_same_v<T, f16>) reduce_half<O, Cvt>(d, a, b, n);
  else reduce_loop<O>(d, a, b, n);
}

template <class T, class Cvt>
COMMLIB_INLINE void reduce_typed(void* dst, const void* a, const void* b, size_t n, int op) {
  auto d = static_cast<T*>(dst);
  auto x = static_cast<const T*>(a);
  auto y = static_cast<const T*>(b);
  switch (op) {
    case SUM: return reduce_n<Sum, T, Cvt>(d, x, y, n);
    case PROD: return reduce_n<Prod, T, Cvt>(d, x, y, n);
    case MIN: return reduce_n<Min, T, Cvt>(d, x, y, n);
    case MAX: return reduce_n<Max, T, Cvt>(d, x, y, n);
    case BAND: return reduce_n<BitAnd, T, Cvt>(d, x, y, n);
    case BOR: return reduce_n<BitOr, T, Cvt>(d, x, y, n);
    case BXOR: return reduce_n<BitXor, T, Cvt>(d, x, y, n);
  }
}

// The single body that every instruction-set variant below inlines; Cvt is
// that variant's float16 converter.
template <class Cvt>
COMMLIB_INLINE void reduce_any(void* dst, const void* a, const void* b, size_t n, int dtype, int op) {
  switch (dtype) {
    case F16: return reduce_typed<f16, Cvt>(dst, a, b, n, op);
    case BF16: return reduce_typed<bf16, Cvt>(dst, a, b, n, op);
    case F32: return reduce_typed<float, Cvt>(dst, a, b, n, op);
    case F64: return reduce_typed<double, Cvt>(dst, a, b, n, op);
    case I8: return reduce_typed<int8_t, Cvt>(dst, a, b, n, op);
    case U8: return reduce_typed<uint8_t, Cvt>(dst, a, b, n, op);
    case I32: return reduce_typed<int32_t, Cvt>(dst, a, b, n, op);
    case I64: return reduce_typed<int64_t, Cvt>(dst, a, b, n, op);
  }
}

template <class Cvt>
COMMLIB_INLINE void scale_any(void* dst, size_t n, int dtype, double f) {
  switch (dtype) {
    case F16: return scale_half<Cvt>(static_cast<f16*>(dst), n, float(f));
    case BF16: return scale_loop(static_cast<bf16*>(dst), n, float(f));
    case F32: return scale_loop(static_cast<float*>(dst), n, float(f));
    case F64: return scale_loop(static_cast<double*>(dst), n, f);
  }
}

void reduce_baseline(void* d, const void* a, const void* b, size_t n, int t, int op) {
  reduce_any<HalfCvt>(d, a, b, n, t, op);
}
void scale_baseline(void* d, size_t n, int t, double f) { scale_any<HalfCvt>(d, n, t, f); }

#if COMMLIB_X86_DISPATCH
// Not inline: intrinsics need the target attribute on the enclosing function,
// and one call per block is cheap. vcvtps2ph with imm 0 rounds to nearest-even
// and quiets NaNs exactly like detail::float_to_half, so results match.
struct HalfCvtF16C {
  COMMLIB_AVX2 static void to_float(float* out, const f16* in, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    HalfCvt::to_float(out + i, in + i, n - i);
  }
  COMMLIB_AVX2 static void from_float(f16* out, const float* in, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), 0));
    HalfCvt::from_float(out + i, in + i, n - i);
  }
};

COMMLIB_AVX2 void reduce_avx2(void* d, const void* a, const void* b, size_t n, int t, int op) {
  reduce_any<HalfCvtF16C>(d, a, b, n, t, op);
}
COMMLIB_AVX2 void scale_avx2(void* d, size_t n, int t, double f) { scale_any<HalfCvtF16C>(d, n, t, f); }

bool pick_avx2() {
  const char* env = std::getenv("COMMLIB_SIMD");
  if (env && std::string(env) == "baseline") return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
const bool use_avx2 = pick_avx2();
#else
const bool use_avx2 = false;
#endif

void check(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

void check_common(const void* dst, int64_t count, int dtype) {
  check(count >= 0, "count must be >= 0, got " + std::to_string(count));
  check(dtype >= F16 && dtype <= I64, "invalid dtype code " + std::to_string(dtype) + " (see _C.DTYPES)");
  check(count == 0 || dst != nullptr, "null pointer with count > 0");
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, int64_t count, int dtype, int op) {
  check_common(dst, count, dtype);
  check(count == 0 || (a != nullptr && b != nullptr), "null pointer with count > 0");
  if (is_user_op(op)) return user_reduce(dst, a, b, count, dtype, op);
  check(op >= SUM && op <= kLastOp, "invalid op code " + std::to_string(op) + " (see _C.OPS)");
  check(!bitwise(op) || !kDTypes[dtype].floating,
        std::string("bitwise op '") + kOpNames[op] + "' needs an integer dtype");
  if (op == AVG) op = SUM;
  if (use_avx2) {
#if COMMLIB_X86_DISPATCH
    return reduce_avx2(dst, a, b, size_t(count), dtype, op);
#endif
  }
  reduce_baseline(dst, a, b, size_t(count), dtype, op);
}

void scale(void* dst, int64_t count, int dtype, double factor) {
  check_common(dst, count, dtype);
  check(dtype <= F64, "scale needs a floating dtype (float16, bfloat16, float32, float64), got dtype code " +
                          std::to_string(dtype));
  if (use_avx2) {
#if COMMLIB_X86_DISPATCH
    return scale_avx2(dst, size_t(count), dtype, factor);
#endif
  }
  scale_baseline(dst, size_t(count), dtype, factor);
}

#if COMMLIB_X86_DISPATCH
// Copies whole 64-byte blocks with 16-byte unaligned loads, the stores cached or streamed
// past the cache; leaves d, s and n at the tail (n < 64).
template <bool Streaming>
void copy_blocks(char*& d, const char*& s, size_t& n) {
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    __m128i block[4];
    for (int k = 0; k < 4; ++k) block[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * k));
    for (int k = 0; k < 4; ++k) {
      auto* to = reinterpret_cast<__m128i*>(d + 16 * k);
      if constexpr (Streaming) _mm_stream_si128(to, block[k]);
      else _mm_storeu_si128(to, block[k]);
    }
  }
}
#endif

// glibc's memmove moves blocks from a few KiB to about a MiB with `rep movsb`, which on
// AMD Zen runs some 20 times slower where the destination lies 1 to 31 bytes past the
// source modulo 4 KiB (rep_movsb_aliases): 64 KiB in 24-39 us instead of 1.6 (2-core AMD
// EPYC, glibc 2.36). numpy arrays allocated one after the other lie 16 bytes apart so,
// and a staged copy meets any offset of a user's buffer against its slot. There a loop of
// 16-byte loads and stores copies instead (2.1 us).
void copy(void* dst, const void* src, int64_t nbytes) {
  if (nbytes < 0) check(false, "nbytes must be >= 0, got " + std::to_string(nbytes));
  if (nbytes == 0) return;
  check(dst != nullptr && src != nullptr, "null pointer with nbytes > 0");
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  size_t n = size_t(nbytes);
  bool aliased = rep_movsb_aliases(d, s), apart = d + n <= s || s + n <= d;
#if COMMLIB_X86_DISPATCH
  if (aliased && apart && n >= 2048) copy_blocks<false>(d, s, n);
#else
  (void)aliased, (void)apart;
#endif
  std::memmove(d, s, n);
}

// Non-temporal stores skip the read-for-ownership a normal store does on a cache miss, so a
// copy into memory that is not in cache moves a third less DRAM traffic. Worth it only for
// destinations far larger than the cache; the caller decides. Ends with a store fence, so
// a flag published after it orders behind the data.
void copy_streaming(void* dst, const void* src, int64_t nbytes) {
#if COMMLIB_X86_DISPATCH
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  size_t n = size_t(nbytes);
  size_t head = n < 256 ? n : (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  copy_blocks<true>(d, s, n);
  std::memcpy(d, s, n);
  _mm_sfence();
#else
  std::memcpy(dst, src, size_t(nbytes));
#endif
}

BuildInfo build_info() {
#if defined(__clang__)
  const char* compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  const char* compiler = "gcc " __VERSION__;
#else
  const char* compiler = "unknown";
#endif
  return {compiler, COMMLIB_CXX_FLAGS, use_avx2 ? "avx2 (runtime dispatch)" : "baseline"};
}

}  // namespace commlib
