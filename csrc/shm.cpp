// Segments, signatures and waiting for the shared-memory transport (see shm.h).
#include "shm.h"

#include "kernels.h"
#include "process.h"
#include "segment_names.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <cstdio>
#include <random>

namespace commlib::shm {

namespace {

std::string unique_name(int rank) { return unique_segment_name("", "-r" + std::to_string(rank)); }

// Layout of every segment: control, doorbell, published descriptors, poison reason, one
// channel per peer, staging, directory, splits.
constexpr size_t kDoorbellAt = kLine, kPublishedAt = 2 * kLine;
constexpr size_t kReasonAt = kPublishedAt + sizeof(Published);
constexpr size_t kExposedAt = kReasonAt + sizeof(Reason);
constexpr size_t kHeaderBytes = kExposedAt + sizeof(Exposed);

}  // namespace

size_t ShmComm::channel_offset(int to) const {
  size_t per_channel = kLine + config_.slots * (sizeof(SlotHeader) + config_.slot_bytes);
  return kHeaderBytes + size_t(to) * per_channel;
}

ChannelTail* ShmComm::tail(int owner, int to) const {
  return reinterpret_cast<ChannelTail*>(peers_[owner].base + channel_offset(to));
}

SlotHeader* ShmComm::slot(int owner, int to, uint64_t k) const {
  size_t stride = sizeof(SlotHeader) + config_.slot_bytes;
  return reinterpret_cast<SlotHeader*>(peers_[owner].base + channel_offset(to) + kLine +
                                       (k % config_.slots) * stride);
}

char* ShmComm::staging(int owner, uint64_t piece) const {
  return peers_[owner].base + channel_offset(size_) + (piece % 2) * (config_.staging_bytes / 2);
}

int64_t* ShmComm::splits(int owner, uint64_t call) const {
  return reinterpret_cast<int64_t*>(staging(owner, 0) + config_.staging_bytes) +
         (call % 2) * 2 * size_;
}

// streaming_from's default among `ranks` on this host: where their copies together fill
// half the last-level cache (as the C library reports it; glibc's own memcpy streams from
// three quarters of a thread's share of it), and from kStreamingBytes at least.
static int64_t streaming_from_cache(int ranks) {
  long cache = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (cache <= 0) cache = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return std::max<int64_t>(ShmComm::kStreamingBytes, cache > 0 ? cache / 2 / ranks : 0);
}

ShmComm::ShmComm(int rank, int size, const Config& config)
    : rank_(rank), size_(size), config_(config), peers_(size), sent_(size), received_(size) {
  if (size < 1 || rank < 0 || rank >= size) throw std::invalid_argument("bad rank or size");
  streaming_from_ = streaming_from_cache(size);
  if (config.slot_bytes < 64 || config.slot_bytes % 64 || config.slots < 1 ||
      config.staging_bytes < 128 * size || config.staging_bytes % 128)
    throw std::invalid_argument(
        "shared-memory config: slot_bytes must be a multiple of 64, slots >= 1, staging_bytes "
        "a multiple of 128 and at least 128 per rank");
  bytes_ = channel_offset(size) + config.staging_bytes + 4 * size * sizeof(int64_t);  // splits
  name_ = unique_name(rank);
  int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open " + name_));
  owner_linked_ = true;
  if (ftruncate(fd, off_t(bytes_)) != 0) {
    std::string err = errno_text("ftruncate " + name_ + " (is /dev/shm full?)");
    close(fd);
    unlink_own();
    throw std::runtime_error(err);
  }
  void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    std::string err = errno_text("mmap " + name_);
    unlink_own();
    throw std::runtime_error(err);
  }
  // ftruncate zero-fills: every counter starts at 0.
  peers_[rank].base = static_cast<char*>(base);
  me_ = reinterpret_cast<Control*>(base);
  me_->pid = getpid();
  regions_.resize(size);
  auto* exposed = reinterpret_cast<Exposed*>(peers_[rank].base + kExposedAt);
  exposed->self = reinterpret_cast<uint64_t>(exposed);
  exposed->nonce = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
}

ShmComm::~ShmComm() {
  unlink_own();
  for (auto& p : peers_)
    if (p.base) munmap(p.base, bytes_);
}

void ShmComm::attach(const std::vector<std::string>& names) {
  if (int(names.size()) != size_) throw std::invalid_argument("one segment name per rank");
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    int fd = shm_open(names[r].c_str(), O_RDWR, 0);
    if (fd < 0) throw std::runtime_error(errno_text("shm_open " + names[r] + " of rank " +
                                                    std::to_string(r)));
    struct stat st;
    if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes_) {
      close(fd);
      throw std::runtime_error("segment of rank " + std::to_string(r) +
                               " has another size: the ranks were configured differently");
    }
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) throw std::runtime_error(errno_text("mmap " + names[r]));
    peers_[r].base = static_cast<char*>(base);
  }
  for (auto& p : peers_) {
    p.control = reinterpret_cast<Control*>(p.base);
    p.bell = reinterpret_cast<Doorbell*>(p.base + kDoorbellAt);
    p.published = reinterpret_cast<Published*>(p.base + kPublishedAt);
    p.reason = reinterpret_cast<Reason*>(p.base + kReasonAt);
    p.exposed = reinterpret_cast<Exposed*>(p.base + kExposedAt);
    p.pid = p.control->pid;
  }
}

void ShmComm::unlink_own() {
  if (owner_linked_) {
    shm_unlink(name_.c_str());
    owner_linked_ = false;
  }
}

// ---------------------------------------------------------------------------------------
// Calls, failures, waiting.

void ShmComm::set_timeout(double seconds) {
  if (!(seconds >= 0)) throw std::invalid_argument("timeout must be >= 0 seconds (0: none)");
  timeout_ = seconds;
}

void ShmComm::abort() {
  aborted_.store(true, std::memory_order_release);
  notify(rank_);  // wake this rank's wait if it sleeps (it checks aborted_ on each wake)
}

void ShmComm::fail_aborted() {
  fail(FAILED, "rank " + std::to_string(rank_) + " aborted the communicator (Communicator." +
                   "abort) during " + describe(desc_));
}

void ShmComm::begin(const Desc& desc) {
  if (aborted_.load(std::memory_order_acquire) && failure_.empty()) {
    desc_ = desc;
    fail_aborted();
  }
  if (uint32_t kind = me_->poisoned.load(std::memory_order_relaxed)) {
    std::string why = "this communicator is unusable after an earlier failure (" + failure_ +
                      "); create a new communicator";
    if (kind == MISMATCHED) throw MismatchError(why);
    throw PeerError(why);
  }
  desc_ = desc;
  sig_ = desc.hash();
  if (timeout_ > 0)
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(timeout_));
  uint64_t next = call_ + 1;
  peers_[rank_].published->call[next % 2] = desc;
  me_->sig[next % 2].store(sig_, std::memory_order_relaxed);
  me_->call.store(++call_, std::memory_order_release);
}

void ShmComm::fail(Poison kind, const std::string& reason) {
  if (failure_.empty()) {
    failure_ = reason;
    failure_kind_ = kind;
    char* text = peers_[rank_].reason->text;
    size_t n = std::min(reason.size(), sizeof(Reason::text) - 1);
    std::memcpy(text, reason.data(), n);
    text[n] = 0;
    me_->poisoned.store(kind, std::memory_order_release);
    notify_peers();
  }
  if (kind == MISMATCHED) throw MismatchError(reason);
  if (kind == TIMED_OUT) throw TimeoutError(reason);
  throw PeerError(reason);
}

std::string ShmComm::mismatch_reason() const {
  // A peer in this call, or already in the next one, still shows this call's descriptor.
  std::vector<const Desc*> descs(size_);
  for (int r = 0; r < size_; ++r) {
    uint64_t call = peers_[r].control->call.load(std::memory_order_acquire);
    if (call == call_ || call == call_ + 1) descs[r] = &peers_[r].published->call[call_ % 2];
  }
  std::string reason = disagreement(descs);
  return reason.empty() ? "the ranks' calls do not match (they called collectives in "
                          "different orders, or different numbers of them)"
                        : reason;
}

void ShmComm::check_signature(int peer) {
  Control* c = peers_[peer].control;
  // A poisoned peer's counter stays at the call it failed in (begin refuses the next): one
  // that failed in a later call finished this one, which its failure does not end.
  uint32_t kind = c->poisoned.load(std::memory_order_acquire);
  if (kind && c->call.load(std::memory_order_acquire) <= call_) {
    // The peer's verdict becomes this rank's, so every rank raises the same error; a
    // timeout elsewhere is a failure here (this rank did not wait too long).
    std::string reason(peers_[peer].reason->text);
    if (kind == MISMATCHED) fail(MISMATCHED, reason);
    fail(FAILED, "rank " + std::to_string(peer) + " failed, which ends this collective on "
                     "every rank: " + reason);
  }
  if (c->call.load(std::memory_order_acquire) != call_) return;  // not (or no longer) in it
  uint64_t sig = c->sig[call_ % 2].load(std::memory_order_acquire);
  if (sig != sig_ && c->call.load(std::memory_order_acquire) == call_)
    fail(MISMATCHED, mismatch_reason());
}

// `call` is the peer's call counter read before `ready()` was found still false: a peer
// that has moved past this call cannot still owe this rank anything.
void ShmComm::check_peer(int peer, uint64_t call) {
  check_signature(peer);
  std::string who = "rank " + std::to_string(peer);
  if (call > call_)
    fail(MISMATCHED, who + " finished " + describe(peers_[peer].published->call[call_ % 2]) +
                         " without the data this rank waits for in " + describe(desc_) +
                         ": the ranks' arguments disagree");
  if (!process_alive(peers_[peer].pid))
    fail(FAILED, who + " (pid " + std::to_string(peers_[peer].pid) + ") has exited during " +
                     describe(desc_));
}

void ShmComm::check_deadline(const std::vector<int>& waited_for) {
  if (timeout_ <= 0 || std::chrono::steady_clock::now() < deadline_) return;
  std::string peers;
  for (int r : waited_for) {
    uint64_t call = peers_[r].control->call.load(std::memory_order_acquire);
    peers += std::string(peers.empty() ? "" : ", ") + "rank " + std::to_string(r) + " (pid " +
             std::to_string(peers_[r].pid) + ", " +
             (call < call_ ? "has not started it: " + std::to_string(call_ - call) +
                                 " call(s) behind"
                           : std::string("in it")) + ")";
  }
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", timeout_);
  fail(TIMED_OUT, "rank " + std::to_string(rank_) + " timed out after " + seconds + " s in " +
                      describe(desc_) + " waiting for " + (peers.empty() ? "its peers" : peers));
}

std::vector<int64_t> ShmComm::part_bytes(int64_t count, int64_t itemsize,
                                         const std::vector<int64_t>& splits) const {
  std::vector<int64_t> bytes(size_, count / size_ * itemsize);
  if (!splits.empty())
    for (int j = 0; j < size_; ++j) bytes[j] = splits.at(j) * itemsize;
  return bytes;
}

void ShmComm::publish_splits(const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  int64_t* table = splits(rank_, call_ + 1);
  std::copy(send.begin(), send.end(), table);
  std::copy(recv.begin(), recv.end(), table + size_);
}

void ShmComm::wait_all_begun() {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Control* c = peers_[r].control;
    wait([&] { return c->call.load(std::memory_order_acquire) >= call_; }, only(r));
    check_signature(r);
  }
}

void ShmComm::agree(const std::vector<int64_t>& fields, const std::vector<int64_t>& send,
                    const std::vector<int64_t>& recv, int64_t itemsize) {
  if (fields.size() != kDescFields) throw std::invalid_argument("a descriptor has 8 fields");
  bool splits = !send.empty();
  if (splits && (int(send.size()) != size_ || int(recv.size()) != size_))
    throw std::invalid_argument("one split per rank");
  Desc desc;
  std::copy(fields.begin(), fields.end(), desc.f);
  std::lock_guard<std::mutex> lock(mutex_);
  if (splits) publish_splits(send, recv);
  begin(desc);
  wait_all_begun();
  if (splits) check_splits(itemsize);
}

void ShmComm::run(const FastEntry& e, const FastCall& c) {
  const int dtype = c.out.dtype;
  if (!e.descriptor.empty()) {  // the descriptor's dtype and op fields are this call's
    std::vector<int64_t> desc = e.descriptor;
    desc[DTYPE] = dtype, desc[OP] = c.op_given;
    agree(desc, {}, {}, itemsize(dtype));
  }
  switch (e.kind) {
    case EntryKind::PLAN:
      run_plan(e.plan.data(), int64_t(e.plan.size()), {c.out.ptr, c.in.ptr}, e.tmp_bytes, dtype,
               c.op);
      break;
    case EntryKind::DIRECT:
      direct(c.collective, c.out.ptr, c.in.ptr, c.count, dtype, c.op, c.root);
      break;
    case EntryKind::ONE_COPY:
      one_copy(c.collective, c.out.ptr, c.in.ptr, c.count, dtype, c.op, c.root, {}, {},
               e.plan.data(), int64_t(e.plan.size()), e.tmp_bytes, e.only_regions);
      break;
    default:
      throw std::logic_error("the shm transport runs no eager entries");
  }
}

void ShmComm::check_splits(int64_t itemsize) {
  // Every rank reads the same published matrix, so all raise alike (nothing is poisoned:
  // no data moved, the communicator stays usable, as after a bad argument).
  std::string reason = split_disagreement(
      size_, itemsize, [&](int i, int j) { return splits(i, call_)[j]; },
      [&](int j, int i) { return splits(j, call_)[size_ + i]; });
  if (reason.empty()) return;
  for (int r = 0; r < size_; ++r)  // a peer two calls on has overwritten this call's splits,
    if (peers_[r].control->call.load(std::memory_order_acquire) > call_ + 1)
      return;  // and it got that far only because the matrix agreed
  throw MismatchError(reason);
}

void ShmComm::notify(int peer) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the sleeper's fence
  ring(peer);
}

void ShmComm::notify_peers() {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // one fence covers every peer
  for (int r = 0; r < size_; ++r)
    if (r != rank_) ring(r);
}

void ShmComm::ring(int peer) {
  Doorbell* bell = peers_[peer].bell;
  if (bell->sleeping.load(std::memory_order_relaxed)) {
    bell->seq.fetch_add(1, std::memory_order_relaxed);
    futex_wake(&bell->seq);
  }
}

uint32_t ShmComm::prepare_nap() {
  Doorbell* bell = peers_[rank_].bell;
  uint32_t seen = bell->seq.load(std::memory_order_relaxed);
  bell->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with notify()'s fence
  return seen;
}

void ShmComm::nap(uint32_t seen) { futex_wait(&peers_[rank_].bell->seq, seen, 2'000'000); }

void ShmComm::end_nap() { peers_[rank_].bell->sleeping.store(0, std::memory_order_relaxed); }

void ShmComm::cpu_relax() { commlib::cpu_relax(); }

void ShmComm::yield() { sched_yield(); }

bool ShmComm::on_main_thread() {
  thread_local const bool main = syscall(SYS_gettid) == getpid();
  return main;
}

uint64_t ShmComm::arrive() {
  uint64_t target = me_->arrived.load(std::memory_order_relaxed) + 1;
  me_->arrived.store(target, std::memory_order_release);
  notify_peers();
  return target;
}

void ShmComm::barrier() {
  std::lock_guard<std::mutex> lock(mutex_);
  begin({BARRIER, pack_name("direct"), kNone, kNone, kNone, kNone, 0, 0});
  wait_arrivals(arrive(), [](int) { return true; });
}

// Staging half piece%2 is free once every peer has released the piece before it there.
void ShmComm::wait_staging_free(uint64_t piece) {
  if (piece < 2) return;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    Control* c = peers_[r].control;
    wait([&] { return c->released.load(std::memory_order_acquire) >= piece - 1; }, only(r));
  }
}

void ShmComm::release_piece(uint64_t piece) {
  me_->released.store(piece + 1, std::memory_order_release);
  notify_peers();
}

}  // namespace commlib::shm
