// Runs a schedule (commlib/schedule.py) over the shared-memory channels.
//
// A plan is the schedule flattened by commlib/executors/shm.py into int64s, offsets in bytes:
//   plan   = call, splits, nrounds, round...
//   call   = collective, algorithm, count, root, variant: the descriptor's fields that the
//            plan fixes (dtype and op come with each run; agreement.h)
//   splits = 0, or n followed by the bytes sent to each peer, then received from each
//            (all_to_all, whose matrix every rank checks before any data moves)
//   round  = ncopies, nsends, nrecvs, copy..., send..., recv...
//   copy   = src_buf, src_offset, dst_buf, dst_offset, nbytes, deferrable (0/1)
//   send   = peer, buf, offset, nbytes
//   recv   = peer, dst_buf, dst_offset, src_buf, src_offset, nbytes, reduce (0/1)
// Buffers are numbered 0 = "out", 1 = "in", 2 = "tmp" (owned here).
//
// A round posts everything at once: the loop below moves whatever can move (a send while
// its channel has a free slot, a receive while its next slot is filled) and waits only
// when nothing can. Transfers to one peer keep their order, so the k-th send to a peer
// meets that peer's k-th receive, as under MPI. A receive reduces straight out of the
// slot: no scratch copy. A transfer whose size differs from what the receiver expects is
// drained (so the channel stays in step) and reported after the schedule, as the mpi4py
// executor does; a transfer from another collective poisons the communicator. A copy that
// no transfer of its round touches (the flattener marks it deferrable) runs when the loop
// would otherwise wait, so a rank's own block moves while its peers catch up.
#include <cstring>

#include "kernels.h"
#include "shm.h"

namespace commlib::shm {

namespace {

struct Send {
  int peer;
  char* src;
  uint64_t nbytes, done = 0;
};

struct Recv {
  int peer;
  char* dst;
  const char* src;  // reduce: dst = src op incoming; nullptr: plain copy
  uint64_t nbytes, done = 0;
  bool discard = false;  // the sender's transfer has another size: drain it, keep nothing
};

int64_t take(const int64_t*& p, const int64_t* end) {
  if (p >= end) throw std::invalid_argument("truncated plan");
  return *p++;
}

}  // namespace

void ShmComm::run_plan(const int64_t* plan, int64_t plan_len, const std::vector<uintptr_t>& bufs,
                       int64_t tmp_bytes, int dtype, int op) {
  const int64_t* p = plan;
  const int64_t* end = plan + plan_len;
  Desc desc{};
  for (int field : {COLLECTIVE, ALGORITHM, COUNT, ROOT, VARIANT}) desc.f[field] = take(p, end);
  desc.f[DTYPE] = dtype;
  desc.f[OP] = collective_info(desc.f[COLLECTIVE]).reduces ? op : kNone;
  int64_t nsplits = take(p, end);
  if (nsplits != 0 && (nsplits != size_ || end - p < 2 * nsplits))
    throw std::invalid_argument("bad splits in plan");
  const int64_t* split_table = p;
  p += 2 * nsplits;
  std::lock_guard<std::mutex> lock(mutex_);
  if (nsplits) {
    publish_splits({split_table, split_table + size_}, {split_table + size_, split_table + 2 * size_});
    begin(desc);
    wait_all_begun();
    check_splits(itemsize(dtype));
  } else {
    begin(desc);
  }
  if (int64_t(tmp_.size()) < tmp_bytes) tmp_.resize(tmp_bytes);
  char* base[3] = {reinterpret_cast<char*>(bufs.at(0)), reinterpret_cast<char*>(bufs.at(1)),
                   tmp_.data()};
  auto buf = [&](int64_t i) {
    if (i < 0 || i > 2) throw std::invalid_argument("bad buffer index in plan");
    return base[i];
  };
  const int64_t item_bytes = itemsize(dtype);
  const uint64_t slot_bytes = config_.slot_bytes;
  const uint64_t slots = config_.slots;
  std::vector<Send> sends;
  std::vector<Recv> recvs;
  std::vector<char> blocked(size_);
  std::vector<char> sent_to(size_);
  struct Copy {
    char* dst;
    const char* src;
    int64_t nbytes;
  };
  std::vector<Copy> deferred;
  std::string mismatch;

  int64_t rounds = take(p, end);
  for (int64_t round = 0; round < rounds; ++round) {
    int64_t ncopies = take(p, end), nsends = take(p, end), nrecvs = take(p, end);
    deferred.clear();
    for (int64_t i = 0; i < ncopies; ++i) {
      char* src = buf(take(p, end)) + take(p, end);
      char* dst = buf(take(p, end)) + take(p, end);
      int64_t nbytes = take(p, end);
      if (take(p, end))
        deferred.push_back({dst, src, nbytes});
      else
        copy(dst, src, nbytes);
    }
    sends.clear();
    recvs.clear();
    for (int64_t i = 0; i < nsends; ++i) {
      int peer = int(take(p, end));
      char* src = buf(take(p, end)) + take(p, end);
      sends.push_back({peer, src, uint64_t(take(p, end))});
    }
    for (int64_t i = 0; i < nrecvs; ++i) {
      int peer = int(take(p, end));
      char* dst = buf(take(p, end)) + take(p, end);
      int64_t src_buf = take(p, end), src_off = take(p, end), nbytes = take(p, end);
      bool reduce = take(p, end) != 0;
      recvs.push_back({peer, dst, reduce ? buf(src_buf) + src_off : nullptr, uint64_t(nbytes)});
    }
    for (auto& s : sends) {
      if (s.peer < 0 || s.peer >= size_ || s.peer == rank_) throw std::invalid_argument("bad peer");
      sent_to[s.peer] = 1;
    }
    for (auto& r : recvs)
      if (r.peer < 0 || r.peer >= size_ || r.peer == rank_) throw std::invalid_argument("bad peer");

    // A send can move while its channel has a free slot, a receive while its next slot is
    // filled; the pass below and the wait share these tests.
    auto slot_free = [&](int peer) {
      return sent_[peer] - tail(rank_, peer)->consumed.load(std::memory_order_acquire) < slots;
    };
    auto slot_filled = [&](int peer) {
      return slot(peer, rank_, received_[peer])->seq.load(std::memory_order_acquire) ==
             received_[peer] + 1;
    };
    const uint64_t streaming_from = uint64_t(std::max<int64_t>(streaming_from_, 0));
    // One pass: move what can move; true if anything did.
    auto pass = [&]() {
      bool moved = false;
      std::fill(blocked.begin(), blocked.end(), 0);
      for (auto& s : sends) {
        if (s.done == s.nbytes || blocked[s.peer]) continue;
        uint64_t& k = sent_[s.peer];
        while (s.done < s.nbytes && slot_free(s.peer)) {
          SlotHeader* h = slot(rank_, s.peer, k);
          uint64_t n = std::min(slot_bytes, s.nbytes - s.done);
          copy(reinterpret_cast<char*>(h + 1), s.src + s.done, n);
          h->sig = sig_;
          h->total = s.nbytes;
          h->offset = s.done;
          h->nbytes = n;
          h->seq.store(++k, std::memory_order_release);
          s.done += n;
          count_sent(n);
          moved = true;
          notify(s.peer);
        }
        if (s.done < s.nbytes) blocked[s.peer] = 1;
      }
      std::fill(blocked.begin(), blocked.end(), 0);
      for (auto& r : recvs) {
        if (r.done == r.nbytes || blocked[r.peer]) continue;
        uint64_t& k = received_[r.peer];
        while (r.done < r.nbytes && slot_filled(r.peer)) {
          SlotHeader* h = slot(r.peer, rank_, k);
          if (h->sig != sig_ || h->offset != r.done)
            fail(MISMATCHED, h->sig != sig_ ? mismatch_reason()
                                            : "rank " + std::to_string(r.peer) +
                                                  " sent data out of order: the ranks' "
                                                  "arguments disagree");
          if (h->total != r.nbytes && !r.discard) {
            if (mismatch.empty())
              mismatch = "rank " + std::to_string(r.peer) + " sent " + std::to_string(h->total) +
                         " bytes where this rank expects " + std::to_string(r.nbytes) +
                         ": the ranks disagree on counts or splits";
            r.discard = true;
            r.nbytes = h->total;
          }
          const char* data = reinterpret_cast<const char*>(h + 1);
          if (r.discard)
            ;
          else if (r.src)
            commlib::reduce(r.dst + r.done, r.src + r.done, data, int64_t(h->nbytes) / item_bytes,
                            dtype, op);
          else if (r.nbytes >= streaming_from)
            copy_streaming(r.dst + r.done, data, h->nbytes);
          else
            copy(r.dst + r.done, data, h->nbytes);
          r.done += h->nbytes;
          tail(r.peer, rank_)->consumed.store(++k, std::memory_order_release);
          notify(r.peer);
          moved = true;
        }
        if (r.done < r.nbytes) blocked[r.peer] = 1;
      }
      return moved;
    };
    while (true) {
      size_t left = 0;
      for (auto& s : sends) left += s.done < s.nbytes;
      for (auto& r : recvs) left += r.done < r.nbytes;
      if (left == 0) break;
      if (pass()) continue;
      if (!deferred.empty()) {  // nothing can move: do a deferred copy instead of waiting
        copy(deferred.back().dst, deferred.back().src, deferred.back().nbytes);
        deferred.pop_back();
        continue;
      }
      std::fill(blocked.begin(), blocked.end(), 0);  // now: peers this rank waits on
      for (auto& s : sends) if (s.done < s.nbytes) blocked[s.peer] = 1;
      for (auto& r : recvs) if (r.done < r.nbytes) blocked[r.peer] = 1;
      wait([&] {
        for (auto& s : sends)
          if (s.done < s.nbytes && slot_free(s.peer)) return true;
        for (auto& r : recvs)
          if (r.done < r.nbytes && slot_filled(r.peer)) return true;
        return false;
      }, [&](int peer) { return blocked[peer] != 0; });
    }
    for (auto& c : deferred) copy(c.dst, c.src, c.nbytes);
  }
  // A send completes once its data is in the channel, so a receiver that is in another
  // collective might never tell this rank. Make sure each receiver has begun this call
  // and agrees (it usually has: it is the one that drained the channel).
  for (int r = 0; r < size_; ++r) {
    if (!sent_to[r]) continue;
    Control* c = peers_[r].control;
    wait([&] { return c->call.load(std::memory_order_acquire) >= call_; }, only(r));
    check_signature(r);
  }
  if (!mismatch.empty()) throw MismatchError(mismatch);
}

}  // namespace commlib::shm
