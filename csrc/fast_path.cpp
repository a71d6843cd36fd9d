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
//           that do not fit, a root outside the communicator, an op it does not know, avg
//           on integers, another timeout, an unknown call, a hold) returns False and the
//           general path takes the call, raising its usual errors. Ranks may take
//           different paths for one collective: both run the same entry, which agrees
//           with itself on the wire.
//   hold    the general path owns the communicator: work of its progress engine is queued
//           or running (a call here would overtake it), or the communicator failed.
//   record  the flight recorder's row for a call run here, kept in a ring as big as the
//           recorder (commlib/calls.py); calls are numbered by one counter for both paths.
//   failure a call that fails here (timeout, disagreement, a dead peer) is handed to
//           Python's `on_failure(collective, op, root, issued, kind, message)`, which
//           records it as the general path would and returns the exception to raise.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <tuple>

#include "agreement.h"
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

double now() {  // seconds on CLOCK_MONOTONIC, Python's time.monotonic()
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool overlap(const Array& a, const Array& b) {
  return a.nbytes() > 0 && b.nbytes() > 0 && a.data < b.data + b.nbytes() &&
         b.data < a.data + a.nbytes();
}

}  // namespace

class FastPath {
 public:
  // `op_codes`: what callers may pass as a reducing collective's op -> its code;
  // `records`: the ring's size.
  FastPath(shm::ShmComm& comm, py::dict op_codes, double timeout, size_t records,
           py::function on_failure)
      : timeout(timeout), comm_(comm), op_codes_(std::move(op_codes)),
        on_failure_(std::move(on_failure)), ring_(records) {}

  // What the general path runs for this call: `plan` (with its scratch bytes), or the
  // direct collective when `plan` is empty. `id` names the entry to the caller.
  void learn(int collective, int64_t count, int64_t itemsize, int64_t root,
             std::vector<int64_t> plan, int64_t tmp_bytes, int id) {
    if (entries_.size() >= kMaxEntries) return;  // the general path runs the rest
    entries_.emplace(Key{collective, count, itemsize, root},
                     std::make_unique<const Entry>(Entry{std::move(plan), tmp_bytes, id}));
  }

  int64_t taken() const { return taken_; }  // calls run here so far
  int64_t next_seq() { return ++seq_; }      // the general path numbers its calls here too
  void hold(int delta) { holds_ += delta; }  // +1 / -1 around the general path's work
  double timeout = 0;  // the communicator's (Communicator.timeout): others go general

  // Runs the collective and returns True, or False: the general path's call. `a` is the
  // output (or the only buffer), `b` the input; `op` as the caller gave it (None where the
  // collective does not reduce), `root` too (None where it has none).
  bool call(int collective, py::handle a, py::handle b, py::handle op_given,
            py::handle root_given) {
    if (holds_.load(std::memory_order_acquire) != 0) return false;
    const bool reduces = collective == ALL_REDUCE || collective == REDUCE ||
                         collective == REDUCE_SCATTER;
    int op = SUM;  // (what the others run with: they reduce nothing)
    if (reduces) {
      PyObject* code = PyDict_GetItemWithError(op_codes_.ptr(), op_given.ptr());
      if (code == nullptr) {  // (an unhashable op leaves a TypeError: the general path's)
        PyErr_Clear();
        return false;
      }
      op = int(PyLong_AsLong(code));
    }
    int64_t root = kNone;
    if (!root_given.is_none()) {
      if (!PyLong_CheckExact(root_given.ptr())) return false;  // (bool is not a root)
      int overflow = 0;
      root = PyLong_AsLongLongAndOverflow(root_given.ptr(), &overflow);
      if (overflow) return false;
    }
    Array out, in;
    const int n = comm_.size();
    const bool two = collective == ALL_GATHER || collective == REDUCE_SCATTER ||
                     collective == ALL_TO_ALL;
    if (!view(a, true, out) || (two && !view(b, false, in))) return false;
    if (timeout != comm_.timeout() || op < SUM || op > AVG) return false;
    if (op == AVG && !floating(out.dtype)) return false;
    int64_t count = out.size;  // the per-rank count the general path plans with
    switch (collective) {
      case ALL_REDUCE: root = kNone; break;
      case BROADCAST: case REDUCE:
        if (root < 0 || root >= n) return false;
        break;
      case ALL_GATHER:  // out = n blocks of in; in may be out's own block
        if (in.dtype != out.dtype || out.size != n * in.size) return false;
        if (overlap(in, out) && in.data != out.data + comm_.rank() * in.nbytes()) return false;
        count = in.size, root = kNone;
        break;
      case REDUCE_SCATTER:  // in = n blocks of out; out may be in's own block
        if (in.dtype != out.dtype || in.size != n * out.size) return false;
        if (overlap(in, out) && out.data != in.data + comm_.rank() * out.nbytes()) return false;
        root = kNone;
        break;
      case ALL_TO_ALL:  // equal parts
        if (in.dtype != out.dtype || in.size != out.size || in.size % n || overlap(in, out))
          return false;
        root = kNone;
        break;
      default: return false;
    }
    const Key key{collective, count, itemsize(out.dtype), root};
    if (key != last_key_) {  // loops repeat one call: skip the lookup
      auto found = entries_.find(key);
      if (found == entries_.end()) return false;
      last_key_ = key, last_ = found->second.get();  // entries are never removed
    }
    const Entry* entry = last_;
    const double issued = now();
    const char* failed = nullptr;  // the kind of error, named as in commlib/errors.py
    std::string why;
    try {
      py::gil_scoped_release nogil;
      run(*entry, collective, out, in, count, op, root);
    } catch (const TimeoutError& e) {
      failed = "CommTimeoutError", why = e.what();
    } catch (const MismatchError& e) {
      failed = "CollectiveMismatchError", why = e.what();
    } catch (const shm::PeerError& e) {
      failed = "CommError", why = e.what();
    }
    if (failed) {
      py::object error =
          on_failure_(collective, reduces ? op : kNone, root, issued, failed, why);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
      throw py::error_already_set();
    }
    ++taken_;
    record({++seq_, collective, entry->id, out.dtype, reduces ? op : kNone, root, issued, now()});
    return true;
  }

  // The recorded calls, oldest first: (seq, collective, entry id, dtype, op, root,
  // issued, finished); op and root are NONE where they do not apply.
  py::list records() const {
    py::list out;
    std::vector<const Record*> kept;
    for (const Record& r : ring_)
      if (r.seq > 0) kept.push_back(&r);
    std::sort(kept.begin(), kept.end(), [](auto x, auto y) { return x->seq < y->seq; });
    for (const Record* r : kept)
      out.append(py::make_tuple(r->seq, r->collective, r->entry, r->dtype, r->op, r->root,
                                r->issued, r->finished));
    return out;
  }

 private:
  struct Entry {
    std::vector<int64_t> plan;  // empty: the direct collective
    int64_t tmp_bytes;
    int id;
  };
  struct Record {
    int64_t seq = 0;  // 0: an empty slot
    int collective, entry, dtype;
    int64_t op, root;
    double issued, finished;
  };
  using Key = std::tuple<int, int64_t, int64_t, int64_t>;
  static constexpr size_t kMaxEntries = 4096;

  void record(const Record& r) {
    if (!ring_.empty()) ring_[slot_++ % ring_.size()] = r;
  }

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
  py::dict op_codes_;
  py::function on_failure_;
  std::atomic<int> holds_{0};
  int64_t taken_ = 0, seq_ = 0;
  size_t slot_ = 0;  // where the next record goes
  std::vector<Record> ring_;
  std::map<Key, std::unique_ptr<const Entry>> entries_;
  Key last_key_{-1, -1, -1, -1};
  const Entry* last_ = nullptr;
};

namespace {

// `FastPath.call` without pybind11's argument dispatch, which costs about as much as a
// Python frame: a plain C function (vectorcall) whose self is (the FastPath's Python
// object, which it keeps alive; a capsule of its pointer).
PyObject* call_without_dispatch(PyObject* bound, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "call(collective, a, b, op, root) takes 5 arguments");
    return nullptr;
  }
  auto* path = static_cast<FastPath*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(bound, 1), nullptr));
  const long collective = PyLong_AsLong(args[0]);
  if (collective == -1 && PyErr_Occurred()) return nullptr;
  try {
    return PyBool_FromLong(path->call(int(collective), args[1], args[2], args[3], args[4]));
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef call_def = {
    "call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_without_dispatch)),
    METH_FASTCALL,
    "call(collective, a, b, op, root) -> True, or False: the general path's call. `a` is the "
    "output (or the only buffer), `b` the input (or None); `op` reducing collectives' only, "
    "`root` rooted ones' only (None elsewhere)."};

}  // namespace

void bind_fast_path(py::module_& m) {
  py::class_<FastPath>(m, "FastPath",
                       "Whole collectives on numpy arrays in one call (csrc/fast_path.cpp).")
      .def(py::init<shm::ShmComm&, py::dict, double, size_t, py::function>(),
           py::arg("transport"), py::arg("op_codes"), py::arg("timeout"), py::arg("records"),
           py::arg("on_failure"), py::keep_alive<1, 2>())
      .def("learn", &FastPath::learn, py::arg("collective"), py::arg("count"), py::arg("itemsize"),
           py::arg("root"), py::arg("plan"), py::arg("tmp_bytes"), py::arg("id"))
      .def_property_readonly("call", [](py::object self) {
        auto bound = py::make_tuple(self, py::capsule(self.cast<FastPath*>()));
        return py::reinterpret_steal<py::object>(PyCFunction_New(&call_def, bound.ptr()));
      })
      .def("next_seq", &FastPath::next_seq)
      .def("hold", &FastPath::hold, py::arg("delta"))
      .def("records", &FastPath::records)
      .def_property_readonly("taken", &FastPath::taken)
      .def_readwrite("timeout", &FastPath::timeout);
}

}  // namespace commlib
