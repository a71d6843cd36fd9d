// Device kernels of the wire formats (csrc/wire.h has the vocabulary: format, block,
// packet, residual, encode, decode_sum, sum_encode): the packets csrc/wire.cpp makes on the
// CPU, bit for bit, so that a GPU's packets and a CPU's meet in one collective.
//
// Follows kernels.cu in one source (Sources, first_index, stride, the float16 conversions).
// Every rounding is spelled (__fmul_rn, __fadd_rn, ...): both compilers would otherwise
// contract a multiply and an add into one FMA, and its single rounding is not the CPU's two.
//
// Work per thread: a scaled format's encode needs a block's largest magnitude before any
// of its codes, so a thread takes a whole block (reading its elements twice: once for the
// maximum, once for the codes; recomputing them costs less than staging 256 floats). The
// 2-byte formats, and every decode, go an element per thread. Grid-stride loops, no shared
// memory or barriers, as kernels.cu's (so tests/cuda_on_host.cpp runs them on the CPU).
// Packets are bytes at any address (a rank's packets lie `width` bytes apart), so scales
// and 2-byte codes are read and written a byte at a time.
//
// Kernels: commlib_wire_<encode|decode_sum|sum_encode>_<format>, the format spelt as
// commlib.compressed.FORMATS has it.

namespace commlib_cuda {

enum WireFormat { kBF16 = 0, kF16 = 1, kINT8 = 2, kE4M3 = 3, kE5M2 = 4 };

constexpr float kFloatMax = 3.40282346638528859812e+38f;

// An 8-bit float, as csrc/wire.cpp's Fp8: `mantissa` bits, exponent `bias`, its largest
// value and code, NaN's code, whether it has infinities, and the rounding anchors.
template <int F> struct Fp8;
template <> struct Fp8<kE4M3> {  // OCP's "fn" variant: no infinities, 448 the largest
  static constexpr int mantissa = 3, bias = 7;
  static constexpr unsigned min_normal_bits = 0x3c800000u, largest_code = 0x7e, nan_code = 0x7f;
  static constexpr bool has_inf = false;
  __device__ static float largest() { return 448.0f; }
  __device__ static float subnormal_anchor() { return 16384.0f; }
};
template <> struct Fp8<kE5M2> {  // IEEE-like: 57344 the largest
  static constexpr int mantissa = 2, bias = 15;
  static constexpr unsigned min_normal_bits = 0x38800000u, largest_code = 0x7b, nan_code = 0x7f;
  static constexpr bool has_inf = true;
  __device__ static float largest() { return 57344.0f; }
  __device__ static float subnormal_anchor() { return 128.0f; }
};

template <int F> __device__ __forceinline__ float wire_largest() {
  if constexpr (F == kINT8) return 127.0f;
  else return Fp8<F>::largest();
}

// v's code (|v| at most the largest value, or NaN), rounded to nearest-even, saturating;
// `value` <- the value the code stands for.
template <int F>
__device__ __forceinline__ unsigned char to_fp8(float v, float& value) {
  typedef Fp8<F> P;
  const unsigned u = __float_as_uint(v), sign = u & 0x80000000u, a = u & 0x7fffffffu;
  const int shift = 23 - P::mantissa;
  const unsigned rounded = (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1)) & ~((1u << shift) - 1);
  const unsigned normal = (rounded - ((unsigned)(127 - P::bias) << 23)) >> shift;
  const float sub_sum = __fadd_rn(__uint_as_float(a), P::subnormal_anchor());
  const bool subnormal = a < P::min_normal_bits;
  unsigned code = subnormal ? __float_as_uint(sub_sum) - __float_as_uint(P::subnormal_anchor()) : normal;
  unsigned value_bits = subnormal ? __float_as_uint(__fsub_rn(sub_sum, P::subnormal_anchor())) : rounded;
  if (code > P::largest_code) code = P::largest_code, value_bits = __float_as_uint(P::largest());
  if (a > 0x7f800000u) code = P::nan_code, value_bits = a;
  value = __uint_as_float(value_bits | sign);
  return (unsigned char)(code | sign >> 24);
}

template <int F>
__device__ __forceinline__ float fp8_value(unsigned char code) {
  typedef Fp8<F> P;
  const unsigned c = code, m = P::mantissa, emask = (1u << (7 - m)) - 1;
  const unsigned e = (c >> m) & emask, mantissa = c & ((1u << m) - 1);
  const float step = __uint_as_float((unsigned)(127 + 1 - P::bias - P::mantissa) << 23);
  unsigned v = e == 0 ? __float_as_uint(__fmul_rn((float)mantissa, step))
                      : (e + (unsigned)(127 - P::bias)) << 23 | mantissa << (23 - m);
  if (P::has_inf)
    v = e == emask ? 0x7f800000u | mantissa << (23 - m) : v;
  else
    v = (c & 0x7f) == 0x7f ? 0x7fc00000u : v;
  return __uint_as_float(v | (c & 0x80) << 24);
}

__device__ __forceinline__ float load_unaligned_float(const unsigned char* p) {
  const unsigned u = p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16 | (unsigned)p[3] << 24;
  return __uint_as_float(u);
}
__device__ __forceinline__ void store_unaligned_float(unsigned char* p, float f) {
  const unsigned u = __float_as_uint(f);
  p[0] = (unsigned char)u, p[1] = (unsigned char)(u >> 8);
  p[2] = (unsigned char)(u >> 16), p[3] = (unsigned char)(u >> 24);
}

// Element i of a packet of `count` elements, decoded (`blocks` scales before the codes).
template <int F>
__device__ __forceinline__ float wire_decode(const unsigned char* packet, i64 i, i64 blocks,
                                             int block) {
  if constexpr (F == kBF16 || F == kF16) {
    const unsigned short h = (unsigned short)(packet[2 * i] | packet[2 * i + 1] << 8);
    return F == kBF16 ? __uint_as_float((unsigned)h << 16) : f16_to_float(h);
  } else {
    const float scale = load_unaligned_float(packet + 4 * (i / block));
    const unsigned char c = packet[4 * blocks + i];
    float value;
    if constexpr (F == kINT8) value = (float)(signed char)c;
    else value = fp8_value<F>(c);
    return __fmul_rn(value, scale);
  }
}

// factor x (decode(packet 0)[i] + decode(packet 1)[i] + ...), in that order from 0.0f (so
// -0.0 sums to +0.0, as on the CPU).
template <int F>
__device__ __forceinline__ float wire_sum(const Sources& packets, int n, i64 i, i64 blocks,
                                          int block, float factor) {
  float acc = 0.0f;
  for (int k = 0; k < n; ++k)
    acc = __fadd_rn(acc, wire_decode<F>(static_cast<const unsigned char*>(packets.p[k]), i, blocks, block));
  return factor != 1.0f ? __fmul_rn(acc, factor) : acc;
}

// Where a block's values come from: the data (+ the residual), or a sum of packets.
struct DataValues {
  const float* data;
  __device__ float operator()(i64 i) const { return data[i]; }
};
template <int F> struct SumValues {
  const Sources* packets;
  int n;
  i64 blocks;
  int block;
  float factor;
  __device__ float operator()(i64 i) const { return wire_sum<F>(*packets, n, i, blocks, block, factor); }
};

// Elements [at, at + n) of a scaled format (block b): values(i) (+ residual) as codes and a
// scale; the residual becomes what they lost.
template <int F, class Values>
__device__ void wire_encode_block(Values values, float* residual, unsigned char* packet,
                                  i64 blocks, i64 b, i64 at, i64 n) {
  unsigned most = 0;
  for (i64 i = at; i < at + n; ++i) {
    const float y = residual ? __fadd_rn(values(i), residual[i]) : values(i);
    const unsigned a = __float_as_uint(y) & 0x7fffffffu;
    most = a > most ? a : most;
  }
  const float largest = wire_largest<F>();
  const float top = most < 0x7f800000u ? __uint_as_float(most) : __uint_as_float(0x7fc00000u);
  const float scale = __fdiv_rn(top, largest);
  const float quotient = __fdiv_rn(largest, top);
  const float up = kFloatMax < quotient ? kFloatMax : quotient;  // (NaN stays NaN, as std::min)
  store_unaligned_float(packet + 4 * b, scale);
  unsigned char* codes = packet + 4 * blocks;
  for (i64 i = at; i < at + n; ++i) {
    const float y = residual ? __fadd_rn(values(i), residual[i]) : values(i);
    if (scale == 0.0f) {  // zeros of either sign: code 0, the residual keeps them
      codes[i] = 0;
      if (residual) residual[i] = y;
      continue;
    }
    const float v = __fmul_rn(y, up);
    float value;
    if constexpr (F == kINT8) {
      // a NaN (a block holding one) lands on -127, as the CPU's conversion puts it; the
      // block's NaN scale decodes it as NaN either way
      int c = v != v ? -127 : __float2int_rn(v);
      c = c > 127 ? 127 : c < -127 ? -127 : c;
      codes[i] = (unsigned char)(signed char)c;
      value = (float)c;
    } else {
      codes[i] = to_fp8<F>(v, value);
    }
    if (residual) residual[i] = __fsub_rn(y, __fmul_rn(value, scale));
  }
}

// Element i of a 2-byte format: y (+ residual) as a code; the residual becomes what it lost.
template <int F>
__device__ __forceinline__ void wire_encode_half(float y, float* residual, unsigned char* packet, i64 i) {
  if (residual) y = __fadd_rn(y, residual[i]);
  const unsigned short h = F == kBF16 ? float_to_bf16(y) : float_to_f16(y);
  packet[2 * i] = (unsigned char)h, packet[2 * i + 1] = (unsigned char)(h >> 8);
  if (residual)
    residual[i] = __fsub_rn(y, F == kBF16 ? __uint_as_float((unsigned)h << 16) : f16_to_float(h));
}

__device__ __forceinline__ i64 wire_blocks(int format, i64 count, int block) {
  return format >= kINT8 ? (count + block - 1) / block : 0;  // (the 2-byte formats have none)
}

template <int F>
__device__ void wire_encode(const float* data, float* residual, unsigned char* packet, i64 count,
                            int block) {
  const i64 blocks = wire_blocks(F, count, block);
  if constexpr (F < kINT8) {
    for (i64 i = first_index(); i < count; i += stride()) wire_encode_half<F>(data[i], residual, packet, i);
  } else {
    const DataValues values{data};
    for (i64 b = first_index(); b < blocks; b += stride()) {
      const i64 at = b * block, n = count - at < block ? count - at : block;
      wire_encode_block<F>(values, residual, packet, blocks, b, at, n);
    }
  }
}

template <int F>
__device__ void wire_decode_sum(float* out, Sources packets, int n, i64 count, int block, float factor) {
  const i64 blocks = wire_blocks(F, count, block);
  for (i64 i = first_index(); i < count; i += stride()) out[i] = wire_sum<F>(packets, n, i, blocks, block, factor);
}

template <int F>
__device__ void wire_sum_encode(unsigned char* packet, float* residual, Sources packets, int n,
                                i64 count, int block, float factor) {
  const i64 blocks = wire_blocks(F, count, block);
  if constexpr (F < kINT8) {
    for (i64 i = first_index(); i < count; i += stride())
      wire_encode_half<F>(wire_sum<F>(packets, n, i, blocks, block, factor), residual, packet, i);
  } else {
    const SumValues<F> values{&packets, n, blocks, block, factor};
    for (i64 b = first_index(); b < blocks; b += stride()) {
      const i64 at = b * block, m = count - at < block ? count - at : block;
      wire_encode_block<F>(values, residual, packet, blocks, b, at, m);
    }
  }
}

}  // namespace commlib_cuda

#define COMMLIB_WIRE(name, F)                                                               \
  extern "C" __global__ void commlib_wire_encode_##name(                                    \
      const float* data, float* residual, unsigned char* packet, long long count, int block) { \
    commlib_cuda::wire_encode<commlib_cuda::F>(data, residual, packet, count, block);       \
  }                                                                                         \
  extern "C" __global__ void commlib_wire_decode_sum_##name(                                \
      float* out, commlib_cuda::Sources packets, int n, long long count, int block,         \
      float factor) {                                                                       \
    commlib_cuda::wire_decode_sum<commlib_cuda::F>(out, packets, n, count, block, factor);  \
  }                                                                                         \
  extern "C" __global__ void commlib_wire_sum_encode_##name(                                \
      unsigned char* packet, float* residual, commlib_cuda::Sources packets, int n,         \
      long long count, int block, float factor) {                                           \
    commlib_cuda::wire_sum_encode<commlib_cuda::F>(packet, residual, packets, n, count,     \
                                                   block, factor);                          \
  }
COMMLIB_WIRE(bf16, kBF16)
COMMLIB_WIRE(fp16, kF16)
COMMLIB_WIRE(int8, kINT8)
COMMLIB_WIRE(fp8_e4m3, kE4M3)
COMMLIB_WIRE(fp8_e5m2, kE5M2)
#undef COMMLIB_WIRE
