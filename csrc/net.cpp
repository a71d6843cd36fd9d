// The network transport's links, rows and plans (net.h has the vocabulary).
#include "net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <stdexcept>

#include "agreement.h"
#include "eager.h"
#include "kernels.h"
#include "process.h"

namespace commlib {

namespace {

using Clock = std::chrono::steady_clock;

enum FrameKind : uint32_t { ROW = 1, DATA = 2 };

struct Header {
  uint32_t kind;
  uint32_t unused;
  int64_t bytes;
};
constexpr int64_t kHeaderBytes = sizeof(Header);
// a link waiting for data wakes when this much has arrived (or all it waits for): at
// 1 Gbit/s, a wake every 2 ms rather than every packet's
constexpr int64_t kLowWaterBytes = 256 << 10;

struct Hello {  // what a connecting rank sends first
  uint64_t token;
  int64_t rank;
};

std::string system_error(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Waits for `events` on `fd` until `deadline`; false when it passed.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, int(std::ceil(left * 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throw PeerError(system_error("poll", errno));
  }
}

// Reads or writes exactly `bytes` on a blocking socket before `deadline` (set-up only).
void whole(int fd, void* data, size_t bytes, bool writing, Clock::time_point deadline,
           const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    if (!wait_for(fd, writing ? POLLOUT : POLLIN, deadline))
      throw TimeoutError("timed out " + what);
    const ssize_t k = writing ? send(fd, p, bytes, MSG_NOSIGNAL) : recv(fd, p, bytes, 0);
    if (k == 0) throw PeerError("connection closed " + what);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw PeerError(system_error("connection failed " + what, errno));
    }
    p += k, bytes -= size_t(k);
  }
}

sockaddr_in resolve(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1) return a;
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || !found)
    throw PeerError("cannot resolve " + host);
  a.sin_addr = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
  freeaddrinfo(found);
  return a;
}

void tune(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // rows are small
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace

struct NetComm::Outgoing {
  Header header;
  const char* data;
  int64_t done = 0;        // bytes of header and data sent
  std::vector<char> kept;  // the data's copy, once the call it belongs to has failed
};

struct NetComm::Incoming {
  FrameKind kind;
  char* dst;
  int64_t bytes;              // exactly (DATA), or at most (ROW)
  const char* src = nullptr;  // a reducing receive: dst = src (op) incoming
  int64_t* got = nullptr;     // where a row's length is noted
  Header header{};
  int64_t header_done = 0, done = 0;  // done: data bytes landed (reduced)
};

struct NetComm::Link {
  int peer = -1, fd = -1;
  std::deque<Outgoing> out;
  std::deque<Incoming> in;
  std::vector<char> scratch;  // a reducing receive's piece
  int64_t filled = 0;         // bytes of the piece that arrived
  int low_water = 1;          // SO_RCVLOWAT: the bytes that wake a wait for this link
  // after a call failed its agreement: the peer's data sent ahead for it are dropped
  // until its next row (skip: what is left of the frame being dropped)
  bool stale = false;
  int64_t skip = 0;
  ~Link() {
    if (fd >= 0) close(fd);
  }
};

struct NetComm::Exchange {
  int dtype = U8, op = SUM;
  double timeout = 0;  // seconds (0: none)
  double spin = 0;     // seconds to poll back to back before sleeping (the calling thread's)
  bool rows_only = false;  // done once every receive is in (sends may still be going out)
};

NetComm::NetComm(int rank, int size, int header, int64_t payload_bytes)
    : rank_(rank), size_(size), header_(header), payload_bytes_(payload_bytes),
      row_words_(header + (payload_bytes + 7) / 8) {
  if (size < 1 || rank < 0 || rank >= size) throw std::invalid_argument("rank out of range");
  if (header < kDescFields + 2 * size) throw std::invalid_argument("a row's header is 8 + 2n words");
  inbox_.assign(size_t(size) * row_words_, 0);
  links_.resize(size);
  wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (wake_ < 0 || listener_ < 0) throw PeerError(system_error("socket", errno));
  const int one = 1;
  setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(any);
  if (bind(listener_, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 ||
      listen(listener_, size + 16) != 0 ||
      getsockname(listener_, reinterpret_cast<sockaddr*>(&any), &length) != 0)
    throw PeerError(system_error("listening for the peers", errno));
  port_ = ntohs(any.sin_port);
}

NetComm::~NetComm() {
  {
    std::lock_guard<std::mutex> lock(jobs_lock_);
    stopping_ = true;
  }
  jobs_changed_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  if (listener_ >= 0) close(listener_);
  if (wake_ >= 0) close(wake_);
}

double NetComm::spin_seconds() const { return background_ ? background_spin_ : spin_; }

void NetComm::connect(const std::vector<std::string>& addresses, const std::vector<int>& ports,
                      uint64_t token, double timeout) {
  if (int(addresses.size()) != size_ || int(ports.size()) != size_)
    throw std::invalid_argument("one address and port per rank");
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout > 0 ? timeout : 1e9));
  for (int peer = 0; peer < rank_; ++peer) {  // the lower ranks listen for this one
    const std::string where = "connecting to rank " + std::to_string(peer) + " at " +
                              addresses[peer] + ":" + std::to_string(ports[peer]);
    const sockaddr_in a = resolve(addresses[peer], ports[peer]);
    int fd = -1;
    for (;;) {  // (refused: retried until the deadline)
      fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) throw PeerError(system_error("socket", errno));
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) break;
      const int error = errno;
      close(fd);
      if (Clock::now() > deadline) throw TimeoutError(system_error("timed out " + where, error));
      usleep(10000);
    }
    auto link = std::make_unique<Link>();
    link->peer = peer, link->fd = fd;
    Hello hello{token, rank_};
    whole(fd, &hello, sizeof(hello), true, deadline, where);
    links_[peer] = std::move(link);
  }
  for (int joined = rank_ + 1; joined < size_;) {  // the higher ranks connect to this one
    if (!wait_for(listener_, POLLIN, deadline))
      throw TimeoutError("timed out waiting for the higher ranks to connect to rank " +
                         std::to_string(rank_));
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello hello{};
    try {
      whole(fd, &hello, sizeof(hello), false, deadline, "reading a peer's hello");
    } catch (const PeerError&) {
      close(fd);
      continue;
    }
    if (hello.token != token || hello.rank <= rank_ || hello.rank >= size_ || links_[hello.rank]) {
      close(fd);  // not one of this communicator's peers
      continue;
    }
    auto link = std::make_unique<Link>();
    link->peer = int(hello.rank), link->fd = fd;
    links_[hello.rank] = std::move(link);
    ++joined;
  }
  for (auto& link : links_)
    if (link) tune(link->fd);
  close(listener_);
  listener_ = -1;
}

void NetComm::usable() const {
  if (!broken_.empty()) throw PeerError(broken_);
}

void NetComm::fail(const std::string& why) {
  broken_ = "the network transport failed earlier (" + why + "); create a new communicator";
  throw PeerError(why);
}

void NetComm::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(why_mutex_);
    if (interrupted_why_.empty())
      interrupted_why_ = why.empty() ? "rank " + std::to_string(rank_) +
                                           " aborted the communicator (Communicator.abort)"
                                     : why;
  }
  interrupted_.store(true);
  const uint64_t one = 1;
  if (write(wake_, &one, sizeof(one)) < 0) {
  }
}

void NetComm::check(const std::vector<int64_t>& desc, int64_t itemsize,
                    const std::vector<int64_t>& splits) {
  std::lock_guard<std::mutex> running(running_);
  background_ = false;
  if (desc.size() != kDescFields || (!splits.empty() && int(splits.size()) != 2 * size_))
    throw std::invalid_argument("a descriptor has 8 fields, and splits 2 per rank");
  std::copy(desc.begin(), desc.end(), row(rank_));
  std::copy(splits.begin(), splits.end(), row(rank_) + kDescFields);
  exchange_rows(header_, itemsize, !splits.empty(), timeout_);
}

void NetComm::eager(const std::vector<int64_t>& desc, const FastCall& c) {
  std::lock_guard<std::mutex> running(running_);
  background_ = false;
  eager_rows(desc, c, timeout_);
}

void NetComm::eager_rows(const std::vector<int64_t>& desc, const FastCall& c, double seconds) {
  const int64_t width = itemsize(c.out.dtype);
  const CollectiveInfo& kind = collective_info(c.collective);
  const Operand& data = kind.has_input() ? c.in : c.out;
  const int64_t bytes = !kind.from_root || rank_ == c.root ? data.count * width : 0;
  if (bytes > payload_bytes_) throw std::invalid_argument("eager data larger than a row");
  int64_t* mine = row(rank_);
  std::copy(desc.begin(), desc.end(), mine);
  mine[DTYPE] = c.out.dtype, mine[OP] = c.op_given;
  std::memcpy(mine + header_, reinterpret_cast<const void*>(data.ptr), size_t(bytes));
  exchange_rows(header_ + (bytes + 7) / 8, width, false, seconds);
  sent_ += uint64_t(bytes) * (size_ - 1);
  eager_result(c.collective, rank_, size_, c.root, reinterpret_cast<const char*>(row(0) + header_),
               row_words_ * 8, bytes, reinterpret_cast<char*>(c.out.ptr), c.out.count,
               c.out.dtype, c.op);
}

void NetComm::exchange_rows(int64_t words, int64_t itemsize, bool splits, double seconds) {
  send_rows(words);
  Exchange x;
  x.timeout = seconds, x.spin = spin_seconds();
  move(x);
  check_rows(itemsize, splits);
}

void NetComm::send_rows(int64_t words) {
  usable();
  row_lengths_.assign(size_, 0);
  for (auto& link : links_) {
    if (!link) continue;
    link->out.push_back({{ROW, 0, words * 8}, reinterpret_cast<const char*>(row(rank_))});
    Incoming in{ROW, reinterpret_cast<char*>(row(link->peer)), row_words_ * 8};
    in.got = &row_lengths_[link->peer];
    link->in.push_back(in);
  }
}

void NetComm::check_rows(int64_t itemsize, bool splits) {
  for (int peer = 0; peer < size_; ++peer)
    if (peer != rank_ && row_lengths_[peer] < header_ * 8)
      fail("rank " + std::to_string(peer) + " sent a row shorter than its header");
  const std::string reason = check_table(row(0), size_, row_words_, itemsize, splits);
  if (reason.empty()) return;
  // what this rank sent ahead goes out during the next call (each peer drops it): its
  // buffers may be gone by then, and this row rewritten
  for (auto& link : links_) {
    if (!link) continue;
    for (Outgoing& o : link->out) {
      o.kept.assign(o.data, o.data + o.header.bytes);  // (whole, sent part too: rare)
      o.data = o.kept.data();
    }
    link->stale = true;
  }
  throw MismatchError(reason);
}

void NetComm::run_plan(const int64_t* plan, int64_t words, uintptr_t out, uintptr_t in,
                       int64_t tmp_bytes, int dtype, int op) {
  std::lock_guard<std::mutex> running(running_);
  background_ = false;
  plan_rounds(plan, words, out, in, tmp_bytes, dtype, op, timeout_, Agreed{});
}

void NetComm::plan_rounds(const int64_t* plan, int64_t words, uintptr_t out, uintptr_t in,
                          int64_t tmp_bytes, int dtype, int op, double seconds, Agreed agreed) {
  usable();
  if (int64_t(tmp_.size()) < tmp_bytes) tmp_.resize(size_t(tmp_bytes));
  char* buffers[3] = {reinterpret_cast<char*>(out), reinterpret_cast<char*>(in), tmp_.data()};
  int64_t at = 0;
  auto next = [&]() -> int64_t {
    if (at >= words) throw std::invalid_argument("a plan shorter than its counts say");
    return plan[at++];
  };
  auto buffer = [&](int64_t id) -> char* {
    if (id < 0 || id > 2) throw std::invalid_argument("a plan names buffers 0, 1, 2");
    return buffers[id];
  };
  auto link = [&](int64_t peer) -> Link& {
    if (peer < 0 || peer >= size_ || !links_[peer]) throw std::invalid_argument("a plan's peer out of range");
    return *links_[peer];
  };
  Exchange x{dtype, op, seconds, spin_seconds()};
  auto agree_now = [&]() {
    Exchange rows = x;
    rows.rows_only = true;
    move(rows);
    check_rows(agreed.itemsize, agreed.splits);
    agreed.rows = false;
  };
  for (int64_t rounds = next(); rounds > 0; --rounds) {
    int64_t copies = next();
    // copies may rearrange the caller's data in place: only once the call is agreed on
    if (agreed.rows && copies > 0 && in == 0) agree_now();
    for (; copies > 0; --copies) {
      char* src = buffer(next());
      const int64_t src_offset = next();
      char* dst = buffer(next());
      const int64_t dst_offset = next(), bytes = next();
      copy(dst + dst_offset, src + src_offset, bytes);
    }
    for (int64_t sends = next(); sends > 0; --sends) {
      Link& l = link(next());
      const char* src = buffer(next());
      const int64_t offset = next(), bytes = next();
      l.out.push_back({{DATA, 0, bytes}, src + offset});
      sent_ += uint64_t(bytes);
    }
    // the rows went out before: the first round's sends follow them and cross with the
    // peers' rows; its receives wait for the check (the peers' data wait in the sockets)
    if (agreed.rows) agree_now();
    for (int64_t recvs = next(); recvs > 0; --recvs) {
      Link& l = link(next());
      char* dst = buffer(next());
      const int64_t offset = next(), bytes = next(), src = next(), src_offset = next();
      Incoming i{DATA, dst + offset, bytes};
      if (src >= 0) i.src = buffer(src) + src_offset;
      l.in.push_back(i);
    }
    move(x);
  }
  if (agreed.rows) agree_now();  // (a plan of no rounds)
}

bool NetComm::takes(const FastEntry& entry, const FastCall& call) const {
  return entry.kind == EntryKind::EAGER || entry.kind == EntryKind::PLAN ||
         (entry.kind == EntryKind::NATIVE && native_ && native_->takes(call, size_));
}

void NetComm::run(const FastEntry& entry, const FastCall& call) {
  std::lock_guard<std::mutex> running(running_);
  background_ = false;
  if (entry.kind == EntryKind::EAGER) return eager_rows(entry.descriptor, call, timeout_);
  if (entry.kind == EntryKind::NATIVE && !native_)
    throw std::logic_error("the network transport runs native entries only over MPI");
  if (!entry.descriptor.empty()) {  // agreed on first, as the general path agrees
    int64_t* mine = row(rank_);
    std::copy(entry.descriptor.begin(), entry.descriptor.end(), mine);
    mine[DTYPE] = call.out.dtype, mine[OP] = call.op_given;
    const int64_t width = itemsize(call.out.dtype);
    const bool splits = collective_info(call.collective).parts == kExchange;  // (equal parts, in bytes)
    if (splits) std::fill(mine + kDescFields, mine + kDescFields + 2 * size_,
                          call.in.count / size_ * width);
    if (entry.kind == EntryKind::PLAN) {  // (its first round's data go out behind the rows)
      send_rows(header_);
      plan_rounds(entry.plan.data(), int64_t(entry.plan.size()), call.out.ptr, call.in.ptr,
                  entry.tmp_bytes, call.out.dtype, call.op, timeout_, Agreed{width, splits});
      return;
    }
    exchange_rows(header_, width, splits, timeout_);
  }
  if (entry.kind == EntryKind::NATIVE) {
    sent_ += native_->run(call, rank_, size_, timeout_);
    return;
  }
  plan_rounds(entry.plan.data(), int64_t(entry.plan.size()), call.out.ptr, call.in.ptr,
              entry.tmp_bytes, call.out.dtype, call.op, timeout_, Agreed{});
}

void NetComm::move(Exchange& x) {
  const auto began = Clock::now();
  const std::string closed = " closed its connection (it exited, or freed the communicator)";

  auto peer_failed = [&](const Link& l, int error) {
    fail(error ? system_error("the link to rank " + std::to_string(l.peer) + " failed", error)
               : "rank " + std::to_string(l.peer) + closed);
  };
  auto send_some = [&](Link& l) {  // until the link takes no more; whether it took any
    bool moved = false;
    while (!l.out.empty()) {
      Outgoing& o = l.out.front();
      iovec parts[2];
      int n = 0;
      if (o.done < kHeaderBytes)
        parts[n++] = {reinterpret_cast<char*>(&o.header) + o.done, size_t(kHeaderBytes - o.done)};
      const int64_t data_done = std::max<int64_t>(0, o.done - kHeaderBytes);
      if (o.header.bytes > data_done)
        parts[n++] = {const_cast<char*>(o.data) + data_done, size_t(o.header.bytes - data_done)};
      msghdr m{};
      m.msg_iov = parts;
      m.msg_iovlen = n;
      const ssize_t k = sendmsg(l.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
        if (errno == EINTR) continue;
        peer_failed(l, errno);
      }
      o.done += k, moved = true;
      if (o.done == kHeaderBytes + o.header.bytes) l.out.pop_front();
    }
    return moved;
  };
  // receives into `dst` what the link has, up to `want` bytes; -1 when it has none now
  auto take = [&](Link& l, char* dst, int64_t want) -> int64_t {
    for (;;) {
      const ssize_t k = recv(l.fd, dst, size_t(want), MSG_DONTWAIT);
      if (k > 0) return k;
      if (k == 0) peer_failed(l, 0);
      if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
      if (errno != EINTR) peer_failed(l, errno);
    }
  };
  auto recv_some = [&](Link& l) {
    bool moved = false;
    while (!l.in.empty()) {
      Incoming& i = l.in.front();
      if (l.skip > 0) {  // a stale frame's data (Link::stale), dropped
        if (l.scratch.empty()) l.scratch.resize(kPieceBytes);
        const int64_t k = take(l, l.scratch.data(), std::min(l.skip, kPieceBytes));
        if (k < 0) return moved;
        l.skip -= k, moved = true;
        continue;
      }
      if (i.header_done < kHeaderBytes) {
        const int64_t k = take(l, reinterpret_cast<char*>(&i.header) + i.header_done,
                               kHeaderBytes - i.header_done);
        if (k < 0) return moved;
        i.header_done += k, moved = true;
        if (i.header_done < kHeaderBytes) continue;
        const Header& h = i.header;
        if (l.stale && h.kind == DATA && i.kind == ROW) {  // sent ahead for a failed call
          l.skip = h.bytes, i.header_done = 0;
          continue;
        }
        if (h.kind == ROW) l.stale = false;
        const std::string from = "rank " + std::to_string(l.peer);
        if (h.kind != i.kind)
          fail(from + (h.kind == ROW ? " began another call" : " sent data") +
               " where this rank expected " + (i.kind == ROW ? "its call's row" : "data") +
               ": the ranks are in different calls");
        if (h.kind == DATA ? h.bytes != i.bytes : (h.bytes < 0 || h.bytes > i.bytes))
          fail(from + " sent " + std::to_string(h.bytes) + " bytes where this rank expected " +
               std::to_string(i.bytes) + ": the ranks disagree on counts or splits");
        if (i.got) *i.got = h.bytes;
        i.bytes = h.bytes;
      }
      if (i.src == nullptr) {  // plain: straight where it goes
        if (i.done < i.bytes) {
          const int64_t k = take(l, i.dst + i.done, i.bytes - i.done);
          if (k < 0) return moved;
          i.done += k, moved = true;
        }
      } else {  // reducing: a piece at a time through the scratch, reduced as it lands
        if (l.scratch.empty()) l.scratch.resize(kPieceBytes);
        const int64_t piece = std::min(kPieceBytes, i.bytes - i.done);
        if (l.filled < piece) {
          const int64_t k = take(l, l.scratch.data() + l.filled, piece - l.filled);
          if (k < 0) return moved;
          l.filled += k, moved = true;
        }
        if (l.filled == piece) {
          reduce(i.dst + i.done, i.src + i.done, l.scratch.data(), piece / itemsize(x.dtype),
                 x.dtype, x.op);
          i.done += piece, l.filled = 0;
        }
      }
      if (i.done == i.bytes) l.in.pop_front();
    }
    return moved;
  };

  std::vector<pollfd> waits;
  Clock::time_point spun_since{};  // when the links last stopped moving (spinning)
  for (;;) {
    bool pending = false, moved = false;
    for (auto& link : links_) {
      if (!link) continue;
      if (!link->out.empty()) moved |= send_some(*link);
      if (!link->in.empty()) moved |= recv_some(*link);
      pending |= !link->in.empty() || (!x.rows_only && !link->out.empty());
    }
    if (!pending) return;
    if (interrupted_.load()) {
      std::lock_guard<std::mutex> lock(why_mutex_);
      fail(interrupted_why_);
    }
    if (moved) {
      spun_since = Clock::time_point{};
      continue;
    }
    if (x.spin > 0) {  // a moment back to back before sleeping: a sleep costs a wake-up
      if (spun_since == Clock::time_point{}) spun_since = Clock::now();
      if (seconds_since(spun_since) < x.spin) continue;
    }
    // nothing can move now: sleep until a link can, the deadline, or an interrupt
    waits.assign(1, {wake_, POLLIN, 0});
    for (auto& link : links_) {
      if (!link || (link->out.empty() && link->in.empty())) continue;
      waits.push_back({link->fd, short((link->out.empty() ? 0 : POLLOUT) |
                                       (link->in.empty() ? 0 : POLLIN)), 0});
      if (!link->in.empty()) {  // wake for a piece's worth, not for every packet
        const Incoming& i = link->in.front();
        const int64_t left = link->skip > 0 ? link->skip
                             : i.header_done < kHeaderBytes ? kHeaderBytes - i.header_done
                             : i.src ? std::min(kPieceBytes, i.bytes - i.done) - link->filled
                                     : i.bytes - i.done;
        const int want = int(std::max<int64_t>(1, std::min(left, kLowWaterBytes)));
        if (want != link->low_water &&
            setsockopt(link->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0)
          link->low_water = want;
      }
    }
    int wait_ms = -1;
    if (x.timeout > 0) {
      const double left = x.timeout - seconds_since(began);
      if (left <= 0) {
        std::string late;
        for (auto& link : links_) {
          if (!link || (link->in.empty() && link->out.empty())) continue;
          const std::string who = "rank " + std::to_string(link->peer);
          late += (late.empty() ? "" : ", ") +
                  (link->in.empty()
                       ? who + " to take a " + std::to_string(link->out.front().header.bytes) + "-byte send"
                   : link->in.front().kind == ROW
                       ? who + " to start the same collective"
                       : who + " (a " + std::to_string(link->in.front().bytes) + "-byte receive)");
        }
        broken_ = "the network transport timed out earlier; create a new communicator";
        throw TimeoutError("timed out after " + seconds_text(x.timeout) + " s waiting for " + late);
      }
      wait_ms = int(std::ceil(left * 1000));
    }
    if (poll(waits.data(), waits.size(), wait_ms) < 0 && errno != EINTR)
      fail(system_error("poll", errno));
  }
}

}  // namespace commlib
