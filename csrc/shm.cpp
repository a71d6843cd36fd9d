// Segments, signatures and waiting for the shared-memory transport (see shm.h).
#include "shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COMMLIB_CPU_RELAX() _mm_pause()
#else
#define COMMLIB_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace commlib::shm {

namespace {


std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string unique_name(int rank) {
  static std::atomic<uint64_t> serial{0};
  std::random_device entropy;
  return "/commlib-" + std::to_string(getuid()) + "-" + std::to_string(getpid()) + "-r" +
         std::to_string(rank) + "-" + std::to_string(serial++) + "-" +
         std::to_string(entropy() & 0xffffff);
}

// Layout of every segment: control, doorbell, one channel per peer, staging.
constexpr size_t kHeaderBytes = 2 * kLine;

// A futex in memory shared between processes (so not FUTEX_PRIVATE).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long nanoseconds) {
  timespec timeout{0, nanoseconds};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr,
          0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

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

Directory* ShmComm::directory(int owner) const {
  return reinterpret_cast<Directory*>(staging(owner, 0) + config_.staging_bytes);
}

int64_t* ShmComm::directory_offsets(int owner) const {
  return reinterpret_cast<int64_t*>(directory(owner) + 1);
}

ShmComm::ShmComm(int rank, int size, const Config& config)
    : rank_(rank), size_(size), config_(config), peers_(size), sent_(size), received_(size) {
  if (size < 1 || rank < 0 || rank >= size) throw std::invalid_argument("bad rank or size");
  if (config.slot_bytes < 64 || config.slot_bytes % 64 || config.slots < 1 ||
      config.staging_bytes < 128 * size || config.staging_bytes % 128)
    throw std::invalid_argument(
        "shared-memory config: slot_bytes must be a multiple of 64, slots >= 1, staging_bytes "
        "a multiple of 128 and at least 128 per rank");
  bytes_ = channel_offset(size) + config.staging_bytes + sizeof(Directory) +
           2 * size * sizeof(int64_t);
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
  me_->self_address = reinterpret_cast<uint64_t>(base);
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
    p.bell = reinterpret_cast<Doorbell*>(p.base + kLine);
    p.pid = p.control->pid;
  }
}

bool ShmComm::probe_cma() const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    uint64_t seen = 0;
    iovec local{&seen, sizeof(seen)};
    iovec remote{reinterpret_cast<void*>(peers_[r].control->self_address + offsetof(Control,
                                                                                    self_address)),
                 sizeof(seen)};
    if (process_vm_readv(peers_[r].pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof(seen)) ||
        seen != peers_[r].control->self_address)
      return false;
  }
  return true;
}

void ShmComm::read_peer(int peer, char* dst, uint64_t remote, uint64_t nbytes) const {
  while (nbytes > 0) {
    iovec local{dst, nbytes};
    iovec far{reinterpret_cast<void*>(remote), nbytes};
    ssize_t got = process_vm_readv(peers_[peer].pid, &local, 1, &far, 1, 0);
    if (got <= 0)
      throw PeerError(errno_text("reading rank " + std::to_string(peer) + "'s buffer"));
    dst += got;
    remote += got;
    nbytes -= got;
  }
}

void ShmComm::publish(const char* base, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& lengths) {
  directory(rank_)->address = reinterpret_cast<uint64_t>(base);
  int64_t* table = directory_offsets(rank_);
  for (int r = 0; r < size_; ++r) {
    table[r] = offsets[r];
    table[size_ + r] = lengths[r];
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

void ShmComm::begin(uint64_t sig) {
  if (me_->poisoned.load(std::memory_order_relaxed))
    throw PeerError("this communicator is unusable after an earlier failure (" + failure_ +
                    "); create a new communicator");
  sig_ = sig;
  me_->sig[(call_ + 1) % 2].store(sig, std::memory_order_relaxed);
  me_->call.store(++call_, std::memory_order_release);
}

void ShmComm::fail(const std::string& message) {
  if (failure_.empty()) failure_ = message;
  me_->poisoned.store(1, std::memory_order_release);
  notify_peers();
  throw PeerError(message);
}

void ShmComm::check_signature(int peer) {
  Control* c = peers_[peer].control;
  if (c->poisoned.load(std::memory_order_acquire))
    fail("rank " + std::to_string(peer) +
         " failed in this or an earlier collective on this communicator");
  if (c->call.load(std::memory_order_acquire) != call_) return;  // not (or no longer) in it
  uint64_t sig = c->sig[call_ % 2].load(std::memory_order_acquire);
  if (sig != sig_ && c->call.load(std::memory_order_acquire) == call_)
    fail("rank " + std::to_string(peer) +
         " called a different collective, or the same one with different counts, dtype, op, "
         "root or algorithm (collective #" + std::to_string(call_) + " on this communicator)");
}

// `call` is the peer's call counter read before `ready()` was found still false: a peer
// that has moved past this call cannot still owe this rank anything.
void ShmComm::check_peer(int peer, uint64_t call) {
  check_signature(peer);
  std::string who = "rank " + std::to_string(peer);
  if (call > call_)
    fail(who + " finished collective #" + std::to_string(call_) +
         " without the data this rank waits for: the ranks' arguments disagree");
  if (kill(peers_[peer].pid, 0) != 0 && errno == ESRCH)
    fail(who + " (pid " + std::to_string(peers_[peer].pid) + ") has exited");
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

void ShmComm::cpu_relax() { COMMLIB_CPU_RELAX(); }

void ShmComm::yield() { sched_yield(); }

uint64_t ShmComm::arrive() {
  uint64_t target = me_->arrived.load(std::memory_order_relaxed) + 1;
  me_->arrived.store(target, std::memory_order_release);
  notify_peers();
  return target;
}

void ShmComm::barrier() {
  std::lock_guard<std::mutex> lock(mutex_);
  begin(0x6261727269657221ull);
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
