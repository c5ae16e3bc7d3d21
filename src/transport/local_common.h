// Pieces shared by the memcpy-based backends (inproc and shm): an event queue, a guard that
// keeps a destination region mapped while a copy runs into it, op validation, and the copy
// worker thread that executes posted batches in order.
//
// Thread-safety: EventQueue and CopyWorker are thread-safe; RegionGuard is shared by
// shared_ptr and synchronises writers against its owner's deregistration.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device/device_api.h"
#include "transport/transfer_core.h"
#include "transport/transport.h"

namespace hxfer::transport::detail {

// FIFO of events with a blocking pop. The popper sleeps in ppoll on an eventfd rather than on a
// condition variable: every control message crosses this queue once, and with the fd wait the
// shm control round trip measured about 4x faster on a loaded machine (docs/performance.md,
// "Control round trip").
class EventQueue {
 public:
  EventQueue();
  ~EventQueue();
  EventQueue(const EventQueue&) = delete;
  EventQueue& operator=(const EventQueue&) = delete;

  void push(Event event);
  // The oldest event, waiting up to `timeout`; nullopt on timeout or after wake().
  std::optional<Event> pop(std::chrono::milliseconds timeout);
  // pop that also wakes when `fd` is readable and then calls `on_ready` (which may push), so
  // that the popper itself can serve a transport's fd instead of waiting for another thread
  // to do it. Once `on_ready` returns false the fd is no longer watched. Without an eventfd of
  // its own the queue naps as pop does and calls `on_ready` after each nap.
  std::optional<Event> popOrServe(std::chrono::milliseconds timeout, int fd,
                                  const std::function<bool()>& on_ready);
  // Makes the pop blocked now, or the next one, return (Agent::wakeEventWaiter).
  void wake();
  // Whether a pop would return at once: an event is queued, or wake() was called.
  bool ready();

 private:
  void signal();

  std::mutex mu_;
  std::deque<Event> events_;  // guarded by mu_
  bool woken_ = false;        // guarded by mu_
  // Readable whenever a push or wake may not have been seen by a sleeping pop; -1 when eventfd
  // could not be created (pop then naps in 50 us steps).
  int efd_ = -1;
};

// A transport fd that a caller waiting for an event may serve itself instead of the progress
// thread (pollServing): while any caller serves it, the fd is out of the progress thread's
// epoll set. The set is level-triggered, so whatever is readable when the fd comes back wakes
// the progress thread at once.
class ServedFd {
 public:
  // Once, before any caller serves: puts `fd` in `progress_epoll` (EPOLLIN), where the
  // progress thread watches it while nobody serves it.
  void watch(int progress_epoll, int fd);
  int fd() const { return fd_; }
  // A caller starts serving; the first takes the fd out of the progress thread's set.
  void enter();
  // A caller stops serving; the last puts the fd back.
  void leave();

 private:
  void addToProgressSet();

  std::mutex mu_;
  int servers_ = 0;  // guarded by mu_
  int progress_epoll_ = -1;
  int fd_ = -1;
};

// EventQueue::popOrServe for an agent whose sockets (shm) or worker (ucx) a waiting caller
// serves while the progress thread sleeps: a message that arrives then wakes the caller, not
// the progress thread and then the caller (docs/transport.md, "Who handles the sockets").
// `drive_mu` is held by whoever handles the fd; a caller that finds it taken only waits for
// events. `serve`, called with drive_mu held, handles what is ready and returns false when
// work is left that the progress thread must go on with (a burst of traffic): the caller then
// gives the fd back and calls `wake_progress` (may be empty). The caller also gives it back
// when it finds drive_mu taken later (the progress thread is at work and watches the fd again
// before it sleeps), and when the wait ends, however it ends.
std::optional<Event> pollServing(EventQueue& events, std::chrono::milliseconds timeout,
                                 std::mutex& drive_mu, ServedFd& served,
                                 const std::function<bool()>& serve,
                                 const std::function<void()>& wake_progress);

// A destination a writer may copy into. `owner` (optional) keeps a mapping alive (shm maps
// the peer's fd); writers hold `mu` shared while copying and the region's owner takes it
// exclusively to retire it, so deregistration waits for copies in flight and no copy lands
// after it returns.
struct RegionGuard {
  uint32_t id = 0;
  uint8_t* base = nullptr;
  uint64_t length = 0;
  std::shared_ptr<void> owner;
  std::shared_mutex mu;
  bool alive = true;  // guarded by mu
  // Set by retireWithoutWaiting: no copy may start into the region any more, while those
  // already running (device copies, holding mu shared) finish and keep `owner` alive.
  std::atomic<bool> retired{false};

  void retire() {
    std::unique_lock<std::shared_mutex> lock(mu);
    alive = false;
  }
  // retire() for a thread that must not wait for a device copy (the cuda agent's socket
  // thread): copies check `retired` under mu before they start.
  void retireWithoutWaiting() {
    retired = true;
    std::unique_lock<std::shared_mutex> lock(mu, std::try_to_lock);
    if (lock.owns_lock()) alive = false;
  }
};

// A peer's region as this agent declared it (addRemoteRegion): its guard, and the length
// declared, which writes are checked against (at most the guard's, the registered length).
struct DeclaredRegion {
  std::shared_ptr<RegionGuard> guard;
  uint64_t length = 0;
};

// Checks one op against the local and remote lengths; the message names the op and field.
Status validateOp(size_t index, const WriteOp& op, uint64_t local_length, uint64_t remote_length);

// The two regions op `index` of a batch to `peer` names: its local region in `locals` (this
// agent's registrations, by id) and its remote region in `remotes` (what `peer` declared, by
// id). NotFound names the op and the unknown region. Pointers into the maps: valid while the
// caller holds the lock that guards them.
template <typename Locals, typename Remotes>
StatusOr<std::pair<const typename Locals::mapped_type*, const typename Remotes::mapped_type*>>
findOpRegions(size_t index, const WriteOp& op, PeerId peer, const Locals& locals,
              const Remotes& remotes) {
  auto l = locals.find(op.local_region);
  if (l == locals.end()) {
    return NotFound("op " + std::to_string(index) +
                    ": local region id=" + std::to_string(op.local_region) + " is not registered");
  }
  auto r = remotes.find(op.remote_region);
  if (r == remotes.end()) {
    return NotFound("op " + std::to_string(index) +
                    ": remote region id=" + std::to_string(op.remote_region) + " of peer " +
                    std::to_string(peer) + " was not added");
  }
  return std::make_pair(&l->second, &r->second);
}

struct CopySegment {
  const uint8_t* src = nullptr;
  RegionGuard* dst = nullptr;  // kept alive by its job (CopyJob::guards)
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

struct CopyJob {
  std::shared_ptr<TransferCore> core;
  std::vector<CopySegment> segments;
  // Every segment's destination guard, held once per run of segments into it rather than
  // once per segment: a storm's ops would otherwise each count a reference in and out.
  std::vector<std::shared_ptr<RegionGuard>> guards;
  // Appends a segment of `bytes` from `src` into `dst` at `dst_offset`.
  void add(const uint8_t* src, const std::shared_ptr<RegionGuard>& dst, uint64_t dst_offset,
           uint64_t bytes) {
    if (guards.empty() || guards.back() != dst) guards.push_back(dst);
    segments.push_back(CopySegment{src, dst.get(), dst_offset, bytes});
  }
  // Called before every stretch of segments (local_common.cc) and after the last one: a non-ok
  // status (e.g. Unavailable when the peer was lost) stops the copy and finishes the transfer with
  // it. Only whoever runs the job (the worker, a waiter, or its submitter for a small job) finishes
  // a job's transfer, so a terminal transfer never has a copy running: once a caller sees kDone /
  // kFailed / kCancelled, neither its source nor its destination is touched again.
  std::function<Status()> check;
  // Set for device memory (the cuda backend): runs the whole job's segments as device work and
  // returns once the device finished them (its event), instead of the worker's memcpy. The
  // worker holds every destination guard (shared) around it, as around a memcpy.
  std::function<Status(const std::vector<CopySegment>&)> device_copy;
  // device_copy only: nothing is copied before this event is done (postWriteAfter).
  std::shared_ptr<const device::Event> ready;
};

// One thread that runs copy jobs in FIFO order, except that a job behind a pending fence
// (CopyJob::ready) waits aside while later ones run, and that a waiter or (small jobs) the
// submitter may run a job itself, beside the worker (below). Before each stretch of segments into
// one region (at most 256 KiB, or one larger segment) it honours cancellation and the job's check
// (peer lost). A job of at least kParallelCopyBytes is cut
// into equal parts that helper threads copy alongside it (one per further core, at most 3), so one
// large request uses the machine's copy bandwidth, not one thread's; the job still finishes only
// once every part stopped.
// A thread waiting on a transfer whose job has not started takes the job out of the queue and
// runs it itself (TransferCore::setWaitHelper): no hand-off to this thread and back. A host job
// of at most kInlineCopyBytes submitted while the worker is idle with nothing queued is copied
// by the submitting thread before submit returns (its transfer is then terminal), for the same
// reason: a small request's write is a few microseconds of copying and two wake-ups.
inline constexpr uint64_t kParallelCopyBytes = 8ull << 20;
inline constexpr uint64_t kInlineCopyBytes = 256 << 10;

class CopyWorker {
 public:
  CopyWorker();
  // Fails queued jobs with Unavailable("agent shut down") and joins; the running job stops at
  // its next check.
  ~CopyWorker();
  // Before the job's transfer escapes (its core set, `core->bytes()` its segments' total): lets
  // a thread that waits on the transfer run the job itself while it is still queued.
  void prepare(CopyJob& job);
  // Runs or queues a prepared job.
  void submit(CopyJob job);
  // A stretch of a job's segments, in bytes: from byte `from_offset` of segment `from` up to
  // (not including) byte `to_offset` of segment `to` (to_offset 0: up to segment `to`).
  struct Slice {
    size_t from = 0;
    uint64_t from_offset = 0;
    size_t to = 0;
    uint64_t to_offset = 0;
  };

 private:
  // Threads that copy parts of large jobs. After stop, a part submitted runs on its caller.
  struct Helpers {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;  // guarded by mu
    bool stop = false;                        // guarded by mu
    size_t threads = 0;                       // fixed at construction
  };
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<CopyJob> jobs;  // guarded by mu
    bool stop = false;         // guarded by mu
    bool running = false;      // guarded by mu: the worker thread is executing a job
    Helpers helpers;
  };
  static void execute(Queue& q, CopyJob& job);
  // Copies `slice` of the job's segments. Cancellation and the job's check are honoured, and
  // the destination's guard taken, once per stretch of up to kCheckBytes into one region: a
  // guard or check per op cost more than copying a few hundred bytes.
  static Status copySegments(const CopyJob& job, const Slice& slice);
  static constexpr uint64_t kCheckBytes = 256 << 10;
  static Status copyOnDevice(const CopyJob& job);
  void run();
  std::vector<std::thread> helper_threads_;

  std::shared_ptr<Queue> q_;  // shared with wait helpers, which may outlive the worker
  std::thread thread_;
};

// Gives `job` (its segments filled, `total` bytes over `op_count` ops, at least one) its
// transfer, whose copy stops Unavailable once `peer` (id `id`) is lost. The caller records the
// transfer where its peer-loss handling looks, then submits the job: a small job may be copied
// within submit (CopyWorker), so it must be visible as outgoing before.
template <typename Peer>
Transfer prepareCopy(CopyWorker& worker, CopyJob& job, uint64_t total, size_t op_count,
                     const std::shared_ptr<Peer>& peer, PeerId id) {
  job.core = std::make_shared<TransferCore>(total, op_count);
  job.check = [weak = std::weak_ptr<Peer>(peer), id]() -> Status {
    auto q = weak.lock();
    if (!q || q->lost) return Unavailable("peer " + std::to_string(id) + " was lost");
    return OkStatus();
  };
  worker.prepare(job);
  return Transfer(job.core);
}

// prepareCopy and submit, for a backend that tracks no outgoing copies. An empty batch is done
// at once.
template <typename Peer>
Transfer submitCopy(CopyWorker& worker, CopyJob job, uint64_t total, size_t op_count,
                    const std::shared_ptr<Peer>& peer, PeerId id) {
  if (op_count == 0) return finishedTransfer(OkStatus());
  Transfer t = prepareCopy(worker, job, total, op_count, peer, id);
  worker.submit(std::move(job));
  return t;
}

// InvalidArgument naming both sizes when a message is larger than `max_bytes`.
Status checkMessageSize(size_t bytes, uint64_t max_bytes);

}  // namespace hxfer::transport::detail
