// Descriptors of calls and the messages that name a disagreement (see agreement.h).
#include "agreement.h"

#include <algorithm>
#include <map>

#include "kernels.h"
#include "user_ops.h"

namespace commlib {

namespace {

const char* const kFieldNames[] = {"collective", "algorithm", "count", "dtype",
                                   "op",         "root",      "variant", "reserved"};

std::string field_value(const Desc& d, int field) {
  int64_t v = d.f[field];
  if (v == kNone) return "-";
  switch (field) {
    case COLLECTIVE: return collective_name(v);
    case ALGORITHM: {
      std::string name;
      for (int i = 0; i < 8 && (uint64_t(v) >> (8 * i)) & 0xff; ++i)
        name += char((uint64_t(v) >> (8 * i)) & 0xff);
      return name;
    }
    case DTYPE: return v >= 0 && v < kNumDTypes ? kDTypes[v].name : std::to_string(v);
    case OP:
      if (v >= 0 && v <= kLastOp) return kOpNames[v];
      if (is_user_op(v) && !user_op_name(v).empty()) return "'" + user_op_name(v) + "'";
      return std::to_string(v);
    default: return std::to_string(v);
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

bool Desc::operator==(const Desc& o) const {
  for (int i = 0; i < kDescFields; ++i)
    if (f[i] != o.f[i]) return false;
  return true;
}

uint64_t Desc::hash() const {  // splitmix64 over the fields
  uint64_t h = 0x636f6d6d6c6962ull;
  for (int64_t v : f) {
    h ^= uint64_t(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

std::string describe(const Desc& d) {
  if (d.f[VARIANT] == kInvalid) return field_value(d, COLLECTIVE) + " with invalid arguments";
  std::string out = field_value(d, COLLECTIVE) + "(";
  bool first = true;
  for (int field : {COUNT, DTYPE, OP, ROOT, ALGORITHM, VARIANT}) {
    if (d.f[field] == kNone || (field == VARIANT && d.f[field] == 0)) continue;
    out += (first ? "" : ", ") + std::string(kFieldNames[field]) + "=" + field_value(d, field);
    first = false;
  }
  return out + ")";
}

std::string disagreement(const std::vector<const Desc*>& descs) {
  std::vector<const Desc*> kinds;     // distinct descriptors, in order of first rank
  std::map<size_t, std::vector<int>> ranks_of;
  for (int r = 0; r < int(descs.size()); ++r) {
    if (!descs[r]) continue;
    size_t k = 0;
    while (k < kinds.size() && *kinds[k] != *descs[r]) ++k;
    if (k == kinds.size()) kinds.push_back(descs[r]);
    ranks_of[k].push_back(r);
  }
  if (kinds.size() < 2) return "";
  std::string calls;
  std::vector<int> invalid;
  for (size_t k = 0; k < kinds.size(); ++k) {
    calls += (k ? "; " : "") + rank_list(ranks_of[k]) + " called " + describe(*kinds[k]);
    if (kinds[k]->f[VARIANT] == kInvalid)
      invalid.insert(invalid.end(), ranks_of[k].begin(), ranks_of[k].end());
  }
  if (!invalid.empty()) {
    std::sort(invalid.begin(), invalid.end());
    return "the ranks' calls do not match: the arguments of " + rank_list(invalid) +
           " are invalid (" + (invalid.size() == 1 ? "it raises" : "they raise") +
           " ValueError or TypeError saying why): " + calls;
  }
  std::string differ;
  for (int field = 0; field < kDescFields; ++field)
    for (const Desc* d : kinds)
      if (d->f[field] != kinds[0]->f[field]) {
        differ += (differ.empty() ? "" : ", ") + std::string(kFieldNames[field]);
        break;
      }
  return "the ranks' calls do not match (" + differ + " differ" +
         (differ.find(',') == std::string::npos ? "s" : "") + "): " + calls;
}

std::string split_disagreement(int size, int64_t itemsize,
                               const std::function<int64_t(int, int)>& sent,
                               const std::function<int64_t(int, int)>& expected) {
  std::string out;
  int shown = 0, pairs = 0;
  for (int i = 0; i < size; ++i)
    for (int j = 0; j < size; ++j) {
      int64_t s = sent(i, j), e = expected(j, i);
      if (s == e) continue;
      if (shown++ < 4)
        out += std::string(out.empty() ? "" : "; ") + "rank " + std::to_string(i) + " sends " +
               std::to_string(s / itemsize) + " elements to rank " + std::to_string(j) +
               ", which expects " + std::to_string(e / itemsize);
      ++pairs;
    }
  if (pairs == 0) return "";
  if (pairs > shown) out += "; and " + std::to_string(pairs - shown) + " more pairs";
  return "all_to_all splits do not match across ranks (input_splits of rank i, entry j, "
         "must equal output_splits of rank j, entry i): " + out;
}

std::string check_table(const int64_t* table, int n, int64_t stride, int64_t itemsize,
                        bool splits) {
  std::vector<const Desc*> rows(n);
  for (int r = 0; r < n; ++r) rows[r] = reinterpret_cast<const Desc*>(table + r * stride);
  std::string reason = disagreement(rows);
  if (!reason.empty() || !splits) return reason;
  auto split = [&](int r, int i) { return table[r * stride + kDescFields + i]; };
  return split_disagreement(
      n, itemsize, [&](int i, int j) { return split(i, j); },
      [&](int j, int i) { return split(j, n + i); });
}

}  // namespace commlib
