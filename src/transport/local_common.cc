#include "transport/local_common.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

namespace hxfer::transport::detail {

EventQueue::EventQueue() : efd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

EventQueue::~EventQueue() {
  if (efd_ >= 0) close(efd_);
}

void EventQueue::signal() {
  if (efd_ < 0) return;
  const uint64_t one = 1;
  // EAGAIN (counter saturated) still leaves the fd readable, which is all that matters.
  (void)!write(efd_, &one, sizeof(one));
}

void EventQueue::push(Event event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  signal();
}

void EventQueue::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  signal();
}

std::optional<Event> EventQueue::pop(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const bool woken = woken_;
      woken_ = false;
      if (!events_.empty()) {
        Event e = std::move(events_.front());
        events_.pop_front();
        // Another popper may be asleep while events remain: keep the fd readable for it.
        if (!events_.empty()) signal();
        return e;
      }
      if (woken) return std::nullopt;
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return std::nullopt;
    if (efd_ < 0) {
      std::this_thread::sleep_for(std::min<Clock::duration>(left, std::chrono::microseconds(50)));
      continue;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    pollfd pfd{efd_, POLLIN, 0};
    // A push between the check above and this call left the fd readable: no lost wake-up.
    if (ppoll(&pfd, 1, &ts, nullptr) > 0 && (pfd.revents & POLLIN)) {
      uint64_t count = 0;
      (void)!read(efd_, &count, sizeof(count));
    }
  }
}

Status validateOp(size_t index, const WriteOp& op, uint64_t local_length, uint64_t remote_length) {
  const std::string where = "op " + std::to_string(index) + " (local region " +
                            std::to_string(op.local_region) + ", remote region " +
                            std::to_string(op.remote_region) + ")";
  if (op.bytes == 0) return InvalidArgument(where + ": bytes=0; zero-byte writes are refused");
  if (op.local_offset > local_length || op.bytes > local_length - op.local_offset) {
    return InvalidArgument(where + ": local_offset=" + std::to_string(op.local_offset) +
                           " + bytes=" + std::to_string(op.bytes) +
                           " exceeds local region length=" + std::to_string(local_length));
  }
  if (op.remote_offset > remote_length || op.bytes > remote_length - op.remote_offset) {
    return InvalidArgument(where + ": remote_offset=" + std::to_string(op.remote_offset) +
                           " + bytes=" + std::to_string(op.bytes) +
                           " exceeds remote region length=" + std::to_string(remote_length));
  }
  return OkStatus();
}

Status checkMessageSize(size_t bytes, uint64_t max_bytes) {
  if (bytes <= max_bytes) return OkStatus();
  return InvalidArgument("message of " + std::to_string(bytes) +
                         " bytes exceeds max_message_bytes=" + std::to_string(max_bytes));
}

CopyWorker::CopyWorker() : q_(std::make_shared<Queue>()), thread_([this] { run(); }) {}

CopyWorker::~CopyWorker() {
  std::deque<CopyJob> left;
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    q_->stop = true;
  }
  q_->cv.notify_all();
  thread_.join();
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    left.swap(q_->jobs);
  }
  for (auto& job : left) job.core->complete(Unavailable("transport agent shut down"));
}

void CopyWorker::submit(CopyJob job) {
  std::weak_ptr<Queue> weak = q_;
  TransferCore* core = job.core.get();
  job.core->setWaitHelper([weak, core] {
    auto q = weak.lock();
    if (!q) return;
    CopyJob mine;
    {
      std::lock_guard<std::mutex> lock(q->mu);
      auto it = std::find_if(q->jobs.begin(), q->jobs.end(),
                             [&](const CopyJob& j) { return j.core.get() == core; });
      if (it == q->jobs.end()) return;  // already running (or done) on the worker
      mine = std::move(*it);
      q->jobs.erase(it);
    }
    execute(mine);
  });
  std::shared_ptr<TransferCore> refused;
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    if (q_->stop) {
      refused = job.core;
    } else {
      q_->jobs.push_back(std::move(job));
    }
  }
  if (refused) {
    refused->complete(Unavailable("transport agent shut down"));
    return;
  }
  q_->cv.notify_one();
}

void CopyWorker::execute(CopyJob& job) {
  Status result = OkStatus();
  for (const CopySegment& seg : job.segments) {
    if (job.core->cancelRequested()) {
      result = Cancelled("transfer cancelled before all ops were copied");
      break;
    }
    if (job.check) {
      result = job.check();
      if (!result.isOk()) break;
    }
    std::shared_lock<std::shared_mutex> lock(seg.dst->mu);
    if (!seg.dst->alive) {
      result = Unavailable("remote region " + std::to_string(seg.dst->id) +
                           " was deregistered by its owner during the transfer");
      break;
    }
    std::memcpy(seg.dst->base + seg.dst_offset, seg.src, seg.bytes);
  }
  // The copies must be visible before anyone can observe kDone (flush semantics).
  std::atomic_thread_fence(std::memory_order_release);
  if (result.isOk() && job.check) result = job.check();
  job.core->complete(std::move(result));
}

void CopyWorker::run() {
  for (;;) {
    CopyJob job;
    {
      std::unique_lock<std::mutex> lock(q_->mu);
      q_->cv.wait(lock, [&] { return q_->stop || !q_->jobs.empty(); });
      if (q_->stop) return;
      job = std::move(q_->jobs.front());
      q_->jobs.pop_front();
    }
    execute(job);
  }
}

}  // namespace hxfer::transport::detail
