// pybind11 module commlib._C. Buffers arrive as raw addresses (Python ints)
// so the Python side can pass numpy, torch or MPI buffers without this module
// depending on any of them. Every call drops the GIL while it works; argument
// errors are std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;
using commlib::DType;
using commlib::Op;

namespace {
void* ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "commlib native kernels: elementwise reductions, scaling and copies on raw buffers";

  py::dict dtypes;
  dtypes["float16"] = int(commlib::F16);
  dtypes["bfloat16"] = int(commlib::BF16);
  dtypes["float32"] = int(commlib::F32);
  dtypes["float64"] = int(commlib::F64);
  dtypes["int8"] = int(commlib::I8);
  dtypes["uint8"] = int(commlib::U8);
  dtypes["int32"] = int(commlib::I32);
  dtypes["int64"] = int(commlib::I64);
  m.attr("DTYPES") = dtypes;

  py::dict ops;
  ops["sum"] = int(commlib::SUM);
  ops["prod"] = int(commlib::PROD);
  ops["min"] = int(commlib::MIN);
  ops["max"] = int(commlib::MAX);
  m.attr("OPS") = ops;

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

  m.def(
      "copy",
      [](uintptr_t dst, uintptr_t src, int64_t nbytes) {
        py::gil_scoped_release nogil;
        commlib::copy(ptr(dst), ptr(src), nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), "Copy nbytes bytes; regions may overlap (memmove).");

  m.def(
      "scale",
      [](uintptr_t dst, int64_t count, int dtype, double factor) {
        py::gil_scoped_release nogil;
        commlib::scale(ptr(dst), count, dtype, factor);
      },
      py::arg("dst"), py::arg("count"), py::arg("dtype"), py::arg("factor"),
      "dst[i] *= factor for floating dtypes (float16/bfloat16 computed in float32).");

  m.def("build_info", [] {
    commlib::BuildInfo info = commlib::build_info();
    py::dict d;
    d["compiler"] = info.compiler;
    d["cxx_flags"] = info.cxx_flags;
    d["simd"] = info.simd;
    d["cuda"] = false;
    return d;
  });
}
