// Wire formats and their kernels (see wire.h). Portable C++ that GCC vectorises at -O3
// (the per-block loops are branch-free, the helpers inlined into the two entry points);
// a block is staged through an L1-sized buffer.
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

#include "kernels.h"

namespace commlib::wire {

namespace {

constexpr int64_t kLargestBlock = 256;

COMMLIB_INLINE bool scaled(int format) { return format >= INT8; }

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

// |v| <= the largest value (or NaN): its code, rounded to nearest-even, saturating.
COMMLIB_INLINE uint8_t to_fp8(float v, const Fp8& f) {
  const uint32_t u = bits(v), sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7fffffff;
  const int shift = 23 - f.mantissa;
  const uint32_t normal =
      (a - (uint32_t(127 - f.bias) << 23) + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1)) >>
      shift;
  const uint32_t sub = bits(detail::from_bits(a) + f.subnormal_anchor) - bits(f.subnormal_anchor);
  uint32_t code = a < f.min_normal_bits ? sub : normal;
  code = std::min<uint32_t>(code, f.largest_code);
  code = a > 0x7f800000 ? f.nan_code : code;
  return uint8_t(code | sign);
}

std::array<float, 256> fp8_values(const Fp8& f) {
  std::array<float, 256> out{};
  const int m = f.mantissa, emask = (1 << (7 - m)) - 1;
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> m) & emask, mt = c & ((1 << m) - 1);
    float v = e == 0 ? std::ldexp(float(mt), 1 - f.bias - m)
                     : std::ldexp(1.0f + float(mt) / float(1 << m), e - f.bias);
    if (!f.has_inf && (c & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
    if (f.has_inf && e == emask)
      v = mt == 0 ? std::numeric_limits<float>::infinity()
                  : std::numeric_limits<float>::quiet_NaN();
    out[c] = c & 0x80 ? -v : v;
  }
  return out;
}

const std::array<float, 256> kE4M3Values = fp8_values(kE4M3);
const std::array<float, 256> kE5M2Values = fp8_values(kE5M2);

// y <- data (+ residual): two loops, each vectorised
COMMLIB_INLINE void load(float* y, const float* data, const float* residual, int64_t n) {
  if (residual)
    for (int64_t i = 0; i < n; ++i) y[i] = data[i] + residual[i];
  else
    std::memcpy(y, data, n * 4);
}

COMMLIB_INLINE float largest(int format) {
  return format == INT8 ? 127.0f : format == E4M3 ? kE4M3.largest : kE5M2.largest;
}

// A block's largest magnitude, or NaN where any value is not finite (the result says so).
// Eight running maxima (a vector's lanes): one chain of max's dependencies cost 4 cycles
// an element.
COMMLIB_INLINE float block_most(const float* y, int64_t n) {
  float most[8] = {}, finite[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float a = std::fabs(y[i + k]);
      most[k] = a > most[k] ? a : most[k];
      finite[k] = a <= std::numeric_limits<float>::max() ? finite[k] : 0;
    }
  for (; i < n; ++i) {
    const float a = std::fabs(y[i]);
    most[0] = a > most[0] ? a : most[0];
    finite[0] = a <= std::numeric_limits<float>::max() ? finite[0] : 0;
  }
  float m = 0, f = 1;
  for (int k = 0; k < 8; ++k) m = most[k] > m ? most[k] : m, f = finite[k] < f ? finite[k] : f;
  return f != 0 ? m : std::numeric_limits<float>::quiet_NaN();
}

// Rounds to nearest-even where |v| < 2^22 (the codes are): with no rounding instruction in
// baseline x86-64, std::nearbyint is a call per element.
COMMLIB_INLINE float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 x 2^23: adding it leaves no fraction bits
  return (v + kMagic) - kMagic;
}

// One block of a scaled format: its values times `up` (the format's largest value over the
// block's) as codes into `out`; what they decode to (codes times `scale`) into `back`.
COMMLIB_INLINE void encode_block(const float* y, int64_t n, int format, float up, float scale,
                  uint8_t* out, float* back) {
  if (scale == 0) {
    std::fill(out, out + n, uint8_t(0));
    std::fill(back, back + n, 0.0f);
    return;
  }
  if (format == INT8) {
    for (int64_t i = 0; i < n; ++i) {
      float q = round_even(y[i] * up);
      q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
      out[i] = uint8_t(int8_t(int32_t(q)));
      back[i] = q * scale;
    }
    return;
  }
  const Fp8& f = format == E4M3 ? kE4M3 : kE5M2;
  const float* values = format == E4M3 ? kE4M3Values.data() : kE5M2Values.data();
  for (int64_t i = 0; i < n; ++i) out[i] = to_fp8(y[i] * up, f);
  for (int64_t i = 0; i < n; ++i) back[i] = values[out[i]] * scale;
}

COMMLIB_INLINE void decode_block(const uint8_t* in, int64_t n, int format, float scale,
                                 float* acc) {
  if (format == INT8) {
    for (int64_t i = 0; i < n; ++i) acc[i] += float(int8_t(in[i])) * scale;
    return;
  }
  const float* values = format == E4M3 ? kE4M3Values.data() : kE5M2Values.data();
  for (int64_t i = 0; i < n; ++i) acc[i] += values[in[i]] * scale;
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
  float y[kLargestBlock], back[kLargestBlock];
  if (!scaled(format)) {
    auto* out = reinterpret_cast<uint16_t*>(packet);  // (may be unaligned: memcpy below)
    for (int64_t at = 0; at < count; at += kLargestBlock) {
      const int64_t n = std::min(kLargestBlock, count - at);
      uint16_t codes[kLargestBlock];
      load(y, data + at, residual ? residual + at : nullptr, n);
      if (format == BF16) {
        for (int64_t i = 0; i < n; ++i) codes[i] = detail::float_to_bf16(y[i]);
        for (int64_t i = 0; i < n; ++i) back[i] = detail::bf16_to_float(codes[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) codes[i] = detail::float_to_half(y[i]);
        for (int64_t i = 0; i < n; ++i) back[i] = detail::half_to_float(codes[i]);
      }
      std::memcpy(out + at, codes, n * 2);
      if (residual)
        for (int64_t i = 0; i < n; ++i) residual[at + i] = y[i] - back[i];
    }
    return;
  }
  const int64_t blocks = (count + block - 1) / block;
  uint8_t* codes = packet + blocks * 4;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * block, n = std::min(block, count - at);
    load(y, data + at, residual ? residual + at : nullptr, n);
    // codes are values x up, decoded as codes x scale (a multiply each way: a division per
    // element cost as much as the rest); up at most the largest float (a block of tiny
    // subnormals encodes as zeros, its residual keeps them)
    const float most = block_most(y, n);
    const float scale = most / largest(format);
    const float up = std::min(largest(format) / most, std::numeric_limits<float>::max());
    std::memcpy(packet + b * 4, &scale, 4);
    encode_block(y, n, format, up, scale, codes + at, back);
    if (residual)
      for (int64_t i = 0; i < n; ++i) residual[at + i] = y[i] - back[i];
  }
}

COMMLIB_CLONES
void decode_sum(float* out, const std::vector<const uint8_t*>& packets, int64_t count,
                int format, int64_t block, float factor) {
  packet_bytes(format, count, block);
  if (packets.empty()) throw std::invalid_argument("decode_sum of no packets");
  float acc[kLargestBlock];
  const int64_t step = scaled(format) ? block : kLargestBlock;
  const int64_t blocks = (count + step - 1) / step;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * step, n = std::min(step, count - at);
    std::fill(acc, acc + n, 0.0f);
    for (const uint8_t* p : packets) {
      if (!scaled(format)) {
        uint16_t codes[kLargestBlock];
        std::memcpy(codes, p + at * 2, n * 2);
        if (format == BF16)
          for (int64_t i = 0; i < n; ++i) acc[i] += detail::bf16_to_float(codes[i]);
        else
          for (int64_t i = 0; i < n; ++i) acc[i] += detail::half_to_float(codes[i]);
        continue;
      }
      float scale;
      std::memcpy(&scale, p + b * 4, 4);
      decode_block(p + ((count + block - 1) / block) * 4 + at, n, format, scale, acc);
    }
    if (factor != 1.0f)
      for (int64_t i = 0; i < n; ++i) acc[i] *= factor;
    std::memcpy(out + at, acc, n * 4);
  }
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
