// Direct collectives: every rank copies a piece of its input into its staging half, and
// after a barrier reads what it needs straight from the peers' staging. One copy in and
// one read per byte, two barriers per piece, no chain of n-1 steps.
//
//   reduce_pieces   rank r stages its piece of every block; after the barrier it reduces
//                   block r from all n stagings (in order 0..n-1, so every rank's result
//                   is bitwise the same) into its output and, to be gathered, back into its
//                   own staging slot r; after a second barrier it copies the other reduced
//                   blocks out of the peers' slots. (all_reduce, reduce, reduce_scatter)
//   gather_pieces   rank r stages its own block; after the barrier it copies the blocks it
//                   wants from the peers' stagings. (all_gather, broadcast)
//   all_to_all      rank r stages piece k of its part for peer j in slot j of its
//                   staging; after the barrier rank j copies it out. A rank whose parts
//                   take several pieces (or are as large as the tuning pass measured
//                   reading in place to pay from: parts_in_place_from) and whose input
//                   lies mostly on huge pages (or anywhere: base_pages_in_place) stages
//                   nothing and says so at the first barrier: its peers read its parts
//                   where they lie with process_vm_readv instead, one copy instead of two,
//                   as one_copy reads (shm_one_copy.cpp; the kernel pins each page it
//                   reads, cheap for huge pages, dearer than staging for 4 KiB ones), and
//                   the call ends with a meeting so that it stays until they have.
#include <algorithm>
#include <cstring>

#include "kernels.h"
#include "shm.h"

namespace commlib::shm {

namespace {

int64_t piece_len(int64_t count, int64_t piece, int64_t per_piece) {
  return std::clamp<int64_t>(count - piece * per_piece, 0, per_piece);
}

constexpr int64_t kAccBytes = 8192;  // reductions go through an L1-sized accumulator

constexpr int64_t kDirect = pack_name("direct");

Desc descriptor(Collective collective, int64_t count, int dtype, int64_t op, int64_t root,
            int64_t variant = 0) {
  return {{collective, kDirect, count, dtype, op, root, variant, 0}};
}

}  // namespace

void ShmComm::reduce_sources(char* acc, const std::vector<const char*>& src, int64_t count,
                             int dtype, int op) {
  if (src.size() == 1) {
    copy(acc, src[0], count * itemsize(dtype));
    return;
  }
  commlib::reduce(acc, src[0], src[1], count, dtype, op);
  for (size_t j = 2; j < src.size(); ++j) commlib::reduce(acc, acc, src[j], count, dtype, op);
}

void ShmComm::reduce_pieces(const std::vector<Block>& blocks, int dtype, int op, bool gather,
                            int gather_root) {
  const int64_t isz = itemsize(dtype);
  const int64_t per_piece = (config_.staging_bytes / 2 / size_) / kLine * kLine / isz;
  int64_t longest = 0;
  for (auto& b : blocks) longest = std::max(longest, b.count);
  const int64_t npieces = (longest + per_piece - 1) / per_piece;
  const int64_t acc_count = kAccBytes / isz;
  alignas(kLine) char acc[kAccBytes];
  std::vector<const char*> src(size_);
  const bool reads_gathered = gather_root < 0 || gather_root == rank_;

  for (int64_t k = 0; k < npieces; ++k) {
    uint64_t g = pieces_++;
    wait_staging_free(g);
    char* mine = staging(rank_, g);
    for (int j = 0; j < size_; ++j) {
      int64_t n = piece_len(blocks[j].count, k, per_piece) * isz;
      copy(mine + j * per_piece * isz, blocks[j].in + k * per_piece * isz, n);
      if (j != rank_) count_sent(n);  // rank j reduces its block from every staging
    }
    wait_arrivals(arrive(), [](int) { return true; });

    const Block& me = blocks[rank_];
    for (int j = 0; j < size_; ++j) src[j] = staging(j, g) + rank_ * per_piece * isz;
    int64_t len = piece_len(me.count, k, per_piece);
    for (int64_t c = 0; c < len; c += acc_count) {
      int64_t m = std::min(acc_count, len - c);
      for (int j = 0; j < size_; ++j) src[j] = staging(j, g) + (rank_ * per_piece + c) * isz;
      reduce_sources(acc, src, m, dtype, op);
      if (gather) copy(mine + (rank_ * per_piece + c) * isz, acc, m * isz);
      if (me.out) copy(me.out + (k * per_piece + c) * isz, acc, m * isz);
    }
    if (gather) {  // the reduced block is read by every rank, or by the root only
      int readers = gather_root < 0 ? size_ - 1 : (gather_root == rank_ ? 0 : 1);
      count_sent(uint64_t(len * isz) * readers);
      uint64_t target = arrive();
      if (reads_gathered) {
        wait_arrivals(target, [](int) { return true; });
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && blocks[j].out)
            copy(blocks[j].out + k * per_piece * isz, staging(j, g) + j * per_piece * isz,
                        piece_len(blocks[j].count, k, per_piece) * isz);
      }
    }
    release_piece(g);
  }
}

// Blocks in bytes here. A rank stages its own block; it reads block j when blocks[j].out.
void ShmComm::gather_pieces(const std::vector<Block>& blocks, bool one_owner) {
  int64_t longest = 0;
  for (auto& b : blocks) longest = std::max(longest, b.count);
  // Where one rank stages and the others only copy out (broadcast), they copy piece k
  // while it stages k + 1: pieces of an eighth of the block (64 KiB at least) leave a
  // ninth of one copy's time unoverlapped, where half the staging each left up to half
  // (2 ranks, 1 MiB: 34 us against 41). Where every rank stages its own block, each
  // stages then copies anyway; and where the ranks outnumber the cores (no spinning),
  // a meeting costs more than the overlap saves (3 ranks on 2 cores, 1 MiB: 78 us
  // against 61). There, fewer pieces.
  const int64_t most = config_.staging_bytes / 2 / kLine * kLine;
  const int64_t per_piece =
      one_owner && config_.spin > 0
          ? std::clamp<int64_t>((longest / 8 + kLine - 1) / kLine * kLine, 64 << 10, most)
          : most;
  const int64_t npieces = (longest + per_piece - 1) / per_piece;
  auto reads = [&](int j) { return j != rank_ && blocks[j].out && blocks[j].count > 0; };
  const Block& me = blocks[rank_];
  const CopyFn copy_out = copy_received(longest);
  const bool keep_own = me.out && me.out != me.in;  // own block copied, not read from a peer

  for (int64_t k = 0; k < npieces; ++k) {
    uint64_t g = pieces_++;
    int64_t len = piece_len(me.count, k, per_piece);
    if (len > 0) {
      wait_staging_free(g);
      copy(staging(rank_, g), me.in + k * per_piece, len);
      count_sent(uint64_t(len) * (size_ - 1));  // every other rank reads this block
    }
    uint64_t barrier = arrive();
    // The own block's copy comes from the staging just written (still in cache) and fills
    // the time the peers take to arrive.
    if (keep_own && len > 0) copy_out(me.out + k * per_piece, staging(rank_, g), len);
    // Wait for everyone, not just the ranks read from: a root that reads nothing still
    // learns here whether the others called the same broadcast.
    wait_arrivals(barrier, [](int) { return true; });
    for (int j = 0; j < size_; ++j)
      if (reads(j))
        copy_out(blocks[j].out + k * per_piece, staging(j, g),
                 piece_len(blocks[j].count, k, per_piece));
    release_piece(g);
  }
}

// ---------------------------------------------------------------------------------------
// The collectives. Blocks of all_reduce/reduce are chunks(count, n) as in schedule.py.

namespace {
std::vector<std::pair<int64_t, int64_t>> chunks(int64_t count, int parts) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t base = count / parts, extra = count % parts, off = 0;
  for (int i = 0; i < parts; ++i) {
    int64_t n = base + (i < extra ? 1 : 0);
    out.push_back({off, n});
    off += n;
  }
  return out;
}
}  // namespace

// Small vectors: one barrier instead of two. Every rank reduces the whole vector from all
// stagings in the same order, so the results are bitwise equal everywhere.
void ShmComm::all_reduce_small(char* buf, int64_t count, int dtype, int op) {
  const int64_t nbytes = count * itemsize(dtype);
  uint64_t g = pieces_++;
  wait_staging_free(g);
  copy(staging(rank_, g), buf, nbytes);
  count_sent(uint64_t(nbytes) * (size_ - 1));
  wait_arrivals(arrive(), [](int) { return true; });
  std::vector<const char*> src(size_);
  for (int j = 0; j < size_; ++j) src[j] = staging(j, g);
  reduce_sources(buf, src, count, dtype, op);
  release_piece(g);
}

void ShmComm::all_reduce(uintptr_t buf, int64_t count, int dtype, int op, int phases) {
  if (phases < 1 || phases > 3) throw std::invalid_argument("phases must be 1, 2 or 3");
  const int64_t isz = itemsize(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  begin(descriptor(ALL_REDUCE, count, dtype, op, kNone, phases == 3 ? 0 : phases));
  if (size_ == 1 || count == 0) return;
  char* base = reinterpret_cast<char*>(buf);
  if (phases == 3 && count * isz <= std::min(kSmallBytes, config_.staging_bytes / 2))
    return all_reduce_small(base, count, dtype, op);
  std::vector<Block> blocks;
  for (auto [off, n] : chunks(count, size_)) blocks.push_back({base + off * isz, base + off * isz, n});
  if (phases == 2) {  // gather the blocks, in bytes
    for (int j = 0; j < size_; ++j) {
      blocks[j].count *= isz;
      if (j == rank_) blocks[j].out = nullptr;
    }
    gather_pieces(blocks);
    return;
  }
  if (phases == 1)
    for (int j = 0; j < size_; ++j)
      if (j != rank_) blocks[j].out = nullptr;
  reduce_pieces(blocks, dtype, op, phases == 3, -1);
}

void ShmComm::reduce(uintptr_t buf, int64_t count, int dtype, int op, int root) {
  const int64_t isz = itemsize(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  begin(descriptor(REDUCE, count, dtype, op, root));
  if (size_ == 1 || count == 0) return;
  char* base = reinterpret_cast<char*>(buf);
  std::vector<Block> blocks;
  for (auto [off, n] : chunks(count, size_))
    blocks.push_back({base + off * isz, rank_ == root ? base + off * isz : nullptr, n});
  reduce_pieces(blocks, dtype, op, true, root);
}

void ShmComm::reduce_scatter(uintptr_t out, uintptr_t in, int64_t count, int dtype, int op) {
  const int64_t isz = itemsize(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  begin(descriptor(REDUCE_SCATTER, count, dtype, op, kNone));
  char* input = reinterpret_cast<char*>(in);
  char* output = reinterpret_cast<char*>(out);
  if (size_ == 1) {
    copy(output, input, count * isz);
    return;
  }
  if (count == 0) return;
  std::vector<Block> blocks;
  for (int j = 0; j < size_; ++j)
    blocks.push_back({input + j * count * isz, j == rank_ ? output : nullptr, count});
  reduce_pieces(blocks, dtype, op, false, -1);
}

void ShmComm::all_gather(uintptr_t out, uintptr_t in, int64_t count, int dtype) {
  const int64_t nbytes = count * itemsize(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  begin(descriptor(ALL_GATHER, count, dtype, kNone, kNone));
  char* input = reinterpret_cast<char*>(in);
  char* output = reinterpret_cast<char*>(out);
  std::vector<Block> blocks;
  for (int j = 0; j < size_; ++j) blocks.push_back({input, output + j * nbytes, nbytes});
  gather_pieces(blocks);
}

void ShmComm::broadcast(uintptr_t buf, int64_t count, int dtype, int root) {
  const int64_t nbytes = count * itemsize(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  begin(descriptor(BROADCAST, count, dtype, kNone, root));
  if (size_ == 1) return;
  char* data = reinterpret_cast<char*>(buf);
  std::vector<Block> blocks(size_, Block{data, nullptr, 0});
  blocks[root] = {data, rank_ == root ? nullptr : data, nbytes};
  gather_pieces(blocks, true);
}

// Every rank runs the same number of pieces: after the first piece's barrier every rank's
// splits (published before begin) are visible, and the longest part fixes the count.
void ShmComm::all_to_all(uintptr_t out, uintptr_t in, int dtype,
                         const std::vector<int64_t>& send_offsets,
                         const std::vector<int64_t>& send_lengths,
                         const std::vector<int64_t>& recv_offsets,
                         const std::vector<int64_t>& recv_lengths) {
  for (auto* v : {&send_offsets, &send_lengths, &recv_offsets, &recv_lengths})
    if (int(v->size()) != size_) throw std::invalid_argument("one offset and length per rank");
  std::lock_guard<std::mutex> lock(mutex_);
  publish_splits(send_lengths, recv_lengths);
  begin(descriptor(ALL_TO_ALL, kNone, dtype, kNone, kNone));
  const char* input = reinterpret_cast<const char*>(in);
  char* output = reinterpret_cast<char*>(out);
  const int64_t per_peer = config_.staging_bytes / 2 / size_ / kLine * kLine;
  // Whether this rank's parts are read where they lie instead of staged: parts of several
  // pieces (or as large as parts_in_place_from), in order (where the peers find them), on
  // memory cheap to read.
  int64_t sent = 0, longest_sent = 0;
  bool in_order = true;
  for (int j = 0; j < size_; ++j) {
    in_order = in_order && send_offsets[j] == sent;
    sent += send_lengths[j], longest_sent = std::max(longest_sent, send_lengths[j]);
  }
  expose(in, out);  // (before cheap_to_read, which looks at the exposed input)
  const int64_t measured = parts_in_place_from_, from = measured >= 0 ? measured : per_peer + 1;
  const bool unstaged = longest_sent >= from && one_copy_ok_ && in_order &&
                        cheap_to_read(ALL_TO_ALL, &Exposed::in, sent);
  say_in_place(unstaged);
  int64_t received = 0;
  for (int64_t n : recv_lengths) received += n;
  const CopyFn copy_out = copy_received(received);
  int64_t npieces = 1;
  bool any_unstaged = false;  // (known after the first barrier, alike on every rank)
  for (int64_t k = 0; k < npieces; ++k) {
    uint64_t g = pieces_++;
    wait_staging_free(g);
    char* mine = staging(rank_, g);
    for (int j = 0; j < size_ && !unstaged; ++j) {
      if (j == rank_) continue;
      int64_t n = piece_len(send_lengths[j], k, per_peer);
      copy(mine + j * per_peer, input + send_offsets[j] + k * per_peer, n);
      count_sent(n);
    }
    uint64_t barrier = arrive();
    if (k == 0)  // the own part fills the wait
      copy_out(output + recv_offsets[rank_], input + send_offsets[rank_],
           std::min(send_lengths[rank_], recv_lengths[rank_]));
    wait_arrivals(barrier, [](int) { return true; });
    if (k == 0) {
      try {
        check_splits(itemsize(dtype));
      } catch (...) {
        release_piece(g);
        throw;
      }
      int64_t longest = 0;  // of the staged parts
      for (int i = 0; i < size_; ++i) {
        if (in_place_at(i)) {
          any_unstaged = true;
          if (i != rank_) read_part_in_place(i, output + recv_offsets[i], recv_lengths[i]);
          continue;
        }
        for (int j = 0; j < size_; ++j)
          if (i != j) longest = std::max(longest, splits(i, call_)[j]);
      }
      npieces = std::max<int64_t>(1, (longest + per_peer - 1) / per_peer);
    }
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && !in_place_at(j))
        copy_out(output + recv_offsets[j] + k * per_peer, staging(j, g) + rank_ * per_peer,
             piece_len(recv_lengths[j], k, per_peer));
    release_piece(g);
  }
  if (!any_unstaged) return;
  if (unstaged) count_sent(uint64_t(sent - send_lengths[rank_]));
  meet();  // no rank leaves while a peer may still read its parts
  ++calls_read_in_place_;
}

void ShmComm::direct(int64_t collective, uintptr_t out, uintptr_t in, int64_t count, int dtype,
                     int op, int64_t root, const std::vector<int64_t>& in_splits,
                     const std::vector<int64_t>& out_splits) {
  switch (collective) {
    case ALL_REDUCE: return all_reduce(out, count, dtype, op, 3);
    case REDUCE: return reduce(out, count, dtype, op, int(root));
    case BROADCAST: return broadcast(out, count, dtype, int(root));
    case ALL_GATHER: return all_gather(out, in, count, dtype);
    case REDUCE_SCATTER: return reduce_scatter(out, in, count, dtype, op);
    case ALL_TO_ALL: {
      const int64_t isz = itemsize(dtype);
      auto send_lengths = part_bytes(count, isz, in_splits);
      auto recv_lengths = part_bytes(count, isz, out_splits);
      auto offsets = [](const std::vector<int64_t>& lengths) {
        std::vector<int64_t> at(lengths.size(), 0);
        for (size_t j = 1; j < lengths.size(); ++j) at[j] = at[j - 1] + lengths[j - 1];
        return at;
      };
      auto send_offsets = offsets(send_lengths), recv_offsets = offsets(recv_lengths);
      return all_to_all(out, in, dtype, send_offsets, send_lengths, recv_offsets, recv_lengths);
    }
  }
  throw std::invalid_argument("no direct collective for code " + std::to_string(collective));
}

}  // namespace commlib::shm
