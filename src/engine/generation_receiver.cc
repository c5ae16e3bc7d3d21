#include "engine/generation_receiver.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <future>
#include <set>
#include <thread>

#include "common/logging.h"
#include "device/copy_table_builder.h"
#include "device/device_api.h"
#include "engine/handshake.h"
#include "plan/staging.h"

namespace hxfer::engine {

// How long shutdown() waits for the transport to confirm that the connections it closed are
// gone, so that the pages of requests still in flight can be released.
constexpr std::chrono::seconds kShutdownFenceWait{5};
// The staging region's id: far from the pools' (numbered from 0).
constexpr uint32_t kStagingRegionId = 0x7FFF0000u;

// One context rank this rank talks to.
struct GenerationReceiver::CtxPeer {
  enum class State { kIdle, kConnecting, kHandshaking, kReady, kDown, kRefused };
  uint32_t rank = 0;  // global rank in the context instance
  std::string address;
  State state = State::kIdle;
  bool ever_ready = false;
  transport::PeerId id = 0;
  Clock::time_point next_attempt{}, handshake_deadline{};
  // While kConnecting: the agent's connect() runs on its own thread, so that a peer that
  // accepts the socket but never answers (hung, stopped, a black-holed address) cannot hold
  // the progress thread for the agent's whole connect timeout.
  std::future<StatusOr<transport::PeerId>> connecting;
  State before_connect = State::kIdle;
  Status last_error;
  wire::RankInfo info;             // valid when ready
  uint64_t incarnation = 0;        // from its last Hello
  uint16_t minor = 0;              // the frame minor of its last Hello: later frames say it too
  std::optional<Planner> planner;  // that context rank -> this rank (checksums)
  uint64_t kv_ops_per_block = 0;   // what a kv block adds to a part's ops (storm control)
};

// One context rank's part of one request.
struct GenerationReceiver::Part {
  // kScattering: its Done came and the device copies its staging slot into the pools (device
  // pools behind a host agent); it stays in flight until that copy is done (finishScattersLocked),
  // or, a part in windows, until the half of the slot its next window goes into is free.
  enum class State { kQueued, kSent, kScattering, kOk, kFailed };
  size_t peer = 0;  // index into peers_
  State state = State::kQueued;
  bool in_flight = false;  // holds a transfer in the cache manager
  // When set, the part failed because this rank dropped the connection itself: its fence (the
  // in-flight transfer) ends at that connection's kPeerLost, when the transport has proved
  // that no write of the peer into these pages can still run.
  transport::PeerId fenced_by = 0;
  uint64_t bytes = 0;
  // The slot this part was asked to write into (storm control); freed when its fence ends.
  std::optional<wire::Staging> staging{};
  // Device pools behind a host agent, a part larger than its slot (wire minor 7): the part's
  // staged bytes, and where the window asked for last starts. 0: the part goes whole. The slot
  // holds two windows (halves; one below 128 bytes), window k in half k % 2: the context rank
  // gathers and writes the next window while the device copies the last into the pools.
  uint64_t total = 0;
  uint64_t window = 0;
  // A staged part's runs in the slot, the whole part's (stagingRuns), laid out once when its slot
  // was taken; freed with the slot.
  std::vector<StagedRun> runs{};
  // The context rank answered a window of it before the last, and holds the request for the
  // next ask: a failure must tell it (Cancel), as it tells one with the part in flight.
  bool ctx_waiting = false;
  bool waiting_room = false;  // in room_waiters_ (device pools behind a host agent)
  // The device's copy of each half of the slot into the pools (of the whole slot: [0]) while it
  // runs, until finishScattersLocked sees it done; the slot and the pages stay fenced meanwhile.
  std::array<std::shared_ptr<device::Event>, 2> copies{};
  // Ended (endPartLocked) while a copy ran: the fence ends once none runs (finishScattersLocked).
  bool draining = false;
  Bytes done_aux{};  // kScattering: the Done's aux, taken once copied

  bool copying() const { return copies[0] || copies[1]; }
  // A window's room in the slot: half of it for a part in windows (all of it below 128 bytes).
  uint64_t windowSpan() const {
    return total > 0 && staging->bytes >= 128 ? (staging->bytes / 2) & ~uint64_t{63}
                                              : staging->bytes;
  }
  // The half of the slot the window asked for last goes into, and the next window's (a slot of
  // one half: 0 for each).
  bool twoHalves() const { return total > 0 && windowSpan() < staging->bytes; }
  size_t half() const { return twoHalves() ? (window / windowSpan()) % 2 : 0; }
  size_t nextHalf() const { return twoHalves() ? 1 - half() : 0; }
  // The bytes of the window asked for last (the whole slot for a part that goes whole).
  uint64_t windowBytes() const {
    return total > 0 ? std::min(windowSpan(), total - window) : staging->bytes;
  }
  // A window of the part comes after the one asked for last.
  bool windowsAfter() const { return total > 0 && window + windowBytes() < total; }
};

struct GenerationReceiver::Sink {
  uint64_t id = 0;
  uint64_t epoch = 0;  // this use of the id; every TransferDone and Cancel for it must match
  Allocation alloc;
  uint32_t first_block = 0;
  Bytes aux;  // sent with the TransferRequest
  Clock::time_point start, deadline;
  std::optional<Clock::time_point> asked;  // when its first TransferRequest went out
  std::vector<Part> parts;
  RequestResult result;
  std::optional<uint32_t> aux_rank;  // the context rank result.aux came from
  // The engine's "pages free" event while it is pending: no part is sent before it is done.
  std::shared_ptr<const device::Event> pages_free;
  bool pages_freed = false;  // by the receiver (failure) or release()
  bool released = false;     // forgotten by the caller; kept while parts are in flight
  bool anyInFlight() const {
    return std::any_of(parts.begin(), parts.end(), [](const Part& p) { return p.in_flight; });
  }
  // The generation positions this request receives, and its length (for token ranges).
  BlockRange range() const {
    return {first_block, static_cast<uint32_t>(alloc.blocks.size()) - first_block,
            alloc.num_tokens};
  }
};

StatusOr<std::unique_ptr<GenerationReceiver>> GenerationReceiver::create(
    Options options, HybridCacheManager* cache, std::unique_ptr<transport::Agent> agent) {
  if (cache == nullptr || agent == nullptr) return InvalidArgument("cache and agent are required");
  const int ordinal = deviceOrdinal(options.device.get(), *cache);
  RETURN_IF_ERROR(checksumsPossible(options.checksum,
                                    agent->capabilities().device_memory || ordinal >= 0,
                                    agent->capabilities().name));
  const bool staged_device = ordinal >= 0 && !agent->capabilities().device_memory;
  if (staged_device && options.staging_bytes == 0) {
    return InvalidArgument(
        "staging_bytes is 0, and these pools are device memory behind a host agent (" +
        agent->capabilities().name +
        "), which they are reached through: give the staging region "
        "at least the bytes of the largest part one context rank sends this rank");
  }
  // A context rank gets our pools only once its Hello matched (onHelloLocked).
  agent->requireWriteGrants();
  const RankLayout& layout = cache->layout();
  if (layout.tp != options.parallel.tp || layout.pp != options.parallel.pp ||
      layout.tp_rank != options.tp_rank || layout.pp_rank != options.pp_rank) {
    return InvalidArgument("cache layout rank " + rankName(layout) +
                           " does not match the options' rank");
  }
  if (options.ctx_addresses.size() != options.ctx_parallel.worldSize()) {
    return InvalidArgument(
        "ctx_addresses has " + std::to_string(options.ctx_addresses.size()) +
        " entries, context tp*pp=" + std::to_string(options.ctx_parallel.worldSize()));
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> ranks,
                   overlappingContextRanks(options.model, options.ctx_parallel, layout));
  std::unique_ptr<GenerationReceiver> g(
      new GenerationReceiver(std::move(options), cache, std::move(agent)));
  g->ctx_ranks_ = std::move(ranks);
  g->self_.instance_id = g->options_.instance_id;
  g->self_.role = wire::InstanceRole::kGeneration;
  const std::string addr = g->agent_->localAddress();
  g->self_.address.assign(addr.begin(), addr.end());
  g->self_.layout = layout;
  g->device_ordinal_ = ordinal;
  g->staged_device_ = staged_device;
  // Device pools behind a host agent are never written by a peer: only the staging region is.
  for (const auto& region : cache->regions()) {
    if (staged_device) break;
    ASSIGN_OR_RETURN(Bytes key,
                     g->agent_->registerRegion(*region, transport::RegionAccess::kRemoteWritable));
    if (!key.empty()) g->self_.region_keys.push_back({region->id(), std::move(key)});
  }
  // Staging is a host-memory path: a device agent's pools are written in place.
  if (g->options_.staging_bytes > 0 && !g->agent_->capabilities().device_memory) {
    const auto backing = g->agent_->capabilities().needs_memfd_regions
                             ? Region::Backing::kMemfd
                             : Region::Backing::kAnonymous;
    ASSIGN_OR_RETURN(g->staging_, Region::allocate(kStagingRegionId, g->options_.staging_bytes,
                                                   backing, "hxfer-staging"));
    if (staged_device) {
      // Pinned, so that the device's copies out of it run at the bus's speed.
      ASSIGN_OR_RETURN(g->staging_pin_, g->options_.device->registerHost(g->staging_->data(),
                                                                         g->staging_->length()));
    }
    ASSIGN_OR_RETURN(Bytes key, g->agent_->registerRegion(
                                    *g->staging_, transport::RegionAccess::kRemoteWritable));
    if (!key.empty()) g->self_.region_keys.push_back({kStagingRegionId, std::move(key)});
    g->self_.layout.regions.push_back({kStagingRegionId, g->options_.staging_bytes, "staging"});
  }
  RETURN_IF_ERROR(wire::checkRankInfo(g->self_).withContext("own rank_info"));
  g->memory_ = cacheMemory(*cache);
  for (uint32_t r : g->ctx_ranks_) {
    auto p = std::make_unique<CtxPeer>();
    p->rank = r;
    p->address = g->options_.ctx_addresses[r];
    g->peers_.push_back(std::move(p));
  }
  g->thread_ = std::thread([p = g.get()] { p->run(); });
  return g;
}

namespace {
// One eventfd per waiting thread, created on first use and closed when the thread ends.
struct ThreadWakeFd {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ~ThreadWakeFd() {
    if (fd >= 0) close(fd);
  }
};
}  // namespace

bool GenerationReceiver::Waiters::waitUntil(std::unique_lock<std::mutex>& lock,
                                            Clock::time_point deadline) {
  thread_local ThreadWakeFd own;
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return false;
  if (own.fd < 0) {  // no eventfd: nap briefly instead
    lock.unlock();
    std::this_thread::sleep_for(std::min<Clock::duration>(left, std::chrono::microseconds(50)));
    lock.lock();
    return Clock::now() < deadline;
  }
  // Registered before the lock is dropped, so a notifyAll after that makes the fd readable.
  fds_.push_back(own.fd);
  lock.unlock();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  pollfd pfd{own.fd, POLLIN, 0};
  if (ppoll(&pfd, 1, &ts, nullptr) > 0 && (pfd.revents & POLLIN)) {
    uint64_t count = 0;
    (void)!read(own.fd, &count, sizeof(count));
  }
  lock.lock();
  fds_.erase(std::find(fds_.begin(), fds_.end(), own.fd));
  return Clock::now() < deadline;
}

void GenerationReceiver::Waiters::notifyAll() {
  const uint64_t one = 1;
  for (int fd : fds_) (void)!write(fd, &one, sizeof(one));
}

GenerationReceiver::GenerationReceiver(Options options, HybridCacheManager* cache,
                                       std::unique_ptr<transport::Agent> agent)
    : options_(std::move(options)),
      cache_(cache),
      agent_(std::move(agent)),
      incarnation_(newIncarnation()) {}

GenerationReceiver::~GenerationReceiver() { shutdown(); }

MetricsSnapshot GenerationReceiver::metrics() const {
  MetricsSnapshot m = metrics_.snapshot(agent_->agentStats());
  m.accounting_errors = selfCheck().isOk() ? 0 : 1;
  return m;
}

Status GenerationReceiver::selfCheck() const {
  std::lock_guard lock(mu_);
  RETURN_IF_ERROR(cache_->selfCheck());
  uint64_t fenced = 0;
  for (const auto& [id, sink] : sinks_) {
    for (const Part& p : sink->parts) fenced += p.in_flight;
    if (!sink->pages_freed && !cache_->find(id).isOk()) {
      return Internal("generation accounting: request " + std::to_string(id) +
                      " holds pages the cache does not know");
    }
  }
  const uint64_t inflight = cache_->counters().inflight_transfers;
  if (inflight != fenced) {
    return Internal("generation accounting: the cache has " + std::to_string(inflight) +
                    " transfers in flight, the receiver holds " + std::to_string(fenced) +
                    " fenced parts");
  }
  return OkStatus();
}

size_t GenerationReceiver::activeRequests() const {
  std::lock_guard lock(mu_);
  return std::count_if(sinks_.begin(), sinks_.end(),
                       [](const auto& kv) { return !kv.second->result.terminal(); });
}

bool GenerationReceiver::anyConnectingLocked(const CtxPeer* except) const {
  return std::any_of(peers_.begin(), peers_.end(), [&](const auto& p) {
    return p.get() != except && p->state == CtxPeer::State::kConnecting;
  });
}

GenerationReceiver::CtxPeer* GenerationReceiver::peerById(transport::PeerId id) {
  for (auto& p : peers_) {
    if (p->id == id &&
        (p->state == CtxPeer::State::kHandshaking || p->state == CtxPeer::State::kReady)) {
      return p.get();
    }
  }
  return nullptr;
}

Status GenerationReceiver::waitForPeers(Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  while (true) {
    // shutdown() wakes the waiters as it starts; the peers never come now.
    if (stop_) return Unavailable("receiver is shut down");
    bool all = true;
    for (const auto& p : peers_) {
      if (p->state == CtxPeer::State::kRefused) {
        return p->last_error.withContext("context rank " + std::to_string(p->rank));
      }
      all &= p->state == CtxPeer::State::kReady;
    }
    if (all) return OkStatus();
    if (!waiters_.waitUntil(lock, deadline)) {
      if (stop_) return Unavailable("receiver is shut down");
      std::string missing;
      for (const auto& p : peers_) {
        if (p->state != CtxPeer::State::kReady) {
          missing += " " + std::to_string(p->rank) +
                     (p->last_error.isOk() ? "" : " (" + p->last_error.toString() + ")");
        }
      }
      return Timeout("context ranks not connected:" + missing);
    }
  }
}

void GenerationReceiver::sendLocked(transport::PeerId peer, const wire::Message& m) {
  if (Status s = agent_->sendMessage(peer, wire::encodeMessage(m)); !s.isOk()) {
    HXFER_LOG_WARN("generation: send {} to peer {}: {}", wire::summarize(m), peer, s.toString());
  }
}

StatusOr<Allocation> GenerationReceiver::startRequest(
    uint64_t request_id, uint32_t num_tokens, uint32_t prefix_tokens, Bytes aux,
    const EnginePages* pages, std::shared_ptr<const device::Event> pages_free) {
  std::lock_guard lock(mu_);
  if (stop_) return Unavailable("receiver is shut down");
  if (pages_free && !agent_->capabilities().device_memory && device_ordinal_ < 0) {
    return InvalidArgument("request " + std::to_string(request_id) +
                           ": a device event given with pools in host memory (" +
                           agent_->capabilities().name + " agent)");
  }
  if (sinks_.count(request_id)) {
    return InvalidArgument("request " + std::to_string(request_id) + " is already known");
  }
  if (aux.size() > wire::kMaxAuxBytes) {
    return InvalidArgument("aux is " + std::to_string(aux.size()) + " bytes, limit " +
                           std::to_string(wire::kMaxAuxBytes));
  }
  for (const auto& p : peers_) {
    if (p->state == CtxPeer::State::kRefused) {
      return p->last_error.withContext("context rank " + std::to_string(p->rank));
    }
    if (p->ever_ready && p->state != CtxPeer::State::kReady) {
      return Unavailable("context rank " + std::to_string(p->rank) + " is down");
    }
  }
  metrics_.requestStarted();
  auto take_pages = [&]() -> StatusOr<Allocation> {
    if (pages == nullptr) return cache_->allocate(request_id, num_tokens);
    const size_t used = std::min<size_t>(pages->blocks.size(), cache_->blocksFor(num_tokens));
    // hxfer never writes the prefix blocks: they are fenced shared, so requests that share a
    // cached prefix may be in flight together.
    const uint32_t prefix_blocks = static_cast<uint32_t>(
        std::min<size_t>(prefix_tokens / self_.layout.tokens_per_block, used));
    return cache_->adopt(request_id, num_tokens,
                         std::span<const uint32_t>(pages->blocks.data(), used), pages->slot,
                         pages->owner, prefix_blocks, pages->group_slots);
  };
  StatusOr<Allocation> alloc = take_pages();
  if (!alloc.isOk()) {
    metrics_.requestFailed(causeOf(alloc.status()));
    return alloc.status();
  }
  auto sink = std::make_unique<Sink>();
  sink->id = request_id;
  sink->epoch = next_epoch_++;
  sink->alloc = *alloc;
  const uint32_t tpb = self_.layout.tokens_per_block;
  sink->first_block = std::min<uint32_t>(prefix_tokens / tpb, sink->alloc.blocks.size());
  sink->aux = std::move(aux);
  sink->start = Clock::now();
  sink->deadline = sink->start + options_.request_timeout;
  if (pages_free && !pages_free->done()) sink->pages_free = std::move(pages_free);
  for (size_t i = 0; i < peers_.size(); ++i) sink->parts.push_back(Part{i});
  Sink& s = *sink;
  sinks_[request_id] = std::move(sink);
  if (pages_free && !pages_free->status().isOk()) {
    failLocked(s, pages_free->status().withContext("the engine's pages-free event"),
               FailureCause::kOther);
  }
  sendQueuedPartsLocked(s);  // or once the engine let go of the pages (timersLocked)
  if (s.result.terminal()) {
    // A send failed (the peer went away before its loss was seen): the pages are freed or
    // quarantined already, so the caller must not get them. The id is forgotten once no part
    // is in flight.
    Status failed = s.result.status;
    s.released = true;
    if (!s.anyInFlight()) sinks_.erase(request_id);
    return failed;
  }
  completeIfDoneLocked(s);
  return *alloc;
}

void GenerationReceiver::sendQueuedPartsLocked(Sink& sink, std::optional<size_t> only_peer) {
  for (Part& part : sink.parts) {
    if (sink.result.terminal() || sink.pages_free) return;
    if (part.state != Part::State::kQueued || (only_peer && part.peer != *only_peer)) continue;
    CtxPeer& peer = *peers_[part.peer];
    if (peer.state == CtxPeer::State::kReady) sendPartLocked(sink, part, peer);
  }
}

void GenerationReceiver::sendPartLocked(Sink& sink, Part& part, CtxPeer& peer) {
  if (staged_device_ && !part.staging) {
    // First come, first served: a part behind others waiting for room waits behind them, and a
    // waiting part is asked for in its turn only.
    if (!serving_waiters_ && (part.waiting_room || !room_waiters_.empty())) {
      waitForRoomLocked(sink, part);
      return;
    }
    auto reserved = reserveSlotLocked(sink, part, peer);
    if (!reserved.isOk()) {
      part.waiting_room = false;
      part.state = Part::State::kFailed;
      failLocked(sink, reserved.status(), FailureCause::kOther);
      return;
    }
    if (!*reserved) {  // queued until a slot frees
      waitForRoomLocked(sink, part);
      return;
    }
    part.waiting_room = false;
  }
  if (Status st = cache_->beginTransfer(sink.id); !st.isOk()) {
    freeSlotLocked(part);
    part.state = Part::State::kFailed;
    failLocked(sink, st, causeOf(st));
    return;
  }
  part.in_flight = true;
  part.state = Part::State::kSent;
  wire::TransferRequest req = requestFor(sink, part);
  if (!part.staging && !staged_device_) {  // staged_device_: a part without a slot moves nothing
    maybeStageLocked(sink, part, peer, &req);
  }
  if (Status st = agent_->sendMessage(peer.id, wire::encodeMessage(req)); !st.isOk()) {
    endPartLocked(sink, part);
    part.state = Part::State::kFailed;
    failLocked(sink, st.withContext("context rank " + std::to_string(peer.rank)),
               FailureCause::kPeerLost);
    return;
  }
  if (!sink.asked) sink.asked = Clock::now();
}

wire::TransferRequest GenerationReceiver::requestFor(const Sink& sink, const Part& part) const {
  wire::TransferRequest req;
  req.request_id = sink.id;
  req.gen_tp_rank = self_.layout.tp_rank;
  req.gen_pp_rank = self_.layout.pp_rank;
  req.dst_block_ids = sink.alloc.blocks;
  req.dst_slot = sink.alloc.slot;
  req.dst_group_slots = sink.alloc.group_slots;
  req.first_block = sink.first_block;
  req.num_tokens = sink.alloc.num_tokens;
  req.aux = sink.aux;
  req.epoch = sink.epoch;
  if (part.staging) req.staging = askedSlot(part);
  return req;
}

wire::Staging GenerationReceiver::askedSlot(const Part& part) {
  wire::Staging slot = *part.staging;
  if (part.total > 0) {
    slot.part = part.total;
    slot.window = part.window;
    slot.offset += part.half() * part.windowSpan();
    slot.bytes = part.windowBytes();
  }
  return slot;
}

void GenerationReceiver::askNextWindowLocked(Sink& sink, Part& part) {
  part.window += part.windowBytes();
  part.ctx_waiting = false;  // asked now, or gone
  CtxPeer& peer = *peers_[part.peer];
  // The context rank answered the last window only once it had landed: no write of this part
  // is in flight, so its fence may end here, once the device's copies are done.
  Status st = peer.state == CtxPeer::State::kReady
                  ? agent_->sendMessage(peer.id, wire::encodeMessage(requestFor(sink, part)))
                  : Unavailable("it went away between two windows of a staged part");
  if (!st.isOk()) {
    endPartLocked(sink, part);
    part.state = Part::State::kFailed;
    failLocked(sink, st.withContext("context rank " + std::to_string(peer.rank)),
               FailureCause::kPeerLost);
    return;
  }
  part.state = Part::State::kSent;
}

void GenerationReceiver::maybeStageLocked(const Sink& sink, Part& part, const CtxPeer& peer,
                                          wire::TransferRequest* req) {
  if (!staging_ || peer.info.version_minor < wire::kStagingMinor || !peer.planner) return;
  if (agent_->capabilities().many_small_ops_cheap && !options_.stage_on_cheap_ops) return;
  // A cheap look first: a part whose kv records are whole runs per block is no storm.
  const uint64_t blocks = sink.alloc.blocks.size() - sink.first_block;
  if (blocks * peer.kv_ops_per_block < options_.stage_min_ops) return;
  auto plan = destinationPlanLocked(sink, peer);
  if (!plan.isOk() || plan->ops.empty() || plan->ops.size() < options_.stage_min_ops ||
      plan->bytes > options_.stage_max_op_bytes * plan->ops.size()) {
    return;
  }
  auto runs = stagingRuns(plan->ops);
  if (!runs.isOk() || !takeSlotLocked(part, plan->bytes)) return;  // full: it goes without staging
  part.runs = std::move(runs).value();
  req->staging = part.staging;
}

bool GenerationReceiver::takeSlotLocked(Part& part, uint64_t bytes) {
  uint64_t at = 0;  // first fit, 64-byte aligned
  for (const auto& [offset, length] : staging_slots_) {
    if (offset >= at + bytes) break;
    at = (offset + length + 63) & ~uint64_t{63};
  }
  if (at + bytes > staging_->length()) return false;
  staging_slots_[at] = bytes;
  part.staging = wire::Staging{kStagingRegionId, at, bytes};
  return true;
}

StatusOr<bool> GenerationReceiver::reserveSlotLocked(const Sink& sink, Part& part,
                                                     const CtxPeer& peer) {
  if (part.staging) return true;
  const std::string what =
      "request " + std::to_string(sink.id) + " from context rank " + std::to_string(peer.rank);
  if (peer.info.version_minor < wire::kStagingMinor || !peer.planner) {
    return Incompatible(what + ": it speaks wire 1." + std::to_string(peer.info.version_minor) +
                        ", without staging, and this rank's pools are device memory behind a " +
                        agent_->capabilities().name + " agent, reached only through staging");
  }
  ASSIGN_OR_RETURN(RankPlan plan, destinationPlanLocked(sink, peer));
  if (plan.ops.empty()) return true;  // nothing of this part lands here
  ASSIGN_OR_RETURN(std::vector<StagedRun> runs, stagingRuns(plan.ops));
  if (plan.bytes <= staging_->length()) {
    if (!takeSlotLocked(part, plan.bytes)) return false;
    part.runs = std::move(runs);
    return true;
  }
  if (peer.info.version_minor < wire::kStagingWindowMinor) {
    return ResourceExhausted(what + ": the part is " + std::to_string(plan.bytes) +
                             " bytes, more than the staging region of " +
                             std::to_string(staging_->length()) +
                             " (staging_bytes), and the context rank speaks wire 1." +
                             std::to_string(peer.info.version_minor) +
                             ", which takes a staged part whole (windows need 1.7 or later)");
  }
  // Window by window through a slot of half the region (whole for a tiny one), so that a
  // second large part moves beside it.
  const uint64_t region = staging_->length();
  if (!takeSlotLocked(part, region >= 128 ? (region / 2) & ~uint64_t{63} : region)) return false;
  part.runs = std::move(runs);
  part.total = plan.bytes;
  part.window = 0;
  if (!windows_noted_) {  // once: metrics count the windows (staging_windows)
    windows_noted_ = true;
    HXFER_LOG_WARN(
        "generation: {}: the part is {} bytes, more than the staging region of {} "
        "(staging_bytes): it moves in windows of {} bytes, a round trip each; a region of at "
        "least the part's size moves it whole",
        what, plan.bytes, region, part.windowSpan());
  }
  return true;
}

void GenerationReceiver::freeSlotLocked(Part& part) {
  if (!part.staging) return;
  staging_slots_.erase(part.staging->offset);
  part.staging.reset();
  part.runs = {};
  part.total = part.window = 0;
  if (!room_waiters_.empty()) room_check_ = true;
}

void GenerationReceiver::waitForRoomLocked(const Sink& sink, Part& part) {
  if (!part.waiting_room) {
    part.waiting_room = true;
    room_waiters_.push_back(RoomWaiter{sink.id, sink.epoch, size_t(&part - sink.parts.data())});
  }
  if (!serving_waiters_) room_check_ = true;  // the first waiters may fit now (timersLocked)
}

void GenerationReceiver::serveRoomWaitersLocked() {
  serving_waiters_ = true;
  for (auto it = room_waiters_.begin(); it != room_waiters_.end();) {
    auto s = sinks_.find(it->request_id);
    Sink* sink = s == sinks_.end() || s->second->epoch != it->epoch ? nullptr : s->second.get();
    Part* part =
        sink != nullptr && it->part < sink->parts.size() ? &sink->parts[it->part] : nullptr;
    if (part == nullptr || !part->waiting_room || part->state != Part::State::kQueued ||
        sink->result.terminal()) {
      if (part != nullptr) part->waiting_room = false;
      it = room_waiters_.erase(it);  // ended or cancelled meanwhile
      continue;
    }
    CtxPeer& peer = *peers_[part->peer];
    if (peer.state != CtxPeer::State::kReady) {
      ++it;  // asked for in its turn once its context rank is back
      continue;
    }
    sendPartLocked(*sink, *part, peer);
    if (part->waiting_room) break;  // no room for it yet: nothing behind it goes first
    it = room_waiters_.erase(it);
  }
  serving_waiters_ = false;
}

StatusOr<std::span<const StagedRun>> GenerationReceiver::slotRuns(const Part& part,
                                                                  std::vector<StagedRun>& window) {
  if (part.total == 0) return std::span<const StagedRun>(part.runs);
  ASSIGN_OR_RETURN(window, windowRuns(part.runs, StagingWindow{part.window, part.windowBytes()}));
  return std::span<const StagedRun>(window);
}

Status GenerationReceiver::scatterLocked(const Part& part) {
  std::vector<StagedRun> window;
  ASSIGN_OR_RETURN(const std::span<const StagedRun> runs, slotRuns(part, window));
  RETURN_IF_ERROR(scatterStaged(
      runs, std::span<const uint8_t>(staging_->data() + part.staging->offset, part.staging->bytes),
      memory_));
  metrics_.stormStaged(runs.size());
  return OkStatus();
}

StatusOr<std::shared_ptr<device::Event>> GenerationReceiver::startScatterLocked(const Part& part) {
  // One batched copy on the device, from the pinned slot into the pools. The pages and the
  // slot stay fenced until its event is done, however long the device takes.
  std::vector<StagedRun> window;
  ASSIGN_OR_RETURN(const std::span<const StagedRun> runs, slotRuns(part, window));
  const RankMemory staging = {{staging_->data(), staging_->length()}};
  ASSIGN_OR_RETURN(
      device::HostCopyTable table,
      device::copyTable(scatterOps(runs, 0, askedSlot(part).offset), staging, memory_));
  if (!scatter_stream_) {
    ASSIGN_OR_RETURN(scatter_stream_, options_.device->createStream(device_ordinal_));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<device::Event> copied, scatter_stream_->copy(table));
  if (!part.windowsAfter()) metrics_.stormStaged(part.runs.size());  // once a part
  scatter_watcher_.watch(copied);
  return copied;
}

void GenerationReceiver::finishScattersLocked() {
  std::vector<uint64_t> forget;
  for (auto& [id, sink_ptr] : sinks_) {
    Sink& sink = *sink_ptr;
    for (Part& part : sink.parts) {
      bool reaped = false;
      Status copied = OkStatus();
      for (auto& copy : part.copies) {
        if (!copy || !copy->done()) continue;
        if (copied.isOk()) copied = copy->status();
        copy.reset();
        reaped = true;
      }
      if (!reaped) continue;
      const CtxPeer& peer = *peers_[part.peer];
      if (!copied.isOk()) {
        const Status why =
            copied
                .withContext("copying a staged part of " + std::to_string(part.bytes) +
                             " bytes into device " + std::to_string(device_ordinal_))
                .withContext("context rank " + std::to_string(peer.rank));
        if (sink.result.terminal()) {
          HXFER_LOG_WARN("generation: request {} (ended): {}", sink.id, why.toString());
        } else {
          // Tells a context rank writing the next window, or waiting to be asked for it.
          failLocked(sink, why, FailureCause::kOther);
        }
      }
      if (part.draining) {
        if (!part.copying()) endPartLocked(sink, part);
        continue;
      }
      // kSent: the next window is asked for; its Done ends the part.
      if (part.state != Part::State::kScattering) continue;
      if (!sink.result.terminal() && part.windowsAfter()) {
        // Its half of the slot is free once the copy of the window before the last is done.
        if (!part.copies[part.nextHalf()]) askNextWindowLocked(sink, part);
        continue;
      }
      if (part.copying()) continue;  // the last window's copy
      endPartLocked(sink, part);
      if (sink.result.terminal()) {
        part.state = Part::State::kFailed;
        part.done_aux.clear();
        continue;
      }
      part.state = Part::State::kOk;
      if (!part.done_aux.empty() && (!sink.aux_rank || peer.rank < *sink.aux_rank)) {
        sink.result.aux = std::move(part.done_aux);
        sink.aux_rank = peer.rank;
      }
      part.done_aux.clear();
      completeIfDoneLocked(sink);
    }
    if (sink.released && !sink.anyInFlight()) forget.push_back(id);
  }
  for (uint64_t id : forget) sinks_.erase(id);
}

void GenerationReceiver::endPartLocked(Sink& sink, Part& part) {
  if (!part.in_flight) return;
  // A device copy of a window still reads the slot and writes the pages: the fence ends with it.
  part.draining = part.copying();
  if (part.draining) return;
  part.in_flight = false;
  // No write of this part can land any more: its staging slot is free again.
  if (part.staging) {
    freeSlotLocked(part);
  }
  if (Status s = cache_->endTransfer(sink.id); !s.isOk()) {
    HXFER_LOG_ERROR("generation: endTransfer of request {}: {}", sink.id, s.toString());
  }
}

void GenerationReceiver::failLocked(Sink& sink, const Status& status, FailureCause cause) {
  if (sink.result.terminal()) return;
  sink.result.state = RequestResult::State::kFailed;
  sink.result.status = status;
  sink.result.latency = Clock::now() - sink.start;
  sink.result.queued = sink.asked ? *sink.asked - sink.start : sink.result.latency;
  metrics_.requestFailed(cause);
  for (Part& p : sink.parts) {
    if (p.waiting_room) room_check_ = true;  // the waiters behind it may fit now
    if (p.state == Part::State::kQueued) {
      p.state = Part::State::kFailed;
    } else if (p.state == Part::State::kSent || p.ctx_waiting) {
      p.ctx_waiting = false;
      CtxPeer& peer = *peers_[p.peer];
      if (peer.state == CtxPeer::State::kReady) {
        sendLocked(peer.id, wire::Cancel{sink.id, status.toString(), sink.epoch});
      }
    }
  }
  if (!sink.pages_freed) {
    sink.pages_freed = true;
    if (sink.anyInFlight()) metrics_.quarantined();
    if (Status s = cache_->free(sink.id); !s.isOk()) {
      HXFER_LOG_ERROR("generation: freeing request {}: {}", sink.id, s.toString());
    }
  }
  HXFER_LOG_INFO("generation: request {} failed: {}", sink.id, status.toString());
  waiters_.notifyAll();
}

void GenerationReceiver::completeIfDoneLocked(Sink& sink) {
  if (sink.result.terminal()) return;
  uint64_t total = 0;
  for (const Part& p : sink.parts) {
    if (p.state != Part::State::kOk) return;
    total += p.bytes;
  }
  // Every context rank of the instance has the same tokens per block, so any peer's planner
  // knows what this rank receives (whole blocks, or token ranges when the block sizes differ).
  const BlockRange range = sink.range();
  uint64_t expected = uint64_t{range.num_blocks} * self_.layout.kvBytesPerBlock() +
                      self_.layout.stateBytesPerSlot();
  for (const Part& p : sink.parts) {
    const CtxPeer& peer = *peers_[p.peer];
    if (peer.planner) {
      expected = peer.planner->expectedBytes(range);
      break;
    }
  }
  if (total != expected) {
    failLocked(sink,
               Internal("request " + std::to_string(sink.id) + " received " +
                        std::to_string(total) + " bytes, expected " + std::to_string(expected)),
               FailureCause::kOther);
    return;
  }
  sink.result.state = RequestResult::State::kDone;
  sink.result.status = OkStatus();
  sink.result.bytes = total;
  sink.result.latency = Clock::now() - sink.start;
  sink.result.queued = sink.asked ? *sink.asked - sink.start : sink.result.latency;
  metrics_.requestOk(total, sink.result.latency);
  waiters_.notifyAll();
}

StatusOr<RankPlan> GenerationReceiver::destinationPlanLocked(const Sink& sink,
                                                             const CtxPeer& peer) const {
  const RankLayout& ctx = peer.info.layout;
  const BlockRange range = sink.range();
  const uint64_t src_blocks =
      peer.planner->byToken()
          ? (peer.planner->kvTokens(range).second + ctx.tokens_per_block - 1) / ctx.tokens_per_block
          : sink.alloc.blocks.size();
  const RankIds src = placeholderIds(ctx, src_blocks);
  RankIds dst = idsOf(sink.alloc);
  return peer.planner->planRank(0, src, dst, range);
}

Status GenerationReceiver::verifyChecksumLocked(const Sink& sink, const CtxPeer& peer,
                                                uint64_t expected) const {
  // Only the destination side is hashed: any source ids the plan accepts will do.
  ASSIGN_OR_RETURN(RankPlan plan, destinationPlanLocked(sink, peer));
  ASSIGN_OR_RETURN(uint64_t got, checksumOps(std::move(plan.ops), memory_, /*source=*/false));
  if (got != expected) {
    return Corruption("request " + std::to_string(sink.id) + " from context rank " +
                      std::to_string(peer.rank) + ": checksum sent " + std::to_string(expected) +
                      " != received " + std::to_string(got));
  }
  return OkStatus();
}

void GenerationReceiver::onDoneLocked(CtxPeer& peer, const wire::TransferDone& done) {
  auto it = sinks_.find(done.request_id);
  if (it == sinks_.end()) return;
  Sink& sink = *it->second;
  if (done.epoch != 0 && done.epoch != sink.epoch) {
    // The answer to an earlier use of this id (its Done crossed a Cancel, or it was delayed):
    // it says nothing about this request.
    HXFER_LOG_DEBUG("generation: ignoring a done of request {} epoch {} (now epoch {})", sink.id,
                    done.epoch, sink.epoch);
    metrics_.staleMessage();
    return;
  }
  Part* part = nullptr;
  for (Part& p : sink.parts) {
    if (peers_[p.peer].get() == &peer && p.state == Part::State::kSent) part = &p;
  }
  if (part == nullptr) return;  // a duplicate answer (e.g. to a Cancel that crossed the Done)
  if (done.status.isOk() && !sink.result.terminal()) {
    // Answered a window before the last: the context rank waits for the next ask, or a Cancel.
    part->ctx_waiting = part->windowsAfter();
  }
  // A staged part lands in its slot: into the pages with it, before the slot is freed.
  Status scattered = OkStatus();
  if (part->staging && done.status.isOk() && !sink.result.terminal()) {
    if (staged_device_) {
      // On the device: the part stays in flight, its slot and pages fenced, until the copy is
      // done; the progress thread goes on meanwhile (finishScattersLocked).
      const uint64_t window = part->windowBytes();
      auto copying =
          done.bytes != window
              ? Corruption("the context rank wrote " + std::to_string(done.bytes) +
                           " bytes into a staging slot of " + std::to_string(window))
          : part->copies[part->half()]  // never asked for while its copy runs
              ? Internal("a window landed in a half of the staging slot the device still copies")
              : startScatterLocked(*part);
      if (copying.isOk()) {
        part->state = Part::State::kScattering;
        part->copies[part->half()] = std::move(*copying);
        part->bytes += done.bytes;  // window by window for a part larger than its slot
        part->done_aux = done.aux;
        if (part->total > 0) metrics_.stagingWindow();
        // The next window at once when its half of the slot is free.
        if (part->windowsAfter() && !part->copies[part->nextHalf()]) {
          askNextWindowLocked(sink, *part);
        }
        return;
      }
      scattered = copying.status().withContext("copying a staged part into device " +
                                               std::to_string(device_ordinal_));
    } else {
      scattered = scatterLocked(*part);
    }
  }
  endPartLocked(sink, *part);
  part->state = done.status.isOk() ? Part::State::kOk : Part::State::kFailed;
  part->bytes = done.bytes;
  if (sink.result.terminal()) {
    if (sink.released && !sink.anyInFlight()) sinks_.erase(it);
    return;
  }
  if (!done.status.isOk()) {
    failLocked(sink, done.status.withContext("context rank " + std::to_string(peer.rank)),
               causeOf(done.status));
    return;
  }
  if (!scattered.isOk()) {
    part->state = Part::State::kFailed;
    failLocked(sink, scattered.withContext("context rank " + std::to_string(peer.rank)),
               FailureCause::kOther);
    return;
  }
  if (options_.checksum && done.checksum) {
    if (Status s = verifyChecksumLocked(sink, peer, *done.checksum); !s.isOk()) {
      part->state = Part::State::kFailed;
      failLocked(sink, s, FailureCause::kChecksum);
      return;
    }
  }
  if (!done.aux.empty() && (!sink.aux_rank || peer.rank < *sink.aux_rank)) {
    sink.result.aux = done.aux;
    sink.aux_rank = peer.rank;
  }
  completeIfDoneLocked(sink);
}

void GenerationReceiver::releaseFencesLocked(transport::PeerId connection) {
  std::vector<uint64_t> forget;
  for (auto& [id, sink] : sinks_) {
    for (Part& p : sink->parts) {
      if (p.fenced_by != connection) continue;
      p.fenced_by = 0;
      endPartLocked(*sink, p);
    }
    if (sink->released && !sink->anyInFlight()) forget.push_back(id);
  }
  for (uint64_t id : forget) sinks_.erase(id);
}

void GenerationReceiver::peerDownLocked(CtxPeer& peer, const Status& why, bool final,
                                        bool transport_lost) {
  const bool was_ready = peer.state == CtxPeer::State::kReady;
  if (was_ready) metrics_.peerLost();
  peer.last_error = why;
  peer.state = final ? CtxPeer::State::kRefused
                     : (peer.ever_ready ? CtxPeer::State::kDown : CtxPeer::State::kIdle);
  peer.next_attempt = Clock::now() + options_.reconnect_interval;
  const size_t index =
      std::find_if(peers_.begin(), peers_.end(), [&](const auto& p) { return p.get() == &peer; }) -
      peers_.begin();
  std::vector<uint64_t> forget;
  for (auto& [id, sink] : sinks_) {
    for (Part& p : sink->parts) {
      if (p.peer != index) continue;
      if (p.state == Part::State::kSent) {
        if (transport_lost) {
          endPartLocked(*sink, p);
        } else {
          p.fenced_by = peer.id;
        }
        p.state = Part::State::kFailed;
        failLocked(*sink, why.withContext("context rank " + std::to_string(peer.rank)),
                   final ? FailureCause::kRefused : FailureCause::kPeerLost);
      } else if ((p.state == Part::State::kQueued && (final || peer.ever_ready)) || p.ctx_waiting) {
        // A part between two windows ends once its copy is done (finishScattersLocked); the
        // context rank, which held the request for the next one, is gone.
        p.ctx_waiting = false;
        if (p.state == Part::State::kQueued) p.state = Part::State::kFailed;
        failLocked(*sink, why.withContext("context rank " + std::to_string(peer.rank)),
                   final ? FailureCause::kRefused : FailureCause::kPeerLost);
      }
    }
    if (sink->released && !sink->anyInFlight()) forget.push_back(id);
  }
  for (uint64_t id : forget) sinks_.erase(id);
  waiters_.notifyAll();
}

namespace {

// The ops one more kv block adds to a part from this context rank (the difference between
// plans of two blocks and of one, made-up ids): 2 when each kv record is one run, one per
// token and K|V half where records fragment (NHD or token-major at TP mismatch).
uint64_t kvOpsPerBlock(const Planner& planner, const RankLayout& ctx, const RankLayout& gen) {
  if (gen.num_blocks < 2 || ctx.num_blocks < 2) return 0;
  auto ops = [&](uint32_t n) -> uint64_t {
    RankIds src, dst;
    const uint64_t src_blocks =
        (uint64_t{n} * gen.tokens_per_block + ctx.tokens_per_block - 1) / ctx.tokens_per_block;
    for (uint64_t i = 0; i < src_blocks; ++i) {
      // Every other block: consecutive ids would merge and hide the per-block cost.
      src.blocks.push_back(static_cast<uint32_t>((2 * i) % ctx.num_blocks));
    }
    for (uint32_t i = 0; i < n; ++i) dst.blocks.push_back(i == 0 ? 0 : gen.num_blocks - 1);
    auto plan = planner.planRank(0, src, dst, BlockRange{0, n, uint64_t{n} * gen.tokens_per_block});
    return plan.isOk() ? plan->ops.size() : 0;
  };
  const uint64_t one = ops(1), two = ops(2);
  return two > one ? two - one : 0;
}

}  // namespace

void GenerationReceiver::onHelloLocked(CtxPeer& peer, wire::Hello hello) {
  auto refuse = [&](const Status& why) {
    HXFER_LOG_WARN("generation rank {}: refusing context rank {}: {}", rankName(self_.layout),
                   peer.rank, why.toString());
    metrics_.handshake(false);
    sendLocked(peer.id, wire::Error{why});
    (void)agent_->disconnect(peer.id);
    peerDownLocked(peer, why, /*final=*/true);
  };
  if (peer.state != CtxPeer::State::kHandshaking) {
    refuse(InvalidArgument("unexpected hello"));
    return;
  }
  const wire::RankInfo& info = hello.rank_info;
  if (info.role != wire::InstanceRole::kContext) {
    refuse(Incompatible("peer role " + std::string(wire::instanceRoleName(info.role)) +
                        " != context"));
    return;
  }
  if (info.layout.tp != options_.ctx_parallel.tp || info.layout.pp != options_.ctx_parallel.pp ||
      info.globalRank() != peer.rank) {
    refuse(Incompatible("peer at " + peer.address + " is rank " + rankName(info.layout) +
                        " of tp=" + std::to_string(info.layout.tp) +
                        " pp=" + std::to_string(info.layout.pp) + ", expected global rank " +
                        std::to_string(peer.rank) +
                        " of tp=" + std::to_string(options_.ctx_parallel.tp) +
                        " pp=" + std::to_string(options_.ctx_parallel.pp)));
    return;
  }
  if (Status s = wire::checkPeerReadsLayout(self_.layout, info.version_minor); !s.isOk()) {
    refuse(s);
    return;
  }
  auto planner = Planner::createForSource(info.layout, self_.layout);
  if (!planner.isOk()) {
    refuse(planner.status());
    return;
  }
  if (peer.ever_ready) {
    metrics_.reconnected();
    if (hello.incarnation != peer.incarnation) {
      HXFER_LOG_INFO("generation rank {}: context rank {} restarted (incarnation {} -> {})",
                     rankName(self_.layout), peer.rank, peer.incarnation, hello.incarnation);
    }
  }
  // Only now, its Hello matched, may it write into our pools (on shm: get their fds). They
  // reach it before any TransferRequest sent below.
  if (Status s = agent_->grantWrites(peer.id); !s.isOk()) {
    if (s.code() == StatusCode::kNotFound || s.code() == StatusCode::kUnavailable) {
      // The connection went between its Hello and the grant: a loss like any other (its
      // kPeerLost follows or came already), not a refusal of the context rank.
      HXFER_LOG_WARN("generation rank {}: context rank {} lost while granting writes: {}",
                     rankName(self_.layout), peer.rank, s.toString());
      peerDownLocked(peer, Unavailable("connection lost while granting writes: " + s.message()),
                     /*final=*/false);
      return;
    }
    refuse(s.withContext("granting writes"));
    return;
  }
  peer.incarnation = hello.incarnation;
  peer.info = std::move(hello.rank_info);
  peer.planner = std::move(*planner);
  peer.kv_ops_per_block = kvOpsPerBlock(*peer.planner, peer.info.layout, self_.layout);
  peer.state = CtxPeer::State::kReady;
  peer.ever_ready = true;
  peer.last_error = OkStatus();
  metrics_.handshake(true);
  HXFER_LOG_INFO("generation rank {}: context rank {} ready", rankName(self_.layout), peer.rank);
  const size_t index =
      std::find_if(peers_.begin(), peers_.end(), [&](const auto& p) { return p.get() == &peer; }) -
      peers_.begin();
  for (auto& [id, sink] : sinks_) sendQueuedPartsLocked(*sink, index);
  waiters_.notifyAll();
}

void GenerationReceiver::handleEventLocked(transport::Event& ev) {
  using Kind = transport::Event::Kind;
  // A connection this rank dropped earlier is now proved quiet: its fences end.
  if (ev.kind == Kind::kPeerLost) releaseFencesLocked(ev.peer);
  CtxPeer* peer = peerById(ev.peer);
  if (peer == nullptr) {
    if (ev.kind == Kind::kPeerConnected) {
      HXFER_LOG_WARN("generation: unexpected incoming peer {}; closing", ev.peer);
      (void)agent_->disconnect(ev.peer);
    } else if (ev.kind == Kind::kPeerLost && anyConnectingLocked(nullptr)) {
      lost_while_connecting_.insert(ev.peer);
    }
    return;
  }
  if (ev.kind == Kind::kPeerLost) {
    HXFER_LOG_WARN("generation rank {}: context rank {} lost: {}", rankName(self_.layout),
                   peer->rank, ev.status.toString());
    peerDownLocked(*peer, Unavailable("connection lost: " + ev.status.message()), false,
                   /*transport_lost=*/true);
    return;
  }
  if (ev.kind != Kind::kMessage) return;
  uint16_t minor = 0;
  auto msg = wire::decodeMessage(ev.payload, &minor);
  if (msg.isOk() && std::holds_alternative<wire::Hello>(*msg)) {
    peer->minor = minor;
  } else if (msg.isOk() && peer->state == CtxPeer::State::kReady && minor != peer->minor) {
    msg = wire::mixedMinor(*msg, minor, peer->minor);
  }
  if (!msg.isOk()) {
    HXFER_LOG_WARN("generation: undecodable message from context rank {}: {}", peer->rank,
                   msg.status().toString());
    sendLocked(peer->id, wire::Error{msg.status()});
    (void)agent_->disconnect(peer->id);
    peerDownLocked(*peer, msg.status(), false);
    return;
  }
  if (auto* hello = std::get_if<wire::Hello>(&*msg)) {
    onHelloLocked(*peer, std::move(*hello));
  } else if (auto* done = std::get_if<wire::TransferDone>(&*msg)) {
    onDoneLocked(*peer, *done);
  } else if (auto* error = std::get_if<wire::Error>(&*msg)) {
    HXFER_LOG_WARN("generation rank {}: context rank {} reports: {}", rankName(self_.layout),
                   peer->rank, error->status.toString());
    if (peer->state == CtxPeer::State::kHandshaking) {
      metrics_.handshake(false);
      (void)agent_->disconnect(peer->id);
      peerDownLocked(*peer, error->status, /*final=*/true);
    }
  } else if (auto* cancel = std::get_if<wire::Cancel>(&*msg)) {
    auto it = sinks_.find(cancel->request_id);
    if (it == sinks_.end()) return;
    if (cancel->epoch != 0 && cancel->epoch != it->second->epoch) {
      metrics_.staleMessage();
      return;
    }
    failLocked(*it->second, Cancelled("cancelled by context: " + cancel->reason),
               FailureCause::kCancelled);
  }
}

void GenerationReceiver::connectDueLocked() {
  const auto now = Clock::now();
  for (auto& owned : peers_) {
    CtxPeer* p = owned.get();
    if (p->state == CtxPeer::State::kConnecting) {
      if (p->connecting.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
      finishConnectLocked(*p, p->connecting.get());
      continue;
    }
    if ((p->state != CtxPeer::State::kIdle && p->state != CtxPeer::State::kDown) ||
        now < p->next_attempt) {
      continue;
    }
    p->before_connect = p->state;
    p->state = CtxPeer::State::kConnecting;
    p->connecting = std::async(std::launch::async, [agent = agent_.get(), address = p->address] {
      auto id = agent->connect(address);
      agent->wakeEventWaiter();  // the progress thread picks the result up at once
      return id;
    });
  }
}

void GenerationReceiver::finishConnectLocked(CtxPeer& peer, StatusOr<transport::PeerId> id) {
  if (id.isOk() && lost_while_connecting_.erase(*id) > 0) {
    id = Unavailable("context rank " + std::to_string(peer.rank) +
                     " closed the connection right after accepting it");
  }
  if (!anyConnectingLocked(&peer)) lost_while_connecting_.clear();
  if (!id.isOk() && id.status().code() == StatusCode::kPermissionDenied) {
    // Authentication failed (token or uid): final for this peer, like a refused handshake.
    HXFER_LOG_WARN("generation rank {}: context rank {} at {}: {}", rankName(self_.layout),
                   peer.rank, peer.address, id.status().toString());
    metrics_.handshake(false);
    peer.state = peer.before_connect;
    peerDownLocked(peer, id.status(), /*final=*/true);
    return;
  }
  if (!id.isOk()) {
    peer.state = peer.before_connect;
    peer.last_error = id.status();
    peer.next_attempt = Clock::now() + options_.reconnect_interval;
    HXFER_LOG_DEBUG("generation: connect to context rank {} at {}: {}", peer.rank, peer.address,
                    id.status().toString());
    return;
  }
  if (stop_) {
    (void)agent_->disconnect(*id);
    peer.state = CtxPeer::State::kDown;
    return;
  }
  peer.id = *id;
  peer.state = CtxPeer::State::kHandshaking;
  peer.handshake_deadline = Clock::now() + options_.handshake_timeout;
  sendLocked(peer.id, wire::Hello{self_, {}, incarnation_});  // the transport proved the token
}

void GenerationReceiver::timersLocked() {
  if (scatters_done_.exchange(false)) finishScattersLocked();
  if (room_check_) {
    // Parts that wait for room in the staging region (device pools behind a host agent).
    room_check_ = false;
    serveRoomWaitersLocked();
  }
  // Requests whose pages the engine has let go of since: ask the context ranks now.
  for (auto& [id, sink] : sinks_) {
    if (!sink->pages_free || sink->result.terminal() || !sink->pages_free->done()) continue;
    const Status freed = sink->pages_free->status();
    sink->pages_free.reset();
    if (!freed.isOk()) {
      failLocked(*sink, freed.withContext("the engine's pages-free event"), FailureCause::kOther);
      continue;
    }
    sendQueuedPartsLocked(*sink);
    completeIfDoneLocked(*sink);
  }
  const auto now = Clock::now();
  for (auto& [id, sink] : sinks_) {
    if (!sink->result.terminal() && now > sink->deadline) {
      // Say what it still waited for: a part queued for a context rank that never became
      // reachable names that rank and its last connection error.
      std::string waiting =
          sink->pages_free ? "; waiting for the engine's pages-free event" : std::string();
      for (const Part& part : sink->parts) {
        if (sink->pages_free) break;
        if (part.state == Part::State::kScattering) {
          waiting += (waiting.empty() ? "; waiting for " : ", ") +
                     std::string("the device's copy of context rank ") +
                     std::to_string(peers_[part.peer]->rank) + "'s part into the pools";
          continue;
        }
        if (part.state != Part::State::kQueued || part.peer >= peers_.size()) continue;
        const CtxPeer& peer = *peers_[part.peer];
        if (peer.state == CtxPeer::State::kReady) {
          if (staged_device_) {
            waiting += (waiting.empty() ? "; waiting for " : ", ") +
                       std::string("room in the staging region for context rank ") +
                       std::to_string(peer.rank) + "'s part";
          }
          continue;
        }
        waiting += (waiting.empty() ? "; waiting for " : ", ") + std::string("context rank ") +
                   std::to_string(peer.rank) + " at " + peer.address + ", not connected" +
                   (peer.last_error.isOk() ? "" : " (" + peer.last_error.toString() + ")");
      }
      failLocked(*sink,
                 Timeout("request " + std::to_string(id) + " not complete after " +
                         std::to_string(options_.request_timeout.count()) + " ms" + waiting),
                 FailureCause::kTimeout);
    }
  }
  for (auto& p : peers_) {
    if (p->state == CtxPeer::State::kHandshaking && now > p->handshake_deadline) {
      (void)agent_->disconnect(p->id);
      peerDownLocked(
          *p, Timeout("handshake with context rank " + std::to_string(p->rank) + " timed out"),
          false);
    }
  }
}

void GenerationReceiver::run() {
  while (true) {
    {
      std::lock_guard lock(mu_);
      if (stop_) break;
      connectDueLocked();
    }
    auto ev = agent_->pollEvent(options_.idle_poll);
    std::lock_guard lock(mu_);
    if (stop_) break;
    int drained = 0;
    while (ev) {
      handleEventLocked(*ev);
      if (++drained >= 64) break;
      ev = agent_->pollEvent(std::chrono::milliseconds(0));
    }
    timersLocked();
  }
}

StatusOr<RequestResult> GenerationReceiver::poll(uint64_t request_id) const {
  std::lock_guard lock(mu_);
  auto it = sinks_.find(request_id);
  if (it == sinks_.end() || it->second->released) {
    return NotFound("request " + std::to_string(request_id) + " is not known");
  }
  return it->second->result;
}

StatusOr<RequestResult> GenerationReceiver::wait(uint64_t request_id, Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  while (true) {
    auto it = sinks_.find(request_id);
    if (it == sinks_.end() || it->second->released) {
      return NotFound("request " + std::to_string(request_id) + " is not known");
    }
    if (it->second->result.terminal()) return it->second->result;
    if (!waiters_.waitUntil(lock, deadline)) {
      it = sinks_.find(request_id);
      if (it == sinks_.end()) return NotFound("request " + std::to_string(request_id));
      return it->second->result;
    }
  }
}

Status GenerationReceiver::cancel(uint64_t request_id) {
  std::lock_guard lock(mu_);
  auto it = sinks_.find(request_id);
  if (it == sinks_.end() || it->second->released) {
    return NotFound("request " + std::to_string(request_id) + " is not known");
  }
  failLocked(*it->second,
             Cancelled("request " + std::to_string(request_id) + " cancelled by generation"),
             FailureCause::kCancelled);
  return OkStatus();
}

Status GenerationReceiver::release(uint64_t request_id) {
  std::lock_guard lock(mu_);
  auto it = sinks_.find(request_id);
  if (it == sinks_.end() || it->second->released) {
    return NotFound("request " + std::to_string(request_id) + " is not known");
  }
  Sink& sink = *it->second;
  if (!sink.result.terminal()) {
    return InvalidArgument("request " + std::to_string(request_id) +
                           " is in progress; cancel it first");
  }
  if (!sink.pages_freed) {
    sink.pages_freed = true;
    RETURN_IF_ERROR(cache_->free(request_id));
  }
  sink.released = true;
  if (!sink.anyInFlight()) sinks_.erase(it);
  return OkStatus();
}

void GenerationReceiver::shutdown() {
  std::call_once(shutdown_once_, [this] {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      waiters_.notifyAll();  // a waitForPeers answers Unavailable now, not after the teardown
    }
    if (thread_.joinable()) thread_.join();
    // A connect still running ends within the agent's connect timeout. It is waited for without
    // the lock, so poll/wait/cancel/release answer meanwhile; what it opened is closed at once
    // (stop_ is set).
    std::vector<std::pair<CtxPeer*, std::future<StatusOr<transport::PeerId>>>> connecting;
    {
      std::lock_guard lock(mu_);
      for (auto& p : peers_) {
        if (p->state == CtxPeer::State::kConnecting) {
          connecting.emplace_back(p.get(), std::move(p->connecting));
        }
      }
    }
    std::vector<std::pair<CtxPeer*, StatusOr<transport::PeerId>>> connected;
    for (auto& [peer, future] : connecting) connected.emplace_back(peer, future.get());
    std::unique_lock lock(mu_);
    for (auto& [peer, id] : connected) finishConnectLocked(*peer, std::move(id));
    for (auto& [id, sink] : sinks_) {
      failLocked(*sink, Cancelled("receiver shut down"), FailureCause::kCancelled);
    }
    // Staged parts the device still copies into the pools: their slots and pages stay fenced
    // until it is done. Waited for without the lock, bounded; a copy still running after that
    // keeps its pages fenced and the staging region is left allocated (the device reads it).
    std::vector<std::shared_ptr<const device::Event>> copying;
    for (auto& [id, sink] : sinks_) {
      for (const Part& part : sink->parts) {
        for (const auto& copy : part.copies) {
          if (copy) copying.push_back(copy);
        }
      }
    }
    if (!copying.empty()) {
      lock.unlock();
      const Clock::time_point until = Clock::now() + kShutdownFenceWait;
      for (const auto& event : copying) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
        (void)event->wait(std::max(left, std::chrono::milliseconds(0)));
      }
      lock.lock();
      finishScattersLocked();
      size_t still = 0;
      for (auto& [id, sink] : sinks_) {
        for (const Part& part : sink->parts) still += part.copying();
      }
      if (still > 0) {
        HXFER_LOG_WARN(
            "generation: shut down while the device still copies {} staged parts into the "
            "pools after {} s; their pages stay fenced, and the staging region and the "
            "stream stay allocated",
            still, kShutdownFenceWait.count());
        // The device may still read the region; destroying the stream would wait for it.
        (void)scatter_stream_.release();  // NOLINT
        (void)staging_pin_.release();     // NOLINT
        (void)staging_.release();         // NOLINT
      }
    }
    // A part in flight keeps its fence until the transport reports its connection lost: only
    // then can no write of that context rank still land in the pages (a disconnect returns
    // before the peer's copies stop). Pages may be engine memory, reused the moment they are
    // released.
    std::set<transport::PeerId> awaiting;
    for (size_t i = 0; i < peers_.size(); ++i) {
      CtxPeer& p = *peers_[i];
      const bool connected_now =
          p.state == CtxPeer::State::kHandshaking || p.state == CtxPeer::State::kReady;
      if (connected_now) (void)agent_->disconnect(p.id);
      p.state = CtxPeer::State::kDown;
      for (auto& [id, sink] : sinks_) {
        for (Part& part : sink->parts) {
          if (connected_now && part.peer == i && part.in_flight && part.fenced_by == 0 &&
              part.state != Part::State::kScattering) {
            part.fenced_by = p.id;
          }
        }
      }
    }
    for (auto& [id, sink] : sinks_) {
      for (Part& part : sink->parts) {
        if (!part.in_flight || part.state == Part::State::kScattering) continue;
        if (part.fenced_by != 0) {
          awaiting.insert(part.fenced_by);
        } else {
          endPartLocked(*sink, part);  // never reached a connection: nothing can write
        }
      }
    }
    lock.unlock();
    scatter_watcher_.stop();  // within its 50 ms wait
    std::vector<transport::PeerId> lost;
    const Clock::time_point until = Clock::now() + kShutdownFenceWait;
    while (!awaiting.empty() && Clock::now() < until) {
      std::optional<transport::Event> e = agent_->pollEvent(std::chrono::milliseconds(20));
      if (e && e->kind == transport::Event::Kind::kPeerLost && awaiting.erase(e->peer)) {
        lost.push_back(e->peer);
      }
    }
    lock.lock();
    for (transport::PeerId connection : lost) releaseFencesLocked(connection);
    if (!awaiting.empty()) {
      HXFER_LOG_WARN(
          "generation: shut down with {} context connections not confirmed closed; their "
          "requests' pages stay fenced",
          awaiting.size());
    }
    for (auto it = sinks_.begin(); it != sinks_.end();) {
      Sink& sink = *it->second;
      if (sink.pages_freed && !sink.anyInFlight()) {
        it = sinks_.erase(it);
      } else {
        ++it;
      }
    }
    waiters_.notifyAll();
  });
}

}  // namespace hxfer::engine
