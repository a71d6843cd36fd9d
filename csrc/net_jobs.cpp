// The network transport's jobs (net.h's vocabulary): whole calls handed to the proxy
// thread, which runs them in order beside the caller (or one run now, on the caller's),
// and the tickets the caller waits on.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <thread>

#include "agreement.h"
#include "kernels.h"
#include "net.h"
#include "process.h"

namespace commlib {

namespace {

double now_seconds() {  // CLOCK_MONOTONIC: Python's time.monotonic
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

uint64_t NetComm::submit(NetJob job) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(jobs_lock_);
    ticket = ++submitted_;
    jobs_.emplace_back(ticket, std::move(job));
    if (!proxy_.joinable()) proxy_ = std::thread([this] { serve(); });
  }
  jobs_changed_.notify_all();
  return ticket;
}

bool NetComm::done(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(jobs_lock_);
  return finished_ >= ticket;
}

bool NetComm::settle(uint64_t ticket, double seconds) {
  std::unique_lock<std::mutex> lock(jobs_lock_);
  auto over = [&] { return finished_ >= ticket; };
  if (seconds < 0) {
    jobs_changed_.wait(lock, over);
    return true;
  }
  return jobs_changed_.wait_for(lock, std::chrono::duration<double>(seconds), over);
}

std::pair<double, double> NetComm::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(jobs_lock_);
  if (ticket == 0 || ticket > submitted_) throw std::invalid_argument("no such ticket");
  jobs_changed_.wait(lock, [&] { return finished_ >= ticket; });
  auto found = ended_.find(ticket);
  if (found == ended_.end()) throw std::invalid_argument("a ticket waited for twice");
  const Ended ended = found->second;
  ended_.erase(found);
  if (ended.error) std::rethrow_exception(ended.error);
  return {ended.started, ended.finished};
}

std::pair<double, double> NetComm::run_now(const NetJob& job) {
  const double started = now_seconds();
  execute(job);
  return {started, now_seconds()};
}

void NetComm::serve() {
  request_slice(100000);  // woken by the network on a busy core, it runs at once (process.h)
  pthread_setname_np(pthread_self(), "commlib-proxy");  // (commlib.work.own_cpu_seconds)
  std::unique_lock<std::mutex> lock(jobs_lock_);
  for (;;) {
    jobs_changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // (stopping)
    auto [ticket, job] = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    Ended ended{now_seconds(), 0, nullptr};
    try {
      execute(job);
    } catch (...) {
      ended.error = std::current_exception();
    }
    ended.finished = now_seconds();
    lock.lock();
    ended_[ticket] = ended;
    finished_ = ticket;
    jobs_changed_.notify_all();
  }
}

void NetComm::put_row(const NetJob& job) {
  std::copy(job.desc.begin(), job.desc.end(), row(rank_));
  std::copy(job.splits.begin(), job.splits.end(), row(rank_) + kDescFields);
}

void NetComm::execute(const NetJob& job) {
  std::lock_guard<std::mutex> running(running_);
  background_ = std::this_thread::get_id() == proxy_.get_id();
  const FastCall& c = job.call;
  if (job.eager) {
    eager_rows(job.desc, c, job.timeout);
  } else if (job.native) {  // (the proxy polls it with naps: poll_until)
    if (!takes_native(c)) throw std::logic_error("a native job MPI's collective cannot take");
    if (job.agree) {
      put_row(job);
      exchange_rows(header_, job.itemsize, !job.splits.empty(), job.timeout);
    }
    sent_ += native_->run(c, rank_, size_, job.timeout, background_);
  } else {
    if (job.agree) {
      put_row(job);
      send_rows(header_);
    }
    plan_rounds(job.plan, job.words, c.out.ptr, c.in.ptr, job.tmp_bytes, c.out.dtype, c.op,
                job.timeout, job.agree ? Agreed{job.itemsize, !job.splits.empty()} : Agreed{});
  }
  if (job.scale != 0)
    scale(reinterpret_cast<void*>(c.out.ptr), c.out.count, c.out.dtype, job.scale);
}

}  // namespace commlib
