// What the ranks of a collective must agree on, and the errors that say they do not.
//
//   descriptor  eight int64 fields of one call: collective, algorithm, count, dtype, op,
//               root, variant, reserved. kNone marks a field that does not apply (a
//               root for all_reduce). The algorithm is its name packed into 8 ASCII
//               bytes, so no table of algorithms is needed here.
//   invalid     the descriptor of a call whose arguments failed validation on its rank:
//               only the collective is set, and variant = kInvalid. The rank still takes
//               part in the agreement, so its peers raise instead of waiting for it.
//   splits      all_to_all's bytes per peer. They may differ from rank to rank, so they
//               are not in the descriptor: what rank i sends to j must equal what j
//               expects from i, checked over the whole matrix.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace commlib {

constexpr int64_t kNone = -1;
constexpr int64_t kInvalid = 1;  // the variant of an invalid call

enum Collective : int64_t {
  ALL_REDUCE = 1, REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, ALL_TO_ALL, BARRIER
};

// How a collective's buffers relate: one buffer read and written in place; an input of
// `size` blocks and an output of one (scatter); the reverse (gather); a part for every
// peer each way, of any sizes (exchange); none (barrier).
enum Parts : int { kInPlace, kScatter, kGather, kExchange, kNoBuffers };

// What each collective is, by code: the one table of it (commlib/collectives.py reads it
// through _C.COLLECTIVE_TABLE; every branch on a collective's kind reads it).
struct CollectiveInfo {
  const char* name;
  bool reduces;  // by an op, into every rank's (or the root's) buffer
  bool rooted;   // one rank is the root (broadcast, reduce)
  bool from_root;  // only the root's data moves (broadcast)
  Parts parts;
  bool has_input() const { return parts == kScatter || parts == kGather || parts == kExchange; }
};
constexpr CollectiveInfo kCollectives[] = {
    {"?", false, false, false, kNoBuffers},  // (codes start at 1)
    {"all_reduce", true, false, false, kInPlace},
    {"reduce", true, true, false, kInPlace},
    {"reduce_scatter", true, false, false, kScatter},
    {"all_gather", false, false, false, kGather},
    {"broadcast", false, true, true, kInPlace},
    {"all_to_all", false, false, false, kExchange},
    {"barrier", false, false, false, kNoBuffers}};
static_assert(sizeof(kCollectives) / sizeof(kCollectives[0]) == BARRIER + 1,
              "a row of kCollectives per Collective");

// The row of `code`; the first row ("?") for a code that is none.
inline const CollectiveInfo& collective_info(int64_t code) {
  return kCollectives[code >= ALL_REDUCE && code <= BARRIER ? code : 0];
}
inline const char* collective_name(int64_t code) { return collective_info(code).name; }

enum DescField { COLLECTIVE, ALGORITHM, COUNT, DTYPE, OP, ROOT, VARIANT, RESERVED, kDescFields };

struct Desc {
  int64_t f[kDescFields];
  bool operator==(const Desc& o) const;
  bool operator!=(const Desc& o) const { return !(*this == o); }
  uint64_t hash() const;  // the signature stored next to it, for cheap comparisons
};

constexpr int64_t pack_name(const char* s) {
  uint64_t v = 0;
  for (int i = 0; i < 8 && s[i]; ++i) v |= uint64_t(uint8_t(s[i])) << (8 * i);
  return int64_t(v);
}

// "all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)"
std::string describe(const Desc& d);

// "" when every present rank's descriptor is the same; otherwise a message that groups
// the ranks by what they called and names the fields that differ. descs[r] is nullptr
// for a rank whose call is unknown.
std::string disagreement(const std::vector<const Desc*>& descs);

// "" when sent(i, j) == expected(j, i) for every pair; otherwise the pairs that differ,
// in elements of `itemsize` bytes.
std::string split_disagreement(int size, int64_t itemsize,
                               const std::function<int64_t(int, int)>& sent,
                               const std::function<int64_t(int, int)>& expected);

// check_table's rows: `n` rows `stride` words apart, each a descriptor, then (all_to_all,
// `splits`) the bytes it sends to each rank and receives from each. "" when they agree,
// else what disagreement() or split_disagreement() says.
std::string check_table(const int64_t* table, int n, int64_t stride, int64_t itemsize,
                        bool splits);

// Raised as commlib.CollectiveMismatchError and commlib.CommTimeoutError. Messages do not
// number the call: Python prefixes its own sequence number (calls.py).
struct MismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A peer that died or failed, or MPI's own error (commlib.CommError).
struct PeerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace commlib
