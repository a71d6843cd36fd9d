// The network transport (commlib/transports/net.py): the ranks of a communicator that spans
// hosts, joined by TCP, one connection per pair. Every wait sleeps in poll() and no call
// holds the GIL, so an async collective's bytes move while the caller computes (on the
// progress engine's thread, which the kernel wakes the moment a link can move more), and
// a link on which nothing can move costs no CPU. Calls are agreed on over the same links
// (the rows MPI's exchange sends, mpi_exchange.cpp), so the ranks raise together where
// they disagree; small calls ride in those rows (eager); MPI's own collectives (NATIVE
// fast-path entries) run after the rows, where the world is MPI's.
//
// Vocabulary:
//   link     the connection to one peer: a byte stream, so what one rank sends another
//            arrives in the order sent (schedule.py's matching rule)
//   frame    what a link carries: a header (kind, bytes) and that many bytes. ROW frames
//            carry an agreement's row (the descriptor and splits, then eager's data);
//            DATA frames a plan's transfer. A frame that is not what its receiver expects
//            (the ranks disagree on a count) fails the call, and the communicator
//   plan     a schedule flattened into int64 words, byte offsets (net.py writes it):
//              rounds, then per round
//              copies, then per copy:   src buffer, src offset, dst buffer, dst offset, bytes
//              sends,  then per send:   peer, buffer, offset, bytes
//              recvs,  then per recv:   peer, dst buffer, dst offset, bytes,
//                                       src buffer (-1: a plain receive), src offset
//            buffers: 0 out, 1 in, 2 tmp. A reducing receive stores src (op) incoming in
//            dst. Copies run first; a round ends when all its transfers have.
//   piece    a reducing receive lands in a link's scratch a piece at a time and is
//            reduced piece by piece as it arrives (kPieceBytes)
//   job      a whole call (its agreement, then its plan or its eager exchange, then an
//            average's scaling) handed to the proxy: submit() returns at once, the
//            proxy's thread runs jobs in order, and wait(ticket) sleeps until that one is
//            done, raising its error. The caller's interpreter is never on the path of the
//            bytes: calls issued back to back run back to back, and one issued while the
//            caller computes starts at once, on a thread the kernel wakes promptly.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fast_path.h"
#include "mpi_native.h"

namespace commlib {

struct NetJob {
  bool agree = true;             // exchange rows first (unless the call goes unchecked)
  std::vector<int64_t> desc;     // the descriptor (dtype and op filled in)
  std::vector<int64_t> splits;   // all_to_all's bytes to and from each rank, or none
  int64_t itemsize = 1;
  bool eager = false;            // the data ride in the rows (else `plan` runs)
  bool native = false;           // MPI's own collective runs after the rows (no plan)
  const int64_t* plan = nullptr; // (kept alive by the caller until the job is done)
  int64_t words = 0;
  FastCall call{};               // the buffers, count, dtype, op
  int64_t tmp_bytes = 0;
  double scale = 0;              // an average's factor on out (0: none)
  double timeout = 0;
};

class NetComm : public FastTransport {
 public:
  static constexpr int64_t kPieceBytes = 256 << 10;

  // Listens on an ephemeral port of every interface (port()); `header` words of a row
  // before `payload_bytes` of eager data.
  NetComm(int rank, int size, int header, int64_t payload_bytes);
  ~NetComm() override;
  NetComm(const NetComm&) = delete;
  NetComm& operator=(const NetComm&) = delete;

  int port() const { return port_; }
  // Joins the peers: rank r listens at addresses[r]:ports[r]; each rank connects to the
  // lower ranks and accepts the higher ones, every connection opened by `token` (which
  // every rank was given alike) and the connecting rank. Within `timeout` seconds.
  void connect(const std::vector<std::string>& addresses, const std::vector<int>& ports,
               uint64_t token, double timeout);

  // Raises MismatchError unless every rank's descriptor (and splits: bytes to each rank,
  // then from each; or none) agree.
  void check(const std::vector<int64_t>& desc, int64_t itemsize,
             const std::vector<int64_t>& splits);
  // An eager collective: the data ride in the rows (eager.h computes the result).
  void eager(const std::vector<int64_t>& desc, const FastCall& call);
  // A plan (the format above) on the call's buffers; `tmp_bytes` of scratch.
  void run_plan(const int64_t* plan, int64_t words, uintptr_t out, uintptr_t in,
                int64_t tmp_bytes, int dtype, int op);
  // From any thread: a call in flight fails now, and every later one, saying `why` ("":
  // this rank aborted the communicator).
  void interrupt(const std::string& why = "");

  // Jobs (the vocabulary above): a ticket, at once; whether it is done; waiting for it,
  // which returns when it ran (seconds on CLOCK_MONOTONIC: Python's time.monotonic), once.
  uint64_t submit(NetJob job);
  bool done(uint64_t ticket);
  bool settle(uint64_t ticket, double seconds);  // until done (true), or `seconds` (<0: ever)
  std::pair<double, double> wait(uint64_t ticket);
  // A job run now, on the calling thread (a blocking call with nothing queued): no thread
  // hop; when it ran, or its error.
  std::pair<double, double> run_now(const NetJob& job);

  // MPI's own collectives for NATIVE entries (mpi_native.h), from now on.
  void use_native(std::unique_ptr<MpiNative> native) { native_ = std::move(native); }
  // whether MPI's own collective can run `c` here (a job's `native`)
  bool takes_native(const FastCall& c) const { return native_ && native_->takes(c, size_); }
  bool takes(const FastEntry& entry, const FastCall& call) const override;
  void run(const FastEntry& entry, const FastCall& call) override;

  // Seconds a wait polls back to back before it sleeps: on the calling thread (a
  // blocking call), and on the proxy's (beside the caller's compute: 0 where they share
  // a core).
  void set_spin(double seconds, double background_seconds) {
    spin_ = seconds, background_spin_ = background_seconds;
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds) { timeout_ = seconds; }
  uint64_t bytes_sent() const { return sent_.load(); }
  int64_t payload_bytes() const { return payload_bytes_; }

 private:
  struct Link;
  struct Outgoing;
  struct Incoming;
  struct Exchange;

  // Sends this rank's row (its first `words` words) to every peer, takes theirs, and
  // checks them (`splits`: all_to_all's fields too).
  void exchange_rows(int64_t words, int64_t itemsize, bool splits, double seconds);
  // The two halves of it: this rank's row queued to every peer, theirs awaited; and,
  // once they are in, the lengths and the table checked. A call that fails the check
  // keeps what it queued behind the row, to go out (and be dropped) during the next.
  void send_rows(int64_t words);
  void check_rows(int64_t itemsize, bool splits);
  // A plan agreed on by rows already sent: checked after its first round's sends are
  // queued behind them (rows: none to check)
  struct Agreed {
    bool rows = false;
    int64_t itemsize = 1;
    bool splits = false;
    Agreed() = default;
    Agreed(int64_t width, bool all_to_all) : rows(true), itemsize(width), splits(all_to_all) {}
  };
  // Moves every frame of `x` (sends and receives, each link in order) until all are done.
  void move(Exchange& x);
  void fail(const std::string& why);  // the communicator is unusable from now on: throws
  void usable() const;
  void execute(const NetJob& job);
  void put_row(const NetJob& job);  // the job's descriptor and splits as this rank's row
  // the calls' work, with running_ held
  void eager_rows(const std::vector<int64_t>& desc, const FastCall& call, double seconds);
  void plan_rounds(const int64_t* plan, int64_t words, uintptr_t out, uintptr_t in,
                   int64_t tmp_bytes, int dtype, int op, double seconds, Agreed agreed);
  void serve();  // the proxy's thread
  int64_t* row(int r) { return inbox_.data() + size_t(r) * row_words_; }

  int rank_, size_;
  int64_t header_, payload_bytes_, row_words_;
  int listener_ = -1, port_ = 0;
  int wake_ = -1;  // an eventfd: interrupt() makes every wait return
  std::vector<std::unique_ptr<Link>> links_;  // by rank (none for this one)
  std::vector<int64_t> inbox_;                // one row per rank; this rank's is what it sends
  std::vector<int64_t> row_lengths_;          // the bytes of each peer's row, as it came
  std::vector<char> tmp_;
  std::unique_ptr<MpiNative> native_;
  std::string broken_;  // why calls can no longer run ("" while they can)
  std::atomic<bool> interrupted_{false};
  std::mutex why_mutex_;
  std::string interrupted_why_;  // what interrupt() was told
  double timeout_ = 0;
  double spin_ = 0, background_spin_ = 0;
  bool background_ = false;  // the call running is the proxy's (with running_ held)
  double spin_seconds() const;
  std::atomic<uint64_t> sent_{0};

  // the proxy: jobs queued, the tickets done and the errors of those that failed
  std::mutex jobs_lock_;
  std::condition_variable jobs_changed_;
  std::deque<std::pair<uint64_t, NetJob>> jobs_;
  struct Ended {
    double started, finished;
    std::exception_ptr error;
  };
  std::map<uint64_t, Ended> ended_;  // until waited for
  uint64_t submitted_ = 0, finished_ = 0;
  bool stopping_ = false;
  std::mutex running_;  // held while a job or a direct call moves data
  std::thread proxy_;
};

}  // namespace commlib
