#include "engine/context_sender.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"
#include "device/copy_table_builder.h"
#include "device/device_api.h"
#include "engine/handshake.h"
#include "plan/staging.h"

namespace hxfer::engine {

// One generation rank connected to us.
struct ContextSender::Peer {
  transport::PeerId id = 0;
  bool ready = false;              // Hello accepted and answered
  bool refused = false;            // refused; messages are ignored until it goes away
  wire::RankInfo info;             // valid when ready
  uint64_t incarnation = 0;        // from its Hello; 0 from a peer older than minor 2
  uint16_t minor = 0;              // the frame minor of its Hello: every later frame says it too
  std::optional<Planner> planner;  // this rank -> that generation rank
  // The ranks of its instance that this rank writes to (each will ask for every request): the
  // instance's shape is the peer's, worked out once at its Hello.
  std::vector<uint32_t> expected;
  uint64_t block_budget = 0;      // destination blocks its waiting asks may name together
  bool regions_declared = false;  // its regions are write targets (at its first request)
  // Requests whose TransferDone went to this peer (with the epoch it answered), so that a
  // Cancel crossing that Done is recognised as such and not answered a second time.
  RecentIds<uint64_t> answered;
  // Its asks not answered yet, and the destination blocks they name (the per-peer bounds).
  size_t open_asks = 0;
  uint64_t open_blocks = 0;
  explicit Peer(size_t remembered) : answered(remembered) {}
  uint32_t globalRank() const { return info.globalRank(); }
};

// One posted write of an ask: the whole request, or (streaming) the layers that became ready
// since the previous one.
struct ContextSender::Piece {
  transport::Transfer transfer;
  bool terminal = false;
  Clock::time_point posted_at;
  // The staging area of a plan with pack ops (RankPlan::scratch_bytes), registered with the
  // agent as a local source while its write runs; released once the write is terminal.
  std::unique_ptr<Region> scratch;
  // Device pools: the pack that fills `scratch` (the write waits for it; the area is reused
  // only once it is done).
  std::shared_ptr<const device::Event> pack;
  // Device pools behind a host agent (postFromDeviceLocked): the device's copy of the part into
  // `scratch` runs, `transfer` is empty, and `ops` (`bytes` in all) are posted once the copy is
  // done (advanceAskLocked); `posted_at` is when the copy was queued, reset when the work
  // ahead of it on the stream is seen done (`behind`).
  std::shared_ptr<const device::Event> copying;
  std::vector<transport::WriteOp> ops;
  uint64_t bytes = 0;
  // Device pools: the work queued on the pack stream before this piece's pack or copy, while it
  // is not done. Until it is, the piece's stall clock runs only while the stream makes no
  // progress (stallsLocked, stream_work_); then it restarts for the piece's own work.
  std::shared_ptr<const device::Event> behind;
  size_t staged_runs = 0;  // the slot's runs (a staged part), counted once it is posted
  bool window = false;     // a window of a part larger than the slot, counted once posted
};

// A staged part's plan of every layer (the request is ready by then: it does not change), its
// gather in slot order, and, host pools, its pack, done at the first window that needs it.
struct ContextSender::StagedPlan {
  RankPlan plan;
  SlotGather gather;
  std::vector<uint8_t> packed;
  bool pack_done = false;
  bool pack_counted = false;  // device pools: the first window that packed counted the part
};

// One TransferRequest of one generation rank for one request.
struct ContextSender::Ask {
  // kWaiting: nothing started. kPosted: started (one cache transfer hold, from beginTransfer
  // until the answer); pieces are posted as layers become ready. kAnswered: Done sent.
  enum class State { kWaiting, kPosted, kAnswered };
  transport::PeerId peer = 0;
  uint32_t gen_rank = 0;
  wire::TransferRequest req;
  State state = State::kWaiting;
  std::string instance;      // the asking generation instance
  uint64_t incarnation = 0;  // of the asking rank (its Hello)
  bool peer_gone = false;
  bool counted = false;           // in its peer's open_asks / open_blocks
  bool cancel_requested = false;  // by the generation rank
  bool stalled = false;           // cancelled for making no progress (stall_timeout)
  bool stalled_in_copy = false;   // that was the device's copy into host memory
  std::optional<Status> failed;   // a piece failed or could not be planned / posted
  std::vector<Piece> pieces;
  // A device copy of a part that ended unposted and may still read the request's pages: the
  // ask's transfer hold outlives its answer until the copy is done (held_for_copies_).
  std::shared_ptr<const device::Event> reading;
  uint32_t sent_end = 0;  // global layers below this one are planned and posted (kPosted)
  uint64_t bytes = 0;
  // A staged part asked for window by window (wire::Staging::window): the bytes its earlier
  // windows moved. `more`: answered, but a window of it is still to come; the generation
  // rank's next ask (same epoch, the next window) continues this one.
  uint64_t earlier_bytes = 0;
  bool more = false;
  // A staged part: its plan and gather, prepared at its first window and taken over by each
  // continuation, so that a window costs its own ops only.
  std::shared_ptr<StagedPlan> staged;
  // The part's checksum (options_.checksum) when it went as one plan of every layer, taken from
  // that plan; a streamed part's is computed once its last piece ended.
  std::optional<uint64_t> checksum;
  Clock::time_point asked_at;
  size_t inFlight() const {
    return std::count_if(pieces.begin(), pieces.end(), [](const Piece& p) { return !p.terminal; });
  }
};

// Everything known about one request id on this rank.
struct ContextSender::Source {
  uint64_t id = 0;
  bool ready = false;   // every layer of this rank is final (the last markReady came)
  bool marked = false;  // some markReady came
  bool owned = false;   // we hold the cache allocation and must free it
  std::optional<Status> cancelled;
  // progress_at: the latest markReady, or the latest window answered (Ask::more).
  Clock::time_point created_at, ready_at, progress_at;
  uint32_t ready_end = 0;  // global layers below this one are final (marked ready)
  std::vector<Ask> asks;
  std::optional<std::vector<uint32_t>> expected;  // gen global ranks that will ask
  std::set<uint32_t> finished;                    // gen ranks answered or gone
  Bytes aux;                                      // from markReady, sent with every ok Done
  // The engine's event from the latest markReady that gave one: no write of the request
  // starts before it is done (device pools).
  std::shared_ptr<const device::Event> ready_event;
  size_t postedCount() const {
    return std::count_if(asks.begin(), asks.end(),
                         [](const Ask& a) { return a.state == Ask::State::kPosted; });
  }
  bool anyInFlight() const {
    return std::any_of(asks.begin(), asks.end(), [](const Ask& a) { return a.inFlight() > 0; });
  }
};

StatusOr<std::unique_ptr<ContextSender>> ContextSender::create(
    Options options, HybridCacheManager* cache, std::unique_ptr<transport::Agent> agent) {
  if (cache == nullptr || agent == nullptr) return InvalidArgument("cache and agent are required");
  const int ordinal = deviceOrdinal(options.device.get(), *cache);
  if (options.device && ordinal < 0 && agent->capabilities().device_memory &&
      !cache->regions().empty()) {
    // Over a device agent the pools are device memory: the runtime must know them.
    RETURN_IF_ERROR(options.device->owner(cache->regions().front()->data(), 1).status());
  }
  RETURN_IF_ERROR(checksumsPossible(options.checksum,
                                    agent->capabilities().device_memory || ordinal >= 0,
                                    agent->capabilities().name));
  const RankLayout& layout = cache->layout();
  if (layout.tp != options.parallel.tp || layout.pp != options.parallel.pp ||
      layout.tp_rank != options.tp_rank || layout.pp_rank != options.pp_rank) {
    return InvalidArgument(
        "cache layout rank " + rankName(layout) + " of tp=" + std::to_string(layout.tp) +
        " pp=" + std::to_string(layout.pp) + " does not match the options' rank");
  }
  std::unique_ptr<ContextSender> s(new ContextSender(std::move(options), cache, std::move(agent)));
  s->self_.instance_id = s->options_.instance_id;
  s->self_.role = wire::InstanceRole::kContext;
  const std::string addr = s->agent_->localAddress();
  s->self_.address.assign(addr.begin(), addr.end());
  s->self_.layout = layout;
  s->device_ordinal_ = ordinal;
  s->staged_device_ = ordinal >= 0 && !s->agent_->capabilities().device_memory;
  // Device pools behind a host agent are never written from: their bytes go through host areas.
  for (const auto& region : cache->regions()) {
    if (s->staged_device_) break;
    ASSIGN_OR_RETURN(Bytes key,
                     s->agent_->registerRegion(*region, transport::RegionAccess::kLocalSource));
    if (!key.empty()) s->self_.region_keys.push_back({region->id(), std::move(key)});
  }
  RETURN_IF_ERROR(wire::checkRankInfo(s->self_).withContext("own rank_info"));
  s->memory_ = cacheMemory(*cache);
  s->stage_ = layout.stageLayers();
  s->waker_->agent = s->agent_.get();
  s->thread_ = std::thread([p = s.get()] { p->run(); });
  return s;
}

ContextSender::ContextSender(Options options, HybridCacheManager* cache,
                             std::unique_ptr<transport::Agent> agent)
    : options_(std::move(options)),
      cache_(cache),
      agent_(std::move(agent)),
      tombstones_(options_.max_remembered_ids),
      incarnation_(newIncarnation()) {}

ContextSender::~ContextSender() { shutdown(); }

std::string ContextSender::address() const { return agent_->localAddress(); }

MetricsSnapshot ContextSender::metrics() const {
  MetricsSnapshot m = metrics_.snapshot(agent_->agentStats());
  m.accounting_errors = selfCheck().isOk() ? 0 : 1;
  return m;
}

Status ContextSender::selfCheck() const {
  std::lock_guard lock(mu_);
  RETURN_IF_ERROR(cache_->selfCheck());
  uint64_t posted = 0;
  for (const auto& [id, src] : sources_) {
    posted += src->postedCount();
    if (src->owned && !cache_->find(id).isOk()) {
      return Internal("context accounting: the sender owns request " + std::to_string(id) +
                      ", which the cache does not know");
    }
  }
  posted += held_for_copies_.size();
  const uint64_t inflight = cache_->counters().inflight_transfers;
  if (inflight != posted) {
    return Internal("context accounting: the cache has " + std::to_string(inflight) +
                    " transfers in flight, the sender posted " + std::to_string(posted));
  }
  return OkStatus();
}

size_t ContextSender::heldRequests() const {
  std::lock_guard lock(mu_);
  return std::count_if(sources_.begin(), sources_.end(),
                       [](const auto& kv) { return kv.second->owned; });
}

size_t ContextSender::connectedPeers() const {
  std::lock_guard lock(mu_);
  return std::count_if(peers_.begin(), peers_.end(),
                       [](const auto& kv) { return kv.second->ready; });
}

size_t ContextSender::rememberedIds() const {
  std::lock_guard lock(mu_);
  size_t n = tombstones_.size();
  for (const auto& [id, peer] : peers_) n += peer->answered.size();
  return n;
}

Status ContextSender::markReady(uint64_t request_id, Bytes aux) {
  return markReady(request_id, kAllLayers, std::move(aux));
}

Status ContextSender::markReady(uint64_t request_id, LayerRange layers, Bytes aux,
                                std::shared_ptr<const device::Event> ready) {
  const std::string what = "request " + std::to_string(request_id);
  if (ready && !agent_->capabilities().device_memory && device_ordinal_ < 0) {
    return InvalidArgument(what + ": a device event given with pools in host memory (" +
                           agent_->capabilities().name + " agent)");
  }
  if (aux.size() > wire::kMaxAuxBytes) {
    return InvalidArgument(what + ": aux is " + std::to_string(aux.size()) + " bytes, limit " +
                           std::to_string(wire::kMaxAuxBytes));
  }
  RETURN_IF_ERROR(cache_->find(request_id).status());
  std::lock_guard lock(mu_);
  if (stop_) return Unavailable("context sender is shut down");
  auto it = sources_.find(request_id);
  Source* known = it == sources_.end() ? nullptr : it->second.get();
  if (known != nullptr && known->marked) {
    if (known->ready) return InvalidArgument(what + " is already marked ready");
    if (known->cancelled) {
      // Streamed, and ended between two ranges: the serving code hears it here, at the first
      // call after the end, and only now stops writing the pages, so only now are they freed.
      const Status why = *known->cancelled;
      freePagesLocked(*known);
      maybeFinishLocked(request_id);
      return Status(why.code(),
                    what + " ended before its last layers were ready: " + why.message());
    }
  } else if (const Tombstone* dead = tombstones_.find(request_id)) {
    // Cancelled, or every rank that asked was already told it timed out: nobody will take the
    // state. The tombstone stays, so a TransferRequest still on its way hears the same.
    (void)cache_->free(request_id);
    return Status(dead->why.code(), what + " is dead before ready: " + dead->why.message());
  }
  const uint32_t from = known != nullptr && known->marked ? known->ready_end : stage_.first;
  uint32_t end = stage_.end();
  if (layers != kAllLayers) {
    const auto range = [](uint32_t a, uint64_t b) {
      return "[" + std::to_string(a) + ", " + std::to_string(b) + ")";
    };
    const uint64_t want_end = uint64_t{layers.first} + layers.count;
    if (layers.count == 0 || want_end > stage_.end() || want_end <= from || layers.first > from) {
      std::string why =
          layers.count == 0 ? "is empty"
          : want_end > stage_.end()
              ? "goes past this rank's layers " + range(stage_.first, stage_.end())
          : want_end <= from
              ? "was marked ready already (layers below " + std::to_string(from) + " are)"
              : "leaves layers " + range(from, layers.first) + " not ready";
      return InvalidArgument(what + ": layers " + range(layers.first, want_end) + " " + why);
    }
    end = static_cast<uint32_t>(want_end);
  }
  auto& slot = sources_[request_id];
  if (!slot) {
    slot = std::make_unique<Source>();
    slot->id = request_id;
    slot->created_at = Clock::now();
    slot->ready_end = stage_.first;
  }
  Source& src = *slot;
  src.marked = true;
  src.owned = true;
  src.ready_end = end;
  src.progress_at = Clock::now();
  if (!aux.empty()) src.aux = std::move(aux);
  if (ready) src.ready_event = std::move(ready);
  if (end == stage_.end()) {
    src.ready = true;
    src.ready_at = src.progress_at;
  } else {
    metrics_.rangeStreamed();
  }
  tryStartLocked(src);
  maybeFinishLocked(request_id);
  return OkStatus();
}

Status ContextSender::cancel(uint64_t request_id) {
  std::lock_guard lock(mu_);
  const Status why = Cancelled("request " + std::to_string(request_id) + " cancelled by context");
  auto it = sources_.find(request_id);
  if (it == sources_.end()) {
    tombstones_.put(request_id, Tombstone{why, {}, {}}, rememberUntil());
    return OkStatus();
  }
  cancelLocked(*it->second, why);
  maybeFinishLocked(request_id);
  return OkStatus();
}

void ContextSender::cancelLocked(Source& src, const Status& why) {
  if (src.cancelled) {
    // Ended already (a streamed request whose ranges stopped coming timed out): its pages were
    // kept only while prefill might still write them. The engine's cancel says it stopped.
    freePagesLocked(src);
    return;
  }
  src.cancelled = why;
  for (Ask& a : src.asks) {
    if (a.state == Ask::State::kWaiting) {
      answerLocked(src, a, why, 0, std::nullopt);
    } else if (a.state == Ask::State::kPosted) {
      advanceAskLocked(src, a);  // cancels its pieces; answers once none is in flight
    } else {
      endWindowsLocked(src, a, FailureCause::kCancelled);  // its next window hears `why`
    }
  }
  freePagesLocked(src);
  tombstones_.put(src.id, tombstoneLocked(src, why), rememberUntil());
}

ContextSender::Tombstone ContextSender::tombstoneLocked(const Source& src, const Status& why) {
  Tombstone t{why, {}, {}};
  if (src.asks.empty()) return t;
  t.instance = src.asks.front().instance;  // one instance per id (checkJoinLocked)
  for (const Ask& a : src.asks) t.askers.emplace_back(a.gen_rank, a.incarnation);
  return t;
}

bool ContextSender::Tombstone::answers(const std::string& asking, uint32_t rank,
                                       uint64_t incarnation) const {
  if (instance.empty()) return true;
  if (asking != instance) return false;
  for (const auto& [r, inc] : askers) {
    if (r == rank && inc != incarnation) return false;  // that rank restarted since
  }
  return true;
}

void ContextSender::freePagesLocked(Source& src) {
  if (!src.owned) return;
  src.owned = false;
  if (src.postedCount() > 0) metrics_.quarantined();
  if (Status s = cache_->free(src.id); !s.isOk()) {
    HXFER_LOG_ERROR("context: freeing request {}: {}", src.id, s.toString());
  }
}

void ContextSender::maybeFinishLocked(uint64_t request_id) {
  auto it = sources_.find(request_id);
  if (it == sources_.end()) return;
  Source& src = *it->second;
  if (src.postedCount() > 0) return;
  // A streamed request's pages are still being written by prefill until its last range. A rank
  // that asks again (a new connection, or the next window of a staged part) is not finished,
  // whatever an earlier ask of it left in `finished`.
  const bool live = std::any_of(src.asks.begin(), src.asks.end(), [](const Ask& a) {
    return a.more || (a.state != Ask::State::kAnswered && !a.peer_gone);
  });
  if (src.owned && src.ready && src.expected && !live) {
    const bool all = std::all_of(src.expected->begin(), src.expected->end(),
                                 [&](uint32_t r) { return src.finished.count(r) > 0; });
    if (all) freePagesLocked(src);
  }
  const bool pending = std::any_of(src.asks.begin(), src.asks.end(), [](const Ask& a) {
    return a.state != Ask::State::kAnswered && !a.peer_gone;
  });
  if (!src.owned && !pending && (src.ready || src.cancelled)) sources_.erase(it);
}

void ContextSender::sendLocked(transport::PeerId peer, const wire::Message& m) {
  if (Status s = wire::checkMessage(m); !s.isOk()) {
    HXFER_LOG_ERROR("context: not sending invalid {}: {}", wire::summarize(m), s.toString());
    return;
  }
  const Bytes frame = wire::encodeMessage(m);
  if (Status s = agent_->sendMessage(peer, frame); !s.isOk()) {
    HXFER_LOG_WARN("context: send {} to peer {}: {}", wire::summarize(m), peer, s.toString());
  }
}

void ContextSender::refuseLocked(Peer& peer, const Status& why) {
  HXFER_LOG_WARN("context rank {}: refusing generation peer {}: {}", rankName(self_.layout),
                 peer.id, why.toString());
  metrics_.handshake(false);
  peer.refused = true;
  peer.ready = false;
  sendLocked(peer.id, wire::Error{why});
  (void)agent_->disconnect(peer.id);
}

void ContextSender::onHelloLocked(Peer& peer, wire::Hello hello) {
  if (peer.ready) {
    refuseLocked(peer, InvalidArgument("second hello on one connection"));
    return;
  }
  // A connection this Hello replaces (the same rank again) does not count.
  const size_t connected = std::count_if(peers_.begin(), peers_.end(), [&](const auto& kv) {
    const Peer& p = *kv.second;
    return p.ready && !(p.info.instance_id == hello.rank_info.instance_id &&
                        p.globalRank() == hello.rank_info.globalRank());
  });
  if (connected >= options_.max_generation_peers) {
    refuseLocked(peer, ResourceExhausted("this context rank serves " + std::to_string(connected) +
                                         " generation ranks already (max_generation_peers=" +
                                         std::to_string(options_.max_generation_peers) + ")"));
    return;
  }
  if (hello.rank_info.role != wire::InstanceRole::kGeneration) {
    refuseLocked(peer, Incompatible("peer role " +
                                    std::string(wire::instanceRoleName(hello.rank_info.role)) +
                                    " != generation"));
    return;
  }
  if (Status s = wire::checkPeerReadsLayout(self_.layout, hello.rank_info.version_minor);
      !s.isOk()) {
    refuseLocked(peer, s);
    return;
  }
  auto planner = Planner::createForSource(self_.layout, hello.rank_info.layout);
  if (!planner.isOk()) {
    refuseLocked(peer, planner.status());
    return;
  }
  auto expected = overlappingGenerationRanks(options_.model, self_.layout, hello.rank_info.layout);
  if (!expected.isOk()) {
    refuseLocked(peer, expected.status());
    return;
  }
  peer.info = std::move(hello.rank_info);
  peer.incarnation = hello.incarnation;
  peer.planner = std::move(*planner);
  peer.expected = std::move(*expected);
  peer.block_budget =
      blockBudget(self_.layout, peer.info.layout, options_.max_waiting_blocks_factor);
  peer.ready = true;
  metrics_.handshake(true);
  HXFER_LOG_INFO("context rank {}: generation rank {} of '{}' connected", rankName(self_.layout),
                 rankName(peer.info.layout), peer.info.instance_id);
  // One connection per generation rank: an older one claiming the same rank is a previous
  // incarnation (a restart) or a connection its rank already dropped; it must not keep asks.
  std::vector<Peer*> older;
  for (auto& [id, other] : peers_) {
    if (other.get() != &peer && other->ready && other->info.instance_id == peer.info.instance_id &&
        other->globalRank() == peer.globalRank()) {
      older.push_back(other.get());
    }
  }
  for (Peer* old : older) supersedeLocked(*old, peer);
  sendLocked(peer.id, wire::Hello{self_, {}, incarnation_});  // the transport proved the token
}

uint64_t ContextSender::blockBudget(const RankLayout& self, const RankLayout& peer,
                                    uint32_t factor) {
  // Our pool's tokens, in the peer's blocks: what a request could name if it took all of them.
  const uint64_t tokens = uint64_t{self.num_blocks} * std::max(self.tokens_per_block, 1u);
  const uint64_t per = std::max(peer.tokens_per_block, 1u);
  const uint64_t own = std::min<uint64_t>((tokens + per - 1) / per, peer.num_blocks);
  return uint64_t{factor} * std::max<uint64_t>(own, 1);
}

void ContextSender::supersedeLocked(Peer& old, const Peer& newer) {
  HXFER_LOG_WARN(
      "context rank {}: generation rank {} of '{}' connected again (incarnation {} -> {}); "
      "dropping its older connection {}",
      rankName(self_.layout), rankName(newer.info.layout), newer.info.instance_id, old.incarnation,
      newer.incarnation, old.id);
  metrics_.connectionSuperseded();
  const transport::PeerId id = old.id;
  (void)agent_->disconnect(id);
  onPeerLostLocked(id);  // its kPeerLost, when it comes, finds nothing left
}

void ContextSender::refuseRequestLocked(Peer& peer, const wire::TransferRequest& req,
                                        const Status& why) {
  // A part waiting for its next window from this connection ends with it: nothing else asks.
  bool ended = false;
  if (auto it = sources_.find(req.request_id); it != sources_.end()) {
    for (Ask& a : it->second->asks) {
      if (a.more && a.peer == peer.id && a.req.epoch == req.epoch) {
        endWindowsLocked(*it->second, a, causeOf(why));
        ended = true;
      }
    }
  }
  // Each request counted once: the part it ended there, and this ask, unless it is a later
  // window (counted with its first), here.
  if (!(req.staging && req.staging->window > 0)) metrics_.requestFailed(causeOf(why));
  sendDoneLocked(peer.id, wire::TransferDone{req.request_id, why, 0, std::nullopt, {}, req.epoch});
  if (ended) maybeFinishLocked(req.request_id);
}

Status ContextSender::checkJoinLocked(const Peer& peer, const Source& src,
                                      const wire::TransferRequest& req) const {
  for (const Ask& a : src.asks) {
    if (a.instance != peer.info.instance_id) {
      return InvalidArgument("request " + std::to_string(src.id) + " belongs to generation '" +
                             a.instance + "'; '" + peer.info.instance_id + "' asked for it too");
    }
    if (a.gen_rank == peer.globalRank() && !a.peer_gone && continues(a, peer, req)) continue;
    if (a.gen_rank == peer.globalRank() && !a.peer_gone && a.more) {
      return InvalidArgument(
          "request " + std::to_string(src.id) + ": generation rank " + rankName(peer.info.layout) +
          " asked for staging window " +
          (req.staging ? std::to_string(req.staging->window) : std::string("(none)")) +
          " of epoch " + std::to_string(req.epoch) + "; the next is " +
          std::to_string(a.req.staging->window + a.req.staging->bytes) + " of epoch " +
          std::to_string(a.req.epoch));
    }
    if (a.gen_rank == peer.globalRank() && !a.peer_gone) {
      return InvalidArgument("request id " + std::to_string(src.id) + " reused: generation rank " +
                             rankName(peer.info.layout) + " asked for it already (epoch " +
                             std::to_string(a.req.epoch) + ", now " + std::to_string(req.epoch) +
                             ") and this rank still holds that request");
    }
  }
  return OkStatus();
}

bool ContextSender::continues(const Ask& a, const Peer& peer, const wire::TransferRequest& req) {
  if (!a.more || a.peer != peer.id || !req.staging) return false;
  // The same request (pages, tokens, epoch, part), asking for the window after the last; the
  // slot may move within the staging region.
  wire::TransferRequest same = req;
  same.staging = a.req.staging;
  return same == a.req && req.staging->part == a.req.staging->part &&
         req.staging->window == a.req.staging->window + a.req.staging->bytes;
}

bool ContextSender::lastWindowBefore(const Ask& a) {
  const auto& slot = a.req.staging;
  return slot && slot->part != 0 && slot->window + slot->bytes < slot->part;
}

void ContextSender::endWindowsLocked(Source& src, Ask& a, FailureCause cause) {
  if (!a.more) return;
  a.more = false;
  src.finished.insert(a.gen_rank);
  metrics_.requestFailed(cause);
}

void ContextSender::onRequestLocked(Peer& peer, wire::TransferRequest req,
                                    std::vector<Callback>* callbacks) {
  const uint64_t id = req.request_id;
  // The next window of a part asked for before: the same request, counted once.
  Ask* prior = nullptr;
  if (auto it = sources_.find(id); it != sources_.end()) {
    for (Ask& a : it->second->asks) {
      if (a.gen_rank == peer.globalRank() && continues(a, peer, req)) prior = &a;
    }
  }
  // A later window of a part counts with its first; one whose first is gone was counted then.
  const bool later_window = req.staging && req.staging->window > 0;
  if (!later_window) metrics_.requestStarted();
  // Checked on arrival, so that nothing a peer could not own waits here: the pages named are
  // the connection's own rank's, inside its pools, each once.
  if (Status s = wire::checkDestination(req, peer.info.layout); !s.isOk()) {
    HXFER_LOG_WARN("context: refusing request {} of generation peer {}: {}", id, peer.id,
                   s.toString());
    refuseRequestLocked(peer, req, s);
    return;
  }
  // Its regions are declared at its first request: a generation rank grants us writes (on shm:
  // sends their fds) only once our Hello matched, and before any request it sends.
  if (!peer.regions_declared) {
    for (const RegionSpec& r : peer.info.layout.regions) {
      const Bytes* key = peer.info.findKey(r.id);
      // Declared without a key (device pools behind ucx, reached only through the staging
      // region): never a write's destination here; a write naming it is refused as unknown.
      if (key == nullptr && agent_->capabilities().remote_regions_need_keys) continue;
      Status s = agent_->addRemoteRegion(
          peer.id, r.id, r.length,
          key ? std::span<const uint8_t>(*key) : std::span<const uint8_t>());
      if (!s.isOk()) {
        refuseLocked(peer, s.withContext("region " + std::to_string(r.id)));
        return;
      }
    }
    peer.regions_declared = true;
  }
  const uint64_t block_budget = peer.block_budget;
  // The next window of an admitted part is not held to the bounds it passed already.
  if (prior == nullptr && (peer.open_asks >= options_.max_waiting_requests ||
                           peer.open_blocks + req.dst_block_ids.size() > block_budget)) {
    metrics_.requestOverLimit();
    refuseRequestLocked(
        peer, req,
        ResourceExhausted("generation rank " + rankName(peer.info.layout) + " has " +
                          std::to_string(peer.open_asks) + " requests (" +
                          std::to_string(peer.open_blocks) + " blocks) waiting here; limits " +
                          std::to_string(options_.max_waiting_requests) + " requests, " +
                          std::to_string(block_budget) + " blocks"));
    return;
  }
  if (const Tombstone* dead = tombstones_.find(id)) {
    if (dead->answers(peer.info.instance_id, peer.globalRank(), peer.incarnation)) {
      refuseRequestLocked(peer, req, dead->why);
      return;
    }
    // The id ended for another generation process (or an earlier incarnation of this one):
    // this ask starts a request of its own.
    tombstones_.erase(id);
  }
  if (auto it = sources_.find(id); it != sources_.end()) {
    if (Status s = checkJoinLocked(peer, *it->second, req); !s.isOk()) {
      HXFER_LOG_WARN("context: refusing request {} of generation peer {}: {}", id, peer.id,
                     s.toString());
      refuseRequestLocked(peer, req, s);
      return;
    }
  }
  if (later_window && prior == nullptr) {
    // Never served from a request started over: its first window went elsewhere.
    const Status s = InvalidArgument(
        "request " + std::to_string(id) + ": generation rank " + rankName(peer.info.layout) +
        " asked for staging window " + std::to_string(req.staging->window) + " of epoch " +
        std::to_string(req.epoch) + ", and this rank holds no earlier window of that part");
    HXFER_LOG_WARN("context: refusing request {} of generation peer {}: {}", id, peer.id,
                   s.toString());
    refuseRequestLocked(peer, req, s);
    return;
  }
  auto& slot = sources_[id];
  if (!slot) {
    slot = std::make_unique<Source>();
    slot->id = id;
    slot->created_at = Clock::now();
    slot->ready_end = stage_.first;
  }
  Source& src = *slot;
  const bool first = src.asks.empty();
  if (!src.expected) src.expected = peer.expected;
  if (first && options_.on_request) {
    callbacks->push_back(
        [cb = options_.on_request, id, n = req.num_tokens, aux = req.aux] { cb(id, n, aux); });
  }
  Ask ask;
  ask.peer = peer.id;
  ask.gen_rank = peer.globalRank();
  ask.instance = peer.info.instance_id;
  ask.incarnation = peer.incarnation;
  ask.asked_at = Clock::now();
  ask.counted = true;
  ++peer.open_asks;
  peer.open_blocks += req.dst_block_ids.size();
  ask.req = std::move(req);
  if (prior != nullptr) {  // answered, nothing in flight: the next window takes its place
    ask.asked_at = prior->asked_at;
    ask.earlier_bytes = prior->earlier_bytes + prior->bytes;
    ask.staged = std::move(prior->staged);
    src.asks.erase(src.asks.begin() + (prior - src.asks.data()));
  }
  src.asks.push_back(std::move(ask));
  tryStartLocked(src);
  maybeFinishLocked(id);
}

void ContextSender::tryStartLocked(Source& src) {
  if (src.cancelled || !src.owned) return;
  for (Ask& a : src.asks) {
    if (a.peer_gone) continue;
    if (a.state == Ask::State::kWaiting && mayPostLocked(src, a)) startAskLocked(src, a);
    if (a.state == Ask::State::kPosted) advanceAskLocked(src, a);
  }
}

bool ContextSender::mayPostLocked(const Source& src, const Ask& ask) const {
  if (src.ready) return true;
  // A staged part goes as one write of the whole part.
  if (ask.req.staging) return false;
  // Short requests go in one piece: a few small writes are cheaper than many tiny ones.
  return src.ready_end > stage_.first && ask.req.num_tokens >= options_.stream_min_tokens;
}

void ContextSender::startAskLocked(Source& src, Ask& ask) {
  auto pit = peers_.find(ask.peer);
  if (pit == peers_.end() || !pit->second->ready) {
    ask.peer_gone = true;
    ask.state = Ask::State::kAnswered;
    metrics_.requestFailed(FailureCause::kPeerLost);
    src.finished.insert(ask.gen_rank);
    return;
  }
  if (auto alloc = cache_->find(src.id); !alloc.isOk()) {
    answerLocked(src, ask, alloc.status(), 0, std::nullopt);
    return;
  }
  if (Status s = cache_->beginTransfer(src.id); !s.isOk()) {
    answerLocked(src, ask, s, 0, std::nullopt);
    return;
  }
  ask.state = Ask::State::kPosted;
  ask.sent_end = stage_.first;
}

void ContextSender::advanceAskLocked(Source& src, Ask& ask) {
  if (ask.state != Ask::State::kPosted) return;
  for (Piece& p : ask.pieces) {
    if (p.terminal || p.copying || p.transfer.poll() == transport::TransferState::kInProgress) {
      continue;
    }
    p.terminal = true;
    retireAreaLocked(std::move(p.scratch), std::move(p.pack));
    if (Status st = p.transfer.status(); !st.isOk() && !ask.failed) ask.failed = st;
  }
  // Why the ask ends before every layer is sent, in order of precedence.
  std::optional<Status> end;
  if (src.cancelled) {
    end = *src.cancelled;
  } else if (ask.cancel_requested) {
    end = Cancelled("cancelled by generation");
  } else if (ask.stalled) {
    end = Timeout(
        "request " + std::to_string(src.id) + ": the " +
        (ask.stalled_in_copy ? "device's copy into host memory of the part for" : "write to") +
        " generation rank " + std::to_string(ask.gen_rank) + " made no progress in " +
        std::to_string(options_.stall_timeout.count()) + " ms");
  } else if (ask.failed) {
    end = *ask.failed;
  } else if (ask.peer_gone) {
    end = Unavailable("generation rank " + std::to_string(ask.gen_rank) + " is gone");
  }
  // Device pools behind a host agent: a part whose copy into host memory is done goes now.
  for (Piece& p : ask.pieces) {
    if (!end && !ask.failed && !p.terminal && p.copying && p.copying->done()) {
      landCopyLocked(ask, p, /*post=*/true);
    }
  }
  // While the engine still writes the layers (its event pending) nothing is packed or posted;
  // the progress loop looks again each turn, and other requests move meanwhile.
  const bool engine_writing = src.ready_event && !src.ready_event->done();
  if (!end && ask.sent_end < src.ready_end && mayPostLocked(src, ask) && !engine_writing) {
    postPieceLocked(src, ask);
  }
  if (end || ask.failed) {
    for (Piece& p : ask.pieces) {
      if (p.terminal) continue;
      if (p.copying) {
        landCopyLocked(ask, p, /*post=*/false);  // never posted: nothing to wait for
      } else {
        p.transfer.cancel();
      }
    }
  }
  if (ask.inFlight() > 0) return;
  if (!end && ask.failed) end = *ask.failed;
  if (!end && !(src.ready && ask.sent_end == stage_.end())) return;  // more layers to come
  if (ask.reading && !ask.reading->done()) {
    held_for_copies_.emplace_back(src.id, std::move(ask.reading));  // timersLocked ends it
  } else {
    (void)cache_->endTransfer(src.id);
  }
  ask.reading.reset();
  std::optional<uint64_t> checksum;
  // A window before a staged part's last carries none: the last one's covers the part.
  const bool last_window = !lastWindowBefore(ask);
  if (!end && options_.checksum && ask.checksum) {
    checksum = ask.checksum;
  } else if (!end && options_.checksum && last_window) {
    auto sum = checksumAskLocked(src, ask);
    if (sum.isOk()) {
      checksum = *sum;
    } else {
      end = sum.status();
    }
  }
  if (end) {
    answerLocked(src, ask, *end, 0, std::nullopt);
  } else {
    answerLocked(src, ask, OkStatus(), ask.bytes, checksum);
  }
}

StatusOr<RankPlan> ContextSender::planAskLocked(const Source& src, const Ask& ask,
                                                LayerRange layers) const {
  auto pit = peers_.find(ask.peer);
  if (pit == peers_.end() || !pit->second->planner) {
    return Unavailable("generation rank " + std::to_string(ask.gen_rank) + " is gone");
  }
  ASSIGN_OR_RETURN(Allocation alloc, cache_->find(src.id));
  const wire::TransferRequest& req = ask.req;
  RankIds src_ids = idsOf(alloc);
  RankIds dst_ids{req.dst_block_ids, req.dst_slot.value_or(0), req.dst_group_slots};
  const uint32_t n = static_cast<uint32_t>(req.dst_block_ids.size());
  BlockRange range{req.first_block, n - req.first_block, req.num_tokens};
  return pit->second->planner->planRank(0, src_ids, dst_ids, range, layers);
}

void ContextSender::refuseAskLocked(const Source& src, Ask& ask, Status why) {
  HXFER_LOG_WARN("context: refusing request {} of generation peer {}: {}", src.id, ask.peer,
                 why.toString());
  ask.failed = std::move(why);
}

void ContextSender::postPieceLocked(Source& src, Ask& ask) {
  // The whole request in one plan when it is all ready at once (ops then merge across layers).
  const LayerRange layers = src.ready && ask.sent_end == stage_.first
                                ? kAllLayers
                                : LayerRange{ask.sent_end, src.ready_end - ask.sent_end};
  // A later window of a staged part goes by the plan of its first.
  std::optional<RankPlan> fresh;
  if (!ask.req.staging || !ask.staged) {
    auto planned = planAskLocked(src, ask, layers);
    if (!planned.isOk()) return refuseAskLocked(src, ask, planned.status());
    fresh = std::move(planned).value();
  }
  const RankPlan* plan = fresh ? &*fresh : &ask.staged->plan;
  ask.sent_end = src.ready_end;
  if (const auto& slot = ask.req.staging) {
    // A staged part goes as one plan: whole, the slot holding exactly its bytes, or window by
    // window, both sides counting the same part and the window inside it.
    const bool fits = slot->part == 0 ? slot->bytes == plan->bytes
                                      : slot->part == plan->bytes && slot->bytes > 0 &&
                                            slot->window < plan->bytes &&
                                            slot->bytes <= plan->bytes - slot->window;
    if (!fits) {
      return refuseAskLocked(
          src, ask,
          InvalidArgument("request " + std::to_string(src.id) + ": staging slot of " +
                          std::to_string(slot->bytes) + " bytes" +
                          (slot->part == 0 ? std::string()
                                           : " at window " + std::to_string(slot->window) +
                                                 " of a part of " + std::to_string(slot->part)) +
                          " for a part of " + std::to_string(plan->bytes)));
    }
    if (fresh && !fresh->ops.empty()) {
      auto runs = stagingRuns(fresh->ops);
      auto gather = runs.isOk() ? slotGather(fresh->ops, *runs) : runs.status();
      if (!gather.isOk()) return refuseAskLocked(src, ask, gather.status());
      ask.staged = std::make_shared<StagedPlan>(
          StagedPlan{std::move(*fresh), std::move(gather).value(), {}, false});
      plan = &ask.staged->plan;
    }
  }
  if (plan->ops.empty()) return;
  // Posting waits until the engine's layers-ready event is done (advanceAskLocked).
  if (src.ready_event && !src.ready_event->status().isOk()) {
    ask.failed = Status(src.ready_event->status().code(),
                        "the engine's layers-ready event: " + src.ready_event->status().message());
    return;
  }
  if (staged_device_) {
    postFromDeviceLocked(src, ask, *plan);  // staged: by ask.staged
    return;
  }
  const bool on_device = agent_->capabilities().device_memory;
  if (on_device && (ask.req.staging || (!plan->pack_ops.empty() && device_ordinal_ < 0))) {
    // Both gather or pack on the host; device pools have neither path yet.
    return refuseAskLocked(
        src, ask,
        Incompatible("request " + std::to_string(src.id) + " for generation rank " +
                     std::to_string(ask.gen_rank) + ": " +
                     (ask.req.staging ? std::string("the generation rank asked for a staged part")
                                      : "the plan packs " + std::to_string(plan->pack_ops.size()) +
                                            " boxes (the two sides order a state record's elements "
                                            "differently, as conv sd against ds)") +
                     ", and this rank's pools are device memory, where " +
                     (ask.req.staging ? "staging" : "packing") + " is not built"));
  }
  if (ask.req.staging) {
    postStagedLocked(src, ask);
    return;
  }
  std::unique_ptr<Region> scratch;
  std::shared_ptr<const device::Event> pack;
  std::shared_ptr<const device::Event> behind = streamTailLocked();
  if (!plan->pack_ops.empty() && on_device) {
    auto packed = packOnDeviceLocked(*plan);
    if (!packed.isOk()) return refuseAskLocked(src, ask, packed.status());
    metrics_.staged(plan->pack_ops.size(), plan->scratch_bytes);
    scratch = std::move(packed->first);
    pack = std::move(packed->second);
  } else if (!plan->pack_ops.empty()) {
    auto staged = stageLocked(*plan);
    if (!staged.isOk()) return refuseAskLocked(src, ask, staged.status());
    scratch = std::move(staged).value();
  }
  if (options_.checksum && layers == kAllLayers) {
    const auto bytes = scratch ? std::span<const uint8_t>(scratch->data(), scratch->length())
                               : std::span<const uint8_t>();
    auto sum = checksumOps(plan->ops, memory_, /*source=*/true, bytes);
    if (!sum.isOk()) {
      releaseScratchLocked(std::move(scratch));
      ask.failed = sum.status();
      return;
    }
    ask.checksum = *sum;
  }
  std::vector<transport::WriteOp> ops;
  ops.reserve(plan->ops.size());
  for (const CopyOp& op : plan->ops) {
    const uint32_t from = op.src_region == kScratchRegion ? scratch->id() : op.src_region;
    ops.push_back({from, op.src_offset, op.dst_region, op.dst_offset, op.bytes});
  }
  const bool packing = pack != nullptr;
  if (Status st = postLocked(ask, std::move(ops), std::move(scratch), plan->bytes, std::move(pack));
      !st.isOk()) {
    ask.failed = st;
  } else if (packing) {
    ask.pieces.back().behind = std::move(behind);
  }
}

Status ContextSender::postLocked(Ask& ask, std::vector<transport::WriteOp> ops,
                                 std::unique_ptr<Region> area, uint64_t bytes,
                                 std::shared_ptr<const device::Event> pack) {
  if (pack && pack->done() && !pack->status().isOk()) {
    retireAreaLocked(std::move(area), pack);
    return Status(pack->status().code(), "the write's fence failed: " + pack->status().message());
  }
  Piece piece;
  piece.scratch = std::move(area);
  piece.pack = std::move(pack);
  piece.ops = std::move(ops);
  if (Status st = writeLocked(ask, piece); !st.isOk()) {
    retireAreaLocked(std::move(piece.scratch), piece.pack);
    return st;
  }
  ask.pieces.push_back(std::move(piece));
  ask.bytes += bytes;
  return OkStatus();
}

Status ContextSender::writeLocked(const Ask& ask, Piece& piece) {
  const size_t n = piece.ops.size();
  // The write waits for the device pack that fills the area (short, on hxfer's own stream).
  auto t = piece.pack && !piece.pack->done()
               ? agent_->postWriteAfter(ask.peer, std::move(piece.ops), piece.pack)
               : agent_->postWrite(ask.peer, std::move(piece.ops));
  piece.ops.clear();
  RETURN_IF_ERROR(t.status());
  metrics_.opsPosted(n);
  t->notifyWhenTerminal([waker = waker_] { waker->wake(); });
  piece.transfer = *t;
  piece.posted_at = Clock::now();
  return OkStatus();
}

void ContextSender::landCopyLocked(Ask& ask, Piece& piece, bool post) {
  Status done = piece.copying->done() ? piece.copying->status() : OkStatus();
  // The copy's event says nothing of the pack before it on the stream (done by now): a failed
  // pack left the scratch unfilled, and its bytes must not go.
  if (done.isOk() && piece.pack && !piece.pack->status().isOk()) {
    done = Status(piece.pack->status().code(),
                  "the device pack failed: " + piece.pack->status().message());
  }
  if (!done.isOk()) {
    done = done.withContext("copying a part of " + std::to_string(piece.bytes) +
                            " bytes from device " + std::to_string(device_ordinal_) +
                            " into host memory");
  } else if (post) {
    piece.copying.reset();
    piece.pack.reset();
    piece.behind.reset();
    done = writeLocked(ask, piece);
    if (done.isOk()) {
      if (piece.staged_runs > 0) metrics_.stormStaged(piece.staged_runs);
      if (piece.window) metrics_.stagingWindow();
      return;
    }
  }
  // Not posted: the area goes back once the device is done with it, and the request's pages
  // stay held until then (the copy reads them).
  if (piece.copying && !piece.copying->done()) ask.reading = piece.copying;
  piece.terminal = true;
  piece.ops.clear();
  retireAreaLocked(std::move(piece.scratch), std::move(piece.copying));
  piece.pack.reset();
  if (!done.isOk() && !ask.failed) {
    HXFER_LOG_WARN("context: a part for generation rank {}: {}", ask.gen_rank, done.toString());
    ask.failed = done;
  }
}

void ContextSender::postStagedLocked(Source& src, Ask& ask) {
  const wire::Staging& slot = *ask.req.staging;
  StagedPlan& staged = *ask.staged;
  const RankPlan& plan = staged.plan;
  // The ops' sources in one local area laid out as the slot (the window of the part it asks
  // for), written as one op.
  const StagingWindow window{slot.window, slot.bytes};
  auto area = acquireAreaLocked(slot.bytes);
  if (!area.isOk()) {
    refuseAskLocked(
        src, ask,
        area.status().withContext("gather area of " + std::to_string(slot.bytes) + " bytes"));
    return;
  }
  std::unique_ptr<Region> gathered = std::move(area).value();
  Status s = OkStatus();
  if (!plan.pack_ops.empty() && !staged.pack_done) {  // once a part, whatever its windows
    staged.packed.resize(plan.scratch_bytes);
    s = packScratch(plan, memory_, staged.packed);
    staged.pack_done = s.isOk();
    if (s.isOk()) metrics_.staged(plan.pack_ops.size(), plan.scratch_bytes);
  }
  if (s.isOk()) {
    s = gatherStaged(staged.gather, memory_, staged.packed,
                     std::span<uint8_t>(gathered->data(), gathered->length()), window);
  }
  const bool last = slot.window + slot.bytes == plan.bytes;
  if (s.isOk() && options_.checksum && last) {
    // A staged part is always the whole part in one plan; its last window carries the sum.
    auto sum = checksumOps(plan.ops, memory_, /*source=*/true, staged.packed);
    if (sum.isOk()) ask.checksum = *sum;
    s = sum.status();
  }
  if (!s.isOk()) {
    releaseScratchLocked(std::move(gathered));
    refuseAskLocked(src, ask, s);
    return;
  }
  const uint32_t from = gathered->id();
  if (Status st = postLocked(ask, {{from, 0, slot.region, slot.offset, slot.bytes}},
                             std::move(gathered), slot.bytes);
      !st.isOk()) {
    refuseAskLocked(src, ask, st);
    return;
  }
  if (last) metrics_.stormStaged(plan.ops.size());  // the part's ops, once
  if (slot.part != 0) metrics_.stagingWindow();
}

void ContextSender::postFromDeviceLocked(Source& src, Ask& ask, const RankPlan& plan) {
  const std::optional<wire::Staging>& slot = ask.req.staging;
  // Where each op's bytes go in the host area (region 0 of `area_memory` below): laid out as
  // the slot when the generation rank asked for staging, else back to back in op order.
  std::vector<CopyOp> gather;
  const uint64_t bytes = slot ? slot->bytes : plan.bytes;  // a window of a staged part
  if (slot) {
    auto ops = windowOps(ask.staged->gather, 0, StagingWindow{slot->window, bytes});
    if (!ops.isOk()) return refuseAskLocked(src, ask, ops.status());
    gather = std::move(ops).value();
  } else {
    gather = backToBack(plan.ops, 0);
  }
  std::unique_ptr<Region> scratch;
  std::shared_ptr<const device::Event> pack;
  std::shared_ptr<const device::Event> behind = streamTailLocked();
  // A window of a staged part packs only when one of its ops reads the pack (the conv records
  // lie in one or two windows of a long part's kv).
  const bool reads_pack = std::any_of(gather.begin(), gather.end(), [](const CopyOp& op) {
    return op.src_region == kScratchRegion;
  });
  if (!plan.pack_ops.empty() && reads_pack) {
    auto packed = packOnDeviceLocked(plan);  // into a pinned host area, on pack_stream_
    if (!packed.isOk()) return refuseAskLocked(src, ask, packed.status());
    // Counted once a part, whatever windows pack (each packs the whole plan again).
    if (!ask.staged || !std::exchange(ask.staged->pack_counted, true)) {
      metrics_.staged(plan.pack_ops.size(), plan.scratch_bytes);
    }
    scratch = std::move(packed->first);
    pack = std::move(packed->second);
  }
  auto area = acquireAreaLocked(bytes);
  if (!area.isOk()) {
    retireAreaLocked(std::move(scratch), pack);
    return refuseAskLocked(
        src, ask, area.status().withContext("host area of " + std::to_string(bytes) + " bytes"));
  }
  const RankMemory area_memory = {{(*area)->data(), bytes}};
  const auto scratch_bytes = scratch ? std::span<const uint8_t>(scratch->data(), scratch->length())
                                     : std::span<const uint8_t>();
  auto table = device::copyTable(gather, memory_, area_memory, scratch_bytes);
  Status launched = table.status();
  if (launched.isOk() && !pack_stream_) {
    auto stream = options_.device->createStream(device_ordinal_);
    launched = stream.status();
    if (stream.isOk()) pack_stream_ = std::move(stream).value();
  }
  std::shared_ptr<const device::Event> copied;
  if (launched.isOk()) {
    auto c = pack_stream_->copy(*table);  // after the pack: one stream
    launched = c.status();
    if (c.isOk()) copied = std::move(c).value();
    if (copied) queuedOnStreamLocked(copied);
  }
  // The pack's area is read by the copy: it goes back once the copy is done.
  retireAreaLocked(std::move(scratch), copied ? copied : pack);
  if (!launched.isOk()) {
    releaseScratchLocked(std::move(area).value());
    return refuseAskLocked(
        src, ask,
        launched.withContext("copying a part of " + std::to_string(bytes) + " bytes from device " +
                             std::to_string(device_ordinal_) + " into host memory"));
  }
  // The write reads the area: it is posted once the copy is done (advanceAskLocked, woken by
  // copy_watcher_), and the progress thread goes on meanwhile.
  Piece piece;
  piece.scratch = std::move(area).value();
  piece.pack = std::move(pack);
  piece.copying = copied;
  piece.bytes = bytes;
  piece.posted_at = Clock::now();
  piece.behind = std::move(behind);
  const uint32_t from = piece.scratch->id();
  if (slot) {
    piece.staged_runs = slot->window + bytes == plan.bytes ? plan.ops.size() : 0;  // once
    piece.window = slot->part != 0;
    piece.ops.push_back({from, 0, slot->region, slot->offset, bytes});
  } else {
    piece.ops.reserve(plan.ops.size());
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      const CopyOp& op = plan.ops[i];
      piece.ops.push_back({from, gather[i].dst_offset, op.dst_region, op.dst_offset, op.bytes});
    }
  }
  ask.pieces.push_back(std::move(piece));
  ask.bytes += bytes;
  copy_watcher_.watch(std::move(copied));
}

StatusOr<uint64_t> ContextSender::checksumAskLocked(const Source& src, const Ask& ask) const {
  // Over the whole request, whatever pieces it went in: the generation rank hashes its
  // destination bytes in the same order (checksumOps sorts by destination).
  ASSIGN_OR_RETURN(RankPlan plan, planAskLocked(src, ask, kAllLayers));
  std::vector<uint8_t> scratch(plan.pack_ops.empty() ? 0 : plan.scratch_bytes);
  if (!scratch.empty()) RETURN_IF_ERROR(packScratch(plan, memory_, scratch));
  return checksumOps(std::move(plan.ops), memory_, /*source=*/true, scratch);
}

StatusOr<std::unique_ptr<Region>> ContextSender::stageLocked(const RankPlan& plan) {
  auto area = acquireAreaLocked(plan.scratch_bytes);
  if (!area.isOk()) {
    return area.status().withContext("staging area of " + std::to_string(plan.scratch_bytes) +
                                     " bytes");
  }
  std::unique_ptr<Region> r = std::move(area).value();
  if (Status s = packScratch(plan, memory_, std::span<uint8_t>(r->data(), r->length()));
      !s.isOk()) {
    releaseScratchLocked(std::move(r));
    return s;
  }
  metrics_.staged(plan.pack_ops.size(), plan.scratch_bytes);
  return r;
}

StatusOr<std::unique_ptr<Region>> ContextSender::acquireAreaLocked(uint64_t bytes) {
  // The smallest spare that fits: a request of the same shape as an earlier one reuses its
  // area, already faulted in and registered.
  auto best = spare_areas_.end();
  for (auto it = spare_areas_.begin(); it != spare_areas_.end(); ++it) {
    if ((*it)->length() >= bytes &&
        (best == spare_areas_.end() || (*it)->length() < (*best)->length())) {
      best = it;
    }
  }
  if (best != spare_areas_.end()) {
    std::unique_ptr<Region> r = std::move(*best);
    spare_areas_.erase(best);
    spare_bytes_ -= r->length();
    return r;
  }
  // Ids far above any pool's (a layout numbers its regions from 0), never reused while one is
  // registered: 2^31 areas later the counter wraps into ids long released.
  const uint32_t id = 0x80000000u | (next_scratch_++ & 0x7FFFFFFFu);
  const auto backing = agent_->capabilities().needs_memfd_regions ? Region::Backing::kMemfd
                                                                  : Region::Backing::kAnonymous;
  const uint64_t length =
      (std::max<uint64_t>(bytes, 1) + kAreaGranule - 1) / kAreaGranule * kAreaGranule;
  std::unique_ptr<Region> r;
  if (staged_device_) {
    // Device pools behind a host agent: host memory the agent writes from, pinned so that the
    // device copies into it at the bus's speed.
    ASSIGN_OR_RETURN(std::unique_ptr<Region> host,
                     Region::allocate(id, length, backing, "hxfer-staging"));
    ASSIGN_OR_RETURN(std::unique_ptr<device::HostRegistration> pin,
                     options_.device->registerHost(host->data(), length));
    uint8_t* data = host->data();
    // The pin goes before the memory it pins.
    auto held = std::make_shared<
        std::pair<std::unique_ptr<Region>, std::unique_ptr<device::HostRegistration>>>(
        std::move(host), std::move(pin));
    r = Region::holding(id, data, length, std::move(held));
  } else if (device_ordinal_ >= 0) {
    // Device pools: the area is device memory of the pools' device, which the agent writes
    // from as from a pool.
    ASSIGN_OR_RETURN(std::unique_ptr<device::DeviceBuffer> buffer,
                     options_.device->allocateBuffer(device_ordinal_, length));
    uint8_t* data = buffer->data();
    r = Region::holding(id, data, length, std::shared_ptr<device::DeviceBuffer>(std::move(buffer)));
  } else {
    ASSIGN_OR_RETURN(r, Region::allocate(id, length, backing, "hxfer-staging"));
  }
  auto key = agent_->registerRegion(*r, transport::RegionAccess::kLocalSource);
  if (!key.isOk()) return key.status().withContext("registering a staging area");
  return r;
}

StatusOr<std::pair<std::unique_ptr<Region>, std::shared_ptr<const device::Event>>>
ContextSender::packOnDeviceLocked(const RankPlan& plan) {
  if (!pack_stream_) {
    auto stream = options_.device->createStream(device_ordinal_);
    if (!stream.isOk()) return stream.status().withContext("the pack stream");
    pack_stream_ = std::move(stream).value();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Region> area, acquireAreaLocked(plan.scratch_bytes));
  auto table = device::packTable(plan, memory_, reinterpret_cast<uint64_t>(area->data()),
                                 plan.scratch_bytes);
  StatusOr<std::shared_ptr<device::Event>> packed = table.status();
  if (table.isOk()) packed = pack_stream_->pack(*table);
  if (packed.isOk()) queuedOnStreamLocked(*packed);
  if (!packed.isOk()) {
    releaseScratchLocked(std::move(area));
    return packed.status().withContext("packing " + std::to_string(plan.pack_ops.size()) +
                                       " boxes on device " + std::to_string(device_ordinal_));
  }
  return std::make_pair(std::move(area), std::shared_ptr<const device::Event>(*packed));
}

void ContextSender::retireAreaLocked(std::unique_ptr<Region> area,
                                     std::shared_ptr<const device::Event> pack) {
  if (!area) return;
  if (pack && !pack->done()) {
    draining_areas_.emplace_back(std::move(area), std::move(pack));
    return;
  }
  releaseScratchLocked(std::move(area));
}

void ContextSender::releaseScratchLocked(std::unique_ptr<Region> scratch) {
  if (!scratch) return;
  if (!stop_ && spare_bytes_ + scratch->length() <= kSpareAreaBytes) {
    spare_bytes_ += scratch->length();
    spare_areas_.push_back(std::move(scratch));
    return;
  }
  if (Status s = agent_->deregisterRegion(scratch->id()); !s.isOk()) {
    HXFER_LOG_ERROR("context: releasing staging area {}: {}", scratch->id(), s.toString());
  }
}

void ContextSender::answerLocked(Source& src, Ask& ask, const Status& status, uint64_t bytes,
                                 std::optional<uint64_t> checksum) {
  ask.state = Ask::State::kAnswered;
  ask.more = status.isOk() && lastWindowBefore(ask);
  if (ask.more) {
    src.progress_at = Clock::now();  // the lease runs from here until the next window
  } else {
    src.finished.insert(ask.gen_rank);
  }
  if (ask.counted) {
    ask.counted = false;
    if (auto pit = peers_.find(ask.peer); pit != peers_.end()) {
      --pit->second->open_asks;
      pit->second->open_blocks -= ask.req.dst_block_ids.size();
    }
  }
  if (status.isOk() && !ask.more) {
    const auto start = std::max(ask.asked_at, src.ready_at);
    metrics_.requestOk(ask.earlier_bytes + bytes, Clock::now() - start);
  } else if (!status.isOk()) {
    metrics_.requestFailed(causeOf(status));
  }
  if (ask.peer_gone) return;
  wire::TransferDone done{src.id, status, bytes, std::nullopt, {}, ask.req.epoch};
  if (status.isOk()) {
    done.checksum = checksum;
    done.aux = src.aux;
  }
  sendDoneLocked(ask.peer, done);
}

void ContextSender::sendDoneLocked(transport::PeerId peer, wire::TransferDone done) {
  if (auto pit = peers_.find(peer); pit != peers_.end()) {
    pit->second->answered.put(done.request_id, done.epoch, rememberUntil());
    // A peer older than minor 2 would refuse the whole message over a code it does not know.
    if (done.status.code() == StatusCode::kExpired && pit->second->info.version_minor < 2) {
      done.status = Timeout(done.status.message());
    }
  }
  sendLocked(peer, done);
}

void ContextSender::onCancelLocked(Peer& peer, const wire::Cancel& cancel) {
  // Epoch 0 (a peer older than minor 2) cancels every use of the id; otherwise only its own.
  auto mine = [&](const Ask& a) {
    return a.peer == peer.id && (cancel.epoch == 0 || a.req.epoch == cancel.epoch);
  };
  auto it = sources_.find(cancel.request_id);
  const bool asked =
      it != sources_.end() && std::any_of(it->second->asks.begin(), it->second->asks.end(), mine);
  if (!asked) {
    // Messages from one peer arrive in order, so its TransferRequest was answered and forgotten
    // already, or it was lost. Answered: that Done is on its way and ends the generation
    // rank's hold; a second one would be a duplicate.
    const uint64_t* epoch = peer.answered.find(cancel.request_id);
    if (epoch != nullptr && (cancel.epoch == 0 || *epoch == cancel.epoch)) {
      peer.answered.erase(cancel.request_id);
      return;
    }
    // Lost: the generation rank holds the request's pages in flight until a Done arrives.
    const Status why = Cancelled("cancel of a request this rank never got");
    sendLocked(peer.id,
               wire::TransferDone{cancel.request_id, why, 0, std::nullopt, {}, cancel.epoch});
    return;
  }
  Source& src = *it->second;
  const Status why = Cancelled("cancelled by generation: " + cancel.reason);
  for (Ask& a : src.asks) {
    if (!mine(a)) continue;
    if (a.state == Ask::State::kWaiting) {
      answerLocked(src, a, why, 0, std::nullopt);
    } else if (a.state == Ask::State::kPosted) {
      a.cancel_requested = true;
      advanceAskLocked(src, a);
    } else {  // between two windows: no more come, and no Done is awaited
      endWindowsLocked(src, a, FailureCause::kCancelled);
    }
  }
  maybeFinishLocked(cancel.request_id);
}

void ContextSender::onPeerLostLocked(transport::PeerId id) {
  auto pit = peers_.find(id);
  if (pit == peers_.end()) return;
  if (pit->second->ready) {
    metrics_.peerLost();
    HXFER_LOG_INFO("context rank {}: generation rank {} gone", rankName(self_.layout),
                   rankName(pit->second->info.layout));
  }
  std::vector<uint64_t> touched;
  for (auto& [rid, src] : sources_) {
    for (Ask& a : src->asks) {
      if (a.peer != id || a.peer_gone) continue;
      a.peer_gone = true;
      endWindowsLocked(*src, a, FailureCause::kPeerLost);
      if (a.state == Ask::State::kWaiting) {
        a.state = Ask::State::kAnswered;
        metrics_.requestFailed(FailureCause::kPeerLost);
      } else {
        advanceAskLocked(*src, a);  // its writes fail with the connection; it ends then
      }
      src->finished.insert(a.gen_rank);
      touched.push_back(rid);
    }
  }
  peers_.erase(pit);
  for (uint64_t rid : touched) maybeFinishLocked(rid);
}

void ContextSender::handleEventLocked(transport::Event& ev, std::vector<Callback>* callbacks) {
  using Kind = transport::Event::Kind;
  if (ev.kind == Kind::kPeerLost) {
    onPeerLostLocked(ev.peer);
    return;
  }
  auto& slot = peers_[ev.peer];
  if (!slot) {
    slot = std::make_unique<Peer>(options_.max_remembered_ids);
    slot->id = ev.peer;
  }
  Peer& peer = *slot;
  if (ev.kind == Kind::kPeerConnected || peer.refused) return;
  uint16_t minor = 0;
  auto msg = wire::decodeMessage(ev.payload, &minor);
  if (!msg.isOk()) {
    refuseLocked(peer, msg.status());
    return;
  }
  if (auto* hello = std::get_if<wire::Hello>(&*msg)) {
    peer.minor = minor;
    onHelloLocked(peer, std::move(*hello));
    return;
  }
  if (!peer.ready) {
    refuseLocked(peer, InvalidArgument(std::string(wire::messageTypeName(wire::messageType(*msg))) +
                                       " before hello"));
    return;
  }
  if (minor != peer.minor) {
    refuseLocked(peer, wire::mixedMinor(*msg, minor, peer.minor));
    return;
  }
  if (auto* req = std::get_if<wire::TransferRequest>(&*msg)) {
    onRequestLocked(peer, std::move(*req), callbacks);
  } else if (auto* cancel = std::get_if<wire::Cancel>(&*msg)) {
    onCancelLocked(peer, *cancel);
  } else if (auto* error = std::get_if<wire::Error>(&*msg)) {
    HXFER_LOG_WARN("context: generation peer {} reports: {}", peer.id, error->status.toString());
  } else {
    HXFER_LOG_WARN("context: unexpected {} from generation peer {}",
                   wire::messageTypeName(wire::messageType(*msg)), peer.id);
  }
}

void ContextSender::progressLocked() {
  std::vector<uint64_t> touched;
  for (auto& [rid, src] : sources_) {
    bool any = false;
    for (Ask& a : src->asks) {
      if (a.state != Ask::State::kPosted) continue;
      advanceAskLocked(*src, a);
      any = true;
    }
    if (any) touched.push_back(rid);
  }
  for (uint64_t rid : touched) maybeFinishLocked(rid);
}

void ContextSender::timersLocked() {
  // Areas whose pack finished since their write ended: free for the next parts.
  for (auto it = draining_areas_.begin(); it != draining_areas_.end();) {
    if (!it->second->done()) {
      ++it;
      continue;
    }
    releaseScratchLocked(std::move(it->first));
    it = draining_areas_.erase(it);
  }
  // Answered requests whose unposted device copy has finished reading their pages.
  std::erase_if(held_for_copies_, [&](const auto& held) {
    if (!held.second->done()) return false;
    (void)cache_->endTransfer(held.first);
    return true;
  });
  const auto now = Clock::now();
  std::vector<uint64_t> touched;
  for (auto& [rid, src] : sources_) {
    if (src->postedCount() > 0) continue;
    if (src->ready && src->owned &&
        now - std::max(src->ready_at, src->progress_at) > options_.lease_timeout) {
      HXFER_LOG_WARN("context: lease of request {} expired ({} of {} generation ranks served)", rid,
                     src->finished.size(), src->expected ? src->expected->size() : 0);
      metrics_.leaseExpired();
      const bool between_windows =
          std::any_of(src->asks.begin(), src->asks.end(), [](const Ask& a) { return a.more; });
      for (Ask& a : src->asks) endWindowsLocked(*src, a, FailureCause::kTimeout);
      freePagesLocked(*src);
      tombstones_.put(
          rid,
          tombstoneLocked(
              *src, Expired("lease of request " + std::to_string(rid) + " expired after " +
                            std::to_string(options_.lease_timeout.count()) +
                            " ms: the context rank freed its pages " +
                            (between_windows ? "while a staged part waited for its next window"
                                             : "before this rank asked"))),
          rememberUntil());
      touched.push_back(rid);
    } else if (!src->ready && !src->cancelled &&
               now - std::max(src->created_at, src->progress_at) > options_.lease_timeout) {
      const Status why = Timeout("request " + std::to_string(rid) +
                                 " was not marked ready on the context rank in time");
      for (Ask& a : src->asks) {
        if (a.state == Ask::State::kWaiting) answerLocked(*src, a, why, 0, std::nullopt);
      }
      src->cancelled = why;
      // Ranks asking later, and a late markReady, hear the same instead of starting over.
      tombstones_.put(rid, tombstoneLocked(*src, why), rememberUntil());
      touched.push_back(rid);
    }
  }
  for (uint64_t rid : touched) maybeFinishLocked(rid);
  stallsLocked(now);
  tombstones_.expire(now);
  for (auto& [id, peer] : peers_) peer->answered.expire(now);
}

void ContextSender::stallsLocked(Clock::time_point now) {
  // The stream's head: the work it runs now, and since when.
  bool moved = false;
  while (!stream_work_.empty() && stream_work_.front()->done()) {
    stream_work_.pop_front();
    moved = true;
  }
  if (moved) stream_head_since_ = now;
  std::vector<transport::PeerId> stuck;
  for (auto& [rid, src] : sources_) {
    for (Ask& a : src->asks) {
      if (a.state != Ask::State::kPosted || a.inFlight() == 0) continue;
      Clock::time_point oldest = now;
      const Piece* eldest = nullptr;
      for (Piece& p : a.pieces) {
        if (p.terminal) continue;
        Clock::time_point since = p.posted_at;
        if (p.behind && !p.behind->done()) {
          // Queued behind other device work: its clock runs while the stream makes no progress
          // (from when its head started), so a part waiting its turn behind work that moves is
          // never stalled, and one behind work that never ends still is.
          since = std::max(since, stream_head_since_);
        } else if (p.behind) {
          p.behind.reset();
          p.posted_at = since = now;
        }
        if (since < oldest || eldest == nullptr) {
          oldest = std::min(oldest, since);
          eldest = &p;
        }
      }
      const auto age = now - oldest;
      if (!a.stalled && age > options_.stall_timeout) {
        a.stalled_in_copy = eldest != nullptr && eldest->copying != nullptr;
        HXFER_LOG_WARN(
            "context: request {}: the {} generation rank {} made no progress in {} ms; "
            "cancelling it",
            rid, a.stalled_in_copy ? "device's copy into host memory of the part for" : "write to",
            a.gen_rank, options_.stall_timeout.count());
        metrics_.writeStalled();
        a.stalled = true;
        advanceAskLocked(*src, a);
      } else if (a.stalled && !a.peer_gone && age > 2 * options_.stall_timeout) {
        stuck.push_back(a.peer);
      }
    }
  }
  std::sort(stuck.begin(), stuck.end());
  stuck.erase(std::unique(stuck.begin(), stuck.end()), stuck.end());
  for (transport::PeerId id : stuck) {
    HXFER_LOG_WARN(
        "context: a cancelled write to generation peer {} did not stop within {} ms; "
        "disconnecting it",
        id, 2 * options_.stall_timeout.count());
    (void)agent_->disconnect(id);
    onPeerLostLocked(id);
  }
}

bool ContextSender::anyInFlightLocked() const {
  for (const auto& [rid, src] : sources_) {
    if (src->anyInFlight()) return true;
  }
  return false;
}

void ContextSender::run() {
  // A finishing write wakes pollEvent (Waker); the 1 ms bound while busy only matters for an
  // agent that does not implement wakeEventWaiter.
  bool busy = false;
  while (true) {
    auto ev = agent_->pollEvent(busy ? std::chrono::milliseconds(1) : options_.idle_poll);
    std::vector<Callback> callbacks;
    {
      std::lock_guard lock(mu_);
      if (stop_) break;
      int drained = 0;
      while (ev) {
        handleEventLocked(*ev, &callbacks);
        if (++drained >= 64) break;
        ev = agent_->pollEvent(std::chrono::milliseconds(0));
      }
      progressLocked();
      timersLocked();
      busy = anyInFlightLocked();
    }
    for (auto& cb : callbacks) cb();
  }
}

void ContextSender::shutdown() {
  std::call_once(shutdown_once_, [this] {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
    copy_watcher_.stop();
    {
      std::lock_guard lock(waker_->mu);
      waker_->agent = nullptr;
    }
    std::lock_guard lock(mu_);
    // Cancel every write, then drop the peers (which fails what the backend still has queued
    // for them), then wait. A write still running at the deadline keeps its hold and its
    // pages: they are never reused while something may still read them. A part whose device
    // copy still runs was never posted: it ends here, its area drained with the stream below.
    for (auto& [rid, src] : sources_) {
      for (Ask& a : src->asks) {
        for (Piece& p : a.pieces) {
          if (p.terminal) continue;
          if (p.copying) {
            landCopyLocked(a, p, /*post=*/false);
          } else {
            p.transfer.cancel();
          }
        }
      }
    }
    // No copy or pack runs past the stream (destroying it waits for the running one and
    // cancels the rest): after it nothing on the device reads a request's pages or an area.
    pack_stream_.reset();
    stream_work_.clear();
    for (auto& [rid, event] : held_for_copies_) (void)cache_->endTransfer(rid);
    held_for_copies_.clear();
    for (auto& [id, peer] : peers_) (void)agent_->disconnect(id);
    peers_.clear();
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (auto& [rid, src] : sources_) {
      bool stuck = false;
      for (Ask& a : src->asks) {
        if (a.state != Ask::State::kPosted) continue;
        bool running = false;
        for (Piece& p : a.pieces) {
          if (p.terminal) continue;
          (void)p.transfer.wait(deadline);
          if (p.transfer.poll() == transport::TransferState::kInProgress) {
            running = true;
            (void)p.scratch.release();  // kept too: the write may still read it
            continue;
          }
          p.terminal = true;
          releaseScratchLocked(std::move(p.scratch));
        }
        if (running) {
          HXFER_LOG_ERROR("context: shutdown: a write of request {} did not stop; pages kept", rid);
          stuck = true;
          continue;
        }
        (void)cache_->endTransfer(rid);
        a.state = Ask::State::kAnswered;
      }
      if (!stuck) freePagesLocked(*src);
    }
    sources_.clear();
    for (auto& [area, pack] : draining_areas_) releaseScratchLocked(std::move(area));
    draining_areas_.clear();
    // Spare areas: no write reads them any more; deregistered before they are unmapped.
    for (auto& area : spare_areas_) {
      if (Status s = agent_->deregisterRegion(area->id()); !s.isOk()) {
        HXFER_LOG_ERROR("context: releasing staging area {}: {}", area->id(), s.toString());
      }
    }
    spare_areas_.clear();
    spare_bytes_ = 0;
  });
}

}  // namespace hxfer::engine
