// Shared-memory transport between the ranks of one host, and the two ways collectives
// run over it (shm_plan.cpp: schedules; shm_direct.cpp: direct collectives).
//
// Vocabulary:
//   segment    one POSIX shared-memory object per rank, mapped by every rank of the
//              communicator. Created 0600 under a unique name and unlinked as soon as all
//              peers have mapped it, so a crash leaves nothing in /dev/shm.
//   control    the cache line where a rank publishes its state: calls started, the current
//              call's signature, barrier arrivals, staging pieces released, poison, pid.
//   doorbell   a futex word per rank; a rank that has waited long sleeps on it and
//              whoever publishes something it may wait for rings it.
//   channel    a FIFO of `slots` slots of `slot_bytes` from the segment's owner to one peer.
//              The owner fills slots; the peer copies or reduces straight out of them and
//              hands them back through the channel's `consumed` counter.
//   staging    two halves in each segment where direct collectives publish a piece of
//              their input for the peers to read in place.
//   exposed    the addresses of this call's buffers in the owner's address space, which
//              one-copy collectives (shm_one_copy.cpp) read with process_vm_readv, or
//              through the shared mapping where they lie in a region.
//   region     host memory every rank of the communicator maps (Communicator.empty),
//              numbered alike on every rank; the owner publishes which region a buffer
//              lies in, so a freed region (and an address reused after it) is never read.
//   piece      the part of a direct collective that fits in one staging half; pieces
//              alternate halves so staging piece g+1 overlaps peers reading piece g.
//   descriptor what every rank must agree on about a call (agreement.h), published per
//              call with its 64-bit hash, the signature. Ranks that meet with different
//              signatures poison the communicator and raise CollectiveMismatchError naming
//              what differs, instead of exchanging wrong data or hanging.
//   splits     all_to_all's bytes to and from each peer, published so that every rank
//              checks the whole matrix (and all raise alike when it does not add up) and
//              knows how many pieces the longest part takes.
//   poison     a failed rank's verdict (kind + reason text) in its segment: peers that see
//              it raise the same error, so one failure ends the call on every rank.
//   timeout    every wait is bounded: past the deadline a rank poisons the communicator and
//              raises CommTimeoutError naming the call and the peers it waited for.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "agreement.h"
#include "fast_path.h"
#include "kernels.h"  // copy, copy_streaming

namespace commlib::shm {

constexpr size_t kLine = 64;

struct alignas(kLine) Control {
  std::atomic<uint64_t> call;      // calls this rank has started
  // Signature of call k in sig[k % 2]: starting call k+1 must not overwrite what a peer
  // still in call k may be comparing against.
  std::atomic<uint64_t> sig[2];
  std::atomic<uint64_t> arrived;   // barrier arrivals, monotone over the communicator's life
  std::atomic<uint64_t> released;  // staging pieces this rank has finished reading
  std::atomic<uint32_t> poisoned;  // a Poison kind, 0 while healthy
  int32_t pid;
};

enum Poison : uint32_t { HEALTHY = 0, FAILED, MISMATCHED, TIMED_OUT };

struct alignas(kLine) Published {  // descriptor of call k in call[k % 2], like Control::sig
  Desc call[2];
};

struct alignas(kLine) Reason {  // why this rank poisoned the communicator
  char text[4 * kLine];
};

struct alignas(kLine) Exposed {
  uint64_t in, out;  // this call's buffers, in the owner's address space
  int64_t in_region, out_region;  // the shared regions they lie in (-1: none)
  uint64_t self;     // where this struct lies in the owner's address space (the probe)
  uint64_t nonce;    // random: what the probe expects to read there
  // whether the buffers peers read are cheap to read where they lie: 2 * call + yes, by
  // call parity (as Control::sig: a rank one call ahead must not overwrite what a peer
  // still reads). A rank two calls ahead (a call between that did not wait for the
  // reader) left this one without reading in place, or it would wait for its readers: a
  // later call's number reads as no.
  uint64_t in_place[2];
  // broadcast: whether this reader's buffer is cheap for the root to write into where it
  // lies (as cheap_to_read); read by the root after the first meeting of the same call
  uint64_t root_may_write;
};

struct alignas(kLine) Doorbell {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleeping;
};

struct alignas(kLine) SlotHeader {
  std::atomic<uint64_t> seq;  // k+1 once the k-th slot of this channel is filled
  uint64_t sig;
  uint64_t total;   // bytes of the whole transfer this slot belongs to
  uint64_t offset;  // where this slot's bytes go within that transfer
  uint64_t nbytes;
};

struct alignas(kLine) ChannelTail {
  std::atomic<uint64_t> consumed;  // slots the receiver has drained
};

struct Config {
  int64_t slot_bytes;
  int64_t slots;
  int64_t staging_bytes;  // both halves
  int64_t spin;           // polls before yielding; 0 when ranks outnumber cores
  int64_t yields;         // sched_yield()s before sleeping on the doorbell
  // polls before yielding on a thread other than the process's main one (an async call's):
  // 0 where a rank has no second core, so that its main thread's compute keeps its core
  int64_t background_spin;
  // sched_yield()s there: 0 where a rank has no second core, for each yield beside compute
  // gives it a whole time slice (16 MiB's host stage beside a matmul: 10 -> 125 ms)
  int64_t background_yields;
};

// Whether at most a quarter of [addr, addr + nbytes) lies on base pages (absent ones
// too) rather than huge ones; true where the kernel cannot tell (before 6.7), as before it
// could (shm_one_copy.cpp).
bool mostly_huge(uintptr_t addr, int64_t nbytes);

class ShmComm : public FastTransport {
 public:
  ShmComm(int rank, int size, const Config& config);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // Set-up, collective over the ranks: create (constructor) -> exchange names -> attach
  // every peer's segment -> barrier -> unlink_own.
  const std::string& name() const { return name_; }
  void attach(const std::vector<std::string>& names);
  void unlink_own();

  // Collectives; pointers are raw addresses, counts in elements of dtype. A plan starts
  // with its call's descriptor fields (shm_plan.cpp); the direct collectives describe
  // themselves.
  void run_plan(const int64_t* plan, int64_t plan_len, const std::vector<uintptr_t>& bufs,
                int64_t tmp_bytes, int dtype, int op);
  void barrier();
  // phases: 1 = reduce-scatter (rank r's block of chunks(count, n) is reduced in place),
  // 2 = all-gather of those blocks, 3 = both (all_reduce).
  void all_reduce(uintptr_t buf, int64_t count, int dtype, int op, int phases);
  void reduce(uintptr_t buf, int64_t count, int dtype, int op, int root);
  void reduce_scatter(uintptr_t out, uintptr_t in, int64_t count, int dtype, int op);
  void all_gather(uintptr_t out, uintptr_t in, int64_t count, int dtype);
  void broadcast(uintptr_t buf, int64_t count, int dtype, int root);
  // all_to_all with byte offsets/lengths per peer into in (send) and out (receive).
  void all_to_all(uintptr_t out, uintptr_t in, int dtype,
                  const std::vector<int64_t>& send_offsets,
                  const std::vector<int64_t>& send_lengths,
                  const std::vector<int64_t>& recv_offsets,
                  const std::vector<int64_t>& recv_lengths);

  // The direct collective of a call: the one mapping from a collective to the functions
  // above. `in` is 0 where the call has no input; all_to_all's splits count elements per
  // peer (empty: equal parts of `count`, the input's elements). op/root as the call's.
  void direct(int64_t collective, uintptr_t out, uintptr_t in, int64_t count, int dtype,
              int op, int64_t root, const std::vector<int64_t>& in_splits = {},
              const std::vector<int64_t>& out_splits = {});

  // One-copy collectives (shm_one_copy.cpp): each rank reads the peers' buffers where
  // they lie with process_vm_readv, instead of staging them. Same arguments as direct();
  // all but reduce. probe_one_copy() (set-up, after attach) says why they cannot run
  // here ("" when they can); one_copy() raises unless the probe succeeded. Where some
  // rank's buffer is not read in place, the call stages: by the flattened schedule
  // `otherwise` (its scratch `tmp_bytes`) where one is given, else as direct() does.
  // `only_regions`: buffers are read in place only where they lie in a region (auto's
  // route for memory every rank maps: commlib/algorithms/pages.py's in_regions).
  void one_copy(int64_t collective, uintptr_t out, uintptr_t in, int64_t count, int dtype,
                int op, int64_t root, const std::vector<int64_t>& in_splits = {},
                const std::vector<int64_t>& out_splits = {}, const int64_t* otherwise = nullptr,
                int64_t otherwise_len = 0, int64_t tmp_bytes = 0, bool only_regions = false);
  std::string probe_one_copy();
  // hier's host stages of an all_reduce (shm_one_copy.cpp), phase 1 (each rank reduces its
  // block from the peers' buffers) and 2 (after the cross stage, each reads the others'
  // blocks from their owners), read in place whatever the pages: three meetings in all,
  // where direct's phases meet twice per staging piece.
  void all_reduce_phase_in_place(uintptr_t buf, int64_t count, int dtype, int op, int phase);
  // calls so far that read peers' buffers where they lie (one_copy's, all_to_all's rest)
  uint64_t calls_read_in_place() const { return calls_read_in_place_; }
  // The collectives (a bit per Collective code) whose buffers on base (4 KiB) pages are
  // read in place too. None by default: where pinning base pages costs more than staging
  // their bytes (2-core AMD EPYC, 4 MiB all_to_all: 173 us against 113), they are
  // staged; the tuning pass measures which wins on this machine (commlib/tuning.py).
  uint32_t base_pages_in_place() const { return base_pages_in_place_; }
  void set_base_pages_in_place(uint32_t collectives) { base_pages_in_place_ = collectives; }
  // The bytes of a rank's largest all_to_all part from which direct's all_to_all reads
  // its parts in place (where they are cheap to read) rather than staging them; -1, the
  // default: where they take several staging pieces. The tuning pass measures it.
  int64_t parts_in_place_from() const { return parts_in_place_from_; }
  void set_parts_in_place_from(int64_t bytes) { parts_in_place_from_ = bytes; }
  // The bytes of a transfer from which received data land with non-temporal stores
  // (copy_streaming), skipping the read-for-ownership a store that misses the cache makes:
  // a third less DRAM traffic, but the data leave the cache, which pays only where they
  // would not have stayed there. So from where the host's ranks, copying at once, would
  // fill half the last-level cache, and from 8 MiB at least (streaming_from_cache). With
  // a fixed 8 MiB, an Intel Xeon reporting 300 MiB of L3 lost a quarter of a ring
  // all_reduce's speed at 16-64 MiB (2 ranks), and one_copy's after it almost half.
  int64_t streaming_from() const { return streaming_from_; }
  void set_streaming_from(int64_t bytes) { streaming_from_ = bytes; }
  // How the received data of a transfer of `bytes` are copied out.
  using CopyFn = void (*)(void*, const void*, int64_t);
  CopyFn copy_received(int64_t bytes) const {
    return bytes >= streaming_from_ ? copy_streaming : copy;
  }
  // Region `index` of rank `owner`: at `owner_base` in the owner's address space, mapped
  // here at `local` (the owner's own: the same address). Removed by the owner before it
  // frees the memory, and by the others then.
  void add_region(int owner, int64_t index, uintptr_t owner_base, uintptr_t local,
                  int64_t bytes);
  void remove_region(int owner, int64_t index);

  // A call that moves its data elsewhere (MPI's own collectives) first meets its peers
  // here, so that ranks that disagree fail alike instead of one waiting inside MPI.
  // send/recv: all_to_all's bytes to and from each peer (else empty).
  void agree(const std::vector<int64_t>& fields, const std::vector<int64_t>& send,
             const std::vector<int64_t>& recv, int64_t itemsize);

  // Seconds any wait of a call may take before it fails with TimeoutError (0: forever).
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds);

  // From any thread: a call waiting now (or begun later) on this rank fails within a nap
  // (Communicator.abort), poisoning the communicator so its peers fail too.
  void abort();

  // Bytes of this rank's data handed to peers so far: pushed into their channels, or
  // staged (published) and read by them, once per reader.
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  // Messages up to this size reduce with one barrier: every rank reduces the whole vector.
  static constexpr int64_t kSmallBytes = 4096;
  // The least streaming_from (see there).
  static constexpr int64_t kStreamingBytes = 8 << 20;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // The fast path's entries: PLAN, DIRECT and ONE_COPY (fast_path.h).
  void run(const FastEntry& entry, const FastCall& call) override;
  const Config& config() const { return config_; }

 private:
  struct Peer {
    char* base = nullptr;  // the peer's mapped segment
    Control* control = nullptr;
    Doorbell* bell = nullptr;
    Published* published = nullptr;
    Reason* reason = nullptr;
    Exposed* exposed = nullptr;
    int pid = 0;
  };
  struct Block {  // one rank's block of a direct collective
    char* in;     // where its input piece comes from (this rank's block only)
    char* out;    // where its result goes (nullptr: nowhere on this rank)
    int64_t count;
  };

  // layout
  size_t channel_offset(int to) const;
  ChannelTail* tail(int owner, int to) const;
  SlotHeader* slot(int owner, int to, uint64_t k) const;
  char* staging(int owner, uint64_t piece) const;

  // calls and waiting
  void begin(const Desc& desc);
  // Poisons the communicator with `kind` and `reason`, then throws the matching error.
  [[noreturn]] void fail(Poison kind, const std::string& reason);
  void check_signature(int peer);  // throws if `peer` is poisoned or in this call with another sig
  void check_peer(int peer, uint64_t call);  // ... or owes this rank data it will never send
  void check_deadline(const std::vector<int>& waited_for);
  std::string mismatch_reason() const;  // every rank's descriptor of this call, compared
  // all_to_all: publish this call's splits (before begin), then check the whole matrix
  // once every peer has published (after a barrier, or wait_all_begun()).
  void publish_splits(const std::vector<int64_t>& send, const std::vector<int64_t>& recv);
  void wait_all_begun();
  void check_splits(int64_t itemsize);
  int64_t* splits(int owner, uint64_t call) const;  // send[n], then recv[n]
  // all_to_all's bytes to or from each peer: `splits` (elements), or equal parts of `count`
  std::vector<int64_t> part_bytes(int64_t count, int64_t itemsize,
                                  const std::vector<int64_t>& splits) const;
  void notify(int peer);  // rings the peer's doorbell if it sleeps
  void notify_peers();     // notify() to every peer
  void ring(int peer);     // notify() without its fence
  // Waits until ready(): spin, then yield, then sleep on this rank's doorbell, checking
  // on each wake that every watched peer can still make it ready. Spinning only pays when
  // each rank has a core; yielding lets a peer on the same core run; sleeping stops a long
  // wait (a peer still computing) from burning a core.
  template <class Cond, class Watched>
  void wait(Cond ready, Watched watched) {
    const bool main = on_main_thread();
    const int64_t spin = main ? config_.spin : config_.background_spin;
    const int64_t yields = main ? config_.yields : config_.background_yields;
    for (int64_t i = 0; !ready(); ++i) {
      if (i < spin) {
        cpu_relax();
      } else if (i < spin + yields) {
        yield();
      } else {
        uint32_t seen = prepare_nap();
        if (!ready()) nap(seen);
        end_nap();
        if (aborted_.load(std::memory_order_acquire)) fail_aborted();
        waited_for_.clear();
        for (int r = 0; r < size_; ++r) {
          if (r == rank_ || !watched(r)) continue;
          uint64_t call = peers_[r].control->call.load(std::memory_order_acquire);
          if (ready()) return;
          check_peer(r, call);
          waited_for_.push_back(r);
        }
        check_deadline(waited_for_);
      }
    }
  }
  uint32_t prepare_nap();
  void nap(uint32_t seen);
  void end_nap();
  static void cpu_relax();
  static void yield();
  static bool on_main_thread();
  static auto only(int peer) { return [peer](int r) { return r == peer; }; }
  uint64_t arrive();  // this rank reached the next barrier; returns the barrier's number
  // Waits until every watched peer reached barrier `target`, and checks its signature.
  template <class Watched>
  void wait_arrivals(uint64_t target, Watched watched) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || !watched(r)) continue;
      Control* c = peers_[r].control;
      wait([&] { return c->arrived.load(std::memory_order_acquire) >= target; }, only(r));
      check_signature(r);
    }
  }
  void wait_staging_free(uint64_t piece);
  void release_piece(uint64_t piece);

  // direct collectives (shm_direct.cpp)
  void reduce_pieces(const std::vector<Block>& blocks, int dtype, int op, bool gather,
                     int gather_root);
  void gather_pieces(const std::vector<Block>& blocks, bool one_owner = false);
  void all_reduce_small(char* buf, int64_t count, int dtype, int op);

  // one-copy collectives (shm_one_copy.cpp)
  // The call run in place; false (before touching any data, the same on every rank) where
  // some rank's buffer would cost more to pin than to stage: the caller stages instead.
  bool read_in_place(int64_t collective, uintptr_t out, uintptr_t in, int64_t count, int dtype,
                     int op, int64_t root, const std::vector<int64_t>& in_splits,
                     const std::vector<int64_t>& out_splits, bool only_regions);
  // Publishes this call's buffers (after begin), and whether peers may read them where
  // they lie (say_in_place); every_rank_in_place() reads that back after a meet.
  // cheap_to_read: whether this rank's exposed `which`, of `bytes`, is (in a region, or,
  // unless `only_regions`, mostly on huge pages, or anywhere where `collective` reads base
  // pages in place).
  void expose(uintptr_t in, uintptr_t out);
  void say_in_place(bool cheap);
  bool cheap_to_read(int64_t collective, uint64_t Exposed::*which, int64_t bytes,
                     bool only_regions = false) const;
  bool in_place_at(int rank) const;
  bool every_rank_in_place() const;
  void meet();  // a barrier inside a call: every peer arrived, signatures checked
  // Where the peer's exposed buffer `which` (+ offset, nbytes) is mapped here, or null.
  const char* view(int peer, uint64_t Exposed::*which, int64_t offset, int64_t nbytes) const;
  // Copies from the peer's exposed buffer `which` (+ offset): from the mapping where it
  // lies in a region, else with process_vm_readv.
  void read_peer(int peer, char* dst, uint64_t Exposed::*which, int64_t offset,
                 int64_t nbytes);
  // process_vm_writev from `here` to the peer's `there` when writing, else _readv back
  void transfer(int peer, char* here, uint64_t there, int64_t nbytes, bool writing);
  // Copies into the peer's exposed output (+ offset): through the mapping where it lies in
  // a region, else with process_vm_writev.
  void write_peer(int peer, int64_t offset, const char* src, int64_t nbytes);
  // broadcast: where the root's share of `reader`'s buffer begins (nbytes: none)
  int64_t root_writes_from(int reader, int root, int64_t nbytes) const;
  void reduce_from_peers(char* out, const char* own, int64_t first, int64_t n, int dtype,
                         int op, uint64_t Exposed::*which);
  // all_to_all: where `owner`'s part for this rank starts in its input (its parts lie in
  // rank order), and that part read from there into `dst`
  int64_t part_offset(int owner) const;
  void read_part_in_place(int owner, char* dst, int64_t nbytes);
  bool one_copy_ok_ = false;
  std::atomic<uint32_t> base_pages_in_place_{0};  // (these three: set between calls)
  std::atomic<int64_t> parts_in_place_from_{-1};
  std::atomic<int64_t> streaming_from_{kStreamingBytes};
  uint64_t calls_read_in_place_ = 0;
  struct Region {
    int64_t index;
    uintptr_t owner_base, local;
    int64_t bytes;
  };
  std::vector<std::vector<Region>> regions_;  // by owner
  void reduce_sources(char* acc, const std::vector<const char*>& src, int64_t count,
                      int dtype, int op);

  int rank_, size_;
  Config config_;
  std::string name_;
  size_t bytes_ = 0;
  std::vector<Peer> peers_;  // index = rank; peers_[rank_] is this rank's own segment
  Control* me_ = nullptr;
  uint64_t call_ = 0, sig_ = 0;
  Desc desc_{};                       // this call's
  double timeout_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  std::vector<int> waited_for_;
  uint64_t pieces_ = 0;               // staging pieces used so far
  std::atomic<uint64_t> bytes_sent_{0};  // see bytes_sent(); read from any thread
  void count_sent(uint64_t n) { bytes_sent_.fetch_add(n, std::memory_order_relaxed); }
  std::vector<uint64_t> sent_, received_;  // slots per channel so far
  std::vector<char> tmp_;             // "tmp" buffer of schedules; one_copy's reduction slots
  std::vector<char> bounce_;          // read_peer's slot where the kernel's copy runs slow
  std::mutex mutex_;                  // one collective at a time
  bool owner_linked_ = false;
  std::atomic<bool> aborted_{false};  // see abort()
  [[noreturn]] void fail_aborted();
  Poison failure_kind_ = HEALTHY;
  std::string failure_;
};

}  // namespace commlib::shm
