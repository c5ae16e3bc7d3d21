#include "transport/local_common.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
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

bool EventQueue::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  return woken_ || !events_.empty();
}

std::optional<Event> EventQueue::pop(std::chrono::milliseconds timeout) {
  return popOrServe(timeout, -1, {});
}

std::optional<Event> EventQueue::popOrServe(std::chrono::milliseconds timeout, int fd,
                                            const std::function<bool()>& on_ready) {
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
      if (fd >= 0 && !on_ready()) fd = -1;
      continue;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    pollfd pfd[2] = {{efd_, POLLIN, 0}, {fd, POLLIN, 0}};
    // A push between the check above and this call left the fd readable: no lost wake-up.
    if (ppoll(pfd, fd >= 0 ? 2 : 1, &ts, nullptr) > 0) {
      if (pfd[0].revents & POLLIN) {
        uint64_t count = 0;
        (void)!read(efd_, &count, sizeof(count));
      }
      if (fd >= 0 && pfd[1].revents != 0 && !on_ready()) fd = -1;
    }
  }
}

void ServedFd::watch(int progress_epoll, int fd) {
  progress_epoll_ = progress_epoll;
  fd_ = fd;
  addToProgressSet();
}

void ServedFd::addToProgressSet() {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd_;
  epoll_ctl(progress_epoll_, EPOLL_CTL_ADD, fd_, &ev);
}

void ServedFd::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (servers_++ == 0) epoll_ctl(progress_epoll_, EPOLL_CTL_DEL, fd_, nullptr);
}

void ServedFd::leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--servers_ == 0) addToProgressSet();
}

std::optional<Event> pollServing(EventQueue& events, std::chrono::milliseconds timeout,
                                 std::mutex& drive_mu, ServedFd& served,
                                 const std::function<bool()>& serve,
                                 const std::function<void()>& wake_progress) {
  std::unique_lock<std::mutex> driving(drive_mu, std::try_to_lock);
  if (!driving.owns_lock()) return events.pop(timeout);
  served.enter();
  // Gives the fd back once: when serve leaves work or drive_mu is taken, else when the wait
  // ends (an exception from serve included, so the progress thread never stops watching). A
  // serve that threw may have left the worker unarmed, its fd silent: the progress thread is
  // then woken to go on, as when serve leaves work (it takes drive_mu once this frame let go).
  struct Serving {
    ServedFd& served;
    const std::function<void()>& wake_progress;
    const int unwinding = std::uncaught_exceptions();
    bool on = true;
    ~Serving() {
      if (!on) return;
      served.leave();
      if (std::uncaught_exceptions() > unwinding && wake_progress) wake_progress();
    }
  } serving{served, wake_progress};
  auto hand_back = [&](std::unique_lock<std::mutex>& lock) {
    serving.on = false;
    served.leave();
    if (!lock.owns_lock()) return;
    lock.unlock();
    if (wake_progress) wake_progress();
  };
  if (!serve()) {
    hand_back(driving);
    return events.pop(timeout);
  }
  driving.unlock();
  return events.popOrServe(timeout, served.fd(), [&] {
    std::unique_lock<std::mutex> lock(drive_mu, std::try_to_lock);
    if (lock.owns_lock() && serve()) return true;
    hand_back(lock);
    return false;
  });
}

Status validateOp(size_t index, const WriteOp& op, uint64_t local_length, uint64_t remote_length) {
  const bool local_ok =
      op.local_offset <= local_length && op.bytes <= local_length - op.local_offset;
  const bool remote_ok =
      op.remote_offset <= remote_length && op.bytes <= remote_length - op.remote_offset;
  if (op.bytes != 0 && local_ok && remote_ok) return OkStatus();  // no text for a good op
  const std::string where = "op " + std::to_string(index) + " (local region " +
                            std::to_string(op.local_region) + ", remote region " +
                            std::to_string(op.remote_region) + ")";
  if (op.bytes == 0) return InvalidArgument(where + ": bytes=0; zero-byte writes are refused");
  if (!local_ok) {
    return InvalidArgument(where + ": local_offset=" + std::to_string(op.local_offset) +
                           " + bytes=" + std::to_string(op.bytes) +
                           " exceeds local region length=" + std::to_string(local_length));
  }
  return InvalidArgument(where + ": remote_offset=" + std::to_string(op.remote_offset) +
                         " + bytes=" + std::to_string(op.bytes) +
                         " exceeds remote region length=" + std::to_string(remote_length));
}

Status checkMessageSize(size_t bytes, uint64_t max_bytes) {
  if (bytes <= max_bytes) return OkStatus();
  return InvalidArgument("message of " + std::to_string(bytes) +
                         " bytes exceeds max_message_bytes=" + std::to_string(max_bytes));
}

CopyWorker::CopyWorker() : q_(std::make_shared<Queue>()), thread_([this] { run(); }) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  q_->helpers.threads = std::min(cores, 4u) - 1;
  for (size_t i = 0; i < q_->helpers.threads; ++i) {
    helper_threads_.emplace_back([h = &q_->helpers] {
      std::unique_lock<std::mutex> lock(h->mu);
      for (;;) {
        h->cv.wait(lock, [&] { return h->stop || !h->tasks.empty(); });
        if (h->tasks.empty()) return;  // stopped and drained
        std::function<void()> task = std::move(h->tasks.front());
        h->tasks.pop_front();
        lock.unlock();
        task();
        lock.lock();
      }
    });
  }
}

CopyWorker::~CopyWorker() {
  std::deque<CopyJob> left;
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    q_->stop = true;
  }
  q_->cv.notify_all();
  thread_.join();
  {
    std::lock_guard<std::mutex> lock(q_->helpers.mu);
    q_->helpers.stop = true;
  }
  q_->helpers.cv.notify_all();
  for (std::thread& t : helper_threads_) t.join();
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    left.swap(q_->jobs);
  }
  for (auto& job : left) job.core->complete(Unavailable("transport agent shut down"));
}

void CopyWorker::prepare(CopyJob& job) {
  std::weak_ptr<Queue> weak = q_;
  TransferCore* core = job.core.get();
  // A device job is not run by its waiter: it may wait for a fence that the waiting thread
  // itself signals later, and the device does its copy anyway.
  if (!job.device_copy)
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
      execute(*q, mine);
    });
}

void CopyWorker::submit(CopyJob job) {
  // A small host job finds the worker idle with nothing queued: the caller copies it now, as
  // the worker would, and skips two thread hand-offs (waking the worker, and the worker waking
  // whoever waits for the transfer).
  const bool small = !job.device_copy && !job.ready && job.core->bytes() <= kInlineCopyBytes;
  std::shared_ptr<TransferCore> refused;
  bool here = false;
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    if (q_->stop) {
      refused = job.core;
    } else if (small && !q_->running && q_->jobs.empty()) {
      here = true;
    } else {
      q_->jobs.push_back(std::move(job));
    }
  }
  if (refused) {
    refused->complete(Unavailable("transport agent shut down"));
    return;
  }
  if (here) {
    execute(*q_, job);
    return;
  }
  q_->cv.notify_one();
}

Status CopyWorker::copySegments(const CopyJob& job, const Slice& slice) {
  const std::vector<CopySegment>& segments = job.segments;
  size_t i = slice.from;
  uint64_t offset = slice.from_offset;
  auto end_of = [&](size_t k) {
    return k == slice.to && slice.to_offset != 0 ? slice.to_offset : segments[k].bytes;
  };
  const size_t last = slice.to_offset != 0 ? slice.to + 1 : slice.to;
  while (i < last) {
    if (job.core->cancelRequested()) {
      return Cancelled("transfer cancelled before all ops were copied");
    }
    if (job.check) RETURN_IF_ERROR(job.check());
    RegionGuard* guard = segments[i].dst;
    std::shared_lock<std::shared_mutex> lock(guard->mu);
    if (!guard->alive) {
      return Unavailable("remote region " + std::to_string(guard->id) +
                         " was deregistered by its owner during the transfer");
    }
    uint64_t copied = 0;
    do {
      const CopySegment& seg = segments[i];
      const uint64_t end = end_of(i);
      std::memcpy(guard->base + seg.dst_offset + offset, seg.src + offset, end - offset);
      copied += end - offset;
      offset = 0;
      ++i;
    } while (i < last && segments[i].dst == guard && copied < kCheckBytes);
  }
  return OkStatus();
}

Status CopyWorker::copyOnDevice(const CopyJob& job) {
  // The fence is waited for here, on the host, so that a cancel or a lost peer while it is
  // pending ends the transfer with nothing written.
  while (job.ready && !job.ready->done()) {
    if (job.core->cancelRequested()) {
      return Cancelled("transfer cancelled while it waited for its fence");
    }
    if (job.check) RETURN_IF_ERROR(job.check());
    (void)job.ready->wait(std::chrono::milliseconds(5));
  }
  if (job.ready) {
    if (Status s = job.ready->status(); !s.isOk()) {
      return Status(s.code(), "the write's fence failed: " + s.message());
    }
  }
  if (job.core->cancelRequested()) return Cancelled("transfer cancelled before it was launched");
  if (job.check) RETURN_IF_ERROR(job.check());
  // Every destination stays mapped and registered until the device finished: the copy runs
  // asynchronously, so the guards are held for all of it (a retire waits, as for a memcpy).
  std::vector<RegionGuard*> guards;
  guards.reserve(job.guards.size());
  for (const auto& g : job.guards) guards.push_back(g.get());
  std::sort(guards.begin(), guards.end());
  guards.erase(std::unique(guards.begin(), guards.end()), guards.end());
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(guards.size());
  for (RegionGuard* g : guards) {
    locks.emplace_back(g->mu);
    if (!g->alive || g->retired) {
      return Unavailable("remote region " + std::to_string(g->id) +
                         " was deregistered by its owner before the transfer was launched");
    }
  }
  return job.device_copy(job.segments);
}

namespace {

// Cuts `segments` into `n` slices of about equal bytes, cutting a segment where a cut falls
// (at 4 KiB multiples, so slices do not share cache lines or pages of a segment). A slice past
// the end is empty.
std::vector<CopyWorker::Slice> cutInto(const std::vector<CopySegment>& segments, uint64_t total,
                                       size_t n) {
  std::vector<CopyWorker::Slice> slices(n);
  const uint64_t share = (total / n + 4095) & ~uint64_t{4095};
  size_t i = 0;
  uint64_t offset = 0;
  for (size_t part = 0; part < n; ++part) {
    CopyWorker::Slice& slice = slices[part];
    slice.from = i;
    slice.from_offset = offset;
    uint64_t room = part + 1 < n ? share : UINT64_MAX;
    while (i < segments.size() && room > 0) {
      const uint64_t take = std::min(segments[i].bytes - offset, room);
      room -= take;
      offset += take;
      if (offset == segments[i].bytes) {
        ++i;
        offset = 0;
      }
    }
    slice.to = i;
    slice.to_offset = offset;
  }
  return slices;
}

}  // namespace

void CopyWorker::execute(Queue& q, CopyJob& job) {
  Status result = OkStatus();
  uint64_t total = 0;
  for (const CopySegment& seg : job.segments) total += seg.bytes;
  const size_t helpers = q.helpers.threads;
  if (job.device_copy) {
    result = copyOnDevice(job);
  } else if (helpers == 0 || total < kParallelCopyBytes) {
    result = copySegments(job, Slice{0, 0, job.segments.size(), 0});
  } else {
    // Parts 1..n-1 go to the helpers; this thread copies part 0, then waits for the others
    // (the job's transfer may finish only when no copy of it runs any more).
    const size_t n = helpers + 1;
    const std::vector<Slice> parts = cutInto(job.segments, total, n);
    std::vector<Status> results(n);
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = n - 1;  // guarded by mu
    for (size_t i = 1; i < n; ++i) {
      auto task = [&, i] {
        Status s = copySegments(job, parts[i]);
        std::lock_guard<std::mutex> lock(mu);
        results[i] = std::move(s);
        if (--pending == 0) cv.notify_all();
      };
      bool inline_run = false;
      {
        std::lock_guard<std::mutex> lock(q.helpers.mu);
        if (q.helpers.stop) {
          inline_run = true;
        } else {
          q.helpers.tasks.push_back(task);
        }
      }
      if (inline_run) {
        task();
      } else {
        q.helpers.cv.notify_one();
      }
    }
    results[0] = copySegments(job, parts[0]);
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
    for (Status& s : results) {
      if (!s.isOk()) {
        result = std::move(s);
        break;
      }
    }
  }
  // The copies must be visible before anyone can observe kDone (flush semantics).
  std::atomic_thread_fence(std::memory_order_release);
  if (result.isOk() && job.check) result = job.check();
  job.core->complete(std::move(result));
}

namespace {

// A job the worker may take now: no fence, a done one, or one that must end without writing
// (cancelled, peer lost). A job behind a pending fence waits aside, holding up no other.
bool mayRun(const CopyJob& job) {
  return !job.ready || job.ready->done() || job.core->cancelRequested() ||
         (job.check && !job.check().isOk());
}

// How often jobs waiting for a fence are looked at again (a fence signals no one).
constexpr auto kFencePoll = std::chrono::milliseconds(1);

}  // namespace

void CopyWorker::run() {
  for (;;) {
    CopyJob job;
    {
      std::unique_lock<std::mutex> lock(q_->mu);
      q_->running = false;  // the last job, if any, has finished
      for (;;) {
        if (q_->stop) return;
        auto it = std::find_if(q_->jobs.begin(), q_->jobs.end(), mayRun);
        if (it != q_->jobs.end()) {
          job = std::move(*it);
          q_->jobs.erase(it);
          q_->running = true;
          break;
        }
        if (q_->jobs.empty()) {
          q_->cv.wait(lock);
        } else {
          q_->cv.wait_for(lock, kFencePoll);
        }
      }
    }
    execute(*q_, job);
  }
}

}  // namespace hxfer::transport::detail
