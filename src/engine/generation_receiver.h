// GenerationReceiver: the generation (decode) side of the transceiver for one rank (DESIGN §7).
//
// At creation it works out which context ranks write anything to this rank (their layers and
// units overlap ours; see handshake.h) and talks to exactly those: it connects, says Hello
// (RankInfo + token), and checks the answer (token, role, rank, plan::checkCompatible).
//
// Request lifecycle:
//   startRequest(id, tokens)  allocates blocks + slot from the cache manager and sends a
//                             TransferRequest to each overlapping context rank (queued until
//                             that rank's handshake completes);
//   TransferDone(ok) from every expected rank (+ checksum verified when enabled, + the byte
//                             total equal to the planner's expectation) -> kDone: the pages
//                             hold the state and belong to the caller until release(id);
//   any failure, timeout (request_timeout), lost peer or cancel(id) -> kFailed with the
//                             status; the receiver frees the pages itself.
// In-flight gating: from the TransferRequest until that rank's TransferDone (or the loss of
// that peer) the request holds a transfer in the cache manager, so pages freed on failure or
// cancel stay quarantined until no context rank can still write into them.
//
// A lost context rank fails only the requests that needed it; requests that need it while it
// is down fail at once (Unavailable), and the receiver reconnects every reconnect_interval.
// A refused handshake (wrong token, incompatible layout) is final for that peer.
//
// Thread-safety: every public method may be called from any thread. A progress thread owned by
// the receiver handles transport events and timers; each connect attempt runs on a thread of its
// own, so a context rank that accepts but never answers delays nobody else.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cache/cache_manager.h"
#include "common/status.h"
#include "device/device_api.h"
#include "engine/event_watcher.h"
#include "engine/metrics.h"
#include "engine/options.h"
#include "plan/memory.h"
#include "plan/planner.h"
#include "plan/staging.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace hxfer::engine {

struct RequestResult {
  enum class State { kInProgress, kDone, kFailed };
  State state = State::kInProgress;
  Status status;                        // ok when kDone; why when kFailed
  uint64_t bytes = 0;                   // bytes received (kDone)
  std::chrono::nanoseconds latency{0};  // start to completion
  // Of latency, the time before its first TransferRequest went out (all of it when none did):
  // waiting for a context rank's connection, for the engine's pages-free event, or for staging
  // room. latency - queued is the transfer, from the first ask to the end.
  std::chrono::nanoseconds queued{0};
  // What the context side gave markReady (kDone): of the context ranks this request read from,
  // the lowest global rank that sent a non-empty one; empty when none did.
  Bytes aux;
  bool terminal() const { return state != State::kInProgress; }
};

// The pages an engine chose for one request on this rank: block ids in order, the slot, and
// the further state groups' ids (vLLM's shared tensors).
struct EnginePages {
  std::vector<uint32_t> blocks;
  std::optional<uint32_t> slot;
  uint64_t owner = 0;  // HybridCacheManager::adopt's tag for the release listener
  std::vector<uint32_t> group_slots{};
};

class GenerationReceiver {
 public:
  struct Options : EngineOptions {
    ParallelConfig ctx_parallel;             // the context instance's tp/pp
    std::vector<std::string> ctx_addresses;  // one per context rank, index pp_rank * tp + tp_rank
    std::chrono::milliseconds request_timeout{30000};
    std::chrono::milliseconds handshake_timeout{10000};
    std::chrono::milliseconds reconnect_interval{500};
    // Storm control (plan/staging.h, docs/engine.md): a part of at least stage_min_ops ops of
    // at most stage_max_op_bytes on average is asked for as one write into a slot of this
    // rank's staging region (staging_bytes, registered once; 0: never) and scattered into the
    // pages here before the request completes. Only context ranks of wire minor 4 or later are
    // asked; a part that finds no free slot goes as it would without staging.
    uint64_t staging_bytes = 64ull << 20;
    uint64_t stage_min_ops = 256;
    uint64_t stage_max_op_bytes = 4096;
    // Also where the transport's per-op cost is about a memcpy call (shm, inproc:
    // Capabilities::many_small_ops_cheap). There staging's two extra local copies cost more
    // than the ops they save (docs/performance.md); tests and benchmarks turn it on.
    bool stage_on_cheap_ops = false;
    // The device runtime of pools in device memory. With a host agent (ucx) such pools are
    // reached only through the staging region: every part is asked for staged, waits for room
    // there, and is copied into the pools on the device (docs/engine.md, "Device pools behind
    // a host agent").
    std::shared_ptr<device::DeviceApi> device;
  };

  // Registers every region of `cache` with `agent`, computes the overlapping context ranks and
  // starts the progress thread (which connects to them). REQUIRES: `cache` outlives the
  // receiver and its layout is this rank's.
  static StatusOr<std::unique_ptr<GenerationReceiver>> create(
      Options options, HybridCacheManager* cache, std::unique_ptr<transport::Agent> agent);
  ~GenerationReceiver();  // shutdown()
  GenerationReceiver(const GenerationReceiver&) = delete;
  GenerationReceiver& operator=(const GenerationReceiver&) = delete;

  // Global ranks of the context ranks this rank talks to.
  const std::vector<uint32_t>& contextRanks() const { return ctx_ranks_; }

  // Waits until every overlapping context rank completed its handshake. The refusal of a peer
  // (token, compatibility) is returned as soon as it is known; Timeout at the deadline.
  Status waitForPeers(Clock::time_point deadline);

  // Allocates pages for `num_tokens` and asks every overlapping context rank for the state.
  // `prefix_tokens` (whole blocks of them) are already held here and not sent. `aux` travels
  // with the request. Errors: ResourceExhausted (no pages), InvalidArgument (known id),
  // Unavailable / Incompatible (a needed peer is down or refused; nothing stays allocated).
  // With `pages` (engine-driven allocation), the engine's blocks and slot are adopted instead
  // (HybridCacheManager::adopt; only the first blocksFor(num_tokens) blocks are touched and
  // fenced) and its errors returned: a page still fenced by an earlier request is refused.
  // `pages_free` (device pools only: InvalidArgument otherwise): the engine's event after its
  // last work on the pages; no context rank is asked, so nothing is written into them, before
  // it is done. One done with an error fails the request naming it; one never done fails it
  // at request_timeout.
  StatusOr<Allocation> startRequest(uint64_t request_id, uint32_t num_tokens,
                                    uint32_t prefix_tokens = 0, Bytes aux = {},
                                    const EnginePages* pages = nullptr,
                                    std::shared_ptr<const device::Event> pages_free = nullptr);
  // The request's state now; NotFound for an unknown (or released) id.
  StatusOr<RequestResult> poll(uint64_t request_id) const;
  // Waits for a terminal state; the in-progress result when the deadline passes first.
  StatusOr<RequestResult> wait(uint64_t request_id, Clock::time_point deadline);
  // Fails an in-progress request with Cancelled (its pages are freed once no context rank can
  // still write into them). A no-op for a terminal request. NotFound for an unknown id.
  Status cancel(uint64_t request_id);
  // Forgets a terminal request and, when it succeeded, frees its pages. InvalidArgument while
  // in progress, NotFound for an unknown id.
  Status release(uint64_t request_id);

  // metrics().accounting_errors is 1 when selfCheck() fails.
  MetricsSnapshot metrics() const;
  // The accounting self-check: the cache manager's own (every page free, live or quarantined,
  // exactly once), every request whose pages the receiver has not freed live in the cache, and
  // the cache's in-flight transfers equal to the request parts the receiver holds fenced.
  Status selfCheck() const;
  size_t activeRequests() const;  // in progress

  // Stops the progress thread, fails every request in progress, disconnects every peer and
  // frees the pages of every request the receiver still owns. Pages a context rank may still
  // be writing into are released only once the transport reports that connection lost (no
  // write of it can land any more), waited for up to 5 s; past that they stay quarantined.
  // Succeeded, unreleased requests stay with the caller.
  // A connect attempt still running is waited for (at most the agent's connect timeout), without
  // the receiver's lock: poll, wait, cancel and release answer at once meanwhile.
  void shutdown();

 private:
  struct CtxPeer;
  struct Part;
  struct Sink;

  GenerationReceiver(Options options, HybridCacheManager* cache,
                     std::unique_ptr<transport::Agent> agent);
  void run();
  void connectDueLocked();
  void finishConnectLocked(CtxPeer& peer, StatusOr<transport::PeerId> id);
  void handleEventLocked(transport::Event& event);
  void onHelloLocked(CtxPeer& peer, wire::Hello hello);
  void onDoneLocked(CtxPeer& peer, const wire::TransferDone& done);
  // Fails the peer's request parts. Their page fences end now only when `transport_lost` (the
  // transport reported kPeerLost: no write of that connection can still land); otherwise they
  // stay until that event arrives for the connection (releaseFencesLocked).
  void peerDownLocked(CtxPeer& peer, const Status& why, bool final, bool transport_lost = false);
  void releaseFencesLocked(transport::PeerId connection);
  void sendPartLocked(Sink& sink, Part& part, CtxPeer& peer);
  // The TransferRequest of `part`: the pages, and its slot (the window now) when staged.
  wire::TransferRequest requestFor(const Sink& sink, const Part& part) const;
  // A staged part's slot as asked for now: for a part larger than it, the window's bytes from
  // where it starts (Part::total, Part::window).
  static wire::Staging askedSlot(const Part& part);
  // Asks `part`'s context rank for the window after the one its slot held (that copy is done).
  void askNextWindowLocked(Sink& sink, Part& part);
  // Asks for `sink`'s queued parts whose context rank is ready (only peers_[only_peer]'s when
  // given), unless the request ended or still waits for the engine's pages-free event.
  void sendQueuedPartsLocked(Sink& sink, std::optional<size_t> only_peer = std::nullopt);
  void failLocked(Sink& sink, const Status& status, FailureCause cause);
  void completeIfDoneLocked(Sink& sink);
  void endPartLocked(Sink& sink, Part& part);
  void timersLocked();
  Status verifyChecksumLocked(const Sink& sink, const CtxPeer& peer, uint64_t expected) const;
  // The plan of `sink`'s part from `peer` with made-up source ids: what lands here does not
  // depend on the context rank's ids (checksums, staging).
  StatusOr<RankPlan> destinationPlanLocked(const Sink& sink, const CtxPeer& peer) const;
  // Asks for staging (req->staging, part.staging) when the part is a storm and a slot is free.
  void maybeStageLocked(const Sink& sink, Part& part, const CtxPeer& peer,
                        wire::TransferRequest* req);
  // A staged part's runs in its slot now: all of them (no copy), or the window's, held in
  // `window`, for a part larger than its slot.
  static StatusOr<std::span<const StagedRun>> slotRuns(const Part& part,
                                                       std::vector<StagedRun>& window);
  // Host pools: the slot scattered into the pages, here.
  Status scatterLocked(const Part& part);
  // Device pools behind a host agent: the slot's batched copy into the pools queued on the
  // device, its event watched (scatter_watcher_); the part finishes in finishScattersLocked.
  StatusOr<std::shared_ptr<device::Event>> startScatterLocked(const Part& part);
  void finishScattersLocked();
  // Device pools behind a host agent: a staging slot for `part` before it is asked for: the
  // part's size, or half the region for a part larger than the region, asked for window by
  // window. False while the region has no room (the part stays queued); an error for a peer
  // without staging, or without windows (wire minor 7) for a part larger than the region.
  StatusOr<bool> reserveSlotLocked(const Sink& sink, Part& part, const CtxPeer& peer);
  // A slot of `bytes` in the staging region for `part` (first fit); false when none is free.
  bool takeSlotLocked(Part& part, uint64_t bytes);
  void freeSlotLocked(Part& part);
  void waitForRoomLocked(const Sink& sink, Part& part);
  void serveRoomWaitersLocked();
  void sendLocked(transport::PeerId peer, const wire::Message& m);
  CtxPeer* peerById(transport::PeerId id);
  // Whether a connect() other than `except`'s is running.
  bool anyConnectingLocked(const CtxPeer* except) const;

  const Options options_;
  HybridCacheManager* const cache_;
  // The staging region (Options::staging_bytes), declared before the agent so that it outlives
  // every write the agent may still run into it.
  std::unique_ptr<Region> staging_;
  std::unique_ptr<device::HostRegistration> staging_pin_;  // device pools: staging_ pinned
  std::unique_ptr<transport::Agent> agent_;
  // Device pools (Options::device owns them): the device's ordinal, else -1. staged_device_:
  // and the agent moves host memory only, so every part goes through staging_.
  int device_ordinal_ = -1;
  bool staged_device_ = false;
  bool windows_noted_ = false;  // the first part in windows was logged (under mu_)
  std::unique_ptr<device::Stream> scatter_stream_;  // progress thread only
  wire::RankInfo self_;                             // fixed after create()
  RankMemory memory_;                               // fixed after create()
  std::vector<uint32_t> ctx_ranks_;                 // fixed after create()

  // Threads blocked in wait() / waitForPeers() under mu_. Each sleeps in ppoll on its own
  // eventfd instead of on a condition variable, like the transport's event queue (measured
  // faster on a loaded machine); every request's completion crosses this hand-off.
  class Waiters {
   public:
    // Like condition_variable::wait_until: REQUIRES `lock` held; false once `deadline` passed.
    // May return early (spuriously); callers re-check their condition.
    bool waitUntil(std::unique_lock<std::mutex>& lock, Clock::time_point deadline);
    void notifyAll();  // REQUIRES the owner's mutex held

   private:
    std::vector<int> fds_;  // guarded by the owner's mutex
  };

  mutable std::mutex mu_;
  Waiters waiters_;    // a request turned terminal, or a peer's state changed
  bool stop_ = false;  // guarded by mu_
  std::vector<std::unique_ptr<CtxPeer>> peers_;                // guarded by mu_
  std::unordered_map<uint64_t, std::unique_ptr<Sink>> sinks_;  // guarded by mu_
  // Peers lost before the connect() that made them had returned to the progress thread (its
  // kPeerLost can come first); finishConnectLocked treats such a connect as failed. Only kept
  // while a connect is running.
  std::unordered_set<transport::PeerId> lost_while_connecting_;  // guarded by mu_
  Metrics metrics_;
  const uint64_t incarnation_;  // this receiver's, in its Hello
  uint64_t next_epoch_ = 1;     // guarded by mu_; the epoch of the next request started
  // Staging slots in use (offset -> bytes), each until its part's fence ends.
  std::map<uint64_t, uint64_t> staging_slots_;  // guarded by mu_
  // Parts of device pools behind a host agent waiting for room in the staging region, in the
  // order they first asked: served first come, first served (serveRoomWaitersLocked), so a later
  // part never takes room an earlier one is waiting for.
  struct RoomWaiter {
    uint64_t request_id, epoch;
    size_t part;  // index into the sink's parts
  };
  std::deque<RoomWaiter> room_waiters_;  // guarded by mu_
  // Room may be there for the first waiters (a slot was freed, or a part queued behind them):
  // timersLocked serves them.
  bool room_check_ = false;       // guarded by mu_
  bool serving_waiters_ = false;  // guarded by mu_; inside serveRoomWaitersLocked
  // Wakes the progress thread as each scatter copy is done; timersLocked then finishes the
  // parts whose copies are (finishScattersLocked), and walks no request otherwise.
  std::atomic<bool> scatters_done_{false};
  EventWatcher scatter_watcher_{[this] {
    scatters_done_ = true;
    agent_->wakeEventWaiter();
  }};
  std::thread thread_;
  std::once_flag shutdown_once_;
};

}  // namespace hxfer::engine
