#include "transport/transport.h"

#include "transport/inproc.h"
#include "transport/shm.h"
#include "transport/transfer_core.h"
#ifdef HXFER_WITH_UCX
#include "transport/ucx.h"
#endif

namespace hxfer::transport {

std::string_view ucxModeName(UcxMode mode) {
  switch (mode) {
    case UcxMode::kAuto:
      return "auto";
    case UcxMode::kPut:
      return "put";
    case UcxMode::kAm:
      return "am";
  }
  return "?";
}

StatusOr<UcxMode> parseUcxMode(std::string_view name) {
  if (name == "auto") return UcxMode::kAuto;
  if (name == "put") return UcxMode::kPut;
  if (name == "am") return UcxMode::kAm;
  return InvalidArgument("ucx mode '" + std::string(name) + "' is not one of auto, put, am");
}

std::string_view transferStateName(TransferState state) {
  switch (state) {
    case TransferState::kInProgress:
      return "in_progress";
    case TransferState::kDone:
      return "done";
    case TransferState::kFailed:
      return "failed";
    case TransferState::kCancelled:
      return "cancelled";
  }
  return "?";
}

std::string_view eventKindName(Event::Kind kind) {
  switch (kind) {
    case Event::Kind::kPeerConnected:
      return "peer_connected";
    case Event::Kind::kMessage:
      return "message";
    case Event::Kind::kPeerLost:
      return "peer_lost";
  }
  return "?";
}

namespace detail {

bool TransferCore::complete(Status status) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != TransferState::kInProgress) return false;
    if (status.isOk()) {
      state_ = TransferState::kDone;
    } else if (status.code() == StatusCode::kCancelled) {
      state_ = TransferState::kCancelled;
    } else {
      state_ = TransferState::kFailed;
    }
    status_ = std::move(status);
    callbacks.swap(on_terminal_);
  }
  cv_.notify_all();
  for (auto& fn : callbacks) fn();
  return true;
}

void TransferCore::notifyWhenTerminal(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == TransferState::kInProgress) {
      on_terminal_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

TransferState TransferCore::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

Status TransferCore::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

Status TransferCore::wait(Clock::time_point deadline) const {
  if (wait_helper_ && !helped_.exchange(true) && state() == TransferState::kInProgress) {
    wait_helper_();
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return state_ != TransferState::kInProgress; })) {
    return Timeout("transfer of " + std::to_string(bytes_) + " bytes in " +
                   std::to_string(op_count_) + " ops still in progress at its deadline");
  }
  return status_;
}

void TransferCore::requestCancel() {
  if (cancel_requested_.exchange(true, std::memory_order_acq_rel)) return;
  if (state() != TransferState::kInProgress) return;
  if (cancel_hook_) cancel_hook_();
}

}  // namespace detail

TransferState Transfer::poll() const { return core_ ? core_->state() : TransferState::kFailed; }

void Transfer::notifyWhenTerminal(std::function<void()> fn) const {
  if (core_) {
    core_->notifyWhenTerminal(std::move(fn));
  } else {
    fn();  // an empty handle is already terminal (kFailed)
  }
}

Status Transfer::wait(Clock::time_point deadline) const {
  return core_ ? core_->wait(deadline) : Internal("wait on an empty Transfer handle");
}

void Transfer::cancel() const {
  if (core_) core_->requestCancel();
}

Status Transfer::status() const {
  return core_ ? core_->status() : Internal("status of an empty Transfer handle");
}

uint64_t Transfer::bytes() const { return core_ ? core_->bytes() : 0; }
size_t Transfer::opCount() const { return core_ ? core_->opCount() : 0; }

StatusOr<Transfer> Agent::postWriteAfter(PeerId, std::vector<WriteOp>,
                                         std::shared_ptr<const device::Event>) {
  return Incompatible("backend '" + capabilities().name +
                      "' moves host memory and takes no device fence (postWriteAfter)");
}

StatusOr<std::unique_ptr<Agent>> createAgent(const AgentConfig& config) {
  if (config.backend == "inproc") return createInprocAgent(config);
  if (config.backend == "shm") return createShmAgent(config);
  if (config.backend == "cuda") {
    if (!config.device) {
      return Incompatible(
          "backend 'cuda' needs a device runtime (AgentConfig::device); this build has no CUDA "
          "implementation of the device seam yet");
    }
    return createShmAgent(config);
  }
  if (config.backend == "ucx") {
#ifdef HXFER_WITH_UCX
    return createUcxAgent(config);
#else
    return NotFound("backend 'ucx' is not compiled in (HXFER_WITH_UCX=OFF)");
#endif
  }
  return InvalidArgument("backend '" + config.backend + "' is not one of inproc, shm, cuda, ucx");
}

std::vector<std::string> availableBackends() {
#ifdef HXFER_WITH_UCX
  return {"shm", "ucx", "inproc"};
#else
  return {"shm", "inproc"};
#endif
}

}  // namespace hxfer::transport
