// The fast path: a whole collective on numpy arrays in one call from Python, on the
// shared-memory transport. The general path (commlib/collectives.py) validates in
// Python and costs a few microseconds per call, more than a small collective itself.
//
// Vocabulary:
//   call    (collective, count, itemsize, root): what fixes the algorithm and its plan
//           (count: elements per rank that the general path plans with).
//   entry   what the general path decided for a call (commlib/fast_path.py teaches it):
//           a flattened schedule (csrc/shm_plan.cpp), or empty for the direct collective.
//           The fast path runs only calls it has an entry for, so it always runs exactly
//           what the general path would.
//   decline anything this path does not check itself (not numpy, not contiguous, sizes
//           that do not fit, a root outside the communicator, avg on integers, another
//           timeout, an unknown call) returns -1 and the general path takes the call,
//           raising its usual errors. Ranks may take different paths for one collective:
//           both run the same entry, which agrees with itself on the wire.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <tuple>

#include "kernels.h"
#include "shm.h"

namespace py = pybind11;

namespace commlib {

namespace {

constexpr int NPY_ARRAY_WRITEABLE_ = 0x0400;  // numpy's flag bit (pybind11 does not name it)

// numpy dtype -> commlib dtype code, -1 if unsupported (numpy has no bfloat16).
int numpy_dtype_code(const py::dtype& dt) {
  if (dt.byteorder() == '>') return -1;
  switch (dt.kind()) {
    case 'f': return dt.itemsize() == 2 ? F16 : dt.itemsize() == 4 ? F32
                   : dt.itemsize() == 8 ? F64 : -1;
    case 'i': return dt.itemsize() == 1 ? I8 : dt.itemsize() == 4 ? I32
                   : dt.itemsize() == 8 ? I64 : -1;
    case 'u': return dt.itemsize() == 1 ? U8 : -1;
    default: return -1;
  }
}

bool floating(int dtype) { return dtype == F16 || dtype == BF16 || dtype == F32 || dtype == F64; }

struct Array {  // a C-contiguous numpy array of a supported dtype
  char* data = nullptr;
  int64_t size = 0;
  int dtype = -1;
  int64_t nbytes() const { return size * itemsize(dtype); }
};

// False unless `obj` is a C-contiguous numpy array of a supported dtype (and writable
// when `write`).
bool view(py::handle obj, bool write, Array& out) {
  if (!py::array::check_(obj)) return false;
  auto arr = py::reinterpret_borrow<py::array>(obj);
  const int needed = py::array::c_style | (write ? NPY_ARRAY_WRITEABLE_ : 0);
  if ((arr.flags() & needed) != needed) return false;
  out = {static_cast<char*>(const_cast<void*>(arr.data())), int64_t(arr.size()),
         numpy_dtype_code(arr.dtype())};
  return out.dtype >= 0;
}

bool overlap(const Array& a, const Array& b) {
  return a.nbytes() > 0 && b.nbytes() > 0 && a.data < b.data + b.nbytes() &&
         b.data < a.data + a.nbytes();
}

}  // namespace

class FastPath {
 public:
  explicit FastPath(shm::ShmComm& comm) : comm_(comm) {}

  // What the general path runs for this call: `plan` (with its scratch bytes), or the
  // direct collective when `plan` is empty. `id` names the entry to the caller.
  void learn(int collective, int64_t count, int64_t itemsize, int64_t root,
             std::vector<int64_t> plan, int64_t tmp_bytes, int id) {
    if (entries_.size() >= kMaxEntries) return;  // the general path runs the rest
    entries_.emplace(Key{collective, count, itemsize, root},
                     std::make_unique<const Entry>(Entry{std::move(plan), tmp_bytes, id}));
  }

  int64_t taken() const { return taken_; }  // calls run here so far

  // Runs the collective and returns its entry's id, or -1: the general path's call.
  // `a` is the output (or the only buffer), `b` the input.
  int call(int collective, py::handle a, py::handle b, int op, int64_t root, double timeout) {
    Array out, in;
    const int n = comm_.size();
    const bool two = collective == ALL_GATHER || collective == REDUCE_SCATTER ||
                     collective == ALL_TO_ALL;
    if (!view(a, true, out) || (two && !view(b, false, in))) return -1;
    if (timeout != comm_.timeout() || op < SUM || op > AVG) return -1;
    if (op == AVG && !floating(out.dtype)) return -1;
    int64_t count = out.size;  // the per-rank count the general path plans with
    switch (collective) {
      case ALL_REDUCE: root = kNone; break;
      case BROADCAST: case REDUCE:
        if (root < 0 || root >= n) return -1;
        break;
      case ALL_GATHER:  // out = n blocks of in; in may be out's own block
        if (in.dtype != out.dtype || out.size != n * in.size) return -1;
        if (overlap(in, out) && in.data != out.data + comm_.rank() * in.nbytes()) return -1;
        count = in.size, root = kNone;
        break;
      case REDUCE_SCATTER:  // in = n blocks of out; out may be in's own block
        if (in.dtype != out.dtype || in.size != n * out.size) return -1;
        if (overlap(in, out) && out.data != in.data + comm_.rank() * out.nbytes()) return -1;
        root = kNone;
        break;
      case ALL_TO_ALL:  // equal parts
        if (in.dtype != out.dtype || in.size != out.size || in.size % n || overlap(in, out))
          return -1;
        root = kNone;
        break;
      default: return -1;
    }
    const Key key{collective, count, itemsize(out.dtype), root};
    if (key != last_key_) {  // loops repeat one call: skip the lookup
      auto found = entries_.find(key);
      if (found == entries_.end()) return -1;
      last_key_ = key, last_ = found->second.get();  // entries are never removed
    }
    const Entry* entry = last_;
    {
      py::gil_scoped_release nogil;
      run(*entry, collective, out, in, count, op, root);
    }
    ++taken_;
    return entry->id;
  }

 private:
  struct Entry {
    std::vector<int64_t> plan;  // empty: the direct collective
    int64_t tmp_bytes;
    int id;
  };
  using Key = std::tuple<int, int64_t, int64_t, int64_t>;
  static constexpr size_t kMaxEntries = 4096;

  void run(const Entry& e, int collective, const Array& out, const Array& in, int64_t count,
           int op, int64_t root) {
    const auto o = reinterpret_cast<uintptr_t>(out.data), i = reinterpret_cast<uintptr_t>(in.data);
    if (!e.plan.empty()) {
      comm_.run_plan(e.plan.data(), int64_t(e.plan.size()), {o, i}, e.tmp_bytes, out.dtype, op);
    } else {
      switch (collective) {
        case ALL_REDUCE: comm_.all_reduce(o, count, out.dtype, op, 3); break;
        case REDUCE: comm_.reduce(o, count, out.dtype, op, int(root)); break;
        case BROADCAST: comm_.broadcast(o, count, out.dtype, int(root)); break;
        case ALL_GATHER: comm_.all_gather(o, i, count, out.dtype); break;
        case REDUCE_SCATTER: comm_.reduce_scatter(o, i, count, out.dtype, op); break;
        case ALL_TO_ALL: {
          const int n = comm_.size();
          const int64_t part = in.nbytes() / n;
          std::vector<int64_t> offsets(n), lengths(n, part);
          for (int j = 0; j < n; ++j) offsets[j] = j * part;
          comm_.all_to_all(o, i, out.dtype, offsets, lengths, offsets, lengths);
          break;
        }
      }
    }
    if (op == AVG && (collective != REDUCE || root == comm_.rank()))
      scale(out.data, out.size, out.dtype, 1.0 / comm_.size());
  }

  shm::ShmComm& comm_;
  int64_t taken_ = 0;
  std::map<Key, std::unique_ptr<const Entry>> entries_;
  Key last_key_{-1, -1, -1, -1};
  const Entry* last_ = nullptr;
};

void bind_fast_path(py::module_& m) {
  py::class_<FastPath>(m, "FastPath",
                       "Whole collectives on numpy arrays in one call (csrc/fast_path.cpp).")
      .def(py::init<shm::ShmComm&>(), py::arg("transport"), py::keep_alive<1, 2>())
      .def("learn", &FastPath::learn, py::arg("collective"), py::arg("count"), py::arg("itemsize"),
           py::arg("root"), py::arg("plan"), py::arg("tmp_bytes"), py::arg("id"))
      .def("call", &FastPath::call, py::arg("collective"), py::arg("a"), py::arg("b"),
           py::arg("op"), py::arg("root"), py::arg("timeout"))
      .def_property_readonly("taken", &FastPath::taken);
}

}  // namespace commlib
