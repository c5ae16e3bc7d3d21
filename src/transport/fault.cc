#include "transport/fault.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/logging.h"
#include "transport/transfer_core.h"

namespace hxfer::transport {

class FaultAgent final : public Agent {
 public:
  FaultAgent(std::unique_ptr<Agent> inner, FaultPolicy policy)
      : inner_(std::move(inner)), policy_(std::move(policy)), rng_(policy_.seed) {
    caps_ = inner_->capabilities();
    caps_.name = "fault(" + caps_.name + ")";
    timer_ = std::thread([this] { timerLoop(); });
  }

  ~FaultAgent() override {
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      stop_ = true;
    }
    timer_cv_.notify_all();
    timer_.join();
    // Delayed transfers whose inner transfer never finished are failed by their cores going
    // away with the inner agent; make it explicit for handles the caller still holds.
    for (auto& [due, task] : timers_) task(/*shutting_down=*/true);
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return inner_->localAddress(); }
  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region,
                                                RegionAccess access) override {
    return inner_->registerRegion(region, access);
  }
  Status deregisterRegion(uint32_t id) override { return inner_->deregisterRegion(id); }
  StatusOr<PeerId> connect(const std::string& address) override {
    auto peer = inner_->connect(address);
    if (!peer.isOk()) return peer;
    bool close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      close = ++connects_ == policy_.close_nth_connect;
      if (close) ++stats_.peers_closed;
    }
    if (close) (void)inner_->disconnect(*peer);
    return peer;
  }
  Status disconnect(PeerId peer) override { return inner_->disconnect(peer); }
  Status addRemoteRegion(PeerId peer, uint32_t id, uint64_t length,
                         std::span<const uint8_t> key) override {
    return inner_->addRemoteRegion(peer, id, length, key);
  }
  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    return inner_->pollEvent(timeout);
  }
  AgentStats agentStats() const override { return inner_->agentStats(); }
  void requireWriteGrants() override { inner_->requireWriteGrants(); }
  Status grantWrites(PeerId peer) override {
    bool close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      close = ++grants_ == policy_.close_nth_grant;
      if (close) ++stats_.peers_closed;
    }
    if (close) (void)inner_->disconnect(peer);
    return inner_->grantWrites(peer);
  }
  void wakeEventWaiter() override { inner_->wakeEventWaiter(); }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override {
    bool fail = false;
    bool close_after = false;
    uint64_t bytes = 0;
    for (const auto& op : ops) bytes += op.bytes;
    const size_t count = ops.size();
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t n = ++writes_;
      const double draw = uniform_(rng_);
      fail = n == policy_.fail_nth_write || draw < policy_.fail_write_probability;
      if (policy_.close_peer_after_writes != 0 &&
          ++writes_per_peer_[peer] == policy_.close_peer_after_writes) {
        close_after = true;
      }
      if (fail) ++stats_.writes_failed;
      if (close_after) ++stats_.peers_closed;
    }
    if (fail) {
      HXFER_LOG_DEBUG("fault: failing write to peer {}", peer);
      if (close_after) (void)inner_->disconnect(peer);
      return detail::finishedTransfer(policy_.fail_status, bytes, count);
    }
    auto inner = inner_->postWrite(peer, std::move(ops));
    if (close_after) {
      HXFER_LOG_DEBUG("fault: closing peer {}", peer);
      (void)inner_->disconnect(peer);
    }
    if (!inner.isOk() || policy_.write_delay.count() == 0) return inner;
    Transfer in = *inner;
    auto outer = std::make_shared<detail::TransferCore>(in.bytes(), in.opCount());
    outer->setCancelHook([in] { in.cancel(); });
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.writes_delayed;
    }
    scheduleCompletion(Clock::now() + policy_.write_delay, in, outer);
    return Transfer(outer);
  }

  // Fenced writes go to the inner agent as they are (no injected fault).
  StatusOr<Transfer> postWriteAfter(PeerId peer, std::vector<WriteOp> ops,
                                    std::shared_ptr<const device::Event> ready) override {
    return inner_->postWriteAfter(peer, std::move(ops), std::move(ready));
  }

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    bool drop = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t n = ++messages_;
      const double draw = uniform_(rng_);
      if (n == policy_.fail_nth_message) {
        ++stats_.messages_failed;
        return Unavailable("injected fault: peer " + std::to_string(peer) + " is gone");
      }
      drop = n == policy_.drop_nth_message || draw < policy_.drop_message_probability;
      if (drop) ++stats_.messages_dropped;
      if (!drop && policy_.message_delay.count() > 0) ++stats_.messages_delayed;
    }
    if (drop) {
      HXFER_LOG_DEBUG("fault: dropping a message to peer {}", peer);
      return OkStatus();
    }
    if (policy_.message_delay.count() == 0) return inner_->sendMessage(peer, payload);
    std::vector<uint8_t> copy(payload.begin(), payload.end());
    schedule(Clock::now() + policy_.message_delay, [this, peer, copy](bool shutting_down) {
      if (!shutting_down) (void)inner_->sendMessage(peer, copy);
    });
    return OkStatus();
  }

  FaultStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  using Task = std::function<void(bool shutting_down)>;

  void schedule(Clock::time_point due, Task task) {
    {
      std::lock_guard<std::mutex> lock(timer_mu_);
      timers_.emplace(std::make_pair(due, timer_seq_++), std::move(task));
    }
    timer_cv_.notify_all();
  }

  // Completes `outer` with `inner`'s status once both the delay passed and inner finished.
  void scheduleCompletion(Clock::time_point due, Transfer inner,
                          std::shared_ptr<detail::TransferCore> outer) {
    schedule(due, [this, inner, outer](bool shutting_down) {
      if (inner.poll() != TransferState::kInProgress) {
        outer->complete(inner.status());
      } else if (shutting_down) {
        outer->complete(Unavailable("fault agent shut down"));
      } else {
        scheduleCompletion(Clock::now() + std::chrono::milliseconds(1), inner, outer);
      }
    });
  }

  void timerLoop() {
    std::unique_lock<std::mutex> lock(timer_mu_);
    while (!stop_) {
      if (timers_.empty()) {
        timer_cv_.wait(lock);
        continue;
      }
      auto it = timers_.begin();
      if (Clock::now() < it->first.first) {
        timer_cv_.wait_until(lock, it->first.first);
        continue;
      }
      Task task = std::move(it->second);
      timers_.erase(it);
      lock.unlock();
      task(false);
      lock.lock();
    }
  }

  Capabilities caps_;
  std::unique_ptr<Agent> inner_;
  const FaultPolicy policy_;

  mutable std::mutex mu_;
  std::mt19937_64 rng_;                             // guarded by mu_
  std::uniform_real_distribution<double> uniform_;  // guarded by mu_
  uint64_t writes_ = 0;                             // guarded by mu_
  uint64_t messages_ = 0;                           // guarded by mu_
  uint64_t connects_ = 0;                           // guarded by mu_
  uint64_t grants_ = 0;                             // guarded by mu_
  std::map<PeerId, uint64_t> writes_per_peer_;      // guarded by mu_
  FaultStats stats_;                                // guarded by mu_

  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  // Ordered by (due, sequence): equal delays keep send order.
  std::map<std::pair<Clock::time_point, uint64_t>, Task> timers_;  // guarded by timer_mu_
  uint64_t timer_seq_ = 0;                                         // guarded by timer_mu_
  bool stop_ = false;                                              // guarded by timer_mu_
  std::thread timer_;
};

std::unique_ptr<Agent> wrapWithFaults(std::unique_ptr<Agent> inner, FaultPolicy policy) {
  return std::make_unique<FaultAgent>(std::move(inner), std::move(policy));
}

FaultStats faultStats(const Agent& agent) {
  if (auto* f = dynamic_cast<const FaultAgent*>(&agent)) return f->stats();
  return FaultStats{};
}

}  // namespace hxfer::transport
