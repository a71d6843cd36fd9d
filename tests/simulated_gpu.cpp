// The simulated GPU's device (simulated_gpu.py drives it through ctypes). Strict where a
// real GPU and driver are, so that what would hang on a GPU fails here, on the CPU:
//
//   streams  C++ threads that run their operations in order, whatever the Python threads
//            do (one holding the GIL included), as a GPU's streams do;
//   queue    a stream holds QUEUE operations; enqueuing onto a full one blocks the caller
//            until the stream drains, as CUDA's launch queue does;
//   driver   one lock per process: every call takes it, and a thread waiting synchronously
//            for a stream (a synchronize, a copy to pageable host memory) holds it for the
//            whole wait, so no other thread of the process gets a CUDA call through
//            meanwhile (what an H200's driver did to an engine thread's cudaMemcpyAsync
//            and event queries);
//   kernels  commlib/cuda/kernels.cu compiled for the CPU (cuda_on_host.cpp), run on the
//            stream's thread; a framework's kernel (the tests' sleep) loads lazily at its
//            first launch, waiting for the device to go idle, holding the driver.
//
// Every blocking wait gives up after LIMIT seconds with an error naming what it waited
// for: a hang on a GPU is an error here.
#define COMMLIB_THREAD_INDICES
#include "cuda_on_host.cpp"

#include <sys/prctl.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
int queue_ops = 32;     // CUDA's holds about a thousand; fewer fills sooner
double limit_s = 30.0;  // any blocking wait longer than this is a hang (simulated_gpu.py sets it)
bool lenient = false;   // synchronous waits let the driver go (to measure what needs that)
thread_local std::string error;

Clock::time_point limit() {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(limit_s));
}

int fail(const std::string& what) {
  error = what;
  return -1;
}

void nap() {
  timespec t{0, 20'000};
  nanosleep(&t, nullptr);
}

struct Stream {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::function<void()>> ops;
  bool running = false;

  Stream() { std::thread([this] { serve(); }).detach(); }
  void serve() {
    prctl(PR_SET_TIMERSLACK, 1UL);  // naps of microseconds, as a GPU polls
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait(lock, [&] { return !ops.empty(); });
        op = std::move(ops.front());
        ops.pop_front();
        running = true;
        changed.notify_all();
      }
      op();
      std::lock_guard<std::mutex> lock(mutex);
      running = false;
      changed.notify_all();
    }
  }
};

std::timed_mutex driver;
std::mutex streams_mutex;
std::map<long, Stream*> streams;  // never freed: their threads run for good
long next_stream = 1;
std::atomic<int> waiting{0};  // waits for the host enqueued and not yet passed

Stream* stream_of(long handle) {
  std::lock_guard<std::mutex> lock(streams_mutex);
  Stream*& s = streams[handle];
  if (s == nullptr) s = new Stream;
  return s;
}

// A CUDA call: holds the driver while it runs.
struct Call {
  std::unique_lock<std::timed_mutex> lock{driver, std::defer_lock};
  bool ok;
  explicit Call(const char* what) {
    ok = lock.try_lock_until(limit());
    if (!ok)
      fail(std::string(what) + " waited " + std::to_string(int(limit_s)) +
           " s for the driver, held by a thread waiting synchronously for a stream: on a "
           "GPU, a hang");
  }
};

int enqueue(long handle, std::function<void()> op) {
  Call call("enqueuing onto a stream");
  if (!call.ok) return -1;
  call.lock.unlock();  // a full queue blocks the caller, not the driver (as an H200's did)
  Stream* s = stream_of(handle);
  std::unique_lock<std::mutex> lock(s->mutex);
  if (!s->changed.wait_until(lock, limit(), [&] { return int(s->ops.size()) < queue_ops; }))
    return fail("stream " + std::to_string(handle) + " stayed full for " +
                std::to_string(int(limit_s)) + " s while this thread enqueued onto it: on a "
                "GPU, a hang");
  s->ops.push_back(std::move(op));
  s->changed.notify_all();
  return 0;
}

bool reached(unsigned now, unsigned value) { return int(now - value) >= 0; }

struct Event {
  std::atomic<uint64_t> recorded{0}, passed{0};
};
std::mutex events_mutex;
std::deque<Event> events;  // never freed: the Python side recycles them

Event& event(long id) {
  std::lock_guard<std::mutex> lock(events_mutex);
  return events[id];
}

template <class Kernel, class... Args>
void run_grid(Kernel kernel, Args... args) {  // a small grid, its threads in turn
  blockDim.x = 2;
  gridDim.x = 2;
  for (unsigned b = 0; b < gridDim.x; ++b)
    for (unsigned t = 0; t < blockDim.x; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kernel(args...);
    }
}

}  // namespace

extern "C" {

const char* sg_error() { return error.c_str(); }

void sg_configure(int ops, double seconds, int lenient_driver) {
  queue_ops = ops;
  limit_s = seconds;
  lenient = lenient_driver != 0;
}

long sg_stream_create() {
  std::lock_guard<std::mutex> lock(streams_mutex);
  return next_stream++;
}

int sg_copy(long stream, void* dst, const void* src, long long nbytes) {
  return enqueue(stream, [=] { std::memmove(dst, src, size_t(nbytes)); });
}

int sg_sleep(long stream, double seconds) {  // a slow kernel
  return enqueue(stream, [=] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  });
}

int sg_wait_value(long stream, unsigned* word, unsigned value) {
  ++waiting;
  int status = enqueue(stream, [=] {
    auto* w = reinterpret_cast<volatile unsigned*>(word);
    while (!reached(*w, value)) nap();
    --waiting;
  });
  if (status != 0) --waiting;
  return status;
}

int sg_write_value(long stream, unsigned* word, unsigned value) {
  return enqueue(stream, [=] {
    reinterpret_cast<std::atomic<unsigned>*>(word)->store(value, std::memory_order_release);
  });
}

int sg_waiting() { return waiting.load(); }

// A framework's kernel launched for the first time, under lazy loading: loading its module
// waits, holding the driver, until every stream of the process has gone idle.
int sg_lazy_load() {
  Call call("loading a kernel's module");
  if (!call.ok) return -1;
  std::vector<Stream*> every;
  {
    std::lock_guard<std::mutex> lock(streams_mutex);
    for (auto& [handle, s] : streams) every.push_back(s);
  }
  auto end = limit();
  for (Stream* s : every) {
    std::unique_lock<std::mutex> lock(s->mutex);
    if (!s->changed.wait_until(lock, end, [&] { return s->ops.empty() && !s->running; }))
      return fail("a kernel's module did not load within " + std::to_string(int(limit_s)) +
                  " s: lazy loading waits for the device to go idle, holding the driver, and "
                  "it did not: on a GPU, a hang");
  }
  return 0;
}

int sg_reduce_n(long stream, void* kernel, void** targets, int nt, void** sources, int ns,
                long long count) {
  using Fn = void (*)(commlib_cuda::Targets, int, commlib_cuda::Sources, int, long long);
  commlib_cuda::Targets d{};
  commlib_cuda::Sources s{};
  for (int i = 0; i < nt; ++i) d.p[i] = targets[i];
  for (int i = 0; i < ns; ++i) s.p[i] = sources[i];
  Fn fn = reinterpret_cast<Fn>(kernel);
  return enqueue(stream, [=] { run_grid(fn, d, nt, s, ns, count); });
}

int sg_scale(long stream, void* kernel, void* x, double factor, long long count) {
  using Fn = void (*)(void*, double, long long);
  Fn fn = reinterpret_cast<Fn>(kernel);
  return enqueue(stream, [=] { run_grid(fn, x, factor, count); });
}

// wire.cu's kernels (the packets' addresses taken by value now, as a launch's parameters)
int sg_wire_encode(long stream, void* kernel, void* data, void* residual, void* packet,
                   long long count, int block) {
  using Fn = void (*)(const float*, float*, unsigned char*, long long, int);
  Fn fn = reinterpret_cast<Fn>(kernel);
  return enqueue(stream, [=] {
    run_grid(fn, static_cast<const float*>(data), static_cast<float*>(residual),
             static_cast<unsigned char*>(packet), count, block);
  });
}

int sg_wire_decode_sum(long stream, void* kernel, void* out, void** packets, int n,
                       long long count, int block, float factor) {
  using Fn = void (*)(float*, commlib_cuda::Sources, int, long long, int, float);
  commlib_cuda::Sources s{};
  for (int i = 0; i < n; ++i) s.p[i] = packets[i];
  Fn fn = reinterpret_cast<Fn>(kernel);
  return enqueue(stream, [=] { run_grid(fn, static_cast<float*>(out), s, n, count, block, factor); });
}

int sg_wire_sum_encode(long stream, void* kernel, void* packet, void* residual, void** packets,
                       int n, long long count, int block, float factor) {
  using Fn = void (*)(unsigned char*, float*, commlib_cuda::Sources, int, long long, int, float);
  commlib_cuda::Sources s{};
  for (int i = 0; i < n; ++i) s.p[i] = packets[i];
  Fn fn = reinterpret_cast<Fn>(kernel);
  return enqueue(stream, [=] {
    run_grid(fn, static_cast<unsigned char*>(packet), static_cast<float*>(residual), s, n, count,
             block, factor);
  });
}

long sg_event_create() {
  Call call("cudaEventCreate");
  if (!call.ok) return -1;
  std::lock_guard<std::mutex> lock(events_mutex);
  events.emplace_back();
  return long(events.size() - 1);
}

int sg_event_record(long id, long stream) {
  Event& e = event(id);
  uint64_t generation = ++e.recorded;
  return enqueue(stream, [&e, generation] {
    uint64_t seen = e.passed.load();
    while (seen < generation && !e.passed.compare_exchange_weak(seen, generation)) {
    }
  });
}

int sg_event_query(long id) {
  Call call("cudaEventQuery");
  if (!call.ok) return -1;
  Event& e = event(id);
  return e.passed.load() >= e.recorded.load() ? 1 : 0;
}

int sg_event_wait(long id, long stream) {
  Event& e = event(id);
  uint64_t generation = e.recorded.load();
  return enqueue(stream, [&e, generation] {
    while (e.passed.load() < generation) nap();
  });
}

// The synchronous waits: they hold the driver until the stream (event) gets there.
int sg_event_synchronize(long id) {
  Call call("cudaEventSynchronize");
  if (!call.ok) return -1;
  if (lenient) call.lock.unlock();
  Event& e = event(id);
  uint64_t generation = e.recorded.load();
  for (auto end = limit(); e.passed.load() < generation; nap())
    if (Clock::now() >= end)
      return fail("an event was not reached within " + std::to_string(int(limit_s)) +
                  " s while this thread waited for it (holding the driver): on a GPU, a hang");
  return 0;
}

int sg_stream_synchronize(long handle) {
  Call call("cudaStreamSynchronize");
  if (!call.ok) return -1;
  if (lenient) call.lock.unlock();
  Stream* s = stream_of(handle);
  std::unique_lock<std::mutex> lock(s->mutex);
  if (!s->changed.wait_until(lock, limit(), [&] { return s->ops.empty() && !s->running; }))
    return fail("stream " + std::to_string(handle) + " did not drain within " +
                std::to_string(int(limit_s)) + " s while this thread waited for it (holding "
                "the driver): on a GPU, a hang");
  return 0;
}

}  // extern "C"
