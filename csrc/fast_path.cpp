// The fast path: a whole collective on numpy arrays or torch CPU tensors in one call from
// Python, on a transport that runs whole collectives in C++ (fast_path.h). The general path
// (commlib/dispatch.py) validates in Python and costs a few microseconds per call, more
// than a small collective itself.
//
// Vocabulary:
//   call    (collective, algorithm asked for, primary count, itemsize, root): what fixes
//           the algorithm and its plan. The rules of a call are call.h's, checked here
//           too; a call that breaks them is declined, and the general path raises.
//   entry   what the general path decided for a call (commlib/fast_path.py teaches it):
//           a FastEntry (fast_path.h), which the transport runs.
//           The fast path runs only calls it has an entry for, so it always runs exactly
//           what the general path would.
//   decline anything this path does not take (not numpy nor a plain CPU tensor, not contiguous, a call that
//           breaks call.h's rules, an op or algorithm it does not know, uneven
//           all_to_all parts, another timeout, an unknown call, a call the entry's
//           transport does not take (FastTransport::takes), a hold) returns False and
//           the general path takes the call, raising its usual errors. Ranks may take
//           different paths for one collective: both run the same entry, which agrees
//           with itself on the wire.
//   hold    the general path owns the communicator: work of its progress engine is queued
//           or running (a call here would overtake it), or the communicator failed.
//   record  the flight recorder's row for a call run here, kept in a ring as big as the
//           recorder (commlib/recorder.py); calls are numbered by one counter for both paths.
//   failure a call that fails here (timeout, disagreement, a dead peer) is handed to
//           Python's `on_failure(collective, op, root, issued, kind, message, arrays)`,
//           which records it as the general path would (keeping the arrays after a
//           timeout, as MPI may still hold them) and returns the exception to raise.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "agreement.h"
#include "call.h"
#include "fast_path.h"
#include "kernels.h"

namespace py = pybind11;

namespace commlib {

namespace {

constexpr int NPY_ARRAY_WRITEABLE_ = 0x0400;  // numpy's flag bit (pybind11 does not name it)

// numpy dtype -> commlib dtype code (kernels.h's table), -1 if unsupported.
int numpy_dtype_code(const py::dtype& dt) {
  if (dt.byteorder() == '>') return -1;
  for (int code = 0; code < kNumDTypes; ++code)
    if (kDTypes[code].numpy_kind == dt.kind() && kDTypes[code].itemsize == dt.itemsize())
      return code;
  return -1;
}

// torch CPU tensors, read through their Python attributes (commlib links no torch):
// the types taken (exactly torch.Tensor and nn.Parameter: a subclass such as DTensor
// says what its memory means itself), torch's dtypes -> codes, torch.strided. Empty
// until Python meets its first tensor (take_torch). And torch.distributed's ReduceOp,
// whose hash is its kind's value (take_torch_ops checks): kind -> op code, -1 where the
// fast path has no such op (PREMUL_SUM carries a factor).
struct TorchKinds {
  std::vector<PyObject*> types;
  PyObject* dtype_codes = nullptr;
  PyObject* strided = nullptr;
  PyObject* reduce_op_type = nullptr;
  std::vector<int> reduce_op_codes;
};

TorchKinds& torch_kinds() {
  static TorchKinds kinds;  // (references held for good: torch's types never go away)
  return kinds;
}

// obj.name, or obj.name() when `call` (a new reference; nullptr with Python's error set).
PyObject* attribute(PyObject* obj, PyObject* name, bool call) {
  return call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
}

// False unless `obj` is a contiguous strided CPU tensor (torch_kinds' types) of a
// supported dtype.
bool torch_view(PyObject* obj, Operand& out) {
  const TorchKinds& kinds = torch_kinds();
  if (std::find(kinds.types.begin(), kinds.types.end(),
                reinterpret_cast<PyObject*>(Py_TYPE(obj))) == kinds.types.end())
    return false;
  struct Read { PyObject* name; bool call; PyObject* value; };
  static PyObject* const names[] = {  // (interned once: no string made or hashed per call)
      PyUnicode_InternFromString("is_cpu"),        PyUnicode_InternFromString("layout"),
      PyUnicode_InternFromString("is_nested"),     PyUnicode_InternFromString("dtype"),
      PyUnicode_InternFromString("is_contiguous"), PyUnicode_InternFromString("data_ptr"),
      PyUnicode_InternFromString("numel")};
  Read reads[] = {{names[0], false, nullptr}, {names[1], false, nullptr},
                  {names[2], false, nullptr}, {names[3], false, nullptr},
                  {names[4], true, nullptr},  {names[5], true, nullptr},
                  {names[6], true, nullptr}};
  bool ok = true;
  for (Read& r : reads)
    if (ok && (r.value = attribute(obj, r.name, r.call)) == nullptr) ok = false;
  PyObject* code = nullptr;
  if (ok) {
    code = PyDict_GetItem(kinds.dtype_codes, reads[3].value);  // (borrowed)
    ok = reads[0].value == Py_True && reads[1].value == kinds.strided &&
         reads[2].value == Py_False && code != nullptr && reads[4].value == Py_True;
  }
  if (ok)
    out = {uintptr_t(PyLong_AsUnsignedLongLong(reads[5].value)),
           int64_t(PyLong_AsLongLong(reads[6].value)), int(PyLong_AsLong(code))};
  for (Read& r : reads) Py_XDECREF(r.value);
  if (PyErr_Occurred()) PyErr_Clear(), ok = false;  // (the general path will say why)
  return ok;
}

// `op`'s code if it is a torch ReduceOp (-1 if the fast path has none for it), else -2.
int torch_op(PyObject* op) {
  const TorchKinds& kinds = torch_kinds();
  if (reinterpret_cast<PyObject*>(Py_TYPE(op)) != kinds.reduce_op_type) return -2;
  const Py_hash_t kind = PyObject_Hash(op);
  if (kind < 0 || size_t(kind) >= kinds.reduce_op_codes.size()) {
    PyErr_Clear();
    return -1;
  }
  return kinds.reduce_op_codes[size_t(kind)];
}

// False unless `obj` is a C-contiguous numpy array of a supported dtype (and writable
// when `write`), or a tensor torch_view takes.
bool view(py::handle obj, bool write, Operand& out) {
  if (!py::array::check_(obj)) return torch_view(obj.ptr(), out);
  auto arr = py::reinterpret_borrow<py::array>(obj);
  const int needed = py::array::c_style | (write ? NPY_ARRAY_WRITEABLE_ : 0);
  if ((arr.flags() & needed) != needed) return false;
  out = {reinterpret_cast<uintptr_t>(arr.data()), int64_t(arr.size()),
         numpy_dtype_code(arr.dtype())};
  return out.dtype >= 0;
}

double now() {  // seconds on CLOCK_MONOTONIC, Python's time.monotonic()
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

class FastPath {
 public:
  // `op_codes`: what callers may pass as a reducing collective's op -> its code;
  // `algorithms`: the algorithm names callers may ask for -> the ids entries are learned
  // under (None, auto, is 0; Python adds names as it teaches them); `records`: the ring's
  // size.
  FastPath(FastTransport& comm, py::dict op_codes, py::dict algorithms, double timeout,
           size_t records, py::function on_failure)
      : timeout(timeout), comm_(comm), op_codes_(std::move(op_codes)),
        algorithms_(std::move(algorithms)), on_failure_(std::move(on_failure)),
        ring_(records) {}

  // What the general path runs for this call: an entry of `kind` ("plan", "direct",
  // "one_copy", "eager" or "native": fast_path.h), with `plan` and its scratch bytes for a
  // plan and the call's `descriptor` where the entry needs it. `id` names the entry to the caller.
  // `only_regions`: a one_copy that reads in place only in regions (fast_path.h).
  void learn(int collective, int algorithm, int64_t count, int64_t itemsize, int64_t root,
             const std::string& kind, std::vector<int64_t> plan, int64_t tmp_bytes, int id,
             std::vector<int64_t> descriptor, bool only_regions) {
    static const std::map<std::string, EntryKind> kinds = {
        {"plan", EntryKind::PLAN}, {"direct", EntryKind::DIRECT},
        {"one_copy", EntryKind::ONE_COPY}, {"eager", EntryKind::EAGER},
        {"native", EntryKind::NATIVE}};
    auto found = kinds.find(kind);
    if (found == kinds.end()) throw std::invalid_argument("no fast-path entry of kind " + kind);
    if (entries_.size() >= kMaxEntries) return;  // the general path runs the rest
    entries_.emplace(Key{collective, algorithm, count, itemsize, root},
                     std::make_unique<const FastEntry>(FastEntry{
                         found->second, std::move(plan), tmp_bytes, id, std::move(descriptor),
                         only_regions}));
  }

  // Forget the entries learned under `algorithm` (0: auto, whose choices a new algorithm
  // table changes). They stay alive unused: a call on another thread may be running one.
  void forget(int algorithm) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (std::get<1>(it->first) != algorithm) {
        ++it;
        continue;
      }
      retired_.push_back(std::move(it->second));
      it = entries_.erase(it);
    }
    last_key_ = Key{-1, -1, -1, -1, -1}, last_ = nullptr;
  }

  int64_t taken() const { return taken_; }  // calls run here so far
  int64_t next_seq() { return ++seq_; }      // the general path numbers its calls here too
  void hold(int delta) { holds_ += delta; }  // +1 / -1 around the general path's work
  double timeout = 0;  // the communicator's (Communicator.timeout): others go general

  // Runs the collective and returns True, or False: the general path's call. `a` is the
  // output (or the only buffer), `b` the input; `op` as the caller gave it (None where the
  // collective does not reduce), `root` too (None where it has none), `algorithm` the
  // name asked for (None: auto).
  bool call(int collective, py::handle a, py::handle b, py::handle op_given,
            py::handle root_given, py::handle algorithm_given) {
    if (holds_.load(std::memory_order_acquire) != 0) return false;
    int algorithm = 0;
    if (!algorithm_given.is_none() && (algorithm = lookup(algorithms_, algorithm_given)) <= 0)
      return false;
    const CollectiveInfo& kind = collective_info(collective);
    int64_t op = kNone;
    if (kind.reduces) {
      if ((op = torch_op(op_given.ptr())) == -2) op = lookup(op_codes_, op_given);
      if (op < 0) return false;
    }
    int64_t root = kNone;
    if (kind.rooted) {
      if (!PyLong_CheckExact(root_given.ptr())) return false;  // (bool is not a root)
      int overflow = 0;
      root = PyLong_AsLongLongAndOverflow(root_given.ptr(), &overflow);
      if (overflow) return false;
    }
    Operand out, in;
    if (!view(a, true, out) || (kind.has_input() && !view(b, false, in))) return false;
    if (timeout != comm_.timeout()) return false;
    const int n = comm_.size();
    if (kind.parts == kExchange && (in.count != out.count || in.count % n)) return false;
    CheckedCall checked;
    try {
      checked = check_call(collective, n, comm_.rank(), out, in, op, root);
    } catch (const std::invalid_argument&) {
      return false;
    }
    const Key key{collective, algorithm, checked.primary, itemsize(out.dtype), root};
    if (key != last_key_) {  // loops repeat one call: skip the lookup
      auto found = entries_.find(key);
      if (found == entries_.end()) return false;
      last_key_ = key, last_ = found->second.get();  // entries are never removed
    }
    const FastEntry* entry = last_;
    const FastCall fast{collective, out, in, checked.primary, kind.reduces ? int(op) : SUM, root, op};
    if (!comm_.takes(*entry, fast)) return false;
    const double issued = now();
    const char* failed = nullptr;  // the kind of error, named as in commlib/errors.py
    std::string why;
    try {
      py::gil_scoped_release nogil;
      comm_.run(*entry, fast);
      if (checked.scale != 0)
        scale(reinterpret_cast<void*>(out.ptr), out.count, out.dtype, checked.scale);
    } catch (const TimeoutError& e) {
      failed = "CommTimeoutError", why = e.what();
    } catch (const MismatchError& e) {
      failed = "CollectiveMismatchError", why = e.what();
    } catch (const PeerError& e) {
      failed = "CommError", why = e.what();
    }
    if (failed) {  // (`a` and `b` kept: MPI may still hold them after a timeout)
      py::object error = on_failure_(collective, op, root, issued, failed, why,
                                     py::make_tuple(a, b));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
      throw py::error_already_set();
    }
    ++taken_;
    record({++seq_, collective, entry->id, out.dtype, op, root, issued, now()});
    return true;
  }

  // Keep the last `records` calls from now on (a trace window keeps more), the newest
  // of those kept so far among them.
  void keep(size_t records) {
    std::vector<Record> kept;
    for (const Record& r : ring_)
      if (r.seq > 0) kept.push_back(r);
    std::sort(kept.begin(), kept.end(), [](auto& x, auto& y) { return x.seq < y.seq; });
    if (kept.size() > records) kept.erase(kept.begin(), kept.end() - records);
    slot_ = kept.size();
    kept.resize(records);
    ring_ = std::move(kept);
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
  struct Record {
    int64_t seq = 0;  // 0: an empty slot
    int collective, entry, dtype;
    int64_t op, root;
    double issued, finished;
  };
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t>;
  static constexpr size_t kMaxEntries = 4096;

  // table[key] as an int, or -1 where the key is absent (or unhashable: the general path
  // raises the TypeError).
  static int lookup(const py::dict& table, py::handle key) {
    PyObject* value = PyDict_GetItemWithError(table.ptr(), key.ptr());
    if (value == nullptr) {
      PyErr_Clear();
      return -1;
    }
    return int(PyLong_AsLong(value));
  }

  void record(const Record& r) {
    if (!ring_.empty()) ring_[slot_++ % ring_.size()] = r;
  }

  FastTransport& comm_;
  py::dict op_codes_, algorithms_;
  py::function on_failure_;
  std::atomic<int> holds_{0};
  int64_t taken_ = 0, seq_ = 0;
  size_t slot_ = 0;  // where the next record goes
  std::vector<Record> ring_;
  std::map<Key, std::unique_ptr<const FastEntry>> entries_;
  std::vector<std::unique_ptr<const FastEntry>> retired_;  // forgotten entries
  Key last_key_{-1, -1, -1, -1, -1};
  const FastEntry* last_ = nullptr;
};

namespace {

// `FastPath.call` without pybind11's argument dispatch, which costs about as much as a
// Python frame: a plain C function (vectorcall) whose self is (the FastPath's Python
// object, which it keeps alive; a capsule of its pointer).
PyObject* call_without_dispatch(PyObject* bound, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "call(collective, a, b, op, root, algorithm) takes 6 arguments");
    return nullptr;
  }
  auto* path = static_cast<FastPath*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(bound, 1), nullptr));
  const long collective = PyLong_AsLong(args[0]);
  if (collective == -1 && PyErr_Occurred()) return nullptr;
  try {
    return PyBool_FromLong(
        path->call(int(collective), args[1], args[2], args[3], args[4], args[5]));
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
    "call(collective, a, b, op, root, algorithm) -> True, or False: the general path's call. "
    "`a` is the output (or the only buffer), `b` the input (or None); `op` reducing "
    "collectives' only, `root` rooted ones' only (None elsewhere); `algorithm` None or a "
    "name."};

}  // namespace

void bind_fast_path(py::module_& m) {
  m.def(
      "take_torch",
      [](py::tuple types, py::dict dtype_codes, py::object strided) {
        TorchKinds& kinds = torch_kinds();
        if (kinds.dtype_codes != nullptr) return;  // (once per process)
        for (py::handle type : types) kinds.types.push_back(type.inc_ref().ptr());
        kinds.dtype_codes = dtype_codes.inc_ref().ptr();
        kinds.strided = strided.inc_ref().ptr();
      },
      py::arg("types"), py::arg("dtype_codes"), py::arg("strided"),
      "Let the fast path take CPU tensors of exactly these types (torch.Tensor, "
      "nn.Parameter), their dtypes as {torch dtype: commlib code}.");
  m.def(
      "take_torch_ops",
      [](py::object reduce_op_type, std::vector<int> codes) {
        TorchKinds& kinds = torch_kinds();
        if (kinds.reduce_op_type != nullptr) return;  // (once per process)
        kinds.reduce_op_codes = std::move(codes);
        kinds.reduce_op_type = reduce_op_type.inc_ref().ptr();
      },
      py::arg("reduce_op_type"), py::arg("codes"),
      "Let the fast path take torch.distributed.ReduceOp objects as ops: codes[kind] is "
      "the op code of the ReduceOp whose hash is kind (-1: none).");

  py::class_<FastTransport>(m, "FastTransport",
                            "A transport that runs whole collectives in C++ (fast_path.h).");
  py::class_<FastPath>(m, "FastPath",
                       "Whole collectives on numpy arrays and CPU tensors in one call (csrc/fast_path.cpp).")
      .def(py::init<FastTransport&, py::dict, py::dict, double, size_t, py::function>(),
           py::arg("transport"), py::arg("op_codes"), py::arg("algorithms"),
           py::arg("timeout"), py::arg("records"), py::arg("on_failure"),
           py::keep_alive<1, 2>())
      .def("learn", &FastPath::learn, py::arg("collective"), py::arg("algorithm"),
           py::arg("count"), py::arg("itemsize"), py::arg("root"), py::arg("kind"),
           py::arg("plan"), py::arg("tmp_bytes"), py::arg("id"), py::arg("descriptor"),
           py::arg("only_regions") = false)
      .def_property_readonly("call", [](py::object self) {
        auto bound = py::make_tuple(self, py::capsule(self.cast<FastPath*>()));
        return py::reinterpret_steal<py::object>(PyCFunction_New(&call_def, bound.ptr()));
      })
      .def("forget", &FastPath::forget, py::arg("algorithm"))
      .def("next_seq", &FastPath::next_seq)
      .def("hold", &FastPath::hold, py::arg("delta"))
      .def("records", &FastPath::records)
      .def("keep", &FastPath::keep, py::arg("records"))
      .def_property_readonly("taken", &FastPath::taken)
      .def_readwrite("timeout", &FastPath::timeout);
}

}  // namespace commlib
