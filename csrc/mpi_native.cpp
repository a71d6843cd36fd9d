// MPI's own collectives started from C++ (mpi_native.h).
#include "mpi_native.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>

#include "agreement.h"
#include "kernels.h"

namespace py = pybind11;

namespace commlib {

namespace {

// MPI's signatures with its handles (datatype, op, communicator) of type H, passed by value;
// requests and statuses by address
template <class H>
struct Calls {
  using Iallreduce = int (*)(const void*, void*, int, H, H, H, void*);
  using Ireduce = int (*)(const void*, void*, int, H, H, int, H, void*);
  using IreduceScatterBlock = int (*)(const void*, void*, int, H, H, H, void*);
  using Iallgather = int (*)(const void*, int, H, void*, int, H, H, void*);
  using Ialltoallv = int (*)(const void*, const int*, const int*, H, void*, const int*,
                             const int*, H, H, void*);
  using Ibcast = int (*)(void*, int, H, int, H, void*);
};
using Test = int (*)(void*, int*, void*);

uintptr_t address(const py::dict& entry_points, const char* name) {
  return entry_points[name].cast<uintptr_t>();
}

template <class F>
F as(uintptr_t address) {
  return reinterpret_cast<F>(address);
}

}  // namespace

MpiNative::MpiNative(py::dict entry_points, int handle_bytes, int status_bytes, uintptr_t comm,
                     std::map<int, uintptr_t> dtypes, std::map<int, uintptr_t> ops,
                     std::vector<int> reducible, uintptr_t in_place)
    : iallreduce_(address(entry_points, "MPI_Iallreduce")),
      ireduce_(address(entry_points, "MPI_Ireduce")),
      ireduce_scatter_block_(address(entry_points, "MPI_Ireduce_scatter_block")),
      iallgather_(address(entry_points, "MPI_Iallgather")),
      ialltoallv_(address(entry_points, "MPI_Ialltoallv")),
      ibcast_(address(entry_points, "MPI_Ibcast")),
      test_(address(entry_points, "MPI_Test")),
      request_(size_t(handle_bytes)), status_(size_t(status_bytes)), comm_(comm),
      in_place_(in_place), dtypes_(std::move(dtypes)), ops_(std::move(ops)),
      reducible_(std::move(reducible)) {
  if (handle_bytes != 4 && handle_bytes != 8)
    throw std::invalid_argument("handles are 4 or 8 bytes");
}

bool MpiNative::takes(const FastCall& c, int size) const {
  if (!dtypes_.count(c.out.dtype) || c.out.count > INT_MAX || c.in.count > INT_MAX) return false;
  if (collective_info(c.collective).reduces && (!ops_.count(c.op) || std::find(reducible_.begin(), reducible_.end(),
                                                 c.out.dtype) == reducible_.end()))
    return false;
  return collective_info(c.collective).parts != kExchange || c.in.count % size == 0;
}

template <class H>
void MpiNative::start(const FastCall& c, int rank, int size, void* result) {
  using F = Calls<H>;
  const H dtype = H(dtypes_.at(c.out.dtype)), comm = H(comm_);
  void* out = reinterpret_cast<void*>(c.out.ptr);
  const void* in = reinterpret_cast<const void*>(c.in.ptr);
  const void* in_place = reinterpret_cast<const void*>(in_place_);
  const int count = int(c.out.count);
  void* request = request_.data();
  int code = 0;
  switch (c.collective) {
    case ALL_REDUCE:
      code = as<typename F::Iallreduce>(iallreduce_)(in_place, out, count, dtype,
                                                     H(ops_.at(c.op)), comm, request);
      break;
    case REDUCE:  // (the root reduces in place; the others only send)
      code = as<typename F::Ireduce>(ireduce_)(rank == c.root ? in_place : out,
                                               rank == c.root ? out : nullptr, count, dtype,
                                               H(ops_.at(c.op)), int(c.root), comm, request);
      break;
    case REDUCE_SCATTER:  // (into `result` where the output lies in the input: run())
      code = as<typename F::IreduceScatterBlock>(ireduce_scatter_block_)(
          in, result, count, dtype, H(ops_.at(c.op)), comm, request);
      break;
    case ALL_GATHER:
      code = as<typename F::Iallgather>(iallgather_)(
          overlap(c.out, c.in) ? in_place : in, int(c.in.count), dtype, out, int(c.in.count),
          dtype, comm, request);
      break;
    case ALL_TO_ALL: {  // (as native.py calls it, so that ranks on either path match)
      const int part = int(c.in.count / size);
      counts_.assign(size, part), displs_.resize(size);
      for (int r = 0; r < size; ++r) displs_[r] = r * part;
      code = as<typename F::Ialltoallv>(ialltoallv_)(in, counts_.data(), displs_.data(), dtype,
                                                     out, counts_.data(), displs_.data(),
                                                     dtype, comm, request);
      break;
    }
    case BROADCAST:
      code = as<typename F::Ibcast>(ibcast_)(out, count, dtype, int(c.root), comm, request);
      break;
    default:
      throw std::invalid_argument(std::string("no native ") + collective_name(c.collective));
  }
  if (code != 0)
    throw PeerError(std::string(collective_name(c.collective)) + ": MPI's own collective "
                    "failed to start (error " + std::to_string(code) + ")");
}

uint64_t MpiNative::run(const FastCall& c, int rank, int size, double timeout, bool nap) {
  const uint64_t width = itemsize(c.out.dtype), n = uint64_t(size);
  // MPI's in-place reduce_scatter leaves the result at the front, not in block r: where the
  // output lies in the input, the result comes apart, then is copied (as native.py does)
  const bool apart = c.collective == REDUCE_SCATTER && overlap(c.out, c.in);
  if (apart) result_.resize(c.out.count * width);
  void* result = apart ? result_.data() : reinterpret_cast<void*>(c.out.ptr);
  if (request_.size() == 4)
    start<uint32_t>(c, rank, size, result);
  else
    start<uint64_t>(c, rank, size, result);
  try {
    wait(timeout, nap);
  } catch (const TimeoutError&) {
    if (apart) new std::vector<char>(std::move(result_));  // MPI may still write it: kept
    throw;
  }
  if (apart) std::memcpy(reinterpret_cast<void*>(c.out.ptr), result, c.out.count * width);
  switch (c.collective) {  // (the least any algorithm sends: native.py's count)
    case ALL_REDUCE: return 2 * (n - 1) * c.out.count * width / n;
    case REDUCE_SCATTER: return (n - 1) * c.out.count * width;
    case ALL_GATHER: return (n - 1) * c.in.count * width;
    case ALL_TO_ALL: return (n - 1) * (c.in.count / n) * width;
    default: return size > 1 ? c.out.count * width : 0;  // broadcast, reduce
  }
}

void MpiNative::wait(double timeout, bool nap) {
  const Test test = as<Test>(test_);
  const bool done = poll_until([&] {
    int finished = 0;
    if (int code = test(request_.data(), &finished, status_.data()))
      throw PeerError("MPI_Test failed inside MPI's own collective (error " +
                      std::to_string(code) + ")");
    return finished != 0;
  }, timeout, nap);
  if (!done)
    throw TimeoutError("timed out after " + seconds_text(timeout) + " s waiting for its "
                       "peers inside MPI's collective (MPI does not say which)");
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

}  // namespace commlib
