// One-copy collectives: every rank exposes the addresses of its buffers, and after a
// barrier reads what it needs from the peers' buffers where they lie: through the shared
// mapping where a buffer lies in a region (Communicator.empty: zero copies, reductions
// read the peers' data in place), else with process_vm_readv (the kernel copies straight
// from one process's pages into the other's). One copy per byte where the direct
// collectives (shm_direct.cpp) make two (into staging, out of it), at the price of a
// system call and the kernel pinning the pages: cheap on huge pages, dear on 4 KiB ones,
// so which wins depends on the machine and the memory, and self-tuning measures both.
//
//   meet            a barrier inside a call: arrive, wait for every peer, check its
//                   signature. Every collective ends with one, so no rank leaves (and
//                   changes its buffers) while a peer may still read them.
//   all_gather      read block j from rank j's input into the output.
//   broadcast       the others read the root's buffer, all but its last n-th share,
//                   which the root writes into each of theirs meanwhile: n ranks copy
//                   where n-1 did (2 ranks, 64 MiB on huge pages: 13.4 ms read by one,
//                   6.9 shared; 4 MiB 426 us, 233), each (n-1)/n of the bytes.
//   all_to_all      read rank j's part for this rank (its offset: the sum of the parts j
//                   sends to lower ranks, from the published splits).
//   reduce_scatter  read block r of every peer's input a chunk at a time, and reduce them
//                   into the own block (own first: the output may be that block).
//   all_reduce      as reduce_scatter, each rank's block (chunks(count, n)) reduced into
//                   its own buffer; meet; then read the other reduced blocks from their
//                   owners (three meetings).
//
//   in place        whether a rank's buffer that peers read is cheap to read where it
//                   lies: in a region, or at most a quarter of its bytes on base pages
//                   (the kernel pins every page it reads, and on some machines pinning
//                   4 KiB pages costs more than staging their bytes; on others it does
//                   not, and where the tuning pass measured that for a collective, its
//                   buffers are read in place wherever they lie: base_pages_in_place).
//                   Each rank says so for its own buffer in the first meeting; where any
//                   says no, every rank sees it alike and the call runs as direct's
//                   instead (a meeting dearer than direct). A call `only_regions` (auto's
//                   route for memory every rank maps, where 4 KiB or huge pages would be
//                   staged better by another algorithm) reads in place only in regions.
//
// Nothing is staged, so there are no pieces: one read per peer and block. probe_one_copy
// reads a nonce from every peer at set-up and writes it back; where the host forbids the
// system calls (a container's seccomp profile, Yama's ptrace_scope) or the ranks cannot
// see each other's pids, it says why and these collectives are not offered.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <mutex>

#include "kernels.h"
#include "shm.h"

namespace commlib::shm {

namespace {

constexpr int64_t kOneCopy = pack_name("one_copy");
constexpr size_t kPage = 4096;
constexpr int64_t kBounceFrom = 2048;  // bytes from which read_peer steps around rep movsb

// Bytes read from each peer per step of a reduction: the ranks' chunks stay in half a
// core's L2 (as the C library reports it), and at least 64 KiB. Fewer, larger reads cost
// fewer system calls: on a 2-core AMD EPYC (1 MiB L2) 256 KiB steps ran a 4 MiB all_reduce
// of 2 ranks on huge pages at 30 GB/s busbw, where 64 KiB ones ran it at 24.
int64_t chunk_bytes(int ranks) {
  static const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return std::max<int64_t>(64 << 10, l2 > 0 ? l2 / 2 / ranks / 4096 * 4096 : 0);
}

Desc descriptor(Collective collective, int64_t count, int dtype, int64_t op, int64_t root) {
  return {{collective, kOneCopy, count, dtype, op, root, 0, 0}};
}

// (offset, count) of block i when `count` is cut into `parts` as schedule.py's chunks()
std::pair<int64_t, int64_t> block(int64_t count, int parts, int i) {
  int64_t base = count / parts, extra = count % parts;
  return {i * base + std::min<int64_t>(i, extra), base + (i < extra ? 1 : 0)};
}

// PAGEMAP_SCAN (Linux 6.7): an ioctl of /proc/self/pagemap that lists a range's pages by
// category. Older headers lack it; these are linux/fs.h's definitions.
struct PageRegion {
  uint64_t start, end, categories;
};
struct PmScanArg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted,
      category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);
constexpr uint64_t kPageIsHuge = 1 << 6;

std::string forbidden_hint(int error, const std::string& call) {
  if (error == EPERM || error == EACCES)
    return " (this host forbids reading or writing another process's memory: a "
           "container's seccomp profile, or /proc/sys/kernel/yama/ptrace_scope above 0)";
  if (error == ENOSYS) return " (the kernel lacks " + call + ")";
  return "";
}

// Slot `j` of `chunk` bytes in `buffer` (grown as needed), at `from`'s offset in a page:
// the kernel copies into it from `from` with rep movsb, which must not meet
// rep_movsb_aliases (slots at fixed places in a heap block met it for every page-aligned
// buffer, or missed it, by where the block fell in a launch: a 4 MiB reduce_scatter of 4
// ranks on a 2-core AMD EPYC, 12.7-13.8 ms against 7.0-7.5 with the buffers 16 bytes on).
char* slot_at_offset_of(std::vector<char>& buffer, int j, int64_t chunk, uint64_t from) {
  const size_t stride = size_t(chunk) + kPage, need = stride * (j + 1) + kPage;
  if (buffer.size() < need) buffer.resize(need);
  char* slots = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) & (kPage - 1));
  return slots + j * stride + (from & (kPage - 1));
}

}  // namespace

// (shm.h) A buffer of base pages shows it in its middle page, looked at first; the walk
// over the rest (cheap on huge pages: one entry each) stops at a quarter.
bool mostly_huge(uintptr_t addr, int64_t nbytes) {
  static std::mutex mutex;  // (communicators on several threads share the file)
  static int fd = -1, opened_by = -1;  // reopened after a fork: /proc/self was the parent
  std::lock_guard<std::mutex> lock(mutex);
  if (opened_by != getpid()) {
    if (fd >= 0) close(fd);
    fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC), opened_by = getpid();
  }
  if (fd < 0) return true;
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE)), end = addr + nbytes;
  const int64_t allowed = nbytes / 4;
  PageRegion runs[16];
  // bytes of [from, to) on base pages, up to about `most` (-1: the kernel cannot tell)
  auto base_bytes = [&](uint64_t from, uint64_t to, int64_t most) -> int64_t {
    int64_t found = 0;
    for (uint64_t at = from & ~(page - 1); at < to && found <= most;) {  // 16 runs a time
      PmScanArg arg{sizeof(PmScanArg), 0, at, (to + page - 1) & ~(page - 1), 0,
                    reinterpret_cast<uint64_t>(runs), 16, uint64_t(most) / page + 1,
                    kPageIsHuge, kPageIsHuge, 0, kPageIsHuge};
      int n = ioctl(fd, kPagemapScan, &arg);
      if (n < 0) return -1;
      for (int i = 0; i < n; ++i)
        found += std::min(runs[i].end, to) - std::max<uint64_t>(runs[i].start, from);
      if (arg.walk_end <= at) break;
      at = arg.walk_end;
    }
    return found;
  };
  const uint64_t middle = addr + nbytes / 2;
  if (int64_t found = base_bytes(middle, middle + 1, 0)) return found < 0;
  int64_t found = base_bytes(addr, end, allowed);
  return found < 0 || found <= allowed;
}

std::string ShmComm::probe_one_copy() {
  one_copy_ok_ = false;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Exposed* seen = peers_[r].exposed;  // through the shared mapping
    uint64_t got = 0;
    iovec local{&got, sizeof(got)};
    iovec remote{reinterpret_cast<void*>(seen->self + offsetof(Exposed, nonce)), sizeof(got)};
    ssize_t n = process_vm_readv(peers_[r].pid, &local, 1, &remote, 1, 0);
    std::string who = "rank " + std::to_string(r) + " (pid " + std::to_string(peers_[r].pid) + ")";
    if (n != ssize_t(sizeof(got)))
      return "process_vm_readv from " + who + ": " + std::strerror(errno) +
             forbidden_hint(errno, "process_vm_readv");
    if (got != seen->nonce)
      return "process_vm_readv from " + who + " read another process (the ranks do not share "
             "a pid namespace)";
    // (broadcast's root writes into the readers: the nonce written back where it lies)
    n = process_vm_writev(peers_[r].pid, &local, 1, &remote, 1, 0);
    if (n != ssize_t(sizeof(got)))
      return "process_vm_writev to " + who + ": " + std::strerror(errno) +
             forbidden_hint(errno, "process_vm_writev");
  }
  one_copy_ok_ = true;
  return "";
}

void ShmComm::add_region(int owner, int64_t index, uintptr_t owner_base, uintptr_t local,
                         int64_t bytes) {
  if (owner < 0 || owner >= size_ || bytes < 0) throw std::invalid_argument("bad region");
  std::lock_guard<std::mutex> lock(mutex_);
  regions_[owner].push_back({index, owner_base, local, bytes});
}

void ShmComm::remove_region(int owner, int64_t index) {
  if (owner < 0 || owner >= size_) throw std::invalid_argument("bad region owner");
  std::lock_guard<std::mutex> lock(mutex_);
  auto& list = regions_[owner];
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const Region& r) { return r.index == index; }),
             list.end());
}

void ShmComm::expose(uintptr_t in, uintptr_t out) {
  auto region_of = [&](uintptr_t p) -> int64_t {
    for (const Region& r : regions_[rank_])
      if (p >= r.owner_base && p < r.owner_base + r.bytes) return r.index;
    return -1;
  };
  Exposed* mine = peers_[rank_].exposed;  // published by the next arrive()'s release
  mine->in = in, mine->out = out;
  mine->in_region = region_of(in), mine->out_region = region_of(out);
}

void ShmComm::say_in_place(bool cheap) {
  peers_[rank_].exposed->in_place[call_ % 2] = 2 * call_ + cheap;
}

bool ShmComm::cheap_to_read(int64_t collective, uint64_t Exposed::*which, int64_t bytes,
                            bool only_regions) const {
  const Exposed* mine = peers_[rank_].exposed;
  if ((which == &Exposed::in ? mine->in_region : mine->out_region) >= 0 || bytes <= 0)
    return true;
  return !only_regions &&
         ((base_pages_in_place_ >> collective & 1) || mostly_huge(mine->*which, bytes));
}

bool ShmComm::in_place_at(int rank) const {
  return peers_[rank].exposed->in_place[call_ % 2] == 2 * call_ + 1;
}

bool ShmComm::every_rank_in_place() const {
  for (int r = 0; r < size_; ++r)
    if (!in_place_at(r)) return false;
  return true;
}

int64_t ShmComm::part_offset(int owner) const {
  int64_t from = 0;
  for (int i = 0; i < rank_; ++i) from += splits(owner, call_)[i];
  return from;
}

void ShmComm::read_part_in_place(int owner, char* dst, int64_t nbytes) {
  read_peer(owner, dst, &Exposed::in, part_offset(owner), nbytes);
}

void ShmComm::meet() { wait_arrivals(arrive(), [](int) { return true; }); }

const char* ShmComm::view(int peer, uint64_t Exposed::*which, int64_t offset,
                          int64_t nbytes) const {
  const Exposed* e = peers_[peer].exposed;
  int64_t index = which == &Exposed::in ? e->in_region : e->out_region;
  if (index < 0) return nullptr;
  uint64_t at = e->*which + offset;
  for (const Region& r : regions_[peer])
    if (r.index == index && at >= r.owner_base && at + nbytes <= r.owner_base + r.bytes)
      return reinterpret_cast<const char*>(r.local + (at - r.owner_base));
  return nullptr;  // a region this rank has not mapped (yet): read it the other way
}

void ShmComm::read_peer(int peer, char* dst, uint64_t Exposed::*which, int64_t offset,
                        int64_t nbytes) {
  if (nbytes <= 0) return;
  if (const char* mapped = view(peer, which, offset, nbytes)) {
    copy_received(nbytes)(dst, mapped, nbytes);
    return;
  }
  uint64_t src = peers_[peer].exposed->*which + offset;
  if (nbytes < kBounceFrom || !rep_movsb_aliases(dst, reinterpret_cast<const void*>(src)))
    return transfer(peer, dst, src, nbytes, false);
  // Where the kernel's copy would run several times slower (a 1 MiB all_gather of 2 ranks
  // into an output 16 bytes past the input modulo 4 KiB: 862 us, 254 otherwise), a chunk
  // at a time into a slot, and from there with commlib::copy, which steps around it
  const int64_t chunk = chunk_bytes(size_);
  for (int64_t done = 0; done < nbytes; done += chunk) {
    int64_t m = std::min(chunk, nbytes - done);
    char* slot = slot_at_offset_of(bounce_, 0, chunk, src + done);
    transfer(peer, slot, src + done, m, false);
    copy(dst + done, slot, m);
  }
}

// Copies between `here` and the peer's address `there` with the kernel's single copy:
// process_vm_writev when `writing`, else process_vm_readv
void ShmComm::transfer(int peer, char* here, uint64_t there, int64_t nbytes, bool writing) {
  auto call = writing ? process_vm_writev : process_vm_readv;
  while (nbytes > 0) {
    iovec local{here, size_t(nbytes)}, remote{reinterpret_cast<void*>(there), size_t(nbytes)};
    ssize_t done = call(peers_[peer].pid, &local, 1, &remote, 1, 0);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0)
      fail(FAILED, "rank " + std::to_string(rank_) + " could not " +
                       (writing ? "write" : "read") + " rank " + std::to_string(peer) +
                       "'s buffer in " + describe(desc_) + ": " +
                       (writing ? "process_vm_writev: " : "process_vm_readv: ") +
                       std::strerror(done < 0 ? errno : EFAULT));
    here += done, there += done, nbytes -= done;
  }
}

void ShmComm::write_peer(int peer, int64_t offset, const char* src, int64_t nbytes) {
  if (nbytes <= 0) return;
  if (const char* mapped = view(peer, &Exposed::out, offset, nbytes)) {
    copy(const_cast<char*>(mapped), src, nbytes);  // (the peer's output: this call's to write)
    return;
  }
  transfer(peer, const_cast<char*>(src), peers_[peer].exposed->out + offset, nbytes, true);
}

int64_t ShmComm::root_writes_from(int reader, int root, int64_t nbytes) const {
  // a whole number of pages, so that no page is pinned by both; none where the reader's
  // memory is dear to pin, or where the kernel's copy would meet its slow gap (read_peer
  // steps around that on the reader's side; the root has no slot in the reader's memory)
  const int64_t share = nbytes / size_ / int64_t(kPage) * int64_t(kPage), from = nbytes - share;
  const Exposed *to = peers_[reader].exposed, *of = peers_[root].exposed;
  const bool slow = rep_movsb_aliases(reinterpret_cast<const void*>(to->out + from),
                                      reinterpret_cast<const void*>(of->out + from));
  return share > 0 && to->root_may_write && !slow ? from : nbytes;
}

// Elements [first, first + n) of every rank's buffer, reduced into `out` in rank order (as
// direct and eager reduce: the same bits): this rank's from `own`, the peers' read at their
// exposed address `which` (in or out), a chunk at a time, each into a slot at its offset in
// a page. Where `out` is `own` and this rank comes third or later, own is set aside first,
// as the fold overwrites it before.
void ShmComm::reduce_from_peers(char* out, const char* own, int64_t first, int64_t n,
                                int dtype, int op, uint64_t Exposed::*which) {
  const int64_t isz = itemsize(dtype), chunk = chunk_bytes(size_), step = chunk / isz;
  slot_at_offset_of(tmp_, size_ - 1, chunk, 0);  // (grown once, for every slot)
  std::vector<const char*> src(size_);
  for (int64_t c = 0; c < n; c += step) {
    int64_t m = std::min(step, n - c), at = (first + c) * isz;
    for (int j = 0; j < size_; ++j) {
      char* slot = slot_at_offset_of(tmp_, j, chunk,
                                     j == rank_ ? reinterpret_cast<uintptr_t>(own + c * isz)
                                                : peers_[j].exposed->*which + at);
      if (j == rank_) {
        bool overwritten = out == own && rank_ >= 2;
        if (overwritten) std::memcpy(slot, own + c * isz, m * isz);
        src[j] = overwritten ? slot : own + c * isz;
        continue;
      }
      const char* mapped = view(j, which, at, m * isz);  // reduced where it lies
      if (!mapped) read_peer(j, slot, which, at, m * isz);
      src[j] = mapped ? mapped : slot;
    }
    reduce_sources(out + c * isz, src, m, dtype, op);
  }
  count_sent(uint64_t(n * isz) * (size_ - 1));  // the peers read as much of this rank's
}

void ShmComm::one_copy(int64_t collective, uintptr_t out, uintptr_t in, int64_t count,
                       int dtype, int op, int64_t root, const std::vector<int64_t>& in_splits,
                       const std::vector<int64_t>& out_splits, const int64_t* otherwise,
                       int64_t otherwise_len, int64_t tmp_bytes, bool only_regions) {
  if (!one_copy_ok_)
    throw std::invalid_argument("one-copy collectives are unavailable here (probe_one_copy)");
  if (read_in_place(collective, out, in, count, dtype, op, root, in_splits, out_splits,
                    only_regions))
    return;
  // (read_in_place's meeting checked that every rank made this call: a rooted schedule
  // needs no agreement of its own)
  if (otherwise_len > 0)
    run_plan(otherwise, otherwise_len, {out, in}, tmp_bytes, dtype, op);
  else
    direct(collective, out, in, count, dtype, op, root, in_splits, out_splits);
}

void ShmComm::all_reduce_phase_in_place(uintptr_t buf, int64_t count, int dtype, int op,
                                        int phase) {
  if (!one_copy_ok_)
    throw std::invalid_argument("one-copy collectives are unavailable here (probe_one_copy)");
  if (phase != 1 && phase != 2) throw std::invalid_argument("phase must be 1 or 2");
  const int64_t isz = itemsize(dtype);
  char* base = reinterpret_cast<char*>(buf);
  std::lock_guard<std::mutex> lock(mutex_);
  begin({{ALL_REDUCE, kOneCopy, count, dtype, op, kNone, phase, 0}});
  if (size_ == 1 || count == 0) return;
  auto [mine, n] = block(count, size_, rank_);
  if (phase == 1) {
    // No meeting at the end: until phase 2's first, each rank writes only its own block,
    // which no peer reads before then.
    expose(buf, buf);
    meet();
    reduce_from_peers(base + mine * isz, base + mine * isz, mine, n, dtype, op,
                      &Exposed::out);
    return;
  }
  meet();  // every block reduced by its owner and through the stage between
  for (int j = 0; j < size_; ++j) {
    auto [first, m] = block(count, size_, j);
    if (j != rank_) read_peer(j, base + first * isz, &Exposed::out, first * isz, m * isz);
  }
  count_sent(uint64_t(n * isz) * (size_ - 1));
  meet();  // no rank leaves (and changes its buffer) while a peer reads it
}

bool ShmComm::read_in_place(int64_t collective, uintptr_t out, uintptr_t in, int64_t count,
                            int dtype, int op, int64_t root,
                            const std::vector<int64_t>& in_splits,
                            const std::vector<int64_t>& out_splits, bool only_regions) {
  const int64_t isz = itemsize(dtype), nbytes = count * isz;
  char* output = reinterpret_cast<char*>(out);
  const char* input = reinterpret_cast<const char*>(in);
  std::lock_guard<std::mutex> lock(mutex_);
  switch (collective) {
    case ALL_REDUCE:
      begin(descriptor(ALL_REDUCE, count, dtype, op, kNone));
      if (size_ == 1 || count == 0) return true;
      expose(out, out);
      say_in_place(cheap_to_read(ALL_REDUCE, &Exposed::out, nbytes, only_regions));
      meet();
      if (!every_rank_in_place()) return false;
      {
        auto [mine, n] = block(count, size_, rank_);
        reduce_from_peers(output + mine * isz, output + mine * isz, mine, n, dtype, op,
                          &Exposed::out);
        meet();  // every block reduced by its owner: gather them
        count_sent(uint64_t(n * isz) * (size_ - 1));
      }
      for (int j = 0; j < size_; ++j) {
        auto [first, n] = block(count, size_, j);
        if (j != rank_)
          read_peer(j, output + first * isz, &Exposed::out, first * isz, n * isz);
      }
      break;
    case REDUCE_SCATTER:
      begin(descriptor(REDUCE_SCATTER, count, dtype, op, kNone));
      if (size_ == 1) {
        copy(output, input, nbytes);
        return true;
      }
      if (count == 0) return true;
      expose(in, out);
      say_in_place(
          cheap_to_read(REDUCE_SCATTER, &Exposed::in, nbytes * size_, only_regions));
      meet();
      if (!every_rank_in_place()) return false;
      reduce_from_peers(output, input + rank_ * nbytes, rank_ * count, count, dtype, op,
                        &Exposed::in);
      break;
    case ALL_GATHER:
      begin(descriptor(ALL_GATHER, count, dtype, kNone, kNone));
      expose(in, out);
      say_in_place(cheap_to_read(ALL_GATHER, &Exposed::in, nbytes, only_regions));
      meet();
      if (!every_rank_in_place()) return false;
      if (output + rank_ * nbytes != input) copy(output + rank_ * nbytes, input, nbytes);
      for (int j = 0; j < size_; ++j)
        if (j != rank_) read_peer(j, output + j * nbytes, &Exposed::in, 0, nbytes);
      count_sent(uint64_t(nbytes) * (size_ - 1));
      break;
    case BROADCAST:
      begin(descriptor(BROADCAST, count, dtype, kNone, root));
      if (size_ == 1) return true;
      expose(out, out);
      peers_[rank_].exposed->root_may_write =
          rank_ != root && cheap_to_read(BROADCAST, &Exposed::out, nbytes, only_regions);
      say_in_place(
          cheap_to_read(BROADCAST, &Exposed::out, rank_ == root ? nbytes : 0, only_regions));
      meet();
      if (!every_rank_in_place()) return false;
      if (rank_ != root) {
        read_peer(int(root), output, &Exposed::out, 0, root_writes_from(rank_, int(root), nbytes));
        break;
      }
      for (int j = 0; j < size_; ++j) {
        const int64_t from = j == rank_ ? nbytes : root_writes_from(j, rank_, nbytes);
        write_peer(j, from, output + from, nbytes - from);
      }
      count_sent(uint64_t(nbytes) * (size_ - 1));
      break;
    case ALL_TO_ALL: {
      auto send = part_bytes(count, isz, in_splits), recv = part_bytes(count, isz, out_splits);
      publish_splits(send, recv);
      begin(descriptor(ALL_TO_ALL, kNone, dtype, kNone, kNone));
      int64_t sent = 0;
      for (int64_t b : send) sent += b;
      expose(in, out);
      say_in_place(cheap_to_read(ALL_TO_ALL, &Exposed::in, sent, only_regions));
      meet();
      check_splits(isz);
      if (!every_rank_in_place()) return false;
      int64_t at = 0;
      for (int j = 0; j < size_; ++j) {
        if (j == rank_) {
          copy(output + at, input + part_offset(j), recv[j]);
        } else {
          read_part_in_place(j, output + at, recv[j]);
          count_sent(send[j]);
        }
        at += recv[j];
      }
      break;
    }
    default:
      throw std::invalid_argument("no one-copy collective for code " +
                                  std::to_string(collective));
  }
  meet();  // no rank leaves while a peer may still read its buffers
  ++calls_read_in_place_;
  return true;
}

}  // namespace commlib::shm
