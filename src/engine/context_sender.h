// ContextSender: the context (prefill) side of the transceiver for one rank (DESIGN §7).
//
// Generation ranks connect to this rank's transport agent and say Hello (RankInfo + token);
// the sender checks the token and compatibility (plan::checkCompatible), declares the peer's
// regions to the agent and answers with its own Hello. Per request it then waits for two
// things, in either order: the serving code's markReady(id) (prefill state is in the pages the
// cache manager allocated for `id`) and a TransferRequest from each generation rank whose
// layers and units overlap this rank. With both, it plans (Planner::createForSource, cached per
// peer), posts the writes, waits for remote completion and sends TransferDone — a Done with ok
// status means the bytes landed.
//
// Streaming: markReady(id, layers) says some layers are final while prefill still runs. The
// sender then posts those layers' ops at once (when the request has arrived and is at least
// stream_min_tokens long), and each later range's as it comes; the range that reaches this
// rank's last layer marks the request ready. TransferDone still follows the last byte of the
// last range; the generation rank sees no difference (no wire change). Cancellation, stalls and
// peer loss end an ask between ranges as they would end a whole one; its pages are then freed
// at the serving code's next markReady (which reports the end) or cancel(id), never while
// prefill may still write them.
//
// Ownership of the request's pages: from markReady(id) the sender owns the allocation of `id`
// in the cache manager and frees it when every overlapping generation rank has been answered
// (or is gone), on cancel(id), or when the lease expires (nobody asked within lease_timeout, or
// a staged part waited longer for its next window; counted as leases_expired). Pages with writes in
// flight are gated through the cache manager (beginTransfer/endTransfer): a free while in flight
// parks them in quarantine until the write reaches a terminal state.
//
// Cancellation: cancel(id) from the serving code, or a Cancel message from a generation rank,
// at any point. Best effort: a posted write is cancelled at the transport and still polled to
// a terminal state; every TransferRequest gets exactly one TransferDone (Cancelled when the
// request was cancelled), unless its peer is gone.
//
// A lost peer fails only its own request parts; the sender keeps serving the others and
// accepts the peer again when it reconnects.
//
// Thread-safety: every public method may be called from any thread. A progress thread owned by
// the sender handles transport events, transfer completion and timers (a finishing write wakes
// it through Agent::wakeEventWaiter, so completion is not polled); the `on_request`
// callback runs on it (without the sender's lock held) and must not block for long.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/cache_manager.h"
#include "common/status.h"
#include "device/device_api.h"
#include "engine/event_watcher.h"
#include "engine/metrics.h"
#include "engine/options.h"
#include "engine/recent_ids.h"
#include "plan/memory.h"
#include "plan/planner.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace hxfer::engine {

class ContextSender {
 public:
  struct Options : EngineOptions {
    // Source pages of a request marked ready that not every overlapping generation rank asked
    // for within this time are freed (counted in leases_expired); between two windows of a
    // staged part it runs from the last window answered. Also bounds how long a
    // TransferRequest waits for markReady before it is answered with Timeout.
    std::chrono::milliseconds lease_timeout{30000};
    // A posted write that has not finished within this time is cancelled and its request part
    // answered with Timeout (counted in writes_stalled); one that still has not stopped after
    // twice this time has its peer disconnected, which ends every write to it.
    std::chrono::milliseconds stall_timeout{30000};
    // Requests shorter than this (the TransferRequest's num_tokens) go in one piece after the
    // last range even when layers are marked ready early: below it a transfer takes about as
    // long as its per-write overheads, and one write of merged ops is cheaper.
    uint64_t stream_min_tokens = 512;
    // Per generation peer, requests asked and not yet answered: at most this many, holding at
    // most max_waiting_blocks_factor x this rank's own pool (its num_blocks, counted in the
    // peer's blocks when their tokens per block differ; never more than the peer's num_blocks)
    // destination blocks together. Bounded by what this rank holds, not by what a peer claims.
    // A request past either bound is answered ResourceExhausted at once (requests_over_limit).
    size_t max_waiting_requests = 4096;
    uint32_t max_waiting_blocks_factor = 4;
    // Generation ranks connected at once (handshake done); a Hello past it is refused
    // ResourceExhausted. With the bounds above it caps what every peer together can park here.
    size_t max_generation_peers = 1024;
    // Ended request ids remembered (tombstones, answers a Cancel may still cross): each for
    // two lease periods, and at most this many per rank and per peer (the oldest go first).
    size_t max_remembered_ids = 65536;
    // Called on the progress thread when the first TransferRequest for a request id arrives,
    // with the prompt length and the aux payload (opaque to hxfer). It may call markReady().
    std::function<void(uint64_t request_id, uint64_t num_tokens, const Bytes& aux)> on_request;
    // The device runtime of device pools (the agent's): a plan that packs is packed on the
    // device into a staging area of device memory. Without it such a plan is refused there.
    std::shared_ptr<device::DeviceApi> device;
  };

  // Registers every region of `cache` with `agent` and starts the progress thread.
  // REQUIRES: `cache` outlives the sender; its layout is this rank's (options' model, parallel
  // config and rank). Errors: region registration, an invalid layout for the options.
  static StatusOr<std::unique_ptr<ContextSender>> create(Options options, HybridCacheManager* cache,
                                                         std::unique_ptr<transport::Agent> agent);
  ~ContextSender();  // shutdown()
  ContextSender(const ContextSender&) = delete;
  ContextSender& operator=(const ContextSender&) = delete;

  // The address generation ranks connect to.
  std::string address() const;
  // This sender's incarnation (its Hello carries it): a restarted rank has another.
  uint64_t incarnation() const { return incarnation_; }

  // The prefill state of `request_id` is in its pages: the sender takes ownership of the
  // allocation. `aux` (opaque, at most wire::kMaxAuxBytes; e.g. the first sampled token)
  // travels to every generation rank with its TransferDone and surfaces as RequestResult::aux.
  // NotFound when the cache manager does not know `request_id`; InvalidArgument when it was
  // already marked or `aux` is too large, Unavailable after shutdown() (nothing changes: the
  // pages stay the caller's); Cancelled when it was cancelled before, Timeout when every
  // generation rank that asked for it gave up waiting (in both cases the pages are freed).
  Status markReady(uint64_t request_id, Bytes aux = {});
  // Streaming: the global layers `layers` of `request_id` are final. Ranges come in order
  // without gaps, from this rank's first layer (a range may start below it, or overlap the
  // previous one); the one reaching its last layer is markReady(id) with `aux`. The first call
  // takes ownership of the allocation as markReady(id) does; prefill goes on writing the later
  // layers of the pages. InvalidArgument naming the range (empty, past this rank's layers,
  // marked already, leaving a gap); after the request ended between ranges (cancelled by
  // generation, timed out), the next call frees the pages and returns that status.
  // `ready` (device pools only: InvalidArgument otherwise): the engine's event after the work
  // that writes these layers; nothing of the request is packed or posted before it is done
  // (the progress loop looks each turn), so other requests' writes never wait for it. A later
  // call's event stands for every layer up to its range.
  Status markReady(uint64_t request_id, LayerRange layers, Bytes aux = {},
                   std::shared_ptr<const device::Event> ready = nullptr);

  // Cancels `request_id` at any point (before markReady too: a later markReady then frees the
  // pages and returns Cancelled). Always ok; idempotent.
  Status cancel(uint64_t request_id);

  // metrics().accounting_errors is 1 when selfCheck() fails.
  MetricsSnapshot metrics() const;
  // The accounting self-check: the cache manager's own (every page free, live or quarantined,
  // exactly once), every request the sender owns live in the cache, and the cache's in-flight
  // transfers equal to the writes the sender has posted. Internal naming the disagreement.
  Status selfCheck() const;
  // Requests whose pages the sender still owns (marked ready, not yet freed).
  size_t heldRequests() const;
  // Generation peers whose handshake completed and which are still connected.
  size_t connectedPeers() const;
  // Ended request ids remembered now: the rank's tombstones plus every peer's answer records
  // (each bounded by max_remembered_ids).
  size_t rememberedIds() const;

  // Stops the progress thread, cancels writes in flight and waits for them (bounded), frees
  // every request the sender owns and disconnects every peer. Idempotent.
  void shutdown();

 private:
  struct Peer;
  struct Piece;
  struct StagedPlan;
  struct Ask;
  struct Source;
  using Callback = std::function<void()>;

  ContextSender(Options options, HybridCacheManager* cache,
                std::unique_ptr<transport::Agent> agent);
  void run();
  // All *Locked methods REQUIRE mu_ held; they may queue callbacks to run after unlocking.
  void handleEventLocked(transport::Event& event, std::vector<Callback>* callbacks);
  void onHelloLocked(Peer& peer, wire::Hello hello);
  void onRequestLocked(Peer& peer, wire::TransferRequest req, std::vector<Callback>* callbacks);
  void onCancelLocked(Peer& peer, const wire::Cancel& cancel);
  void onPeerLostLocked(transport::PeerId id);
  // Starts the asks that may start and advances the started ones.
  void tryStartLocked(Source& src);
  // Whether `ask` may have layers posted now: the request is ready, or layers of it are and the
  // request is long enough to stream (stream_min_tokens).
  bool mayPostLocked(const Source& src, const Ask& ask) const;
  // kWaiting -> kPosted: takes the cache's transfer hold (the peer and allocation checked).
  void startAskLocked(Source& src, Ask& ask);
  // Drives a kPosted ask: reaps finished pieces, posts the layers ready since the last piece,
  // cancels its pieces when it must end early, and answers it once nothing is in flight and
  // either every layer went or it ended.
  void advanceAskLocked(Source& src, Ask& ask);
  // Plans and posts the ask's layers [sent_end, src.ready_end) (one piece, or none when they
  // hold nothing for the peer); a failure is left in ask.failed.
  void postPieceLocked(Source& src, Ask& ask);
  // Ends `ask` unposted with `why` (ask.failed), said once in the log.
  void refuseAskLocked(const Source& src, Ask& ask, Status why);
  // A part the generation rank asked to stage (TransferRequest::staging): its ops (ask.staged)
  // gathered into one local area in the slot's order (plan/staging.h) and posted as one write.
  void postStagedLocked(Source& src, Ask& ask);
  // Device pools behind a host agent (staged_device_): the part's bytes copied on the device
  // into a pinned host area (laid out as the generation rank's slot when it asked for staging,
  // else back to back), then written from there. The copy is not waited for here: the piece
  // stays in flight with its event (copy_watcher_ wakes the progress thread) until
  // advanceAskLocked posts it (landCopyLocked); it counts against stall_timeout meanwhile.
  void postFromDeviceLocked(Source& src, Ask& ask, const RankPlan& plan);
  // A piece whose device copy is done (or, `post` false, may still run): its write posted when
  // `post` and the copy and the pack before it succeeded; otherwise the piece ends unposted
  // (its area back once the device is done with it) and a failed copy fails the ask.
  void landCopyLocked(Ask& ask, Piece& piece, bool post);
  // Posts `piece.ops` (after `piece.pack` where it is pending) and starts its stall clock.
  Status writeLocked(const Ask& ask, Piece& piece);
  StatusOr<RankPlan> planAskLocked(const Source& src, const Ask& ask, LayerRange layers) const;
  // Posts `ops` as one piece of `ask` (`area`, a registered local source the ops read, is
  // released once the write is terminal, or now when posting fails).
  // `pack`: the device pack that fills `area`, which the write waits for (nullptr or done:
  // none). The engine's layers-ready event is done before anything is posted.
  Status postLocked(Ask& ask, std::vector<transport::WriteOp> ops, std::unique_ptr<Region> area,
                    uint64_t bytes, std::shared_ptr<const device::Event> pack = nullptr);
  // The checksum of a streamed request part (options_.checksum), over every piece's bytes.
  StatusOr<uint64_t> checksumAskLocked(const Source& src, const Ask& ask) const;
  void answerLocked(Source& src, Ask& ask, const Status& status, uint64_t bytes,
                    std::optional<uint64_t> checksum);
  // A registered staging area holding `plan`'s pack ops' bytes (RankPlan::scratch_bytes).
  StatusOr<std::unique_ptr<Region>> stageLocked(const RankPlan& plan);
  // Device pools: plan.pack_ops packed on the device into a staging area of device memory
  // (the engine's layers-ready event is done by then); the area and the pack's event.
  StatusOr<std::pair<std::unique_ptr<Region>, std::shared_ptr<const device::Event>>>
  packOnDeviceLocked(const RankPlan& plan);
  // The device work a pack or copy queued now would wait behind: the last one queued on
  // pack_stream_ while it is not done, else nullptr.
  std::shared_ptr<const device::Event> streamTailLocked() const {
    return !stream_work_.empty() && !stream_work_.back()->done() ? stream_work_.back() : nullptr;
  }
  // Records a pack or copy just queued on pack_stream_ (its head's clock starts when the stream
  // was idle).
  void queuedOnStreamLocked(std::shared_ptr<const device::Event> work) {
    if (stream_work_.empty()) stream_head_since_ = Clock::now();
    stream_work_.push_back(std::move(work));
  }
  // A piece's area once its write ended: released now, or once its pack (`pack`) is done.
  void retireAreaLocked(std::unique_ptr<Region> area, std::shared_ptr<const device::Event> pack);
  // A registered local area of at least `bytes` (staging, gathering): a spare one, or new.
  StatusOr<std::unique_ptr<Region>> acquireAreaLocked(uint64_t bytes);
  // Takes back an area whose write is terminal (or never started): kept as a spare while the
  // spares stay under kSpareAreaBytes, deregistered and freed otherwise.
  void releaseScratchLocked(std::unique_ptr<Region> scratch);
  void progressLocked();
  void timersLocked();
  void cancelLocked(Source& src, const Status& why);
  void freePagesLocked(Source& src);
  // Frees the pages once every expected rank is answered, and forgets a finished source.
  void maybeFinishLocked(uint64_t request_id);
  void sendLocked(transport::PeerId peer, const wire::Message& m);
  void sendDoneLocked(transport::PeerId peer, wire::TransferDone done);
  // Answers a TransferRequest that never became an Ask (refused on arrival, or dead already).
  void refuseRequestLocked(Peer& peer, const wire::TransferRequest& req, const Status& why);
  // Why `req` may not join `src` (another instance's request, or an id this rank of the peer
  // asked for already); ok when it may.
  Status checkJoinLocked(const Peer& peer, const Source& src,
                         const wire::TransferRequest& req) const;
  // Whether `req` of `peer` asks for the next window of the staged part `a` answered.
  static bool continues(const Ask& a, const Peer& peer, const wire::TransferRequest& req);
  // Whether `a` asks for a window of a staged part before its last one.
  static bool lastWindowBefore(const Ask& a);
  // Ends `a` if it waits for its part's next window (Ask::more): counted failed with `cause`.
  void endWindowsLocked(Source& src, Ask& a, FailureCause cause);
  // Drops `old`, whose generation rank a newer connection now claims: its asks end as if the
  // connection had been lost.
  void supersedeLocked(Peer& old, const Peer& newer);
  // Stall handling of posted writes (stall_timeout).
  void stallsLocked(Clock::time_point now);
  void refuseLocked(Peer& peer, const Status& why);
  bool anyInFlightLocked() const;
  // How long a tombstone or an answered-request record is kept: two leases, past any message
  // of the request still on its way.
  Clock::time_point rememberUntil() const { return Clock::now() + 2 * options_.lease_timeout; }

  // Wakes the progress thread out of agent_->pollEvent when a posted write finishes, so a Done
  // leaves as soon as its bytes landed. Shared with the transfers' completion callbacks, which
  // may run after the sender is gone: shutdown() detaches the agent first.
  struct Waker {
    std::mutex mu;
    transport::Agent* agent = nullptr;  // guarded by mu; null once shut down
    void wake() {
      std::lock_guard lock(mu);
      if (agent != nullptr) agent->wakeEventWaiter();
    }
  };

  const Options options_;
  HybridCacheManager* const cache_;
  std::unique_ptr<transport::Agent> agent_;
  wire::RankInfo self_;  // fixed after create()
  RankMemory memory_;    // fixed after create()
  LayerRange stage_;     // this rank's global layers; fixed after create()

  mutable std::mutex mu_;
  bool stop_ = false;                                                   // guarded by mu_
  std::unordered_map<transport::PeerId, std::unique_ptr<Peer>> peers_;  // guarded by mu_
  std::unordered_map<uint64_t, std::unique_ptr<Source>> sources_;       // guarded by mu_
  // An ended id: its asks are answered with `why` (cancelled, lease expired, timed out). It
  // belongs to the generation instance whose ranks asked (each rank with the incarnation it
  // asked in), or, when it ended before any ask, to whoever asks. A rank of another instance, or
  // one restarted since it asked (another incarnation), starts a request of its own: a new
  // generation process that numbers its requests from 1 again does not inherit old failures.
  struct Tombstone {
    Status why;
    std::string instance;                               // empty: every asker
    std::vector<std::pair<uint32_t, uint64_t>> askers;  // (global rank, incarnation)
    bool answers(const std::string& asking, uint32_t rank, uint64_t incarnation) const;
  };
  static Tombstone tombstoneLocked(const Source& src, const Status& why);
  // The destination blocks one generation peer's waiting asks may name together
  // (Options::max_waiting_blocks_factor).
  static uint64_t blockBudget(const RankLayout& self, const RankLayout& peer, uint32_t factor);
  RecentIds<Tombstone> tombstones_;  // guarded by mu_
  const uint64_t incarnation_;       // this sender's, in its Hello
  uint32_t next_scratch_ = 0;        // guarded by mu_; staging area ids (acquireAreaLocked)
  // Areas whose writes ended, kept registered and faulted in for the next parts that need one
  // (a fresh area of tens of MiB costs more to fault in than to fill).
  static constexpr uint64_t kSpareAreaBytes = 256ull << 20;
  static constexpr uint64_t kAreaGranule = 1ull << 20;
  std::vector<std::unique_ptr<Region>> spare_areas_;  // guarded by mu_
  uint64_t spare_bytes_ = 0;                          // guarded by mu_
  // Device pools: the device of this rank's pools, its stream for packs (made on first use),
  // and areas whose write ended while their pack may still run (released once it is done).
  int device_ordinal_ = -1;
  // Device pools behind an agent that moves host memory only (ucx): every part goes through a
  // host area (postFromDeviceLocked).
  bool staged_device_ = false;
  std::unique_ptr<device::Stream> pack_stream_;  // guarded by mu_
  // The packs and copies queued on pack_stream_ in order, those seen done dropped from the
  // front (stallsLocked), and when the front one became the head: a part queued behind the
  // head counts its stall clock from then, so it stalls only when the stream makes no progress.
  std::deque<std::shared_ptr<const device::Event>> stream_work_;  // guarded by mu_
  Clock::time_point stream_head_since_;                           // guarded by mu_
  std::vector<std::pair<std::unique_ptr<Region>, std::shared_ptr<const device::Event>>>
      draining_areas_;  // guarded by mu_
  // Answered requests whose transfer hold waits for an unposted device copy that still reads
  // their pages (Ask::reading): the pages are not freed before it is done.
  std::vector<std::pair<uint64_t, std::shared_ptr<const device::Event>>>
      held_for_copies_;  // guarded by mu_
  Metrics metrics_;
  std::shared_ptr<Waker> waker_ = std::make_shared<Waker>();
  // Wakes the progress thread as each device copy into a host area is done (staged_device_).
  EventWatcher copy_watcher_{[waker = waker_] { waker->wake(); }};
  std::thread thread_;
  std::once_flag shutdown_once_;
};

}  // namespace hxfer::engine
