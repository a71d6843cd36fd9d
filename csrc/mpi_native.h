// MPI's own collectives started from C++, for the fast path's NATIVE entries (fast_path.h):
// the same calls commlib/algorithms/native.py makes from Python (MPI's non-blocking
// collective on the world's `coll` communicator, polled until it completes or the
// communicator's timeout passes), so that a rank on either path meets its peers on the
// other. After the agreement's exchange (mpi_exchange.cpp), a call across hosts then costs
// MPI's collective and the exchange's round trip, without a Python frame.
//
// Vocabulary:
//   handles  MPI datatypes, ops, the communicator and requests as mpi4py made them
//            (MPI._handleof): an int (MPICH) or a pointer (Open MPI), `handle_bytes` each.
//            MPI's functions take the first three by value, so they are called through
//            one of two sets of signatures (Calls<H>), chosen by that size.
//   takes    whether a call can run here: its dtype has an MPI datatype, and a reduction
//            an MPI op (16-bit floats and user-defined ops reduce through an op Python
//            made: they stay on the general path).
#pragma once

#include <pybind11/pybind11.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fast_path.h"

namespace commlib {

// Polls `done()` back to back (MPI progresses only while called), yielding the core
// between polls (ranks may outnumber cores); false once `timeout` seconds (0: none) pass.
// `nap`: a thread beside the caller's compute (net's proxy) sleeps between polls after the
// first 64, 10 us doubling to 100 us, for back to back its polls took the core the compute
// ran on (an async 16 MiB all_reduce at 1 Gbit/s: 72% of it); 100 us of a 1 Gbit/s link
// is 12 KB, less than the sockets hold.
template <class Done>
bool poll_until(Done done, double timeout, bool nap = false) {
  using clock = std::chrono::steady_clock;
  const auto began = clock::now();
  long nap_ns = 10'000;
  for (uint64_t polls = 1;; ++polls) {
    if (done()) return true;
    if (polls % 64 == 0 && timeout > 0 &&
        std::chrono::duration<double>(clock::now() - began).count() >= timeout)
      return false;
    if (nap && polls > 64) {
      timespec pause{0, nap_ns};
      nanosleep(&pause, nullptr);
      nap_ns = std::min(2 * nap_ns, 100'000L);
    } else {
      sched_yield();
    }
  }
}

std::string seconds_text(double seconds);  // "%g"

class MpiNative {
 public:
  // `entry_points`: name -> address of MPI_Iallreduce, MPI_Ireduce, MPI_Ireduce_scatter_block,
  // MPI_Iallgather, MPI_Ialltoallv, MPI_Ibcast, MPI_Test; `dtypes`: commlib dtype code ->
  // MPI datatype; `ops`: op code -> MPI op, for the dtypes in `reducible`; `in_place`: the
  // value of MPI_IN_PLACE.
  MpiNative(pybind11::dict entry_points, int handle_bytes, int status_bytes, uintptr_t comm,
            std::map<int, uintptr_t> dtypes, std::map<int, uintptr_t> ops,
            std::vector<int> reducible, uintptr_t in_place);

  bool takes(const FastCall& c, int size) const;
  // Runs `c` among `size` ranks (this one `rank`); returns the bytes it counts as sent
  // (the least any algorithm sends, as native.py counts). Throws TimeoutError past
  // `timeout` seconds (0: none), leaving the request to MPI (the caller keeps the buffers).
  // `nap`: polled with poll_until's naps (beside the caller's compute).
  uint64_t run(const FastCall& c, int rank, int size, double timeout, bool nap = false);

 private:
  template <class H>
  void start(const FastCall& c, int rank, int size, void* result);
  void wait(double timeout, bool nap);

  // MPI's entry points, by address (cast to Calls<H>'s signatures where called)
  uintptr_t iallreduce_, ireduce_, ireduce_scatter_block_, iallgather_, ialltoallv_, ibcast_,
      test_;
  std::vector<uint8_t> request_, status_;  // a handle's and a status's bytes, reused
  uintptr_t comm_, in_place_;
  std::map<int, uintptr_t> dtypes_, ops_;
  std::vector<int> reducible_;
  std::vector<char> result_;  // a reduce_scatter's result, where its output is in its input
  std::vector<int> counts_, displs_;  // all_to_all's, as MPI takes them
};

}  // namespace commlib
