// Reduce ops defined at run time (commlib/user_ops.py): per dtype, two compiled functions
// that reduce a block, called without the GIL from every kernel that reduces.
//
//   apart(dst, a, b, n)   dst[i] = a[i] op b[i], dst distinct from a and b
//   into(dst, b, n)       dst[i] = dst[i] op b[i]
// Two entry points because a compiled loop that may alias falls back to scalar code; the
// caller picks the one whose operands cannot overlap (ops are commutative, so dst == b
// reduces as into(dst, a)). float16 and bfloat16 reduce through the op's float32 functions
// on float32 blocks. Codes start at kFirstUserOp; the Python side derives them from the
// op's definition so that every rank gives the same op the same code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace commlib {

inline constexpr int64_t kFirstUserOp = int64_t(1) << 16;
inline constexpr int64_t kLastUserOp = (int64_t(1) << 31) - 1;  // codes travel as int
inline bool is_user_op(int64_t op) { return op >= kFirstUserOp && op <= kLastUserOp; }

using UserApart = void (*)(void* dst, const void* a, const void* b, int64_t n);
using UserInto = void (*)(void* dst, const void* b, int64_t n);

// Registers `code` (is_user_op) as `name`, with (apart, into) addresses by dtype code, 0
// where the op does not take that dtype (16-bit floats: the float32 pair, or 0). A code
// defined again keeps its first functions (which the caller keeps alive for good).
void define_user_op(int64_t code, const std::string& name,
                    const std::vector<std::pair<uintptr_t, uintptr_t>>& by_dtype);

// The op's name, "" for a code nobody defined.
std::string user_op_name(int64_t code);
// Whether the op takes `dtype`; throws std::invalid_argument for an undefined code.
bool user_op_takes(int64_t code, int dtype);
// The dtypes it takes, by name, comma-separated (for messages).
std::string user_op_dtypes(int64_t code);

// dst[i] = a[i] op b[i]; throws std::invalid_argument for an undefined op or dtype.
void user_reduce(void* dst, const void* a, const void* b, int64_t count, int dtype, int64_t op);

}  // namespace commlib
