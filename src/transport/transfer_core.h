// TransferCore: the shared state behind a Transfer handle. Backends own one per posted batch
// and finish it exactly once with complete(); the first terminal status wins and later calls
// are ignored (a peer-loss sweep and a finishing copy may race; whichever comes first counts).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "transport/transport.h"

namespace hxfer::transport::detail {

class TransferCore {
 public:
  TransferCore(uint64_t bytes, size_t op_count) : bytes_(bytes), op_count_(op_count) {}

  // Finishes the transfer: Ok -> kDone, Cancelled -> kCancelled, anything else -> kFailed.
  // Returns false when it had already finished.
  bool complete(Status status);
  TransferState state() const;
  Status status() const;
  Status wait(Clock::time_point deadline) const;

  // Marks cancellation requested and runs the backend's hook (once, outside the lock).
  void requestCancel();
  bool cancelRequested() const { return cancel_requested_.load(std::memory_order_acquire); }
  // The backend's way to stop early; may be called at most once, before the handle escapes.
  void setCancelHook(std::function<void()> hook) { cancel_hook_ = std::move(hook); }
  // Optional: wait() calls this once before blocking, so a backend can run queued work in the
  // waiting thread (memcpy backends run a not-yet-started copy inline, saving two thread
  // wake-ups). Set at most once, before the handle escapes.
  void setWaitHelper(std::function<void()> helper) { wait_helper_ = std::move(helper); }
  // Runs `fn` once when terminal (now, in this thread, if it already is); see
  // Transfer::notifyWhenTerminal. Callbacks run after the state is published, outside the lock.
  void notifyWhenTerminal(std::function<void()> fn);

  uint64_t bytes() const { return bytes_; }
  size_t opCount() const { return op_count_; }

 private:
  const uint64_t bytes_;
  const size_t op_count_;
  std::atomic<bool> cancel_requested_{false};
  std::function<void()> cancel_hook_;
  std::function<void()> wait_helper_;
  mutable std::atomic<bool> helped_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  TransferState state_ = TransferState::kInProgress;  // guarded by mu_
  Status status_;                                     // guarded by mu_
  std::vector<std::function<void()>> on_terminal_;    // guarded by mu_
};

// A transfer that is already terminal (empty batches, synchronous failures).
inline Transfer finishedTransfer(Status status, uint64_t bytes = 0, size_t op_count = 0) {
  auto core = std::make_shared<TransferCore>(bytes, op_count);
  core->complete(std::move(status));
  return Transfer(std::move(core));
}

}  // namespace hxfer::transport::detail
