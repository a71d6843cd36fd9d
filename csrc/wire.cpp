// Wire formats and their kernels (see wire.h). Portable C++ that GCC vectorises at -O3
// (the per-block loops are branch-free, the helpers inlined into the entry points, so
// compiled for each clone's target); a block is staged through an L1-sized buffer.
#include "wire.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels.h"

namespace commlib::wire {

namespace {

constexpr int64_t kLargestBlock = 256;
// Elements a group of steps stages (4 KiB, in L1): a reducing step sums a scaled format's
// blocks a group at a time before it encodes any, so that no block's encoding waits on its
// own largest magnitude (a maximum, then two divisions) while nothing else can run (int8's
// sum_encode 1.2-1.5x faster; encode, reading twice the memory per element, runs as fast
// block by block from 1 MiB up and faster at 64 MiB: it does not group).
constexpr int64_t kGroup = 1024;

constexpr bool scaled(int format) { return format >= INT8; }

// An 8-bit float: `mantissa` bits, exponent `bias`; the encoding's anchors (csrc keeps
// them as numbers: a value at least `min_normal` rounds by its bits, a smaller one by
// adding `subnormal_anchor`, a float whose last bit is the format's smallest step).
struct Fp8 {
  int mantissa, bias;
  float largest;
  uint32_t min_normal_bits;
  float subnormal_anchor;
  uint8_t largest_code, nan_code;
  bool has_inf;
};
// e4m3 as OCP's "fn" variant (no infinities; 448 the largest), e5m2 IEEE-like (57344).
constexpr Fp8 kE4M3{3, 7, 448.0f, 0x3c800000u, 16384.0f, 0x7e, 0x7f, false};
constexpr Fp8 kE5M2{2, 15, 57344.0f, 0x38800000u, 128.0f, 0x7b, 0x7f, true};

COMMLIB_INLINE uint32_t bits(float f) { return detail::bits(f); }

// v's code (|v| at most the largest value, or NaN), rounded to nearest-even, saturating;
// `value` <- the value the code stands for (as fp8_value, computed on the way).
COMMLIB_INLINE uint32_t to_fp8(float v, const Fp8& f, float& value) {
  const uint32_t u = bits(v), sign = u & 0x80000000u, a = u & 0x7fffffff;
  const int shift = 23 - f.mantissa;
  // a's bits rounded to the format's mantissa: a normal code's value, as a float
  const uint32_t rounded =
      (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1)) & ~((1u << shift) - 1);
  const uint32_t normal = (rounded - (uint32_t(127 - f.bias) << 23)) >> shift;
  const float sub_sum = detail::from_bits(a) + f.subnormal_anchor;
  // (a below 2^31: compared as signed, one AVX2 instruction where unsigned takes three)
  const bool subnormal = int32_t(a) < int32_t(f.min_normal_bits);
  uint32_t code = subnormal ? bits(sub_sum) - bits(f.subnormal_anchor) : normal;
  uint32_t value_bits = subnormal ? bits(sub_sum - f.subnormal_anchor) : rounded;
  // saturating: a code above the largest, and its value's bits above the largest's, are
  // the largest's (unsigned minima: a NaN's, above both, is set below)
  code = std::min(code, uint32_t(f.largest_code));
  value_bits = std::min(value_bits, bits(f.largest));
  const bool nan = int32_t(a) > int32_t(0x7f800000);
  code = nan ? f.nan_code : code;
  value_bits = nan ? a : value_bits;
  value = detail::from_bits(value_bits | sign);
  return code | sign >> 24;
}

// A code's value: the format's table, computed (vectorisable, where a lookup is not). The
// magnitude's bits t, moved into a float's place with the exponent rebiased, are a normal
// code's value; a subnormal one's (exponent 0) is t steps. Integers convert as signed
// (AVX2 converts no unsigned ones: a sequence of several instructions each).
COMMLIB_INLINE float fp8_value(uint8_t code, const Fp8& f) {
  const int32_t t = code & 0x7f, m = f.mantissa;
  const float step = detail::from_bits(uint32_t(127 + 1 - f.bias - f.mantissa) << 23);
  const uint32_t normal = (uint32_t(t) << (23 - m)) + (uint32_t(127 - f.bias) << 23);
  uint32_t v = t < (1 << m) ? bits(float(t) * step) : normal;
  if (f.has_inf)  // (the largest exponent: infinity or NaN)
    v = t >= (((1 << (7 - m)) - 1) << m) ? 0x7f800000u | ((uint32_t(t) << (23 - m)) & 0x7fffff)
                                         : v;
  else
    v = t == 0x7f ? 0x7fc00000u : v;  // NaN
  return detail::from_bits(v | uint32_t(code & 0x80) << 24);
}

COMMLIB_INLINE float largest(int format) {
  return format == INT8 ? 127.0f : format == E4M3 ? kE4M3.largest : kE5M2.largest;
}

// A float whose bits (sign cleared) are `most`, or NaN where they are not finite: with the
// sign bit cleared, a float's bits order as its magnitude (infinity and NaN above every
// finite one), so one integer maximum (which GCC vectorises; a float one it may not
// reorder) finds a block's largest magnitude and whether any value is not finite.
COMMLIB_INLINE float magnitude(uint32_t most) {
  return most < 0x7f800000 ? detail::from_bits(most) : std::numeric_limits<float>::quiet_NaN();
}

// A block's largest magnitude, or NaN where any value is not finite
COMMLIB_INLINE float block_most(const float* y, int64_t n) {
  uint32_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = bits(y[i]) & 0x7fffffff;
    most = a > most ? a : most;
  }
  return magnitude(most);
}

// Rounds to nearest-even where |v| < 2^22 (the codes are): with no rounding instruction in
// baseline x86-64, std::nearbyint is a call per element.
COMMLIB_INLINE float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 x 2^23: adding it leaves no fraction bits
  return (v + kMagic) - kMagic;
}

// Element i of the codes `in` holds in `format`, decoded (code x scale for a scaled one)
template <int format>
COMMLIB_INLINE float decoded(const uint8_t* in, int64_t i, float scale) {
  if constexpr (format == INT8) return float(int8_t(in[i])) * scale;
  if constexpr (format == E4M3) return fp8_value(in[i], kE4M3) * scale;
  if constexpr (format == E5M2) return fp8_value(in[i], kE5M2) * scale;
  uint16_t code;  // (a 2-byte format's codes may lie at an odd address)
  std::memcpy(&code, in + 2 * i, 2);
  if constexpr (format == BF16) return detail::bf16_to_float(code);
  return detail::half_to_float(code);
}

// The codes of n values y x up in fp8 format f; the residual (unless null) <- what they lost.
// Each code goes through a 32-bit lane (`wide`), narrowed in a pass of its own: a loop
// writing bytes works 32 elements at a time, more than AVX2's registers hold of the
// conversion's values.
COMMLIB_INLINE void fp8_codes(const float* y, int64_t n, float up, float scale, const Fp8& f,
                              uint8_t* codes, float* residual) {
  uint32_t wide[kLargestBlock];
  float value;
  if (residual)
    for (int64_t i = 0; i < n; ++i)
      wide[i] = to_fp8(y[i] * up, f, value), residual[i] = y[i] - value * scale;
  else
    for (int64_t i = 0; i < n; ++i) wide[i] = to_fp8(y[i] * up, f, value);
  for (int64_t i = 0; i < n; ++i) codes[i] = uint8_t(wide[i]);
}

// A block's scale (decoding: codes x scale) and its inverse `up` (encoding: values x up; a
// multiply each way, as a division per element cost as much as the rest), from its
// largest magnitude; up at most the largest float (a block of tiny subnormals encodes as
// zeros, its residual keeps them)
struct Scale {
  float scale, up;
};
COMMLIB_INLINE Scale block_scale(float most, int format) {
  return {most / largest(format),
          std::min(largest(format) / most, std::numeric_limits<float>::max())};
}

// A block's codes, its n values y encoded by s (written at scale_at, unaligned); the
// residual (unless null) <- what they lost
COMMLIB_INLINE void scaled_codes(const float* y, int64_t n, Scale s, int format,
                                 uint8_t* codes, uint8_t* scale_at, float* residual) {
  const float scale = s.scale, up = s.up;
  std::memcpy(scale_at, &scale, 4);
  if (scale == 0) {  // (zeros, of either sign: code 0)
    std::fill(codes, codes + n, uint8_t(0));
    if (residual) std::copy(y, y + n, residual);
  } else if (format == INT8) {
    // clamped as integers (a vector min and max; a float test per side GCC blends), where
    // a NaN (a block holding one) lands too: its scale decodes it as NaN
    auto code = [&](int64_t i) __attribute__((always_inline)) {
      const int32_t c = int32_t(round_even(y[i] * up));
      return c > 127 ? 127 : c < -127 ? -127 : c;
    };
    if (residual)  // (two loops: GCC does not always take the test out of one)
      for (int64_t i = 0; i < n; ++i) {
        const int32_t c = code(i);
        codes[i] = uint8_t(int8_t(c));
        residual[i] = y[i] - float(c) * scale;
      }
    else
      for (int64_t i = 0; i < n; ++i) codes[i] = uint8_t(int8_t(code(i)));
  } else if (format == E4M3) {  // (each format's constants known: the loops vectorise)
    fp8_codes(y, n, up, scale, kE4M3, codes, residual);
  } else {
    fp8_codes(y, n, up, scale, kE5M2, codes, residual);
  }
}

// One block of a scaled format: data (+ residual) as codes and a scale; the residual
// becomes what they lost (data + residual staged in `stage`). Two passes: the sum and its
// largest magnitude, then each element's code and residual.
COMMLIB_INLINE void encode_scaled(const float* data, float* residual, uint8_t* codes,
                                  uint8_t* scale_at, int64_t n, int format, float* stage) {
  const float* y = data;
  if (residual) {
    for (int64_t i = 0; i < n; ++i) stage[i] = data[i] + residual[i];
    y = stage;
  }
  scaled_codes(y, n, block_scale(block_most(y, n), format), format, codes, scale_at,
               residual);
}

// n elements of a 2-byte format (bf16 or else fp16): data (+ residual) as codes; the
// residual becomes what they lost
template <bool bf16>
COMMLIB_INLINE void encode_halves(const float* data, float* residual, uint16_t* codes,
                                  int64_t n) {
  auto to = [](float y) { return bf16 ? detail::float_to_bf16(y) : detail::float_to_half(y); };
  auto from = [](uint16_t c) { return bf16 ? detail::bf16_to_float(c) : detail::half_to_float(c); };
  if (!residual) {
    for (int64_t i = 0; i < n; ++i) codes[i] = to(data[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float y = data[i] + residual[i];
    codes[i] = to(y);
    residual[i] = y - from(codes[i]);
  }
}

// `whole` blocks of `length` elements (inlined into its caller, so compiled for its target;
// the length a constant, GCC's loops have no remainders: 15% faster)
template <int64_t length>
COMMLIB_INLINE void encode_whole(const float* data, float* residual, uint8_t* scales,
                                 uint8_t* codes, int64_t whole, int format) {
  float stage[kLargestBlock];
  for (int64_t b = 0; b < whole; ++b)
    encode_scaled(data + b * length, residual ? residual + b * length : nullptr,
                  codes + b * length, scales + b * 4, length, format, stage);
}

}  // namespace

int64_t packet_bytes(int format, int64_t count, int64_t block) {
  if (format < 0 || format >= kFormats)
    throw std::invalid_argument("unknown wire format code " + std::to_string(format));
  if (count < 0) throw std::invalid_argument("a negative count");
  if (!scaled(format)) return 2 * count;
  if (block != 32 && block != 64 && block != 128 && block != 256)
    throw std::invalid_argument("block must be 32, 64, 128 or 256 elements, not " +
                                std::to_string(block));
  return (count + block - 1) / block * 4 + count;
}

// (compiled twice, for AVX2 and for any x86-64, picked at load: the same operations, so
// the same bits either way; no FMA contracts them)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COMMLIB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define COMMLIB_CLONES
#endif

COMMLIB_CLONES
void encode(const float* data, float* residual, uint8_t* packet, int64_t count, int format,
            int64_t block) {
  packet_bytes(format, count, block);  // (checks)
  if (!scaled(format)) {
    // staged through `codes` (the packet may be unaligned for uint16_t)
    for (int64_t at = 0; at < count; at += kLargestBlock) {
      const int64_t n = std::min(kLargestBlock, count - at);
      uint16_t codes[kLargestBlock];
      if (format == BF16)
        encode_halves<true>(data + at, residual ? residual + at : nullptr, codes, n);
      else
        encode_halves<false>(data + at, residual ? residual + at : nullptr, codes, n);
      std::memcpy(packet + 2 * at, codes, n * 2);
    }
    return;
  }
  float stage[kLargestBlock];
  const int64_t blocks = (count + block - 1) / block, whole = count / block;
  uint8_t* codes = packet + blocks * 4;
  // the whole blocks with their length a constant (GCC's loops then have no remainders),
  // the last one as long as it is
  switch (block) {
    case 32: encode_whole<32>(data, residual, packet, codes, whole, format); break;
    case 64: encode_whole<64>(data, residual, packet, codes, whole, format); break;
    case 128: encode_whole<128>(data, residual, packet, codes, whole, format); break;
    default: encode_whole<256>(data, residual, packet, codes, whole, format); break;
  }
  if (whole < blocks) {
    const int64_t at = whole * block;
    encode_scaled(data + at, residual ? residual + at : nullptr, codes + at,
                  packet + whole * 4, count - at, format, stage);
  }
}

// The packets' elements [at, at + n) of one step: block b of a scaled format, or a run of
// a 2-byte one.
template <int format>
struct Step {
  const std::vector<const uint8_t*>& packets;
  int64_t count, block, b, at, n;

  const uint8_t* codes(const uint8_t* p) const {
    return scaled(format) ? p + (count + block - 1) / block * 4 + at : p + 2 * at;
  }
  float scale(const uint8_t* p) const {
    float scale = 1.0f;
    if (scaled(format)) std::memcpy(&scale, p + b * 4, 4);
    return scale;
  }
  // acc <- the sum of every packet's elements but the last's, in their order, from 0 (0 +
  // x, not x: it turns a -0 into +0, as on every rank and device)
  void sum_but_last(float* acc) const {
    const size_t last = packets.size() - 1;
    if (last == 0) std::fill(acc, acc + n, 0.0f);
    for (size_t k = 0; k < last; ++k) {
      const uint8_t* in = codes(packets[k]);
      const float s = scale(packets[k]);
      for (int64_t i = 0; i < n; ++i)
        acc[i] = (k == 0 ? 0.0f : acc[i]) + decoded<format>(in, i, s);
    }
  }
};

// A reducing step over steps (blocks, or 2-byte runs) [first, last), `step` elements apart
// and n long (`fixed` where it is not 0: the loops, with a constant length, then have no
// remainders, as encode_whole's): out <- factor x their sum (decode_sum) or, with `packet`
// given, packet <- its encoding (+ the residual where `with`, which becomes what it lost:
// sum_encode). The last packet's elements, the factor and the residual go in one pass,
// with the block's largest magnitude.
template <int format, int64_t fixed, bool with>
COMMLIB_INLINE void reduce_steps(float* out, uint8_t* packet, float* residual,
                                 const std::vector<const uint8_t*>& packets, int64_t count,
                                 int64_t step, int64_t first, int64_t last, int64_t n_given,
                                 int64_t block, float factor) {
  const int64_t n = fixed ? fixed : n_given;
  constexpr int64_t per_group = scaled(format) && fixed ? kGroup / fixed : 1;
  float acc[kGroup];
  uint32_t most[per_group];
  uint8_t* codes = packet ? packet + (scaled(format) ? (count + block - 1) / block * 4 : 0)
                          : nullptr;
  for (int64_t b0 = first; b0 < last; b0 += per_group) {
    const int64_t blocks = std::min(per_group, last - b0);
    for (int64_t g = 0; g < blocks; ++g) {
      const int64_t at = (b0 + g) * step;
      float* sum = acc + g * n;
      const Step<format> in{packets, count, block, b0 + g, at, n};
      in.sum_but_last(sum);
      const uint8_t* tail = in.codes(packets.back());
      const float tail_scale = in.scale(packets.back());
      // the sum's element i x factor (x 1 leaves every value as it is, the NaNs the sums
      // make included: one loop for every factor)
      auto y = [&](int64_t i) __attribute__((always_inline)) {
        return (sum[i] + decoded<format>(tail, i, tail_scale)) * factor;
      };
      float* r = with ? residual + at : nullptr;
      if (!packet) {
        for (int64_t i = 0; i < n; ++i) out[at + i] = y(i);
      } else if constexpr (scaled(format)) {
        uint32_t m = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float v = with ? y(i) + r[i] : y(i);
          sum[i] = v;
          const uint32_t a = bits(v) & 0x7fffffff;
          m = a > m ? a : m;
        }
        most[g] = m;
      } else {
        uint8_t* to = codes + 2 * at;
        for (int64_t i = 0; i < n; ++i) {
          const float v = with ? y(i) + r[i] : y(i);
          const uint16_t c =
              format == BF16 ? detail::float_to_bf16(v) : detail::float_to_half(v);
          std::memcpy(to + 2 * i, &c, 2);
          if (with)
            r[i] = v - (format == BF16 ? detail::bf16_to_float(c) : detail::half_to_float(c));
        }
      }
    }
    if (scaled(format) && packet)
      for (int64_t g = 0; g < blocks; ++g) {
        const int64_t at = (b0 + g) * step;
        scaled_codes(acc + g * n, n, block_scale(magnitude(most[g]), format), format,
                     codes + at, packet + (b0 + g) * 4, with ? residual + at : nullptr);
      }
  }
}

// reduce_steps over a call's every step: the whole ones with their length a constant, then
// the last, shorter one
template <int format, bool with>
COMMLIB_INLINE void reduce(float* out, uint8_t* packet, float* residual,
                           const std::vector<const uint8_t*>& packets, int64_t count,
                           int64_t block, float factor) {
  const int64_t step = scaled(format) ? block : kLargestBlock;
  const int64_t whole = count / step, tail = count - whole * step;
#define COMMLIB_WHOLE(L)                                                                   \
  reduce_steps<format, L, with>(out, packet, residual, packets, count, step, 0, whole, L, \
                                block, factor)
  switch (step) {
    case 32: COMMLIB_WHOLE(32); break;
    case 64: COMMLIB_WHOLE(64); break;
    case 128: COMMLIB_WHOLE(128); break;
    default: COMMLIB_WHOLE(256); break;
  }
#undef COMMLIB_WHOLE
  if (tail > 0)
    reduce_steps<format, 0, with>(out, packet, residual, packets, count, step, whole,
                                  whole + 1, tail, block, factor);
}

// reduce<format, with> with the format a constant (each one's loops compiled for it alone)
// and whether a residual is given
template <bool with>
COMMLIB_INLINE void reduce_any(float* out, uint8_t* packet, float* residual,
                               const std::vector<const uint8_t*>& packets, int64_t count,
                               int format, int64_t block, float factor) {
  switch (format) {
    case BF16: return reduce<BF16, with>(out, packet, residual, packets, count, block, factor);
    case F16: return reduce<F16, with>(out, packet, residual, packets, count, block, factor);
    case INT8: return reduce<INT8, with>(out, packet, residual, packets, count, block, factor);
    case E4M3: return reduce<E4M3, with>(out, packet, residual, packets, count, block, factor);
    default: return reduce<E5M2, with>(out, packet, residual, packets, count, block, factor);
  }
}

COMMLIB_CLONES
void decode_sum(float* out, const std::vector<const uint8_t*>& packets, int64_t count,
                int format, int64_t block, float factor) {
  packet_bytes(format, count, block);
  if (packets.empty()) throw std::invalid_argument("decode_sum of no packets");
  reduce_any<false>(out, nullptr, nullptr, packets, count, format, block, factor);
}

COMMLIB_CLONES
void sum_encode(uint8_t* packet, float* residual, const std::vector<const uint8_t*>& packets,
                int64_t count, int format, int64_t block, float factor) {
  packet_bytes(format, count, block);
  if (packets.empty()) throw std::invalid_argument("sum_encode of no packets");
  if (residual)
    reduce_any<true>(nullptr, packet, residual, packets, count, format, block, factor);
  else
    reduce_any<false>(nullptr, packet, residual, packets, count, format, block, factor);
}

}  // namespace commlib::wire

namespace commlib {

namespace py = pybind11;

void bind_wire(py::module_& m) {
  py::dict formats;
  formats["bf16"] = int(wire::BF16);
  formats["fp16"] = int(wire::F16);
  formats["int8"] = int(wire::INT8);
  formats["fp8_e4m3"] = int(wire::E4M3);
  formats["fp8_e5m2"] = int(wire::E5M2);
  m.attr("WIRE_FORMATS") = formats;
  m.def("wire_packet_bytes", &wire::packet_bytes, py::arg("format"), py::arg("count"),
        py::arg("block"), "Bytes of a packet of count elements (csrc/wire.h).");
  m.def(
      "wire_encode",
      [](uintptr_t data, uintptr_t residual, uintptr_t packet, int64_t count, int format,
         int64_t block) {
        py::gil_scoped_release nogil;
        wire::encode(reinterpret_cast<const float*>(data), reinterpret_cast<float*>(residual),
                     reinterpret_cast<uint8_t*>(packet), count, format, block);
      },
      py::arg("data"), py::arg("residual"), py::arg("packet"), py::arg("count"),
      py::arg("format"), py::arg("block"),
      "packet <- data (+ residual, where its address is not 0), and the residual <- what "
      "the packet lost.");
  m.def(
      "wire_sum_encode",
      [](uintptr_t packet, uintptr_t residual, const std::vector<uintptr_t>& packets,
         int64_t count, int format, int64_t block, float factor) {
        std::vector<const uint8_t*> from;
        for (uintptr_t p : packets) from.push_back(reinterpret_cast<const uint8_t*>(p));
        py::gil_scoped_release nogil;
        wire::sum_encode(reinterpret_cast<uint8_t*>(packet), reinterpret_cast<float*>(residual),
                         from, count, format, block, factor);
      },
      py::arg("packet"), py::arg("residual"), py::arg("packets"), py::arg("count"),
      py::arg("format"), py::arg("block"), py::arg("factor") = 1.0f,
      "packet <- the encoded factor x sum of packets (+ residual, 0 for none), one pass "
      "(csrc/wire.h).");
  m.def(
      "wire_decode_sum",
      [](uintptr_t out, const std::vector<uintptr_t>& packets, int64_t count, int format,
         int64_t block, float factor) {
        std::vector<const uint8_t*> from;
        for (uintptr_t p : packets) from.push_back(reinterpret_cast<const uint8_t*>(p));
        py::gil_scoped_release nogil;
        wire::decode_sum(reinterpret_cast<float*>(out), from, count, format, block, factor);
      },
      py::arg("out"), py::arg("packets"), py::arg("count"), py::arg("format"),
      py::arg("block"), py::arg("factor") = 1.0f,
      "out <- factor * the sum of the packets' values, in their order, in float32.");
}

}  // namespace commlib
