// The GPU proxy (see gpu_proxy.h) and its binding, commlib._C.GpuProxy.
#include "gpu_proxy.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>

#include <algorithm>
#include <random>
#include <stdexcept>

#include "process.h"
#include "segment_names.h"

namespace py = pybind11;

namespace commlib::gpu {

struct alignas(64) Line {
  std::atomic<uint64_t> reached;  // meetings this rank's proxy has reached
  std::atomic<uint32_t> bell;     // a futex its peers bump when it sleeps
  std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t> poisoned;  // a Failure, OK while healthy
  int32_t pid;
  alignas(64) int64_t row[2][kRowWords];  // by plan parity: a peer one plan ahead must not
                                          // overwrite the row a slower rank still checks
  char reason[256];
};

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic<uint32_t>* word(uintptr_t address) {
  return reinterpret_cast<std::atomic<uint32_t>*>(address);
}

// a cyclic >=, as cuStreamWaitValue32's
bool reached(uint32_t now, uint32_t value) { return static_cast<int32_t>(now - value) >= 0; }

std::string channel_name() { return unique_segment_name("proxy-", ""); }

struct Failed {  // thrown inside the proxy's thread, caught by run()
  Failure kind;
  std::string reason;
};

std::string describe_plan(const Plan& plan) {
  return describe(*reinterpret_cast<const Desc*>(plan.row));
}

// An exchanged all_to_all's steps: as many as the largest part any rank sends takes.
uint64_t steps_for_splits(const Plan& plan) {
  int size = int(plan.rows.size() / kRowWords);
  int64_t largest = 0;
  for (int r = 0; r < size; ++r)
    for (int j = 0; j < size; ++j) largest = std::max(largest, plan.rows[r * kRowWords + kDescFields + j]);
  return std::max<uint64_t>(1, uint64_t((largest + plan.step_bytes - 1) / plan.step_bytes));
}

}  // namespace

GpuProxy::GpuProxy(int rank, int size, const std::string& channel, bool create, Words words,
                   int64_t spin, bool streams_meet)
    : rank_(rank), size_(size), words_(words), spin_(spin), streams_meet_(streams_meet),
      registered_(streams_meet) {
  if (size < 1 || size > kMaxRanks || rank < 0 || rank >= size)
    throw std::invalid_argument("GpuProxy: rank " + std::to_string(rank) + " of " +
                                std::to_string(size) + " (1 to " + std::to_string(kMaxRanks) +
                                " ranks)");
  static_assert(kMaxRanks * 2 * 64 <= kPageBytes, "a line per rank and meeting");
  bytes_ = kPageBytes + sizeof(Line) * size;
  name_ = create ? channel_name() : channel;
  int fd = create ? shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name_.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open " + name_));
  owner_ = create;
  if (create && ftruncate(fd, off_t(bytes_)) != 0) {  // zero-filled: every word starts at 0
    std::string error = errno_text("ftruncate " + name_ + " (is /dev/shm full?)");
    ::close(fd);
    unlink();
    throw std::runtime_error(error);
  }
  void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    std::string error = errno_text("mmap " + name_);
    unlink();
    throw std::runtime_error(error);
  }
  base_ = static_cast<char*>(base);
  line(rank_).pid = getpid();
  if (streams_meet_)
    for (int k = 0; k < 2; ++k) words_.arrive[k] = arrival(rank_, k);
  thread_ = std::thread([this] { serve(); });
}

GpuProxy::~GpuProxy() {
  close();
  unlink();
  if (!registered_) munmap(base_, bytes_);
}

void GpuProxy::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

Line& GpuProxy::line(int r) const { return reinterpret_cast<Line*>(base_ + kPageBytes)[r]; }

uintptr_t GpuProxy::arrival(int r, int k) const {
  if (r < 0 || r >= size_ || k < 0 || k > 1)
    throw std::invalid_argument("GpuProxy.arrival: rank " + std::to_string(r) + ", meeting " +
                                std::to_string(k));
  return uintptr_t(base_) + 64 * (2 * r + k);
}

uint64_t GpuProxy::submit(uint64_t first, uint64_t steps, int meetings,
                          const std::vector<int64_t>& row, int64_t itemsize, bool splits,
                          bool exchanged, double timeout, int64_t step_bytes) {
  if (meetings < 1 || meetings > 2 || row.size() > size_t(kRowWords) || itemsize < 1)
    throw std::invalid_argument("GpuProxy.submit: 1 or 2 meetings a step, at most " +
                                std::to_string(kRowWords) + " words of row");
  auto plan = std::make_shared<Plan>();
  plan->first = first;
  plan->steps = steps;
  plan->meetings = meetings;
  std::copy(row.begin(), row.end(), plan->row);
  plan->itemsize = itemsize;
  plan->splits = splits;
  plan->exchanged = exchanged;
  plan->timeout = timeout;
  plan->step_bytes = step_bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) throw PeerError("this communicator's GPU proxy is closed");
  plan->id = made_++;
  plans_[plan->id] = plan;
  changed_.notify_all();
  return plan->id;
}

void GpuProxy::throw_failure(const Plan& plan) const {
  if (plan.failure == MISMATCHED) throw MismatchError(plan.error);
  if (plan.failure == TIMED_OUT) throw TimeoutError(plan.error);
  throw PeerError(plan.error);
}

std::vector<int64_t> GpuProxy::rows(uint64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = plans_.find(id);
  if (it == plans_.end()) throw std::invalid_argument("GpuProxy.rows: no plan " + std::to_string(id));
  std::shared_ptr<Plan> plan = it->second;
  changed_.wait(lock, [&] { return plan->met || plan->failure != OK || plan->finished; });
  if (plan->failure != OK) throw_failure(*plan);
  return plan->rows;
}

std::pair<double, double> GpuProxy::wait(uint64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = plans_.find(id);
  if (it == plans_.end()) throw std::invalid_argument("GpuProxy.wait: no plan " + std::to_string(id));
  std::shared_ptr<Plan> plan = it->second;
  changed_.wait(lock, [&] { return plan->finished; });
  plans_.erase(id);
  if (plan->failure != OK) throw_failure(*plan);
  return {plan->started, plan->ended};
}

bool GpuProxy::drain(double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  return changed_.wait_for(lock, std::chrono::duration<double>(seconds),
                           [&] { return served_ == made_; });
}

std::pair<Failure, std::string> GpuProxy::take_failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_ == OK || failure_taken_) return {OK, ""};
  failure_taken_ = true;
  return {failure_, failure_text_};
}

std::vector<std::pair<std::string, double>> GpuProxy::heartbeat() const {
  std::vector<std::pair<std::string, double>> beat = {
      {"plan", double(at_plan_.load())}, {"step", double(at_step_.load())},
      {"meeting", double(at_meeting_.load())}, {"waiting_for", double(waiting_for_.load())},
      {"waited_s", waiting_for_.load() ? seconds_now() - since_.load() : 0.0},
      {"go0", double(word(words_.go[0])->load())}, {"go1", double(word(words_.go[1])->load())},
      {"free", double(word(words_.free)->load())},
      {"arrive0", double(word(words_.arrive[0])->load())},
      {"arrive1", double(word(words_.arrive[1])->load())}};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    beat.push_back({"plans_made", double(made_)});
    beat.push_back({"plans_served", double(served_)});
    beat.push_back({"failed", double(failure_)});
  }
  for (int r = 0; r < size_; ++r) {
    beat.push_back({"reached_r" + std::to_string(r), double(line(r).reached.load())});
    if (streams_meet_)
      for (int k = 0; k < 2; ++k)
        beat.push_back({"arrive" + std::to_string(k) + "_r" + std::to_string(r),
                        double(word(arrival(r, k))->load())});
  }
  return beat;
}

void GpuProxy::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abandoned_) return;
    abandoned_text_ = reason;
  }
  abandoned_ = true;
}

void GpuProxy::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

// ---------------------------------------------------------------- the proxy's thread

void GpuProxy::serve() {
  prctl(PR_SET_TIMERSLACK, 1UL);  // naps of microseconds, not the default 50
  for (;;) {
    std::shared_ptr<Plan> plan;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto ready = [&] { return stopping_ || plans_.count(served_); };
      // After a failure, streams may still write their arrivals (the last steps they had
      // enqueued): write every rank's past again, often, so that no peer's wait is lowered.
      while (streams_meet_ && released_ && !ready()) {
        changed_.wait_for(lock, std::chrono::milliseconds(1), ready);
        release_arrivals();
      }
      changed_.wait(lock, ready);
      auto it = plans_.find(served_);
      if (it == plans_.end()) return;  // stopping, and every plan is over
      plan = it->second;
    }
    run(*plan);
    std::lock_guard<std::mutex> lock(mutex_);
    plan->ended = seconds_now();
    plan->finished = true;
    ++served_;
    changed_.notify_all();
  }
}

void GpuProxy::run(Plan& plan) {
  plan.started = seconds_now();
  at_plan_ = plan.id;
  try {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_ != OK)
        throw Failed{failure_, "an earlier collective on this communicator's GPU failed: " +
                                   failure_text_};
    }
    check_stop(plan);
    if (plan.exchanged) meet(plan, true, deadline_of(plan));
    if (plan.step_bytes > 0) plan.steps = steps_for_splits(plan);
    for (uint64_t i = 0; i < plan.steps; ++i) {
      uint64_t s = plan.first + i;
      at_step_ = s;
      for (int k = 0; k < plan.meetings; ++k) {
        at_meeting_ = k;
        Clock::time_point deadline = deadline_of(plan);
        bool first = !plan.exchanged && i == 0 && k == 0;
        bool proxied = first || !streams_meet_;  // the streams wait for go[k]
        wait_arrival(k, uint32_t(s + 1), plan, deadline, proxied);
        if (proxied)
          meet(plan, first, deadline);
        else
          watch_peers(k, uint32_t(s + 1), plan, deadline);
        if (k == 0) word(words_.free)->store(uint32_t(s), std::memory_order_release);
        word(words_.go[k])->store(uint32_t(s + 1), std::memory_order_release);
      }
    }
    at_meeting_ = -1;
  } catch (const Failed& failed) {
    {  // known before any stream goes on: the caller's next call raises it
      std::lock_guard<std::mutex> lock(mutex_);
      plan.failure = failed.kind;
      plan.error = failed.reason;
      changed_.notify_all();
    }
    release(plan.first);
  }
}

GpuProxy::Clock::time_point GpuProxy::deadline_of(const Plan& plan) const {
  if (plan.timeout <= 0) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(plan.timeout));
}

void GpuProxy::release(uint64_t from) {
  // No stream may wait forever: every wait for a step from `from` on passes (the counters'
  // comparisons are cyclic, over half of 2^32), this plan's and any later one's, whose
  // steps the proxy may not know (an all_to_all that failed before its exchange).
  uint32_t past = uint32_t(from + (1u << 30));
  if (past == 0) past = 1;  // (0 means none)
  word(words_.free)->store(past, std::memory_order_release);
  for (uintptr_t go : words_.go) word(go)->store(past, std::memory_order_release);
  released_ = past;
  release_arrivals();
}

void GpuProxy::release_arrivals() {
  if (!streams_meet_) return;
  uint32_t past = released_.load();
  for (int r = 0; r < size_; ++r)
    for (int k = 0; k < 2; ++k) word(arrival(r, k))->store(past, std::memory_order_release);
}

void GpuProxy::fail_now(Failure kind, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_ == OK) {
      failure_ = kind;
      failure_text_ = reason;
      Line& me = line(rank_);
      size_t n = std::min(reason.size(), sizeof(me.reason) - 1);
      std::memcpy(me.reason, reason.data(), n);
      me.reason[n] = 0;
      me.poisoned.store(kind, std::memory_order_release);
    }
  }
  ring_peers();
  throw Failed{kind, reason};
}

void GpuProxy::ring_peers() {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with a sleeper's fence
  for (int r = 0; r < size_; ++r) {
    Line& peer = line(r);
    if (r != rank_ && peer.sleeping.load(std::memory_order_relaxed)) {
      peer.bell.fetch_add(1, std::memory_order_relaxed);
      futex_wake(&peer.bell);
    }
  }
}

void GpuProxy::wait_arrival(int k, uint32_t value, const Plan& plan, Clock::time_point deadline,
                            bool eager) {
  // `eager`: the streams wait for this proxy, so spin (where each rank has a core) and
  // yield before napping; otherwise only watch
  std::atomic<uint32_t>* arrival = word(words_.arrive[k]);
  waiting_for_ = 1;
  since_ = seconds_now();
  long nap_ns = 1000;
  int64_t spin = eager ? spin_ : 0, yields = eager ? 64 : 0;
  for (int64_t i = 0; !reached(arrival->load(std::memory_order_acquire), value); ++i) {
    if (i < spin) {
      cpu_relax();
    } else if (i < spin + yields) {
      sched_yield();
    } else {  // the GPU cannot ring a bell: nap, longer and longer, up to 50 us
      timespec nap{0, nap_ns};
      nanosleep(&nap, nullptr);
      nap_ns = std::min(nap_ns * 2, 50'000L);
      if (Clock::now() >= deadline) {
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%g", plan.timeout);
        fail_now(TIMED_OUT, "rank " + std::to_string(rank_) + " timed out after " + seconds +
                                " s in " + describe_plan(plan) + " (ipc): its stream did not " +
                                "reach step " + std::to_string(value - 1 - plan.first) +
                                " (the GPU work before it did not finish)");
      }
      check_stop(plan);
    }
  }
  waiting_for_ = 0;
}

void GpuProxy::watch_peers(int k, uint32_t value, const Plan& plan, Clock::time_point deadline) {
  // The streams meet by themselves: watch their arrivals for a peer that fails, dies or
  // does not come, in naps (the streams wait for nothing of ours).
  waiting_for_ = 2;
  since_ = seconds_now();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    std::atomic<uint32_t>* theirs = word(arrival(r, k));
    long nap_ns = 1000;
    while (!reached(theirs->load(std::memory_order_acquire), value)) {
      timespec nap{0, nap_ns};
      nanosleep(&nap, nullptr);
      nap_ns = std::min(nap_ns * 2, 50'000L);
      uint32_t now = theirs->load(std::memory_order_acquire);
      if (!reached(now, value))
        check_peer(r, plan, deadline,
                   "its stream " + std::to_string(value - now) + " step(s) behind");
    }
  }
  // A peer that failed wrote every arrival past (its release): they all read as reached,
  // so this rank fails with it rather than finishing a call whose data is not there.
  for (int r = 0; r < size_; ++r)
    if (r != rank_) check_poisoned(r);
  waiting_for_ = 0;
}

void GpuProxy::check_poisoned(int r) {
  const Line& peer = line(r);
  uint32_t kind = peer.poisoned.load(std::memory_order_acquire);
  if (kind == OK) return;
  std::string who = "rank " + std::to_string(r) + " (pid " + std::to_string(peer.pid) + ")";
  fail_now(Failure(kind), kind == MISMATCHED || kind == TIMED_OUT
                              ? std::string(peer.reason)
                              : who + " failed: " + peer.reason);
}

void GpuProxy::check_peer(int r, const Plan& plan, Clock::time_point deadline,
                          const std::string& behind) {
  check_poisoned(r);
  const Line& peer = line(r);
  std::string who = "rank " + std::to_string(r) + " (pid " + std::to_string(peer.pid) + ")";
  if (!process_alive(peer.pid))
    fail_now(PEER_FAILED, who + " has exited during " + describe_plan(plan) + " (ipc)");
  if (Clock::now() >= deadline) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", plan.timeout);
    fail_now(TIMED_OUT, "rank " + std::to_string(rank_) + " timed out after " + seconds +
                                  " s in " + describe_plan(plan) + " (ipc) waiting for " + who +
                                  ", " + behind);
  }
  check_stop(plan);
}

void GpuProxy::check_stop(const Plan& plan) {
  if (stopping_) fail_now(CLOSED, "the communicator was freed during " + describe_plan(plan));
  if (abandoned_) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      why = abandoned_text_;
    }
    fail_now(PEER_FAILED, why);
  }
}

void GpuProxy::meet(Plan& plan, bool first, Clock::time_point deadline) {
  Line& me = line(rank_);
  uint64_t m = ++meetings_;
  if (first) std::memcpy(me.row[plan.id % 2], plan.row, sizeof(plan.row));
  me.reached.store(m, std::memory_order_release);
  ring_peers();
  waiting_for_ = 2;
  since_ = seconds_now();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Line& peer = line(r);
    for (int64_t i = 0; peer.reached.load(std::memory_order_acquire) < m; ++i) {
      if (i < spin_) {
        cpu_relax();
      } else if (i < spin_ + 64) {
        sched_yield();
      } else {
        uint32_t seen = me.bell.load(std::memory_order_relaxed);
        me.sleeping.store(1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with ring_peers'
        if (peer.reached.load(std::memory_order_acquire) < m) futex_wait(&me.bell, seen, 1'000'000);
        me.sleeping.store(0, std::memory_order_relaxed);
        check_peer(r, plan, deadline,
                   std::to_string(m - peer.reached.load()) + " meeting(s) behind");
      }
    }
  }
  waiting_for_ = 0;
  if (!first) return;
  std::vector<int64_t> table(size_t(size_) * kRowWords);
  for (int r = 0; r < size_; ++r)
    std::memcpy(&table[size_t(r) * kRowWords], line(r).row[plan.id % 2], sizeof(plan.row));
  std::string reason = check_table(table.data(), size_, kRowWords, plan.itemsize, plan.splits);
  if (!reason.empty()) fail_now(MISMATCHED, reason);
  std::lock_guard<std::mutex> lock(mutex_);
  plan.rows = std::move(table);
  plan.met = true;
  changed_.notify_all();
}

// ---------------------------------------------------------------- binding

void bind(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<GpuProxy>(m, "GpuProxy",
                       "The meetings of a communicator's collectives through CUDA IPC on one "
                       "device, served by a thread of its own (csrc/gpu_proxy.h)")
      .def(py::init([](int rank, int size, const std::string& channel, bool create,
                       const std::vector<uintptr_t>& words, int64_t spin, bool streams_meet) {
             if (words.size() != 5)
               throw std::invalid_argument("GpuProxy: words are go0, go1, free, arrive0, arrive1");
             return new GpuProxy(rank, size, channel, create,
                                 Words{{words[0], words[1]}, words[2], {words[3], words[4]}}, spin,
                                 streams_meet);
           }),
           py::arg("rank"), py::arg("size"), py::arg("channel"), py::arg("create"),
           py::arg("words"), py::arg("spin"), py::arg("streams_meet") = false)
      .def_property_readonly("channel", &GpuProxy::channel)
      .def_property_readonly("page", &GpuProxy::page,
                             "(address, bytes): the channel's arrivals in this process")
      .def("unregistered", &GpuProxy::unregistered,
           "CUDA has let the page go: the proxy may unmap its channel when dropped")
      .def("arrival", &GpuProxy::arrival, py::arg("rank"), py::arg("meeting"),

           "The word where rank's stream marks a step's meeting when streams meet")
      .def("unlink", &GpuProxy::unlink)
      .def("submit", &GpuProxy::submit, Release(), py::arg("first"), py::arg("steps"),
           py::arg("meetings"), py::arg("row"), py::arg("itemsize"), py::arg("splits"),
           py::arg("exchanged"), py::arg("timeout"), py::arg("step_bytes") = 0,
           "A plan handed over; returns its id. An exchanged plan with step_bytes takes as "
           "many steps as the largest part any rank sends (its row's splits) takes in parts "
           "of step_bytes")
      .def("rows", [](GpuProxy& proxy, uint64_t id) {
             std::vector<int64_t> rows;
             {
               py::gil_scoped_release release;
               rows = proxy.rows(id);
             }
             py::list out;
             for (size_t r = 0; r < rows.size() / kRowWords; ++r)
               out.append(std::vector<int64_t>(rows.begin() + r * kRowWords,
                                               rows.begin() + (r + 1) * kRowWords));
             return out;
           }, py::arg("id"), "Every rank's row once the plan's first meeting is over")
      .def("wait", &GpuProxy::wait, Release(), py::arg("id"),
           "Until the plan is over: (started, ended) in time.monotonic's seconds")
      .def("drain", &GpuProxy::drain, Release(), py::arg("seconds"))
      .def("take_failure", [](GpuProxy& proxy) {
             auto [kind, text] = proxy.take_failure();
             return py::make_tuple(int(kind), text);
           })
      .def("heartbeat", [](const GpuProxy& proxy) {
             py::dict beat;
             for (auto& [name, value] : proxy.heartbeat()) beat[py::str(name)] = value;
             return beat;
           })
      .def("fail", &GpuProxy::fail, py::arg("reason"),
           "Fail the plan being served (and every later one), on every rank: this rank "
           "cannot do its part")
      .def("close", &GpuProxy::close, Release());
  m.attr("GPU_PROXY_ROW_WORDS") = kRowWords;
  py::dict failures;
  failures["peer_failed"] = int(PEER_FAILED);
  failures["mismatched"] = int(MISMATCHED);
  failures["timed_out"] = int(TIMED_OUT);
  failures["closed"] = int(CLOSED);
  m.attr("GPU_PROXY_FAILURES") = failures;
}

}  // namespace commlib::gpu

namespace commlib {
void bind_gpu_proxy(py::module_& m) { gpu::bind(m); }
}  // namespace commlib
