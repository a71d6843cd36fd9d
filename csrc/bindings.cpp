// pybind11 module commlib._C. Buffers arrive as raw addresses (Python ints)
// so the Python side can pass numpy, torch or MPI buffers without this module
// depending on any of them. Every call drops the GIL while it works; argument
// errors are std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "call.h"
#include "fast_path.h"
#include "kernels.h"
#include "net.h"
#include "process.h"
#include "shm.h"
#include "user_ops.h"

namespace py = pybind11;
using commlib::DType;
using commlib::Op;
using commlib::NetComm;
using commlib::shm::ShmComm;

namespace {
void* ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

constexpr int NPY_ARRAY_WRITEABLE_ = 0x0400;  // numpy's flag bit (pybind11 does not name it)
}  // namespace

namespace commlib {
void bind_fast_path(py::module_& m);     // fast_path.cpp
void bind_mpi_exchange(py::module_& m);  // mpi_exchange.cpp
void bind_eager(py::module_& m);         // eager.cpp
void bind_gpu_proxy(py::module_& m);     // gpu_proxy.cpp
void bind_wire(py::module_& m);          // wire.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "commlib native kernels: elementwise reductions, scaling and copies on raw buffers";

  // kernels.h's tables: DTYPES name -> code, DTYPE_TABLE by code (name, itemsize,
  // floating), OPS name -> code
  py::dict dtypes;
  py::list dtype_table;
  for (int code = 0; code < commlib::kNumDTypes; ++code) {
    const commlib::DTypeInfo& d = commlib::kDTypes[code];
    dtypes[d.name] = code;
    dtype_table.append(py::make_tuple(d.name, d.itemsize, d.floating));
  }
  m.attr("DTYPES") = dtypes;
  m.attr("DTYPE_TABLE") = dtype_table;
  py::dict ops;
  for (int code = commlib::SUM; code <= commlib::kLastOp; ++code) ops[commlib::kOpNames[code]] = code;
  m.attr("OPS") = ops;

  py::dict collectives;
  // agreement.h's kCollectives: (name, code, reduces, rooted, from_root, parts)
  py::list collective_table;
  for (int64_t c = commlib::ALL_REDUCE; c <= commlib::BARRIER; ++c) {
    const commlib::CollectiveInfo& info = commlib::collective_info(c);
    collectives[info.name] = c;
    collective_table.append(py::make_tuple(info.name, c, info.reduces, info.rooted,
                                           info.from_root, static_cast<int>(info.parts)));
  }
  m.attr("COLLECTIVES") = collectives;
  m.attr("COLLECTIVE_TABLE") = collective_table;
  m.attr("NONE") = commlib::kNone;
  m.attr("INVALID") = commlib::kInvalid;
  // what the direct all_reduce reduces whole, with one barrier (select.py's cost model)
  m.attr("SMALL_ALL_REDUCE_BYTES") = ShmComm::kSmallBytes;

  m.def(
      "check_call",
      [](int64_t collective, int size, int rank, uintptr_t out, int64_t out_count,
         int out_dtype, uintptr_t in, int64_t in_count, int in_dtype, int64_t op,
         int64_t root) {
        auto c = commlib::check_call(collective, size, rank, {out, out_count, out_dtype},
                                     {in, in_count, in_dtype}, op, root);
        return py::make_tuple(c.primary, c.scale);
      },
      py::arg("collective"), py::arg("size"), py::arg("rank"), py::arg("out"),
      py::arg("out_count"), py::arg("out_dtype"), py::arg("in"), py::arg("in_count"),
      py::arg("in_dtype"), py::arg("op"), py::arg("root"),
      "(primary count, avg scale) of a call that meets the rules of csrc/call.h; raises "
      "ValueError (TypeError for operands of different dtypes) naming what is wrong.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const commlib::CallTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  m.def(
      "reduce",
      [](uintptr_t dst, uintptr_t a, uintptr_t b, int64_t count, int dtype, int op) {
        py::gil_scoped_release nogil;
        commlib::reduce(ptr(dst), ptr(a), ptr(b), count, dtype, op);
      },
      py::arg("dst"), py::arg("a"), py::arg("b"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      "dst[i] = a[i] op b[i] for i < count; dst may be exactly a or b.");

  m.def(
      "reduce_into",
      [](uintptr_t dst, uintptr_t src, int64_t count, int dtype, int op) {
        py::gil_scoped_release nogil;
        commlib::reduce(ptr(dst), ptr(dst), ptr(src), count, dtype, op);
      },
      py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      "dst[i] = dst[i] op src[i] for i < count.");

  m.attr("FIRST_USER_OP") = commlib::kFirstUserOp;
  m.attr("LAST_USER_OP") = commlib::kLastUserOp;
  m.def("define_user_op", &commlib::define_user_op, py::arg("code"), py::arg("name"),
        py::arg("by_dtype"),
        "Register reduce op `code` as `name`: one (apart, into) pair of function addresses "
        "per dtype code, (0, 0) where it does not take that dtype (csrc/user_ops.h).");

  m.def(
      "copy",
      [](uintptr_t dst, uintptr_t src, int64_t nbytes) {
        py::gil_scoped_release nogil;
        commlib::copy(ptr(dst), ptr(src), nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), "Copy nbytes bytes; regions may overlap (memmove).");

  m.def(
      "copy_streaming",
      [](uintptr_t dst, uintptr_t src, int64_t nbytes) {
        if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
        py::gil_scoped_release nogil;
        commlib::copy_streaming(ptr(dst), ptr(src), nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "Copy nbytes bytes with stores that bypass the cache (large copies); no overlap.");

  m.def("request_slice", &commlib::request_slice, py::arg("nanoseconds"),
        "Ask for scheduler slices this short for the calling thread (Linux 6.12+); whether "
        "the kernel took it.");
  m.def("process_alive", &commlib::process_alive, py::arg("pid"),
        "Whether process pid of this host still lives (a zombie does not).");

  m.def(
      "mostly_huge",
      [](uintptr_t addr, int64_t nbytes) { return commlib::shm::mostly_huge(addr, nbytes); },
      py::arg("addr"), py::arg("nbytes"),
      "Whether at most a quarter of the bytes lie on base pages rather than huge ones "
      "(true where the kernel cannot tell).");

  m.def(
      "scale",
      [](uintptr_t dst, int64_t count, int dtype, double factor) {
        py::gil_scoped_release nogil;
        commlib::scale(ptr(dst), count, dtype, factor);
      },
      py::arg("dst"), py::arg("count"), py::arg("dtype"), py::arg("factor"),
      "dst[i] *= factor for floating dtypes (float16/bfloat16 computed in float32).");

  // Failures raise subclasses of commlib's own errors, so callers need no translation
  // (errors.py imports nothing, so importing it here is safe).
  py::module_ errors = py::module_::import("commlib.errors");
  py::register_exception<commlib::PeerError>(m, "CommError", errors.attr("CommError"));
  py::register_exception<commlib::MismatchError>(m, "CollectiveMismatchError",
                                                 errors.attr("CollectiveMismatchError"));
  py::register_exception<commlib::TimeoutError>(m, "CommTimeoutError",
                                                errors.attr("CommTimeoutError"));

  m.def(
      "check_agreement",
      [](py::array_t<int64_t> table, int64_t itemsize, bool splits) {
        // one row per rank: the descriptor's 8 fields, then (all_to_all) the bytes it
        // sends to each peer and the bytes it receives from each (agreement.h)
        const int n = int(table.shape(0));
        if (table.ndim() != 2 || table.shape(1) != commlib::kDescFields + 2 * n ||
            table.strides(1) != sizeof(int64_t))
          throw std::invalid_argument("the table must have one row of 8 + 2n fields per rank");
        std::string reason = commlib::check_table(table.data(), n,
                                                  table.strides(0) / sizeof(int64_t),
                                                  itemsize, splits);
        if (!reason.empty()) throw commlib::MismatchError(reason);
      },
      py::arg("table"), py::arg("itemsize"), py::arg("splits"),
      "Raise CollectiveMismatchError naming what differs if the ranks' calls disagree.");
  commlib::bind_fast_path(m);  // (FastTransport: the base of ShmComm and MpiExchange)
  commlib::bind_mpi_exchange(m);
  commlib::bind_eager(m);
  commlib::bind_gpu_proxy(m);
  commlib::bind_wire(m);
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<ShmComm, commlib::FastTransport>(m, "ShmComm",
                      "Shared-memory transport among the ranks of one host (csrc/shm.h). Set-up: "
                      "construct on every rank, exchange .name, attach(names), barrier, "
                      "unlink_own(). Methods release the GIL; ptrs are raw addresses.")
      .def(py::init([](int rank, int size, int64_t slot_bytes, int64_t slots,
                       int64_t staging_bytes, int64_t spin, int64_t yields,
                       int64_t background_spin, int64_t background_yields) {
             return new ShmComm(rank, size, {slot_bytes, slots, staging_bytes, spin, yields,
                                             background_spin, background_yields});
           }),
           py::arg("rank"), py::arg("size"), py::arg("slot_bytes"), py::arg("slots"),
           py::arg("staging_bytes"), py::arg("spin"), py::arg("yields"),
           py::arg("background_spin") = 0, py::arg("background_yields") = 0)
      .def_property_readonly("name", &ShmComm::name)
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("size", &ShmComm::size)
      .def("attach", &ShmComm::attach, py::arg("names"))
      .def("unlink_own", &ShmComm::unlink_own)
      .def(
          "run_plan",
          [](ShmComm& c, py::array_t<int64_t, py::array::c_style> plan, uintptr_t out,
             uintptr_t in, int64_t tmp_bytes, int dtype, int op) {
            const int64_t* data = plan.data();
            int64_t len = plan.size();
            py::gil_scoped_release release;
            c.run_plan(data, len, {out, in}, tmp_bytes, dtype, op);
          },
          py::arg("plan"), py::arg("out"), py::arg("in"), py::arg("tmp_bytes"), py::arg("dtype"),
          py::arg("op"))
      .def("barrier", &ShmComm::barrier, nogil())
      .def("abort", &ShmComm::abort)
      .def("all_reduce", &ShmComm::all_reduce, py::arg("buf"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("phases"), nogil())
      .def("all_reduce_phase_in_place", &ShmComm::all_reduce_phase_in_place, py::arg("buf"),
           py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("phase"), nogil())
      .def("direct", &ShmComm::direct, py::arg("collective"), py::arg("out"), py::arg("in"),
           py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
           py::arg("in_splits"), py::arg("out_splits"), nogil())
      .def(
          "one_copy",
          [](ShmComm& c, int64_t collective, uintptr_t out, uintptr_t in, int64_t count,
             int dtype, int op, int64_t root, const std::vector<int64_t>& in_splits,
             const std::vector<int64_t>& out_splits,
             py::array_t<int64_t, py::array::c_style> otherwise, int64_t tmp_bytes,
             bool only_regions) {
            const int64_t* steps = otherwise.data();
            int64_t len = otherwise.size();
            py::gil_scoped_release release;
            c.one_copy(collective, out, in, count, dtype, op, root, in_splits, out_splits,
                       steps, len, tmp_bytes, only_regions);
          },
          py::arg("collective"), py::arg("out"), py::arg("in"), py::arg("count"),
          py::arg("dtype"), py::arg("op"), py::arg("root"), py::arg("in_splits"),
          py::arg("out_splits"), py::arg("otherwise"), py::arg("tmp_bytes"),
          py::arg("only_regions") = false)
      .def("add_region", &ShmComm::add_region, py::arg("owner"), py::arg("index"),
           py::arg("owner_base"), py::arg("local"), py::arg("bytes"))
      .def("remove_region", &ShmComm::remove_region, py::arg("owner"), py::arg("index"))
      .def("probe_one_copy", &ShmComm::probe_one_copy,
           "Why one-copy collectives cannot run here ('' when they can); after attach.")
      .def("agree", &ShmComm::agree, py::arg("fields"), py::arg("send"), py::arg("recv"),
           py::arg("itemsize"), nogil())
      .def_property_readonly("bytes_sent", &ShmComm::bytes_sent)
      .def_property_readonly("calls_read_in_place", &ShmComm::calls_read_in_place,
                             "calls that read the peers' buffers where they lie")
      .def_property("base_pages_in_place", &ShmComm::base_pages_in_place,
                    &ShmComm::set_base_pages_in_place,
                    "the collectives (bits by code) whose buffers on base (4 KiB) pages are "
                    "read in place too (else staged)")
      .def_property("parts_in_place_from", &ShmComm::parts_in_place_from,
                    &ShmComm::set_parts_in_place_from,
                    "bytes of a rank's largest part from which direct's all_to_all reads its "
                    "parts in place (-1: where they take several staging pieces)")
      .def_property("streaming_from", &ShmComm::streaming_from, &ShmComm::set_streaming_from,
                    "bytes of a transfer from which received data land with non-temporal "
                    "stores (skipping the cache)")
      .def_property_readonly("staging_bytes",
                             [](const ShmComm& c) { return c.config().staging_bytes; })
      .def_property("timeout", &ShmComm::timeout, &ShmComm::set_timeout,
                    "seconds a call may wait for its peers before CommTimeoutError (0: none)");

  py::class_<NetComm, commlib::FastTransport>(
      m, "NetComm", "The ranks of a communicator across hosts, joined by TCP (csrc/net.h). "
                    "Set-up: construct on every rank, exchange addresses and .port, connect. "
                    "Methods release the GIL and sleep while the links cannot move.")
      .def(py::init<int, int, int, int64_t>(), py::arg("rank"), py::arg("size"),
           py::arg("header"), py::arg("payload_bytes"))
      .def_property_readonly("port", &NetComm::port)
      .def("connect", &NetComm::connect, py::arg("addresses"), py::arg("ports"), py::arg("token"),
           py::arg("timeout"), nogil())
      .def("check", &NetComm::check, py::arg("descriptor"), py::arg("itemsize"),
           py::arg("splits"), nogil(),
           "Raise CollectiveMismatchError unless every rank's descriptor (and splits: the "
           "bytes to each rank, then from each, or none) agree.")
      .def(
          "eager",
          [](NetComm& c, std::vector<int64_t> desc, uintptr_t out, int64_t out_count,
             uintptr_t in, int64_t in_count, int op) {
            if (desc.size() != commlib::kDescFields)
              throw std::invalid_argument("a descriptor has 8 fields");
            const int dtype = int(desc[commlib::DTYPE]);
            py::gil_scoped_release release;
            c.eager(desc, {int(desc[commlib::COLLECTIVE]), {out, out_count, dtype},
                           {in, in_count, dtype}, commlib::kNone, op, desc[commlib::ROOT],
                           desc[commlib::OP]});
          },
          py::arg("descriptor"), py::arg("out"), py::arg("out_count"), py::arg("inp"),
          py::arg("in_count"), py::arg("op"))
      .def(
          "run_plan",
          [](NetComm& c, py::array_t<int64_t, py::array::c_style> plan, uintptr_t out,
             uintptr_t in, int64_t tmp_bytes, int dtype, int op) {
            const int64_t* words = plan.data();
            const int64_t length = plan.size();
            py::gil_scoped_release release;
            c.run_plan(words, length, out, in, tmp_bytes, dtype, op);
          },
          py::arg("plan"), py::arg("out"), py::arg("in"), py::arg("tmp_bytes"), py::arg("dtype"),
          py::arg("op"))
      .def("interrupt", &NetComm::interrupt, py::arg("why") = "",
           "From any thread: the call in flight fails now, and every later one, saying why.")
      .def(
          "submit",
          [](NetComm& c, bool now, bool agree, std::vector<int64_t> desc,
             std::vector<int64_t> splits, int64_t itemsize,
             std::optional<py::array_t<int64_t, py::array::c_style>> plan, uintptr_t out,
             int64_t out_count, uintptr_t in, int64_t in_count, int op, int64_t tmp_bytes,
             double scale, double timeout, bool native) -> py::object {
            if (desc.size() != commlib::kDescFields)
              throw std::invalid_argument("a descriptor has 8 fields");
            commlib::NetJob job;
            const int dtype = int(desc[commlib::DTYPE]);
            job.call = {int(desc[commlib::COLLECTIVE]), {out, out_count, dtype},
                        {in, in_count, dtype}, commlib::kNone, op, desc[commlib::ROOT],
                        desc[commlib::OP]};
            job.agree = agree, job.desc = std::move(desc), job.splits = std::move(splits);
            job.itemsize = itemsize, job.eager = !plan && !native, job.native = native;
            job.tmp_bytes = tmp_bytes;
            if (native && !c.takes_native(job.call)) return py::none();
            job.scale = scale, job.timeout = timeout;
            if (plan) job.plan = plan->data(), job.words = plan->size();
            if (!now) return py::int_(c.submit(std::move(job)));
            std::pair<double, double> ran;
            {
              py::gil_scoped_release release;
              ran = c.run_now(job);
            }
            return py::make_tuple(ran.first, ran.second);
          },
          py::arg("now"), py::arg("agree"), py::arg("descriptor"), py::arg("splits"),
          py::arg("itemsize"), py::arg("plan"), py::arg("out"), py::arg("out_count"),
          py::arg("inp"), py::arg("in_count"), py::arg("op"), py::arg("tmp_bytes"),
          py::arg("scale"), py::arg("timeout"), py::arg("native") = false,
          "A whole call (net.h's job; no plan: eager, or `native`: MPI's own collective): "
          "for the proxy's thread, its ticket at once (the caller keeps the plan and the "
          "buffers alive until it is done); or, `now`, run on this thread: when it ran. "
          "None where a native job is one MPI's collective cannot take.")
      .def(
          "takes_native",
          [](NetComm& c, int64_t collective, int dtype, int op, int64_t out_count,
             int64_t in_count) {
            commlib::FastCall call{};
            call.collective = int(collective), call.op = op;
            call.out = {0, out_count, dtype}, call.in = {0, in_count, dtype};
            return c.takes_native(call);
          },
          py::arg("collective"), py::arg("dtype"), py::arg("op"), py::arg("out_count"),
          py::arg("in_count"),
          "Whether a job of MPI's own collective (submit's `native`) can run this call.")
      .def("done", &NetComm::done, py::arg("ticket"), nogil())
      .def("settle", &NetComm::settle, py::arg("ticket"), py::arg("seconds"), nogil(),
           "Sleep until the job is done (True), or `seconds` pass (negative: no limit).")
      .def("wait", &NetComm::wait, py::arg("ticket"), nogil(),
           "Sleep until the job is done; raise its error.")
      .def(
          "use_native",
          [](NetComm& c, py::dict entry_points, int status_bytes, uintptr_t comm,
             std::map<int, uintptr_t> dtypes, std::map<int, uintptr_t> ops,
             std::vector<int> reducible, uintptr_t in_place, int handle_bytes) {
            c.use_native(std::make_unique<commlib::MpiNative>(
                entry_points, handle_bytes, status_bytes, comm, dtypes, ops, reducible,
                in_place));
          },
          py::arg("entry_points"), py::arg("status_bytes"), py::arg("comm"), py::arg("dtypes"),
          py::arg("ops"), py::arg("reducible"), py::arg("in_place"), py::arg("handle_bytes"))
      .def("set_spin", &NetComm::set_spin, py::arg("seconds"), py::arg("background_seconds"),
           "Seconds a wait polls back to back before it sleeps, on the caller's thread and on "
           "the proxy's.")
      .def_property_readonly("payload_bytes", &NetComm::payload_bytes)
      .def_property_readonly("bytes_sent", &NetComm::bytes_sent)
      .def_property("timeout", &NetComm::timeout, &NetComm::set_timeout,
                    "seconds a call may wait for its peers before CommTimeoutError (0: none)");

  m.def(
      "array_info",
      [](py::handle obj) -> py::object {
        // (address, C-contiguous, writable) of a numpy array, None for anything else:
        // cheaper than reading them through numpy's Python attributes.
        if (!py::array::check_(obj)) return py::none();
        auto arr = py::reinterpret_borrow<py::array>(obj);
        return py::make_tuple(reinterpret_cast<uintptr_t>(arr.data()),
                              bool(arr.flags() & py::array::c_style),
                              bool(arr.flags() & NPY_ARRAY_WRITEABLE_));
      },
      py::arg("array"));

  m.def("build_info", [] {
    commlib::BuildInfo info = commlib::build_info();
    py::dict d;
    d["compiler"] = info.compiler;
    d["cxx_flags"] = info.cxx_flags;
    d["simd"] = info.simd;
    return d;
  });
}
