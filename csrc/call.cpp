// The rules of a collective call (see call.h).
#include "call.h"

#include <string>

#include "agreement.h"
#include "kernels.h"
#include "user_ops.h"

namespace commlib {

int64_t Operand::nbytes() const { return count * itemsize(dtype); }

bool overlap(const Operand& a, const Operand& b) {
  return a.nbytes() > 0 && b.nbytes() > 0 && a.ptr < b.ptr + b.nbytes() &&
         b.ptr < a.ptr + a.nbytes();
}

namespace {

std::string str(int64_t v) { return std::to_string(v); }

void same_dtype(const Operand& a, const Operand& b, const char* names) {
  if (a.dtype != b.dtype)
    throw CallTypeError(std::string(names) + " must have the same dtype, got " +
                        kDTypes[a.dtype].name + " and " + kDTypes[b.dtype].name);
}

// reduce_scatter's input and all_gather's output (`whole`) hold size blocks of the other's
// size; the only overlap allowed is `block` being exactly whole's own block (in place).
void whole_and_block(const char* collective, int size, int rank, const Operand& whole,
                     const char* whole_name, const Operand& block, const char* block_name) {
  const std::string w = whole_name, b = block_name, c = collective;
  same_dtype(whole, block, (w + " and " + b).c_str());
  if (whole.count != size * block.count)
    throw CallError(c + ": " + w + " has " + str(whole.count) + " elements, expected size * " +
                    b + ".numel = " + str(size) + " * " + str(block.count) + " = " +
                    str(size * block.count));
  if (overlap(whole, block) && block.ptr != whole.ptr + rank * block.nbytes())
    throw CallError(c + ": " + b + " overlaps " + w + "; the only overlap allowed is " + b +
                    " being exactly " + w + "'s own block " + w + "[rank*n:(rank+1)*n]");
}

}  // namespace

CheckedCall check_call(int64_t collective, int size, int rank, const Operand& out,
                       const Operand& in, int64_t op, int64_t root) {
  dtype_info(out.dtype);  // (throws for an unknown code: a caller's bug, not the user's)
  int64_t primary = out.count;
  switch (collective) {
    case ALL_REDUCE: break;
    case BROADCAST: case REDUCE:
      if (root < 0 || root >= size)
        throw CallError("root=" + str(root) + " is outside the communicator (size " +
                        str(size) + ")");
      break;
    case REDUCE_SCATTER:
      whole_and_block("reduce_scatter", size, rank, in, "input", out, "output");
      break;
    case ALL_GATHER:
      whole_and_block("all_gather", size, rank, out, "output", in, "input");
      primary = in.count;
      break;
    case ALL_TO_ALL:
      same_dtype(out, in, "output and input");
      if (overlap(out, in))
        throw CallError("all_to_all: output and input overlap; use separate tensors");
      primary = in.count;
      break;
    default: throw std::invalid_argument("unknown collective code " + str(collective));
  }
  if (!collective_info(collective).reduces) return {primary, 0};
  if (is_user_op(op)) {
    const std::string name = user_op_name(op);
    if (name.empty())
      throw CallError("reduce op code " + str(op) + " was never defined in this process");
    if (!user_op_takes(op, out.dtype))
      throw CallError("op '" + name + "' is defined for " + user_op_dtypes(op) + ", not " +
                      kDTypes[out.dtype].name + "; define it with that dtype too");
    return {primary, 0};
  }
  if (op < SUM || op > kLastOp) throw CallError("unknown reduce op code " + str(op));
  if (bitwise(op) && kDTypes[out.dtype].floating)
    throw CallError(std::string("op '") + kOpNames[op] + "' is bitwise and needs an integer " +
                    "dtype (int8, uint8, int32, int64), got " + kDTypes[out.dtype].name);
  if (op == AVG && !kDTypes[out.dtype].floating)
    throw CallError(std::string("op 'avg' needs a floating dtype, got ") +
                    kDTypes[out.dtype].name +
                    "; use 'sum' and divide, or convert to a float type first");
  const bool keeps = collective != REDUCE || rank == root;
  return {primary, op == AVG && keeps ? 1.0 / size : 0};
}

}  // namespace commlib
