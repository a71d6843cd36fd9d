// What the fast path (fast_path.cpp) runs a call on: a transport that runs a whole
// collective in C++. The general path teaches the fast path one entry per call
// (commlib/fast_path.py), of the kinds the transport runs (its Python `fast_kinds`):
//   PLAN      a flattened schedule (shm_plan.cpp)            shm.h's ShmComm
//   DIRECT    the direct collective (shm_direct.cpp)          ShmComm
//   ONE_COPY  the one-copy collective (shm_one_copy.cpp)      ShmComm
//   EAGER     the data ride in the agreement's rows           mpi_exchange.cpp's MpiExchange
//   NATIVE    MPI's own collective, after the agreement       MpiExchange (mpi_native.h)
#pragma once

#include <cstdint>
#include <vector>

#include "call.h"

namespace commlib {

enum class EntryKind { PLAN, DIRECT, ONE_COPY, EAGER, NATIVE };

struct FastEntry {
  EntryKind kind;
  std::vector<int64_t> plan;  // PLAN's steps; ONE_COPY's where it stages (else direct's)
  int64_t tmp_bytes;          // the plan's scratch
  int id;                     // names the entry to Python (the flight recorder's rows)
  // the call's descriptor (dtype and op are filled in per call), which the ranks agree
  // on before a PLAN runs (rooted plans: transports/shm.py) and which EAGER sends; empty
  // where there is none
  std::vector<int64_t> descriptor;
  bool only_regions = false;  // ONE_COPY's: reads in place only in regions (shm.h)
};

struct FastCall {
  int collective;
  Operand out, in;  // in.ptr is 0 for a collective of one buffer
  int64_t count;    // the primary count (call.h)
  int op;           // the reduction's code (SUM where the collective does not reduce)
  int64_t root;     // kNone where the collective has none
  int64_t op_given; // the descriptor's op field (kNone where the collective does not reduce)
};

class FastTransport {
 public:
  virtual ~FastTransport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual double timeout() const = 0;  // seconds (0: none); the fast path runs only its own
  // Whether `call` can run as `entry` says (else the general path takes it).
  virtual bool takes(const FastEntry&, const FastCall&) const { return true; }
  // Runs `call` as `entry` says; throws TimeoutError, MismatchError or PeerError.
  virtual void run(const FastEntry& entry, const FastCall& call) = 0;
};

}  // namespace commlib
