// The GPU proxy: for one communicator on one device, a thread that serves the meetings of
// the collectives through CUDA IPC (commlib/transports/cuda_ipc.py). It never takes the
// GIL and makes no CUDA call, so neither a Python thread holding the GIL nor a thread
// blocked in the CUDA driver can stall a collective's progress: the streams mark where
// they are in pinned memory, the proxy meets the peers' proxies in shared memory and
// raises the counters the streams wait for.
//
// Vocabulary:
//   plan      one call as the proxy sees it: its steps (numbered across the communicator's
//             calls), the meetings of each step (1 or 2), its row, its timeout. Plans are
//             handed over before the call enqueues anything and served in order.
//   row       what a rank publishes at a call's first meeting: the descriptor, all_to_all's
//             bytes to and from each rank, and two words of the caller's (a registered
//             buffer's place). The rows are checked against each other (check_table) and
//             handed back to the caller.
//   exchanged a plan whose first meeting is the caller's, before it enqueues anything (the
//             call's steps depend on the peers' rows); otherwise the first meeting is the
//             stream's first arrival.
//   arrival   a word per meeting of a step in pinned memory that the stream itself sets to
//             step + 1 when it gets there (cuStreamWriteValue32).
//   streams meet  (the default) the arrivals lie in the channel's first page, which every
//             rank registers with CUDA, and a stream waits for its peers' arrivals itself
//             (cuStreamWaitValue32 on each): no host is between the streams. Only a call's
//             first meeting, which checks the rows, goes through the proxies (go[0]); the
//             proxy watches the other meetings for failures and timeouts. Otherwise every
//             meeting goes through the proxies (COMMLIB_GPU_MEET=proxy).
//   counters  go[k] (steps allowed past meeting k) and free (steps every rank is done
//             with, whose slot may be refilled): pinned words the streams wait for
//             (cuStreamWaitValue32) and only the proxy raises.
//   channel   one POSIX shared-memory segment per proxy: a page of arrivals, then a line
//             per rank: the meetings it
//             has reached (monotone), its rows by plan parity, its poison and reason, its
//             pid, and a doorbell its peers ring when it sleeps.
//   failure   a timeout, a mismatch or a dead peer: the proxy poisons the channel (the
//             peers fail alike), raises every counter past the plan and every later plan
//             (no stream waits forever), and reports the error to whoever waits for the
//             plan, and once to take_failure() (the communicator's next call raises it).
//             When streams meet it also writes every rank's arrivals past, and keeps
//             writing them (a late stream's arrival must not lower them) until close();
//             a peer's waits that those writes let through still end in its poison.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agreement.h"

namespace commlib::gpu {

constexpr int kMaxRanks = 16;  // as commlib/cuda's kMaxPointers
constexpr int kRowWords = kDescFields + 2 * kMaxRanks + 2;  // descriptor, splits, caller's
constexpr size_t kPageBytes = 4096;  // the channel's arrivals: a 64-byte line per (rank, meeting)

// The pinned words of one proxy, as the streams address them on the host.
struct Words {
  uintptr_t go[2], free, arrive[2];
};

enum Failure : uint32_t { OK = 0, PEER_FAILED, MISMATCHED, TIMED_OUT, CLOSED };

struct Plan {
  uint64_t id = 0;                  // the same on every rank: plans are made in call order
  uint64_t first = 0, steps = 0;    // steps [first, first + steps)
  int meetings = 1;                 // per step
  bool exchanged = false, splits = false;
  int64_t itemsize = 1;
  int64_t row[kRowWords] = {};
  double timeout = 0;               // seconds per wait (0: none)
  int64_t step_bytes = 0;           // > 0: steps from every rank's splits (all_to_all)
  // what became of it
  bool met = false, finished = false;
  std::vector<int64_t> rows;        // every rank's row, once met
  Failure failure = OK;
  std::string error;
  double started = 0, ended = 0;    // CLOCK_MONOTONIC seconds, as Python's time.monotonic
};

struct Line;

class GpuProxy {
 public:
  // Creates the channel (`create`, one rank) or opens the one named `channel`.
  // With `streams_meet` the arrivals are the channel's (words.arrive is ignored).
  GpuProxy(int rank, int size, const std::string& channel, bool create, Words words,
           int64_t spin, bool streams_meet);
  ~GpuProxy();
  GpuProxy(const GpuProxy&) = delete;
  GpuProxy& operator=(const GpuProxy&) = delete;

  const std::string& channel() const { return name_; }
  void unlink();  // by the creator, once every rank has opened the channel
  // The channel's page of arrivals in this process (to register with CUDA), and the word
  // where rank r's stream marks meeting k.
  std::pair<uintptr_t, size_t> page() const { return {uintptr_t(base_), kPageBytes}; }
  // CUDA has let the page go (cudaHostUnregister): the destructor may unmap the channel.
  // Until then it does not (a proxy dropped without it leaks the mapping): a registered
  // range unmapped and mapped again could not be registered again, and the destructor,
  // which runs wherever Python drops the proxy, makes no CUDA call.
  void unregistered() { registered_ = false; }
  uintptr_t arrival(int r, int k) const;

  // Hands a plan over; returns its id. `row` holds at most kRowWords words. An exchanged
  // plan with `step_bytes` takes as many steps as the largest part a rank sends (the rows'
  // splits) in parts of step_bytes, known once the rows are.
  uint64_t submit(uint64_t first, uint64_t steps, int meetings, const std::vector<int64_t>& row,
                  int64_t itemsize, bool splits, bool exchanged, double timeout,
                  int64_t step_bytes);
  // Every rank's row once the plan's first meeting is over (throws the plan's error).
  std::vector<int64_t> rows(uint64_t id);
  // Waits until the plan is over and forgets it; returns when it started and ended
  // (throws its error).
  std::pair<double, double> wait(uint64_t id);
  // Until every plan handed over is over, at most `seconds` (false: not yet).
  bool drain(double seconds);
  // The proxy's first failure, once ("" when none, or already taken), and its kind.
  std::pair<Failure, std::string> take_failure();
  // What the proxy is doing, for a hang's report: plan, step, meeting, waiting for what
  // and since when, the counters, the arrivals, every rank's meetings reached.
  std::vector<std::pair<std::string, double>> heartbeat() const;
  // This rank cannot do its part (enqueuing failed): the plan being served fails, on
  // every rank, and so does every later one.
  void fail(const std::string& reason);
  // Stops serving: every plan not over fails and its counters are raised.
  void close();

 private:
  using Clock = std::chrono::steady_clock;
  struct Stop {};  // close() while a plan waits

  void serve();
  void run(Plan& plan);
  void meet(Plan& plan, bool first, Clock::time_point deadline);
  void wait_arrival(int k, uint32_t value, const Plan& plan, Clock::time_point deadline,
                    bool eager);
  void watch_peers(int k, uint32_t value, const Plan& plan, Clock::time_point deadline);
  [[noreturn]] void fail_now(Failure kind, const std::string& reason);
  // Fails (fail_now) where peer r has poisoned the channel.
  void check_poisoned(int r);
  void check_peer(int r, const Plan& plan, Clock::time_point deadline,
                  const std::string& behind);
  void check_stop(const Plan& plan);  // close() or fail() since
  void release(uint64_t from);
  void release_arrivals();  // every rank's, past released_
  void ring_peers();
  Line& line(int r) const;
  Clock::time_point deadline_of(const Plan& plan) const;
  void throw_failure(const Plan& plan) const;

  int rank_, size_;
  std::string name_;
  bool owner_ = false;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  Words words_;
  int64_t spin_;
  bool streams_meet_, registered_;  // (the page may be registered where streams meet)


  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<uint64_t, std::shared_ptr<Plan>> plans_;  // handed over, not yet waited for
  uint64_t made_ = 0, served_ = 0;                   // plans handed over, and over
  std::atomic<uint32_t> released_{0};                 // counters raised to this (0: none)
  std::atomic<bool> stopping_{false}, abandoned_{false};  // (read unlocked by the waits)
  std::string abandoned_text_;
  Failure failure_ = OK;
  std::string failure_text_;
  bool failure_taken_ = false;
  uint64_t meetings_ = 0;                             // (the proxy's thread only)

  // heartbeat, written by the proxy's thread
  std::atomic<uint64_t> at_plan_{0}, at_step_{0};
  std::atomic<int> at_meeting_{-1}, waiting_for_{0};  // 0 nothing, 1 its stream, 2 its peers
  std::atomic<double> since_{0};

  std::thread thread_;
};

}  // namespace commlib::gpu
