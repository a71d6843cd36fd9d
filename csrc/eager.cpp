#include "eager.h"

#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "agreement.h"
#include "kernels.h"

namespace py = pybind11;

namespace commlib {

void eager_result(int64_t collective, int rank, int n, int64_t root, const char* payloads,
                  int64_t row_bytes, int64_t sent, char* out, int64_t out_count, int dtype,
                  int op) {
  const int64_t out_bytes = out_count * itemsize(dtype);
  auto payload = [&](int r) { return payloads + r * row_bytes; };
  auto reduce_rows = [&](int64_t offset) {  // out = row 0 (op) row 1 (op) ... in rank order
    if (n == 1) {
      copy(out, payload(0) + offset, out_bytes);
      return;
    }
    reduce(out, payload(0) + offset, payload(1) + offset, out_count, dtype, op);
    for (int r = 2; r < n; ++r) reduce(out, out, payload(r) + offset, out_count, dtype, op);
  };
  switch (collective) {
    case ALL_REDUCE:
      reduce_rows(0);
      break;
    case REDUCE:
      if (rank == root) reduce_rows(0);
      break;
    case REDUCE_SCATTER:
      reduce_rows(rank * out_bytes);
      break;
    case BROADCAST:
      if (rank != root) copy(out, payload(int(root)), out_bytes);
      break;
    case ALL_GATHER:
      for (int r = 0; r < n; ++r) copy(out + r * sent, payload(r), sent);
      break;
    default:
      throw std::invalid_argument(std::string("no eager ") + collective_name(collective));
  }
}

void bind_eager(py::module_& m) {
  m.def(
      "eager_result",
      [](int64_t collective, int rank, int n, int64_t root, uintptr_t payloads,
         int64_t row_bytes, int64_t sent, uintptr_t out, int64_t out_count, int dtype, int op) {
        py::gil_scoped_release nogil;
        eager_result(collective, rank, n, root, reinterpret_cast<const char*>(payloads),
                     row_bytes, sent, reinterpret_cast<char*>(out), out_count, dtype, op);
      },
      py::arg("collective"), py::arg("rank"), py::arg("n"), py::arg("root"),
      py::arg("payloads"), py::arg("row_bytes"), py::arg("sent"), py::arg("out"),
      py::arg("out_count"), py::arg("dtype"), py::arg("op"),
      "An eager collective's result from every rank's row (csrc/eager.h): `payloads` the "
      "address of row 0's data, row r's `row_bytes` further on; `sent` the bytes a row "
      "carries; `op` the reduction's code (SUM where none).");
}

}  // namespace commlib
