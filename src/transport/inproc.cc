#include "transport/inproc.h"

#include <openssl/crypto.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/logging.h"
#include "transport/local_common.h"

namespace hxfer::transport {
namespace {

using detail::CopyJob;
using detail::CopyWorker;
using detail::EventQueue;
using detail::RegionGuard;
using detail::TransferCore;

constexpr std::string_view kScheme = "inproc:";
constexpr uint64_t kMaxMessageBytes = 64ull << 20;

struct InprocState;

struct InprocPeer {
  PeerId id = 0;
  std::weak_ptr<InprocState> remote;
  PeerId remote_id = 0;  // our id in the remote's table
  std::atomic<bool> lost{false};
  std::atomic<bool> granted{false};  // may declare our regions (Agent::grantWrites)
  std::map<uint32_t, detail::DeclaredRegion> remote_regions;  // guarded by state mu
};

// The part of an agent its peers can reach (through the registry or a peer's weak pointer).
struct InprocState {
  std::string name;
  std::string token;  // AgentConfig::auth_token; both agents of a connection must hold the same
  std::atomic<uint64_t> auth_failures{0};
  std::atomic<bool> grants_required{false};
  std::mutex mu;
  std::map<uint32_t, std::shared_ptr<RegionGuard>> regions;       // guarded by mu
  std::unordered_map<PeerId, std::shared_ptr<InprocPeer>> peers;  // guarded by mu
  PeerId next_peer = 1;                                           // guarded by mu
  EventQueue events;

  std::shared_ptr<InprocPeer> peer(PeerId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = peers.find(id);
    return it == peers.end() ? nullptr : it->second;
  }

  // Marks a peer lost: fails its transfers, forgets its regions, queues kPeerLost.
  void onPeerLost(PeerId id, const Status& why) {
    std::shared_ptr<InprocPeer> p;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = peers.find(id);
      if (it == peers.end()) return;
      p = it->second;
      if (p->lost.exchange(true)) return;
      p->remote_regions.clear();
    }
    events.push(Event{Event::Kind::kPeerLost, id, {}, why});
  }
};

std::mutex& registryMu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<std::string, std::weak_ptr<InprocState>>& registry() {
  static auto* r = new std::unordered_map<std::string, std::weak_ptr<InprocState>>();
  return *r;
}

class InprocAgent final : public Agent {
 public:
  explicit InprocAgent(std::shared_ptr<InprocState> state) : state_(std::move(state)) {
    caps_.name = "inproc";
    caps_.same_host_only = true;
    caps_.one_sided = true;
    caps_.many_small_ops_cheap = true;
    caps_.needs_memfd_regions = false;
    caps_.max_message_bytes = kMaxMessageBytes;
  }

  ~InprocAgent() override {
    {
      std::lock_guard<std::mutex> lock(registryMu());
      registry().erase(state_->name);
    }
    std::vector<std::shared_ptr<InprocPeer>> peers;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      for (auto& [id, p] : state_->peers) peers.push_back(p);
      for (auto& [id, g] : state_->regions) g->retire();
    }
    const Status gone = Unavailable("inproc agent '" + state_->name + "' shut down");
    for (auto& p : peers) {
      if (auto remote = p->remote.lock()) remote->onPeerLost(p->remote_id, gone);
      p->lost = true;
    }
    // copy_ (declared last) is destroyed first: queued jobs fail, the running one finishes.
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return std::string(kScheme) + state_->name; }

  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region,
                                                RegionAccess access) override {
    auto g = std::make_shared<RegionGuard>();
    g->id = region.id();
    g->base = region.data();
    g->length = region.length();
    std::lock_guard<std::mutex> lock(state_->mu);
    auto [it, inserted] = state_->regions.emplace(region.id(), g);
    if (!inserted) {
      return InvalidArgument("region id=" + std::to_string(region.id()) + " is already registered");
    }
    return std::vector<uint8_t>{};
  }

  Status deregisterRegion(uint32_t region_id) override {
    std::shared_ptr<RegionGuard> g;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto it = state_->regions.find(region_id);
      if (it == state_->regions.end()) {
        return NotFound("region id=" + std::to_string(region_id) + " is not registered");
      }
      g = it->second;
      state_->regions.erase(it);
    }
    g->retire();  // waits for copies into it to finish
    return OkStatus();
  }

  StatusOr<PeerId> connect(const std::string& address) override {
    if (!address.starts_with(kScheme)) {
      return InvalidArgument("inproc address '" + address + "' does not start with 'inproc:'");
    }
    const std::string name = address.substr(kScheme.size());
    std::shared_ptr<InprocState> remote;
    {
      std::lock_guard<std::mutex> lock(registryMu());
      auto it = registry().find(name);
      if (it != registry().end()) remote = it->second.lock();
    }
    if (!remote) return Unavailable("no inproc agent listens on '" + name + "'");
    // Same process, so no proof crosses anything: the tokens are compared directly.
    if (remote->token.size() != state_->token.size() ||
        CRYPTO_memcmp(remote->token.data(), state_->token.data(), state_->token.size()) != 0) {
      ++remote->auth_failures;
      ++state_->auth_failures;
      return PermissionDenied("inproc agent '" + name + "' holds another auth token");
    }
    auto mine = std::make_shared<InprocPeer>();
    auto theirs = std::make_shared<InprocPeer>();
    mine->remote = remote;
    theirs->remote = state_;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      mine->id = state_->next_peer++;
      state_->peers.emplace(mine->id, mine);
    }
    {
      std::lock_guard<std::mutex> lock(remote->mu);
      theirs->id = remote->next_peer++;
      remote->peers.emplace(theirs->id, theirs);
    }
    mine->remote_id = theirs->id;
    theirs->remote_id = mine->id;
    remote->events.push(Event{Event::Kind::kPeerConnected, theirs->id, {}, OkStatus()});
    return mine->id;
  }

  void requireWriteGrants() override { state_->grants_required = true; }

  Status grantWrites(PeerId peer) override {
    auto p = state_->peer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    p->granted = true;
    return OkStatus();
  }

  AgentStats agentStats() const override {
    AgentStats s;
    s.token_configured = !state_->token.empty();
    s.auth_failures = state_->auth_failures.load();
    return s;
  }

  Status disconnect(PeerId peer) override {
    auto p = state_->peer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    const Status why = Unavailable("peer " + std::to_string(peer) + " was disconnected");
    if (auto remote = p->remote.lock()) {
      remote->onPeerLost(p->remote_id, Unavailable("the peer disconnected"));
    }
    state_->onPeerLost(peer, why);
    return OkStatus();
  }

  Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                         std::span<const uint8_t> key) override {
    auto p = state_->peer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    auto remote = p->remote.lock();
    if (!remote || p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    std::shared_ptr<RegionGuard> g;
    {
      std::lock_guard<std::mutex> lock(remote->mu);
      auto me = remote->peers.find(p->remote_id);
      if (remote->grants_required && (me == remote->peers.end() || !me->second->granted)) {
        return PermissionDenied("peer " + std::to_string(peer) +
                                " has not granted this agent writes into its regions");
      }
      auto it = remote->regions.find(region_id);
      if (it == remote->regions.end()) {
        return NotFound("peer " + std::to_string(peer) +
                        " has no region id=" + std::to_string(region_id));
      }
      g = it->second;
    }
    if (length > g->length) {
      return InvalidArgument("remote region id=" + std::to_string(region_id) +
                             " length=" + std::to_string(length) +
                             " exceeds the peer's registered length=" + std::to_string(g->length));
    }
    std::lock_guard<std::mutex> lock(state_->mu);
    p->remote_regions[region_id] = detail::DeclaredRegion{g, length};
    return OkStatus();
  }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override {
    auto p = state_->peer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    CopyJob job;
    uint64_t total = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      job.segments.reserve(ops.size());
      for (size_t i = 0; i < ops.size(); ++i) {
        const WriteOp& op = ops[i];
        ASSIGN_OR_RETURN(auto regions,
                         detail::findOpRegions(i, op, peer, state_->regions, p->remote_regions));
        const auto& [local, remote] = regions;
        RETURN_IF_ERROR(detail::validateOp(i, op, (*local)->length, remote->length));
        job.add((*local)->base + op.local_offset, remote->guard, op.remote_offset, op.bytes);
        total += op.bytes;
      }
    }
    return detail::submitCopy(copy_, std::move(job), total, ops.size(), p, peer);
  }

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    RETURN_IF_ERROR(detail::checkMessageSize(payload.size(), kMaxMessageBytes));
    auto p = state_->peer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    auto remote = p->remote.lock();
    if (!remote || p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    remote->events.push(Event{Event::Kind::kMessage, p->remote_id,
                              std::vector<uint8_t>(payload.begin(), payload.end()), OkStatus()});
    return OkStatus();
  }

  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    return state_->events.pop(timeout);
  }
  void wakeEventWaiter() override { state_->events.wake(); }

 private:
  Capabilities caps_;
  std::shared_ptr<InprocState> state_;
  CopyWorker copy_;
};

}  // namespace

StatusOr<std::unique_ptr<Agent>> createInprocAgent(const AgentConfig& config) {
  static std::atomic<uint64_t> counter{0};
  auto state = std::make_shared<InprocState>();
  state->name = config.listen.empty() ? config.label + "-" + std::to_string(counter.fetch_add(1))
                                      : config.listen;
  state->token = config.auth_token;
  {
    std::lock_guard<std::mutex> lock(registryMu());
    auto& slot = registry()[state->name];
    if (slot.lock()) {
      return InvalidArgument("inproc listen name '" + state->name + "' is already in use");
    }
    slot = state;
  }
  return std::unique_ptr<Agent>(new InprocAgent(std::move(state)));
}

}  // namespace hxfer::transport
