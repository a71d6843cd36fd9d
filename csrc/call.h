// The rules a collective call must meet, and the messages that name a broken one: the one
// place they are written. Python's Call (commlib/call.py) checks every call with them and
// raises; the fast path (fast_path.cpp) checks its calls with them too and leaves a
// broken one to Python.
//
// Vocabulary:
//   operand  one buffer of a call as the rules see it: address, elements, dtype.
//   primary  the per-rank element count that fixes a call's algorithm and plan: the
//            tensor (all_reduce, broadcast, reduce), the output block (reduce_scatter),
//            the input (all_gather, all_to_all).
//   scale    what an average multiplies this rank's result by: 1/size on the ranks that
//            keep the result, 0 where nothing is scaled.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace commlib {

struct Operand {
  uintptr_t ptr = 0;
  int64_t count = 0;
  int dtype = -1;  // -1: the call has no such operand
  int64_t nbytes() const;
};

// Whether two operands share any byte (empty ones share none).
bool overlap(const Operand& a, const Operand& b);

struct CheckedCall {
  int64_t primary;
  double scale;
};

// Broken calls: a ValueError in Python, or a TypeError for operands of different dtypes.
struct CallError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct CallTypeError : CallError {
  using CallError::CallError;
};

// `out` is the output (or the only buffer), `in` the input; `op` a reducing collective's
// (kNone elsewhere), `root` a rooted one's (kNone elsewhere). Throws CallError.
CheckedCall check_call(int64_t collective, int size, int rank, const Operand& out,
                       const Operand& in, int64_t op, int64_t root);

}  // namespace commlib
