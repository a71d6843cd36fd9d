// An eager collective's result (commlib/algorithms/eager.py), once every rank's row of the
// agreement has arrived: each row carries its rank's data after the header (the whole
// input; a broadcast's root alone sends), and every rank computes the result from all of
// them. Reductions fold the rows in rank order, ((row 0 op row 1) op row 2) ..., so the
// result is bitwise the same on every rank. The exchange is the transport's: MPI's in C++
// (mpi_exchange.cpp), gloo's all-gather in Python (commlib/transports/gloo.py).
#pragma once

#include <cstdint>

namespace commlib {

// `payloads`: row 0's data, row r's `row_bytes` further on (n rows); `sent` the bytes a
// rank's row carries (a broadcast: the root's). `out`: `out_count` elements of `dtype`.
void eager_result(int64_t collective, int rank, int n, int64_t root, const char* payloads,
                  int64_t row_bytes, int64_t sent, char* out, int64_t out_count, int dtype,
                  int op);

}  // namespace commlib
