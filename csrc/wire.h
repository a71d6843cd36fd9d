// Wire formats: float32 data carried in fewer bytes by compressed collectives
// (commlib/compressed.py), and the kernels that go in and out of them.
//
// Vocabulary:
//   format      how an element travels: BF16 and F16 (2 bytes, rounded to nearest-even,
//               no scale), INT8, E4M3 and E5M2 (1 byte, block-scaled).
//   block       the run of elements (32, 64, 128 or 256; the last one of a packet may be
//               shorter) that shares one float32 scale: its largest magnitude over the
//               format's largest value, so that the block's largest element lands on it
//               (the MX idea, with a float32 scale rather than a power of two).
//   packet      `count` elements in a format: the blocks' scales (float32, one per
//               block; none for BF16/F16), then the elements. Packets of parts of a
//               buffer are cut and encoded separately: blocks restart at each.
//   residual    error feedback: what encoding lost, float32 per element, added to the
//               next call's data before it is encoded (Seide et al.'s 1-bit SGD, as
//               DeepSpeed's 1-bit Adam keeps a worker's and a server's).
//   encode      packet <- data (+ residual); residual <- (data + residual) - decode(packet).
//   decode_sum  out <- factor * (decode(packet 0) + decode(packet 1) + ...), in float32,
//               in that order whatever the rank (the same bits on every rank).
//   sum_encode  packet <- encode(decode_sum(packets) (+ residual)), block by block in one
//               pass (a reducing step's decode + add + encode: the sum never in memory).
#pragma once

#include <cstdint>
#include <vector>

namespace commlib::wire {

enum Format : int { BF16 = 0, F16 = 1, INT8 = 2, E4M3 = 3, E5M2 = 4, kFormats };

// Bytes of a packet of `count` elements; checks the format and the block size.
int64_t packet_bytes(int format, int64_t count, int64_t block);

void encode(const float* data, float* residual, uint8_t* packet, int64_t count, int format,
            int64_t block);

void decode_sum(float* out, const std::vector<const uint8_t*>& packets, int64_t count,
                int format, int64_t block, float factor);

void sum_encode(uint8_t* packet, float* residual, const std::vector<const uint8_t*>& packets,
                int64_t count, int format, int64_t block, float factor);

}  // namespace commlib::wire
