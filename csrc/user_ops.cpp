// The registry of user-defined reduce ops and their block kernel (see user_ops.h).
#include "user_ops.h"

#include <map>
#include <mutex>
#include <stdexcept>

#include "kernels.h"

namespace commlib {

namespace {

struct UserOp {
  std::string name;
  UserApart apart[kNumDTypes] = {};
  UserInto into[kNumDTypes] = {};
};

// Entries are never changed or removed once made, so a lookup holds the lock only to find
// one and then reads it without (a map's nodes stay where they are).
std::mutex registry_lock;
std::map<int64_t, UserOp> registry;

const UserOp& find(int64_t code) {
  std::lock_guard<std::mutex> hold(registry_lock);
  auto it = registry.find(code);
  if (it == registry.end())
    throw std::invalid_argument("reduce op code " + std::to_string(code) +
                                " was never defined in this process (commlib.ReduceOp.define)");
  return it->second;
}

void call(const UserOp& op, int t, void* dst, const void* a, const void* b, int64_t n) {
  if (dst == a) return op.into[t](dst, b, n);
  if (dst == b) return op.into[t](dst, a, n);  // ops commute
  op.apart[t](dst, a, b, n);
}

// 16-bit floats: converted to float32 blocks, reduced by the dtype's slot (which holds the
// float32 function), rounded back.
template <class Load, class Store>
void through_float(UserInto into, uint16_t* dst, const uint16_t* a, const uint16_t* b,
                   int64_t n, Load load, Store store) {
  float x[kHalfBlock], y[kHalfBlock];
  for (int64_t i = 0; i < n; i += int64_t(kHalfBlock)) {
    int64_t m = n - i < int64_t(kHalfBlock) ? n - i : int64_t(kHalfBlock);
    for (int64_t j = 0; j < m; ++j) x[j] = load(a[i + j]), y[j] = load(b[i + j]);
    into(x, y, m);
    for (int64_t j = 0; j < m; ++j) dst[i + j] = store(x[j]);
  }
}

}  // namespace

void define_user_op(int64_t code, const std::string& name,
                    const std::vector<std::pair<uintptr_t, uintptr_t>>& by_dtype) {
  if (!is_user_op(code)) throw std::invalid_argument("user op codes start at " +
                                                     std::to_string(kFirstUserOp));
  if (by_dtype.size() != size_t(kNumDTypes))
    throw std::invalid_argument("define_user_op takes one (apart, into) pair per dtype");
  UserOp op{name};
  for (int t = 0; t < kNumDTypes; ++t) {
    if (!by_dtype[t].first != !by_dtype[t].second)
      throw std::invalid_argument("define_user_op: a dtype needs both functions or neither");
    op.apart[t] = reinterpret_cast<UserApart>(by_dtype[t].first);
    op.into[t] = reinterpret_cast<UserInto>(by_dtype[t].second);
  }
  std::lock_guard<std::mutex> hold(registry_lock);
  registry.emplace(code, op);  // (a code defined again keeps its first functions)
}

std::string user_op_name(int64_t code) {
  std::lock_guard<std::mutex> hold(registry_lock);
  auto it = registry.find(code);
  return it == registry.end() ? "" : it->second.name;
}

bool user_op_takes(int64_t code, int dtype) {
  dtype_info(dtype);  // (throws for an unknown code)
  return find(code).into[dtype] != nullptr;
}

std::string user_op_dtypes(int64_t code) {
  const UserOp& op = find(code);
  std::string out;
  for (int t = 0; t < kNumDTypes; ++t)
    if (op.into[t]) out += (out.empty() ? "" : ", ") + std::string(kDTypes[t].name);
  return out;
}

void user_reduce(void* dst, const void* a, const void* b, int64_t count, int dtype,
                 int64_t code) {
  const UserOp& op = find(code);
  if (!op.into[dtype])
    throw std::invalid_argument("reduce op '" + op.name + "' is not defined for " +
                                kDTypes[dtype].name);
  if (count == 0) return;
  auto d = static_cast<uint16_t*>(dst);
  auto x = static_cast<const uint16_t*>(a);
  auto y = static_cast<const uint16_t*>(b);
  if (dtype == F16)
    return through_float(op.into[F16], d, x, y, count, detail::half_to_float,
                         detail::float_to_half);
  if (dtype == BF16)
    return through_float(op.into[BF16], d, x, y, count, detail::bf16_to_float,
                         detail::float_to_bf16);
  call(op, dtype, dst, a, b, count);
}

}  // namespace commlib
