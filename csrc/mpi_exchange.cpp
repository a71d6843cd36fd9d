// The agreement's exchange over MPI (commlib/transports/mpi.py, Agreement), in C++ so
// that a checked call across hosts costs MPI's round trip and little more: every rank
// sends one row (its call's descriptor, then all_to_all's splits or eager's data) to
// every peer over persistent requests, waits for theirs, and checks that the rows agree.
//
// Vocabulary:
//   inbox    one row per rank, `row_words` int64 words each: the header (the descriptor
//            and 2n split fields: agreement.h), then the payload. This rank's own row is
//            what it sends.
//   sends    persistent sends of this rank's row to every peer, one set per row length in
//            words (MPI fixes a send's length when it is made), made by Python's
//            `make_sends(words)` the first time a length is sent; receives take whole rows,
//            so no message is ever truncated.
//   handles  MPI requests as mpi4py made them (MPI._handleof), `handle_bytes` each. The
//            extension does not link MPI: it calls the entry points of whichever MPI
//            mpi4py loaded (Python finds them by name), and hands MPI the addresses of
//            handles kept as bytes, so an int (MPICH) and a pointer (Open MPI) both work.
//   eager    small collectives whose data ride in the rows (commlib/algorithms/eager.py):
//            every rank reduces the rows in rank order, so results are bitwise equal
//            everywhere. The fast path's EAGER entries run here (fast_path.h), and its
//            NATIVE ones: the exchange, then MPI's own collective (mpi_native.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agreement.h"
#include "eager.h"
#include "fast_path.h"
#include "kernels.h"
#include "mpi_native.h"

namespace py = pybind11;

namespace commlib {

namespace {

struct MpiEntryPoints {  // MPI's own signatures, with every handle passed by address
  int (*startall)(int, void*);
  int (*testall)(int, void*, int*, void*);
  int (*test)(void*, int*, void*);
  int (*cancel)(void*);
  int (*error_string)(int, char*, int*);
};

template <class F>
F entry_point(const py::dict& addresses, const char* name) {
  return reinterpret_cast<F>(addresses[name].cast<uintptr_t>());
}

}  // namespace

class MpiExchange : public FastTransport {
 public:
  // `receives`: one persistent receive of a whole row from each of `peers` (the ranks
  // other than this one, in order), as handles; `make_sends(words)` -> (the persistent
  // sends of this rank's first `words` words to each peer, their handles).
  MpiExchange(py::dict entry_points, int handle_bytes, int status_bytes,
              py::array_t<int64_t, py::array::c_style> inbox, int header, int rank,
              std::vector<int> peers, std::vector<uintptr_t> receives, py::function make_sends)
      : inbox_(std::move(inbox)), header_(header), rank_(rank), peers_(std::move(peers)),
        handle_bytes_(handle_bytes), status_bytes_(status_bytes),
        make_sends_(std::move(make_sends)) {
    mpi_ = {entry_point<decltype(mpi_.startall)>(entry_points, "MPI_Startall"),
            entry_point<decltype(mpi_.testall)>(entry_points, "MPI_Testall"),
            entry_point<decltype(mpi_.test)>(entry_points, "MPI_Test"),
            entry_point<decltype(mpi_.cancel)>(entry_points, "MPI_Cancel"),
            entry_point<decltype(mpi_.error_string)>(entry_points, "MPI_Error_string")};
    if (handle_bytes != 4 && handle_bytes != 8) throw std::invalid_argument("handles are 4 or 8 bytes");
    if (inbox_.ndim() != 2 || inbox_.shape(0) != int64_t(peers_.size()) + 1 ||
        inbox_.shape(1) < header)
      throw std::invalid_argument("the inbox needs one row per rank, each at least a header");
    if (receives.size() != peers_.size()) throw std::invalid_argument("one receive per peer");
    receives_ = as_handles(receives);
  }

  // Checks a call: every rank's `desc` (and, where `splits` is not empty, the bytes it
  // sends to each rank and receives from each) must agree, else MismatchError.
  void check(const std::vector<int64_t>& desc, int64_t itemsize,
             const std::vector<int64_t>& splits) {
    if (desc.size() != kDescFields || (!splits.empty() && int(splits.size()) != 2 * size()))
      throw std::invalid_argument("a descriptor has 8 fields, and splits 2 per rank");
    std::copy(desc.begin(), desc.end(), row(rank_));
    std::copy(splits.begin(), splits.end(), row(rank_) + kDescFields);
    exchange(header_, itemsize, !splits.empty(), 0);
  }

  // An eager collective: this rank's row carries `desc` (dtype and op filled in here) and
  // its data; the result is computed from every rank's row. (Every rank waits for every
  // row, a broadcast's root too: so that all raise in the call where they disagree.)
  void eager(const std::vector<int64_t>& desc, const FastCall& c) {
    const int n = size();
    const int64_t width = itemsize(c.out.dtype);
    const CollectiveInfo& kind = collective_info(c.collective);
    const Operand& data = kind.has_input() ? c.in : c.out;
    const int64_t bytes = !kind.from_root || rank_ == c.root ? data.count * width : 0;
    if ((header_ + (bytes + 7) / 8) > row_words())
      throw std::invalid_argument("eager data larger than a row");
    int64_t* mine = row(rank_);
    std::copy(desc.begin(), desc.end(), mine);
    mine[DTYPE] = c.out.dtype, mine[OP] = c.op_given;
    std::memcpy(payload(rank_), reinterpret_cast<const void*>(data.ptr), bytes);
    exchange(header_ + (bytes + 7) / 8, width, false, bytes);
    eager_result(c.collective, rank_, n, c.root, payload(0), row_words() * 8, bytes,
                 reinterpret_cast<char*>(c.out.ptr), c.out.count, c.out.dtype, c.op);
  }

  // MPI's own collectives for NATIVE entries (mpi_native.h), from now on.
  void use_native(std::unique_ptr<MpiNative> native) { native_ = std::move(native); }

  bool takes(const FastEntry& entry, const FastCall& call) const override {
    return entry.kind == EntryKind::EAGER ||
           (entry.kind == EntryKind::NATIVE && native_ && native_->takes(call, size()));
  }

  void run(const FastEntry& entry, const FastCall& call) override {
    if (entry.kind == EntryKind::EAGER) return eager(entry.descriptor, call);
    if (entry.kind != EntryKind::NATIVE || !native_)
      throw std::logic_error("MPI runs only eager and native entries");
    // agreed on first, as the general path agrees (equal all_to_all parts, in bytes)
    int64_t* mine = row(rank_);
    std::copy(entry.descriptor.begin(), entry.descriptor.end(), mine);
    mine[DTYPE] = call.out.dtype, mine[OP] = call.op_given;
    const int64_t width = itemsize(call.out.dtype);
    const bool splits = collective_info(call.collective).parts == kExchange;
    if (splits) std::fill(mine + kDescFields, mine + kDescFields + 2 * size(),
                          call.in.count / size() * width);
    exchange(header_, width, splits, 0);
    sent_ += native_->run(call, rank_, size(), timeout_);
  }
  int rank() const override { return rank_; }
  int size() const override { return int(peers_.size()) + 1; }
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds) { timeout_ = seconds; }
  uint64_t bytes_sent() const { return sent_; }
  py::list sends() const { return sends_; }

 private:
  // Sends the first `words` words of this rank's row to every peer, `payload_bytes` of
  // them data (counted as sent), and waits for every peer's row; raises MismatchError
  // unless the descriptors (and, with `splits`, the split fields) agree.
  void exchange(int64_t words, int64_t itemsize, bool splits, int64_t payload_bytes) {
    std::vector<uint8_t>& requests = requests_for(words);
    require_success(mpi_.startall(count(requests), requests.data()), "MPI_Startall");
    sent_ += uint64_t(payload_bytes) * peers_.size();
    wait(requests);
    std::string reason = check_table(row(0), size(), row_words(), itemsize, splits);
    if (!reason.empty()) throw MismatchError(reason);
  }

  int count(const std::vector<uint8_t>& requests) const {
    return int(requests.size() / handle_bytes_);
  }

  // The receives, then the sends of `words` words (made on first use).
  std::vector<uint8_t>& requests_for(int64_t words) {
    auto found = requests_.find(words);
    if (found != requests_.end()) return found->second;
    if (words < header_ || words > row_words())
      throw std::invalid_argument("a row sent takes its header and at most a whole row");
    std::vector<uint8_t> requests = receives_;
    {
      py::gil_scoped_acquire gil;
      py::tuple made = make_sends_(words);
      auto handles = made[1].cast<std::vector<uintptr_t>>();
      if (handles.size() != peers_.size()) throw std::invalid_argument("one send per peer");
      std::vector<uint8_t> sends = as_handles(handles);
      requests.insert(requests.end(), sends.begin(), sends.end());
      for (py::handle send : made[0]) sends_.append(send);
    }
    return requests_[words] = std::move(requests);
  }

  int64_t row_words() const { return inbox_.shape(1); }
  int64_t* row(int r) { return inbox_.mutable_data(r, 0); }
  char* payload(int r) { return reinterpret_cast<char*>(row(r) + header_); }

  std::vector<uint8_t> as_handles(const std::vector<uintptr_t>& values) const {
    std::vector<uint8_t> bytes(values.size() * handle_bytes_);
    for (size_t i = 0; i < values.size(); ++i) {
      if (handle_bytes_ == 4) {
        const uint32_t v = uint32_t(values[i]);
        std::memcpy(&bytes[i * 4], &v, 4);
      } else {
        const uint64_t v = values[i];
        std::memcpy(&bytes[i * 8], &v, 8);
      }
    }
    return bytes;
  }

  void require_success(int code, const char* what) {
    if (code == 0) return;  // MPI_SUCCESS
    char text[1024] = "";
    int length = 0;
    mpi_.error_string(code, text, &length);
    throw PeerError(std::string(what) + " failed inside MPI: " + text);
  }

  // Polls until every request is done (poll_until). Past the timeout, abandons what is
  // pending (receives are cancelled; the communicator is unusable after a timeout anyway)
  // and names the late.
  void wait(std::vector<uint8_t>& requests) {
    const int count = this->count(requests);
    std::vector<uint8_t> statuses(size_t(count) * status_bytes_);
    if (poll_until([&] {
          int done = 0;
          require_success(mpi_.testall(count, requests.data(), &done, statuses.data()),
                          "MPI_Testall");
          return done != 0;
        }, timeout_))
      return;
    std::vector<int> late;  // peers, in the order of the requests (receives first)
    const int receives = int(peers_.size());
    for (int i = 0; i < count; ++i) {
      uint8_t* request = &requests[size_t(i) * handle_bytes_];
      int done = 0;
      require_success(mpi_.test(request, &done, statuses.data()), "MPI_Test");
      if (done) continue;
      if (i < receives) mpi_.cancel(request);
      const int peer = peers_[i % receives];
      if (std::find(late.begin(), late.end(), peer) == late.end()) late.push_back(peer);
    }
    std::string names;
    for (int peer : late) names += (names.empty() ? "rank " : ", rank ") + std::to_string(peer);
    throw TimeoutError("timed out after " + seconds_text(timeout_) + " s waiting for " + names +
                       " to start the same collective");
  }

  py::array_t<int64_t, py::array::c_style> inbox_;
  int64_t header_;
  int rank_;
  std::vector<int> peers_;
  int handle_bytes_, status_bytes_;
  MpiEntryPoints mpi_;
  std::vector<uint8_t> receives_;
  py::function make_sends_;
  std::unique_ptr<MpiNative> native_;  // (none until use_native)
  py::list sends_;  // every send made, as mpi4py's requests (Agreement.free frees them)
  std::map<int64_t, std::vector<uint8_t>> requests_;  // words -> receives, then those sends
  double timeout_ = 0;
  uint64_t sent_ = 0;
};

void bind_mpi_exchange(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<MpiExchange, FastTransport>(
      m, "MpiExchange", "The agreement's exchange over MPI, and eager collectives "
                        "(csrc/mpi_exchange.cpp). Methods release the GIL.")
      .def(py::init<py::dict, int, int, py::array_t<int64_t, py::array::c_style>, int, int,
                    std::vector<int>, std::vector<uintptr_t>, py::function>(),
           py::arg("entry_points"), py::arg("handle_bytes"), py::arg("status_bytes"),
           py::arg("inbox"), py::arg("header"), py::arg("rank"), py::arg("peers"),
           py::arg("receives"), py::arg("make_sends"))
      .def("check", &MpiExchange::check, nogil(), py::arg("descriptor"), py::arg("itemsize"),
           py::arg("splits"),
           "Raise CollectiveMismatchError unless every rank's descriptor (and splits: the "
           "bytes to each rank, then from each, or none) agree.")

      .def(
          "eager",
          [](MpiExchange& x, std::vector<int64_t> desc, uintptr_t out, int64_t out_count,
             uintptr_t in, int64_t in_count, int op) {
            if (desc.size() != kDescFields) throw std::invalid_argument("a descriptor has 8 fields");
            const int dtype = int(desc[DTYPE]);
            py::gil_scoped_release nogil;
            x.eager(desc, {int(desc[COLLECTIVE]), {out, out_count, dtype}, {in, in_count, dtype},
                           kNone, op, desc[ROOT], desc[OP]});
          },
          py::arg("descriptor"), py::arg("out"), py::arg("out_count"), py::arg("inp"),
          py::arg("in_count"), py::arg("op"),
          "An eager collective as the descriptor says (its dtype, root); `op` the reduction's "
          "code (SUM where none).")
      .def(
          "use_native",
          [](MpiExchange& x, py::dict entry_points, int status_bytes, uintptr_t comm,
             std::map<int, uintptr_t> dtypes, std::map<int, uintptr_t> ops,
             std::vector<int> reducible, uintptr_t in_place, int handle_bytes) {
            x.use_native(std::make_unique<MpiNative>(entry_points, handle_bytes, status_bytes,
                                                     comm, dtypes, ops, reducible, in_place));
          },
          py::arg("entry_points"), py::arg("status_bytes"), py::arg("comm"), py::arg("dtypes"),
          py::arg("ops"), py::arg("reducible"), py::arg("in_place"), py::arg("handle_bytes"),
          "Run the fast path's native entries: MPI's own collectives on `comm` (mpi_native.h).")
      .def_property_readonly("sends", &MpiExchange::sends)
      .def_property("timeout", &MpiExchange::timeout, &MpiExchange::set_timeout)
      .def_property_readonly("bytes_sent", &MpiExchange::bytes_sent);
}

}  // namespace commlib
