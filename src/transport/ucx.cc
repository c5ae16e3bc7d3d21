#include "transport/ucx.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bitset>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/coding.h"
#include "common/logging.h"
#include "transport/auth.h"
#include "transport/local_common.h"
#include "transport/transfer_core.h"

namespace hxfer::transport {
namespace {

using detail::pollServing;
using detail::ServedFd;
using detail::TransferCore;

constexpr std::string_view kScheme = "ucx:";
// 2: the authenticated handshake (hello / challenge / proof / welcome | refused). 3: every
// message, write and write ack after it carries a MAC under the connection's session keys.
constexpr uint32_t kProtocolVersion = 3;
constexpr uint64_t kMaxMessageBytes = 64ull << 20;

// Per-peer bounds, so that an authenticated peer that floods us (or a bug) costs bounded
// memory: it is disconnected instead. UCX reorders messages only across lanes, a handful at a
// time, so the reorder buffer never legitimately comes near 1024 messages; 256 MiB is four
// maximum-size messages. The engine keeps a few dozen transfers in flight per peer, far below
// 4096 half-received ones.
constexpr size_t kMaxReorderMessages = 1024;
constexpr uint64_t kMaxReorderBytes = 256ull << 20;
constexpr size_t kMaxInTransfers = 4096;
// Writes may arrive out of order (across lanes), never this far: older seqs are refused.
constexpr size_t kWriteSeqWindow = 4096;
// Messages and writes up to these sizes are posted on the caller's thread when the worker is
// free (UcxAgent::postHere); larger ones go to the progress thread.
constexpr uint64_t kInlineMessageBytes = 64ull << 10;
constexpr size_t kInlineWriteOps = 64;
constexpr uint64_t kInlineWriteBytes = 256ull << 10;
// A caller serving the worker (UcxAgent::serveWorkerLocked) progresses it at most this many
// times before handing it back to the progress thread.
constexpr unsigned kServeProgressCalls = 64;
// While a write is being sent or received, the progress thread keeps progressing the worker
// (yielding the CPU between calls) instead of sleeping on its event fd, as long as the worker
// made progress within this window: each arrival then finds it awake. A transfer whose peer
// stalls lets it sleep again after the window.
constexpr auto kBusyPollWindow = std::chrono::microseconds(2000);
// A refused connection gets this long to read the reason before we close it.
constexpr auto kRefusedGrace = std::chrono::milliseconds(250);
constexpr size_t kMaxReasonBytes = 1024;

// Active message ids (docs/transport.md has the header layouts). Ids 1, 2, 6, 7 and 8 are the
// handshake (transport/auth.h); until a peer has proved it holds our token, any other id from it
// is dropped unread and the connection closed. Ids 3, 4 and 5 end their header with mac[16] =
// auth::mac(sender's session key, id byte | the header before it, the data for 3 and 5): a
// relay that passed the handshake along learns no key, so it can neither inject nor alter a
// message, a write's target or an ack, nor replay a write (its seq is checked in a window).
enum AmId : unsigned {
  kAmHello = 1,      // connector -> listener. header: fixed32 version, nonce_c[32]
  kAmChallenge = 2,  // listener -> connector. header: fixed32 version, nonce_l[32], proof_l[32]
  kAmMessage = 3,    // header: fixed64 seq, mac; data: the user's payload
  kAmWrite = 4,      // header: fixed64 transfer, fixed32 op_count, fixed32 region,
                     //         fixed64 offset, fixed64 bytes, fixed64 seq, mac; data: the bytes
  kAmWriteAck = 5,   // header: fixed64 transfer, fixed32 status code, mac; data: error message
  kAmProof = 6,      // connector -> listener. header: proof_c[32]
  kAmWelcome = 7,    // listener -> connector. header: empty
  kAmRefused = 8,    // listener -> connector. header: empty; data: the reason (<= 1 KiB)
};
// A write's header (kAmWrite) with its MAC: reserved up front, as every op sends one.
constexpr size_t kAmWriteHeaderBytes = 8 + 4 + 4 + 8 + 8 + 8 + auth::kMacBytes;

// Where a connection stands in the handshake (transport/auth.h).
enum class Handshake {
  kAwaitHello,      // listener: accepted, nothing received yet
  kAwaitProof,      // listener: challenge sent
  kAwaitChallenge,  // connector: hello sent
  kAwaitWelcome,    // connector: the listener proved itself, our proof sent
  kRefused,         // listener: refused sent; closed after kRefusedGrace
  kDone,            // both proved
};

std::string_view handshakeName(Handshake h) {
  switch (h) {
    case Handshake::kAwaitHello:
      return "awaiting hello";
    case Handshake::kAwaitProof:
      return "awaiting proof";
    case Handshake::kAwaitChallenge:
      return "awaiting challenge";
    case Handshake::kAwaitWelcome:
      return "awaiting welcome";
    case Handshake::kRefused:
      return "refused";
    case Handshake::kDone:
      return "done";
  }
  return "?";
}

Status ucxError(std::string_view what, ucs_status_t st) {
  return Unavailable(std::string(what) + ": " + ucs_status_string(st));
}

struct RemoteRegion {
  uint64_t length = 0;
  uint64_t address = 0;
  ucp_rkey_h rkey = nullptr;  // progress thread
};

struct LocalRegion {
  const Region* region = nullptr;
  ucp_mem_h memh = nullptr;
  RegionAccess access = RegionAccess::kLocalSource;  // only kRemoteWritable takes incoming writes
};

// An outgoing batch (progress thread only, except `core`).
struct OutTransfer {
  std::shared_ptr<TransferCore> core;
  size_t sends_outstanding = 0;
  bool remote_done = false;  // ack (am) or flush (put) arrived
  Status first_error;
};

// An incoming am batch being received (progress thread only).
struct InTransfer {
  uint32_t op_count = 0;
  uint32_t accounted = 0;  // received or rejected
  uint32_t in_flight = 0;  // rendezvous receives started, not finished
  Status first_error;
};

struct UcxPeer {
  PeerId id = 0;
  bool incoming = false;
  std::string address;  // connector side: what connect() was given (for messages)
  std::atomic<bool> lost{false};
  std::atomic<bool> welcomed{false};  // the handshake completed (set under the agent's mu_)
  std::atomic<bool> granted{false};   // its writes into our regions are accepted (grantWrites)
  bool use_put = false;               // decided when the connection is up

  // Guarded by the agent's mu_ (read by API threads for validation).
  std::map<uint32_t, RemoteRegion> remote_regions;
  Status handshake_error;  // why connect() fails, when the handshake did

  // Bytes of messages accepted by sendMessage whose UCX send has not completed: what the peer
  // has not taken yet. At most max_send_queue_bytes (sendMessage); written by API threads,
  // released by the send buffer's owner when UCX hands the request back.
  std::atomic<uint64_t> queued_bytes{0};

  // Progress thread only.
  ucp_ep_h ep = nullptr;
  Handshake handshake = Handshake::kAwaitHello;
  // The remote end proved it holds our token: only from then on are its non-handshake active
  // messages honoured (the connector knows after the challenge, the listener after the proof).
  bool proven = false;
  // connect() returned it or kPeerConnected was queued: only then is its loss an event.
  bool announced = false;
  // Condemned from inside an active-message callback; markLost runs once the callback
  // returned (UCX still uses the endpoint then). Everything it sends meanwhile is ignored.
  bool dropping = false;
  auth::Nonce nonce_c{};
  auth::Nonce nonce_l{};
  // Once proven: the session keys that MAC ids 3, 4, 5 each way (used by the worker's driver).
  auth::MacKey send_mac;
  auth::MacKey receive_mac;
  uint64_t next_write_seq = 1;                  // our writes' seq
  uint64_t write_seq_top = 0;                   // the highest write seq received
  std::bitset<kWriteSeqWindow> write_seq_seen;  // seqs top, top-1, ... received (bit 0: top)
  Clock::time_point auth_deadline;              // listener: closed if not authenticated by then
  uint64_t next_send_seq = 0;
  uint64_t next_recv_seq = 0;
  // Messages posted to UCX and not handed back, and when UCX last handed one back (or the
  // first was posted): a peer with messages outstanding and none taken for
  // send_stall_timeout is dropped.
  uint32_t messages_in_flight = 0;
  Clock::time_point message_progress;
  std::map<uint64_t, std::vector<uint8_t>> reorder;  // at most kMaxReorderMessages
  uint64_t reorder_bytes = 0;                        // at most kMaxReorderBytes
  std::unordered_map<uint64_t, OutTransfer> out;
  std::unordered_map<uint64_t, InTransfer> in;  // at most kMaxInTransfers
  // Rendezvous receives into our regions that UCX has not handed back (completed or
  // cancelled by the endpoint's close). A lost peer's kPeerLost waits in `pending_lost` until
  // this is 0: once the user sees it, none of the peer's writes can still land.
  uint32_t recvs_in_flight = 0;
  std::optional<Status> pending_lost;
  // rkeys of a lost peer's remote regions: destroyed once its puts are terminal (`out` empty),
  // since an rkey must outlive every operation that uses it.
  std::vector<ucp_rkey_h> retired_rkeys;
};

// "incoming peer 3" / "ucx agent at ucx:10.0.0.2:4096", for messages about a handshake.
std::string describe(const UcxPeer& p) {
  return p.incoming ? "incoming peer " + std::to_string(p.id) : "ucx agent at " + p.address;
}

struct ReqCtx;
class UcxAgent;

// The agent whose worker this thread drives now (UcxAgent::worker_mu_ held), if any: a
// callback that sends on this thread queues the send instead of taking the lock again.
thread_local const UcxAgent* t_worker_owner = nullptr;

// Marks this thread as driving `agent`'s worker for its scope.
class DrivingScope {
 public:
  explicit DrivingScope(const UcxAgent* agent) : outer_(std::exchange(t_worker_owner, agent)) {}
  ~DrivingScope() { t_worker_owner = outer_; }
  DrivingScope(const DrivingScope&) = delete;
  DrivingScope& operator=(const DrivingScope&) = delete;

 private:
  const UcxAgent* outer_;
};

// The error-callback argument of one endpoint; owned by the agent (freed at teardown).
struct EpErrArg {
  UcxAgent* agent;
  UcxPeer* peer;
};

class UcxAgent final : public Agent {
 public:
  UcxAgent(const AgentConfig& config) : config_(config) {
    caps_.name = "ucx";
    caps_.same_host_only = false;
    caps_.one_sided = config.ucx_mode == UcxMode::kPut;
    caps_.many_small_ops_cheap = false;
    caps_.needs_memfd_regions = false;
    caps_.max_message_bytes = kMaxMessageBytes;
    caps_.remote_regions_need_keys = true;
  }

  ~UcxAgent() override {
    if (progress_.joinable()) {
      post([this] { stopping_ = true; });
      progress_.join();
    }
    teardown();
  }

  Status init();

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return address_; }

  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region,
                                                RegionAccess access) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (regions_.count(region.id()) != 0) {
        return InvalidArgument("region id=" + std::to_string(region.id()) +
                               " is already registered");
      }
    }
    return runSync<std::vector<uint8_t>>([&]() -> StatusOr<std::vector<uint8_t>> {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = region.data();
      mp.length = region.length() == 0 ? 1 : region.length();
      ucp_mem_h memh = nullptr;
      // Sources are mapped too: put reads from them. Only writable regions get an rkey.
      ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
      if (st != UCS_OK) return ucxError("ucp_mem_map of region " + std::to_string(region.id()), st);
      if (access == RegionAccess::kLocalSource) {
        std::lock_guard<std::mutex> lock(mu_);
        regions_[region.id()] = LocalRegion{&region, memh, access};
        return std::vector<uint8_t>{};
      }
      std::vector<uint8_t> key;
      putFixed64(key, reinterpret_cast<uint64_t>(region.data()));
      putFixed64(key, region.length());
      if (!accepts_put_) {  // no rkey: a writer to this region uses am
        std::lock_guard<std::mutex> lock(mu_);
        regions_[region.id()] = LocalRegion{&region, memh, access};
        return key;
      }
      void* rkey_buf = nullptr;
      size_t rkey_len = 0;
      st = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_len);
      if (st != UCS_OK) {
        ucp_mem_unmap(context_, memh);
        return ucxError("ucp_rkey_pack of region " + std::to_string(region.id()), st);
      }
      key.insert(key.end(), static_cast<uint8_t*>(rkey_buf),
                 static_cast<uint8_t*>(rkey_buf) + rkey_len);
      ucp_rkey_buffer_release(rkey_buf);
      std::lock_guard<std::mutex> lock(mu_);
      regions_[region.id()] = LocalRegion{&region, memh, access};
      return key;
    });
  }

  Status deregisterRegion(uint32_t region_id) override {
    return runSync<bool>([&]() -> StatusOr<bool> {
             LocalRegion r;
             {
               std::lock_guard<std::mutex> lock(mu_);
               auto it = regions_.find(region_id);
               if (it == regions_.end()) {
                 return NotFound("region id=" + std::to_string(region_id) + " is not registered");
               }
               r = it->second;
               regions_.erase(it);
             }
             ucp_mem_unmap(context_, r.memh);
             return true;
           })
        .status();
  }

  StatusOr<PeerId> connect(const std::string& address) override;

  Status disconnect(PeerId peer) override {
    auto p = findWelcomedPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    post([this, p] {
      markLost(p, Unavailable("peer " + std::to_string(p->id) + " was disconnected"));
    });
    return OkStatus();
  }

  Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                         std::span<const uint8_t> key) override {
    auto p = findWelcomedPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    if (key.size() < 16) {
      return InvalidArgument("ucx key of remote region id=" + std::to_string(region_id) + " has " +
                             std::to_string(key.size()) + " bytes, expected >= 16");
    }
    std::vector<uint8_t> rkey_bytes(key.begin() + 16, key.end());
    const uint64_t address = loadFixed64(key.data());
    const uint64_t real_length = loadFixed64(key.data() + 8);
    if (length > real_length) {
      return InvalidArgument(
          "remote region id=" + std::to_string(region_id) + " length=" + std::to_string(length) +
          " exceeds the peer's registered length=" + std::to_string(real_length));
    }
    return runSync<bool>([&]() -> StatusOr<bool> {
             if (p->lost || p->ep == nullptr) {
               return Unavailable("peer " + std::to_string(peer) + " is gone");
             }
             RemoteRegion rr{length, address, nullptr};
             if (p->use_put && rkey_bytes.empty()) {
               if (config_.ucx_mode == UcxMode::kPut) {
                 return Incompatible(
                     "remote region id=" + std::to_string(region_id) +
                     ": the peer does not accept put (its ucx mode leaves RMA off); "
                     "ucx_mode put needs put on both sides");
               }
               if (!p->out.empty()) {
                 return Incompatible("remote region id=" + std::to_string(region_id) +
                                     ": the peer does not accept put, and puts to it are "
                                     "in flight");
               }
               p->use_put = false;
               HXFER_LOG_INFO("ucx {}: peer {} data mode am (the peer does not accept put)",
                              config_.label, p->id);
             }
             if (p->use_put) {
               ucs_status_t st = ucp_ep_rkey_unpack(p->ep, rkey_bytes.data(), &rr.rkey);
               if (st != UCS_OK) {
                 return InvalidArgument("ucp_ep_rkey_unpack of remote region id=" +
                                        std::to_string(region_id) + ": " + ucs_status_string(st));
               }
             }
             std::lock_guard<std::mutex> lock(mu_);
             auto& slot = p->remote_regions[region_id];
             if (slot.rkey != nullptr) ucp_rkey_destroy(slot.rkey);
             slot = rr;
             return true;
           })
        .status();
  }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override;

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    RETURN_IF_ERROR(detail::checkMessageSize(payload.size(), kMaxMessageBytes));
    auto p = findWelcomedPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    // Bounded like shm's queue (transport.h): a peer that takes nothing costs at most
    // max_send_queue_bytes here (one message always fits), then it is disconnected.
    const uint64_t bytes = payload.size();
    const uint64_t queued = p->queued_bytes.fetch_add(bytes);
    if (queued != 0 && queued + bytes > config_.max_send_queue_bytes) {
      p->queued_bytes -= bytes;
      ++peers_over_limit_;
      const std::string why =
          "peer " + std::to_string(peer) + " is not taking messages: " + std::to_string(queued) +
          " bytes queued for it and a message of " + std::to_string(bytes) +
          " would exceed max_send_queue_bytes=" + std::to_string(config_.max_send_queue_bytes);
      HXFER_LOG_WARN("ucx {}: disconnecting peer {}: {}", config_.label, peer, why);
      post([this, p, why] { markLost(p, Unavailable(why)); });
      return Unavailable(why);
    }
    // The buffer's owner gives the bytes back when UCX is done with them (or never sends).
    std::shared_ptr<std::vector<uint8_t>> data(
        new std::vector<uint8_t>(payload.begin(), payload.end()),
        [weak = std::weak_ptr<UcxPeer>(p), bytes](std::vector<uint8_t>* v) {
          if (auto q = weak.lock()) q->queued_bytes -= bytes;
          delete v;
        });
    postHere(bytes <= kInlineMessageBytes, [this, p, data] {
      if (p->lost) return;
      Bytes header;
      putFixed64(header, p->next_send_seq++);
      seal(*p, kAmMessage, header, *data);
      sendAm(p, kAmMessage, std::move(header), data->data(), data->size(), data,
             UCP_AM_SEND_FLAG_EAGER, /*transfer=*/0);
    });
    return OkStatus();
  }

  // A waiting caller serves the worker itself while the progress thread sleeps (pollServing;
  // docs/transport.md, "Who handles the sockets"). The progress thread still runs posted
  // commands meanwhile. The caller hands the worker back when a burst of traffic keeps it busy
  // (serveWorkerLocked leaves it unarmed), and wakes the progress thread to go on. A zero
  // timeout, or an event already queued, only takes what is queued.
  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0 || t_worker_owner == this || events_.ready()) {
      return events_.pop(timeout);
    }
    return pollServing(
        events_, timeout, worker_mu_, served_, [this] { return serveWorkerLocked(); },
        [this] { wakeProgress(); });
  }

  // Progresses the worker until it arms, as the progress thread does before it sleeps: true.
  // false after kServeProgressCalls calls without arming (a burst of traffic): the worker is
  // then not armed, and the caller wakes the progress thread to go on.
  bool serveWorkerLocked() {
    DrivingScope driving(this);
    bool armed = false;
    for (unsigned calls = 0; calls < kServeProgressCalls && !armed; ++calls) {
      if (ucp_worker_progress(worker_) != 0) continue;
      armed = ucp_worker_arm(worker_) != UCS_ERR_BUSY;
    }
    return armed;
  }

  void wakeEventWaiter() override { events_.wake(); }

  void requireWriteGrants() override { grants_required_ = true; }

  Status grantWrites(PeerId peer) override {
    auto p = findWelcomedPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    p->granted = true;
    return OkStatus();
  }

  AgentStats agentStats() const override {
    AgentStats s;
    s.token_configured = !config_.auth_token.empty();
    s.auth_failures = auth_failures_.load();
    s.unauthenticated_dropped = unauthenticated_dropped_.load();
    s.connections_refused = connections_refused_.load();
    s.peers_over_limit = peers_over_limit_.load();
    s.accepts_put = accepts_put_;
    return s;
  }

  // --- progress-thread callbacks (static trampolines call these) ---
  void onConnRequest(ucp_conn_request_h req);
  void onEpError(UcxPeer* raw, ucp_ep_h ep, ucs_status_t st);
  // Progress thread, at most every send_stall_timeout / 4: drops peers that took none of their
  // outstanding messages for send_stall_timeout.
  void dropStalledSenders();
  ucs_status_t onAm(unsigned id, const void* header, size_t header_length, void* data,
                    size_t length, const ucp_am_recv_param_t* param);
  void onSendDone(ReqCtx* ctx, ucs_status_t st);
  void onRecvDone(ReqCtx* ctx, ucs_status_t st);
  void onFlushDone(ReqCtx* ctx, ucs_status_t st);

 private:
  std::shared_ptr<UcxPeer> findPeer(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second;
  }
  // For the API: a peer still authenticating is not known to the caller yet.
  std::shared_ptr<UcxPeer> findWelcomedPeer(PeerId id) {
    auto p = findPeer(id);
    return p && p->welcomed ? p : nullptr;
  }

  void pushEvent(Event e) { events_.push(std::move(e)); }

  // Runs `fn` on the progress thread.
  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      commands_.push_back(std::move(fn));
    }
    wakeProgress();
  }

  // Runs `fn` on this thread when `small` and the worker is free with nothing queued before
  // it, else as post does. A message the engine sends then leaves without waking the progress
  // thread first: one thread hand-off less per message (docs/performance.md, "Control round
  // trip"). Large work still goes to the progress thread, so the caller can prepare the next
  // part while it is posted.
  void postHere(bool small, std::function<void()> fn) {
    if (small && t_worker_owner != this) {
      std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
      bool queue_empty = false;
      if (worker.owns_lock()) {
        std::lock_guard<std::mutex> lock(cmd_mu_);
        queue_empty = commands_.empty();
      }
      if (queue_empty) {  // every command posted before this one has run
        // Handed back as the progress thread leaves it before it sleeps: progressed and armed,
        // so that what the send left in flight wakes it; else (an exception from fn or the
        // worker's callbacks included) it is woken to go on.
        struct HandBack {
          UcxAgent& agent;
          std::unique_lock<std::mutex>& worker;
          bool armed = false;
          ~HandBack() {
            worker.unlock();
            if (!armed) agent.wakeProgress();
          }
        } hand_back{*this, worker};
        {
          DrivingScope driving(this);
          fn();
        }
        hand_back.armed = serveWorkerLocked();
        return;
      }
    }
    post(std::move(fn));
  }

  void wakeProgress() {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // Runs `fn` on the progress thread and waits for its result.
  template <typename T>
  StatusOr<T> runSync(std::function<StatusOr<T>()> fn) {
    std::promise<StatusOr<T>> done;
    auto fut = done.get_future();
    post([&] { done.set_value(fn()); });
    return fut.get();
  }

  void progressLoop();
  // A write of ours not yet acknowledged, or one of a peer's being received (progress thread).
  bool writesInFlight() const;
  void drainLostPeers(bool force);
  void teardown();
  std::shared_ptr<UcxPeer> addPeer(ucp_ep_h ep, bool incoming);
  void markLost(const std::shared_ptr<UcxPeer>& p, const Status& why, bool queue_event = true);
  void destroyRetiredRkeys(UcxPeer& p);
  StatusOr<ucp_ep_h> createEp(const std::shared_ptr<UcxPeer>& p, ucp_ep_params_t params);
  void decideMode(const std::shared_ptr<UcxPeer>& p);
  void sendAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Bytes header, const void* data,
              size_t length, std::shared_ptr<void> keep, uint32_t flags, uint64_t transfer);
  void startWrite(const std::shared_ptr<UcxPeer>& p, uint64_t tid,
                  std::shared_ptr<TransferCore> core, std::vector<WriteOp> ops);
  void maybeFinishOut(const std::shared_ptr<UcxPeer>& p, uint64_t tid);
  void maybeAckIn(const std::shared_ptr<UcxPeer>& p, uint64_t tid);
  void deliverMessages(const std::shared_ptr<UcxPeer>& p);
  ucs_status_t onHandshakeAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Decoder& d,
                             const void* data, size_t length, bool rndv);
  // Loss decided inside an active-message callback: takes effect right after it (dropping).
  void dropPeer(const std::shared_ptr<UcxPeer>& p, const Status& why);
  // An unauthenticated connection goes: counted in auth_failures, connect() fails with `why`.
  void failHandshake(const std::shared_ptr<UcxPeer>& p, const Status& why);
  // Appends the MAC of an id 3/4/5 active message (see AmId) to `header`, under p's send key.
  static void seal(UcxPeer& p, unsigned id, Bytes& header, std::span<const uint8_t> covered);
  // Whether `tag` is the MAC of (id, fields, covered) under p's receive key.
  static bool checkSeal(UcxPeer& p, unsigned id, std::span<const uint8_t> fields,
                        std::span<const uint8_t> covered, std::span<const uint8_t> tag);
  static void setSessionKeys(UcxPeer& p, const auth::SessionKeys& keys);
  // Records a received write's seq: refused when it came before or is older than the window.
  static Status acceptWriteSeq(UcxPeer& p, uint64_t seq);
  void refuse(const std::shared_ptr<UcxPeer>& p, const std::string& reason);
  ucs_status_t overLimit(const std::shared_ptr<UcxPeer>& p, const std::string& what);
  void expireHandshakes();
  std::shared_ptr<UcxPeer> peerOfEp(ucp_ep_h ep) {
    auto it = ep_peers_.find(ep);
    return it == ep_peers_.end() ? nullptr : it->second;
  }

  const AgentConfig config_;
  Capabilities caps_;
  std::string address_;
  bool accepts_put_ = false;            // UCP_FEATURE_RMA in context_; set by init()
  Clock::time_point next_stall_check_;  // progress thread

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread progress_;
  bool stopping_ = false;  // progress thread only
  // Held by whichever thread drives worker_ and the state marked "progress thread": the
  // progress thread, except while it sleeps, or a caller while the progress thread sleeps (a
  // send in postHere, a wait in pollEvent). Whoever lets go of it leaves the worker armed, or
  // wakes the progress thread.
  std::mutex worker_mu_;
  ServedFd served_;  // worker_fd_, served by waiting callers (pollEvent)

  std::mutex cmd_mu_;
  std::deque<std::function<void()>> commands_;  // guarded by cmd_mu_

  std::mutex mu_;
  std::condition_variable ack_cv_;
  std::map<uint32_t, LocalRegion> regions_;                     // guarded by mu_
  std::unordered_map<PeerId, std::shared_ptr<UcxPeer>> peers_;  // guarded by mu_
  PeerId next_peer_ = 1;                                        // guarded by mu_
  std::atomic<uint64_t> next_transfer_{1};

  std::unordered_map<ucp_ep_h, std::shared_ptr<UcxPeer>> ep_peers_;  // progress thread
  std::vector<void*> closing_;                                       // progress thread
  std::vector<EpErrArg*> err_args_;                                  // progress thread
  // Incoming connections not yet authenticated (lost or done ones are pruned lazily); at most
  // config_.max_unauthenticated live ones.
  std::vector<std::shared_ptr<UcxPeer>> pending_auth_;  // progress thread
  // Lost peers whose writes still wait for UCX to hand back requests; forced after a deadline.
  std::vector<std::pair<std::shared_ptr<UcxPeer>, Clock::time_point>> draining_;  // progress

  // Sleeps on an eventfd, like the local transports' queues: a condition-variable hand-off
  // measured about 300 us per control round trip on a loaded machine.
  detail::EventQueue events_;

  // AgentStats counters (written by the progress thread, read by anyone).
  // Lines about connections that never authenticated: whoever reaches the port can cause them.
  LogLimiter unauth_log_;
  std::atomic<bool> grants_required_{false};  // requireWriteGrants
  std::atomic<uint64_t> auth_failures_{0};
  std::atomic<uint64_t> unauthenticated_dropped_{0};
  std::atomic<uint64_t> connections_refused_{0};
  std::atomic<uint64_t> peers_over_limit_{0};
};

// Context of one UCX request callback; owned by the callback (deleted there).
struct ReqCtx {
  UcxAgent* agent = nullptr;
  PeerId peer = 0;
  uint64_t transfer = 0;       // 0: not part of a transfer (a control message)
  Bytes header;                // the AM header, alive until the send completes
  std::shared_ptr<void> keep;  // a send buffer, kept alive; for a receive, its UcxPeer
  bool message = false;        // a kAmMessage: counted in the peer's messages_in_flight
};

template <unsigned Id>
ucs_status_t amHandler(void* arg, const void* header, size_t header_length, void* data,
                       size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<UcxAgent*>(arg)->onAm(Id, header, header_length, data, length, param);
}

void connHandler(ucp_conn_request_h req, void* arg) {
  static_cast<UcxAgent*>(arg)->onConnRequest(req);
}

void epErrHandler(void* arg, ucp_ep_h ep, ucs_status_t st) {
  auto* a = static_cast<EpErrArg*>(arg);
  a->agent->onEpError(a->peer, ep, st);
}

void sendCallback(void* request, ucs_status_t st, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onSendDone(ctx, st);
  ucp_request_free(request);
}

void recvCallback(void* request, ucs_status_t st, size_t length, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onRecvDone(ctx, st);
  ucp_request_free(request);
}

void flushCallback(void* request, ucs_status_t st, void* user) {
  auto* ctx = static_cast<ReqCtx*>(user);
  ctx->agent->onFlushDone(ctx, st);
  ucp_request_free(request);
}

StatusOr<sockaddr_in> parseIpPort(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) {
    return InvalidArgument("ucx address '" + s + "' is not ip:port");
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  const std::string host = s.substr(0, colon);
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    return InvalidArgument("ucx address '" + s + "': '" + host + "' is not an IPv4 address");
  }
  char* end = nullptr;
  const std::string port_text = s.substr(colon + 1);
  unsigned long port = std::strtoul(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port > 65535) {
    return InvalidArgument("ucx address '" + s + "': port '" + port_text + "' is not 0..65535");
  }
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

// UCX's RNDV_THRESH where the context is tcp only (contextIsTcpOnly).
constexpr const char* kTcpRndvThresh = "256k";

// Ep lanes that do real one-sided RMA; put over anything else (tcp, shared-memory emulation
// in UCX 1.13) was measured far slower than active messages.
// True when ucp_context_print_info lists a resource whose transport does RMA in hardware (or
// through a real device path): the only case where `auto` turns on UCP_FEATURE_RMA.
bool contextHasRealRma(const std::string& info) {
  for (const char* tl : {"rc_verbs/", "rc_mlx5/", "dc_mlx5/", "rc_x/", "dc_x/", "cuda_ipc/",
                         "rocm_ipc/", "gdr_copy/"}) {
    if (info.find(tl) != std::string::npos) return true;
  }
  return false;
}

std::string printed(const std::function<void(FILE*)>& print) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return {};
  print(f);
  std::fclose(f);
  std::string text(buf, len);
  std::free(buf);
  return text;
}

// True when every transport of the context is tcp (or self): no shared memory, no zero-copy
// rendezvous. There a rendezvous costs a round trip per write, so hxfer raises UCX's
// RNDV_THRESH (kTcpRndvThresh) unless the user set one: measured on a TP mismatch (thousands of
// ~27 KB writes), 3x the goodput of UCX's default.
bool contextIsTcpOnly(const std::string& info) {
  bool any = false;
  size_t pos = 0;
  while ((pos = info.find("flags -- ", pos)) != std::string::npos) {
    pos += 9;
    const std::string tl = info.substr(pos, info.find('/', pos) - pos);
    if (tl != "tcp" && tl != "self") return false;
    any = any || tl == "tcp";
  }
  return any;
}

bool lanesDoRealRma(const std::string& info) {
  for (const char* tl : {"rc_verbs", "rc_mlx5", "dc_mlx5", "rc_x", "dc_x", "cuda_ipc", "rocm_ipc",
                         "gdr_copy", "ud_mlx5"}) {
    size_t pos = 0;
    while ((pos = info.find(tl, pos)) != std::string::npos) {
      const size_t eol = info.find('\n', pos);
      if (info.substr(pos, eol - pos).find("rma") != std::string::npos) return true;
      pos += 1;
    }
  }
  return false;
}

Status UcxAgent::init() {
  ucp_config_t* cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  if (st != UCS_OK) return ucxError("ucp_config_read", st);
  for (const auto& [name, value] : config_.ucx_options) {
    st = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(cfg);
      return InvalidArgument("ucx option " + name + "=" + value + ": " + ucs_status_string(st));
    }
  }
  // UCP_FEATURE_RMA installs UCX's handler for emulated put (tcp, shared memory), which writes
  // wherever its sender says, for any endpoint, before any hello: only a writer that puts
  // needs it on the other side. `am` never enables it; `auto` only where a real RMA
  // transport (with hardware-checked rkeys) exists; `put` does, and says so.
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  accepts_put_ = config_.ucx_mode == UcxMode::kPut;
  if (accepts_put_) params.features |= UCP_FEATURE_RMA;
  st = ucp_init(&params, cfg, &context_);
  if (st == UCS_OK && config_.ucx_mode == UcxMode::kAuto &&
      contextHasRealRma(printed([&](FILE* f) { ucp_context_print_info(context_, f); }))) {
    ucp_cleanup(context_);
    context_ = nullptr;
    accepts_put_ = true;
    params.features |= UCP_FEATURE_RMA;
    st = ucp_init(&params, cfg, &context_);
  }
  const bool rndv_set = std::getenv("UCX_RNDV_THRESH") != nullptr ||
                        std::any_of(config_.ucx_options.begin(), config_.ucx_options.end(),
                                    [](const auto& kv) { return kv.first == "RNDV_THRESH"; });
  if (st == UCS_OK && !rndv_set &&
      contextIsTcpOnly(printed([&](FILE* f) { ucp_context_print_info(context_, f); })) &&
      ucp_config_modify(cfg, "RNDV_THRESH", kTcpRndvThresh) == UCS_OK) {
    ucp_cleanup(context_);
    context_ = nullptr;
    st = ucp_init(&params, cfg, &context_);
    HXFER_LOG_INFO("ucx {}: tcp only: rendezvous from RNDV_THRESH={} (set RNDV_THRESH to override)",
                   config_.label, kTcpRndvThresh);
  }
  ucp_config_release(cfg);
  if (st != UCS_OK) return ucxError("ucp_init", st);
  if (accepts_put_) {
    HXFER_LOG_WARN(
        "ucx {}: RMA enabled (ucx mode {}): this worker answers puts, and UCX's emulated put "
        "(tcp, shared memory lanes) honours any endpoint at any address; use only on a network "
        "of trusted hosts",
        config_.label, config_.ucx_mode == UcxMode::kPut ? "put" : "auto, a real RMA transport");
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // one thread at a time, under worker_mu_
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) return ucxError("ucp_worker_create", st);
  st = ucp_worker_get_efd(worker_, &worker_fd_);
  if (st != UCS_OK) return ucxError("ucp_worker_get_efd", st);

  auto set_handler = [&](unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = cb;
    hp.arg = this;
    return ucp_worker_set_am_recv_handler(worker_, &hp);
  };
  for (auto [id, cb] :
       {std::pair{kAmHello, &amHandler<kAmHello>},
        std::pair{kAmChallenge, &amHandler<kAmChallenge>},
        std::pair{kAmMessage, &amHandler<kAmMessage>}, std::pair{kAmWrite, &amHandler<kAmWrite>},
        std::pair{kAmWriteAck, &amHandler<kAmWriteAck>}, std::pair{kAmProof, &amHandler<kAmProof>},
        std::pair{kAmWelcome, &amHandler<kAmWelcome>},
        std::pair{kAmRefused, &amHandler<kAmRefused>}}) {
    st = set_handler(id, cb);
    if (st != UCS_OK) return ucxError("ucp_worker_set_am_recv_handler", st);
  }

  const std::string listen = config_.listen.empty() ? "127.0.0.1:0" : config_.listen;
  ASSIGN_OR_RETURN(sockaddr_in sa, parseIpPort(listen));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = connHandler;
  lp.conn_handler.arg = this;
  st = ucp_listener_create(worker_, &lp, &listener_);
  if (st != UCS_OK) return ucxError("ucp_listener_create on " + listen, st);
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  st = ucp_listener_query(listener_, &la);
  if (st != UCS_OK) return ucxError("ucp_listener_query", st);
  const auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
  char ip[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
  address_ = std::string(kScheme) + ip + ":" + std::to_string(ntohs(bound->sin_port));

  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) return ResourceExhausted("eventfd/epoll_create1 failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  served_.watch(epoll_fd_, worker_fd_);
  HXFER_LOG_DEBUG("ucx {}: listening on {}", config_.label, address_);
  if (config_.auth_token.empty()) {
    HXFER_LOG_WARN(
        "ucx {}: no auth_token configured: anyone who can reach {} can connect and write into "
        "its writable regions",
        config_.label, address_);
  }
  progress_ = std::thread([this] { progressLoop(); });
  return OkStatus();
}

void UcxAgent::progressLoop() {
  DrivingScope driving(this);
  std::unique_lock<std::mutex> worker(worker_mu_);
  Clock::time_point last_progress{};
  while (!stopping_) {
    std::deque<std::function<void()>> cmds;
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
    unsigned progressed = 0;
    while (ucp_worker_progress(worker_) != 0) ++progressed;
    if (!draining_.empty()) drainLostPeers(/*force=*/false);
    if (!pending_auth_.empty()) expireHandshakes();
    dropStalledSenders();
    if (stopping_) break;
    if (progressed != 0 || !cmds.empty()) {
      last_progress = Clock::now();
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      if (!commands_.empty()) continue;
    }
    if (Clock::now() - last_progress < kBusyPollWindow && writesInFlight()) {
      worker.unlock();
      std::this_thread::yield();
      worker.lock();
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    worker.unlock();  // callers may drive the worker while this thread sleeps (postHere, pollEvent)
    epoll_event evs[2];
    epoll_wait(epoll_fd_, evs, 2, 100);
    uint64_t v;
    while (read(wake_fd_, &v, sizeof(v)) > 0) {
    }
    worker.lock();
  }
}

bool UcxAgent::writesInFlight() const {
  for (const auto& [ep, p] : ep_peers_) {
    if (!p->out.empty() || !p->in.empty()) return true;
  }
  return false;
}

void UcxAgent::drainLostPeers(bool force) {
  const auto now = Clock::now();
  std::erase_if(draining_, [&](auto& entry) {
    auto& [p, deadline] = entry;
    if (p->out.empty()) {
      destroyRetiredRkeys(*p);
      return true;
    }
    if (!force && now < deadline) return false;
    // UCX did not hand every put back: its rkeys stay until teardown, when the worker is idle.
    for (auto& [tid, t] : p->out) t.core->complete(t.first_error);
    p->out.clear();
    return true;
  });
}

void UcxAgent::teardown() {
  // Runs after the progress thread stopped: this thread now owns the worker.
  std::lock_guard<std::mutex> worker(worker_mu_);
  DrivingScope driving(this);
  std::vector<std::shared_ptr<UcxPeer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : peers_) peers.push_back(p);
  }
  const Status gone = Unavailable("ucx agent " + address_ + " shut down");
  for (auto& p : peers) {
    if (p->ep == nullptr) continue;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    ep_peers_.erase(p->ep);
    p->ep = nullptr;
  }
  drainLostPeers(/*force=*/true);
  for (auto& p : peers) {
    p->lost = true;
    for (auto& [tid, t] : p->out) t.core->complete(gone);
    p->out.clear();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : p->remote_regions) {
      if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
    }
    p->remote_regions.clear();
    destroyRetiredRkeys(*p);
  }
  if (worker_ != nullptr) {
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (!closing_.empty() && Clock::now() < deadline) {
      ucp_worker_progress(worker_);
      std::erase_if(closing_, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
  }
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : regions_) ucp_mem_unmap(context_, r.memh);
    regions_.clear();
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  for (auto* a : err_args_) delete a;
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

StatusOr<ucp_ep_h> UcxAgent::createEp(const std::shared_ptr<UcxPeer>& p, ucp_ep_params_t params) {
  auto* arg = new EpErrArg{this, p.get()};
  err_args_.push_back(arg);
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = epErrHandler;
  params.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(worker_, &params, &ep);
  if (st != UCS_OK) return ucxError("ucp_ep_create", st);
  p->ep = ep;
  ep_peers_[ep] = p;
  return ep;
}

std::shared_ptr<UcxPeer> UcxAgent::addPeer(ucp_ep_h ep, bool incoming) {
  auto p = std::make_shared<UcxPeer>();
  p->incoming = incoming;
  std::lock_guard<std::mutex> lock(mu_);
  p->id = next_peer_++;
  peers_.emplace(p->id, p);
  return p;
}

StatusOr<PeerId> UcxAgent::connect(const std::string& address) {
  if (!address.starts_with(kScheme)) {
    return InvalidArgument("ucx address '" + address + "' does not start with 'ucx:'");
  }
  ASSIGN_OR_RETURN(sockaddr_in sa, parseIpPort(address.substr(kScheme.size())));
  ASSIGN_OR_RETURN(const auth::Nonce nonce_c, auth::randomNonce());
  auto p = addPeer(nullptr, /*incoming=*/false);
  p->address = address;
  Status s =
      runSync<bool>([&]() -> StatusOr<bool> {
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
        ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
        ep.sockaddr.addrlen = sizeof(sa);
        RETURN_IF_ERROR(createEp(p, ep).status());
        p->handshake = Handshake::kAwaitChallenge;
        p->nonce_c = nonce_c;
        Bytes hello;
        putFixed32(hello, kProtocolVersion);
        hello.insert(hello.end(), nonce_c.begin(), nonce_c.end());
        sendAm(p, kAmHello, std::move(hello), nullptr, 0, nullptr, UCP_AM_SEND_FLAG_EAGER, 0);
        return true;
      }).status();
  if (s.isOk()) {
    std::unique_lock<std::mutex> lock(mu_);
    ack_cv_.wait_for(lock, config_.connect_timeout, [&] { return p->welcomed || p->lost; });
    if (!p->welcomed) {
      if (!p->handshake_error.isOk()) {
        s = p->handshake_error;
      } else if (p->lost) {
        s = Unavailable("ucx agent at " + address + " closed the connection during the handshake");
      } else {
        s = Unavailable("ucx agent at " + address + " did not complete the handshake within " +
                        "connect_timeout=" + std::to_string(config_.connect_timeout.count()) +
                        "ms");
      }
    }
  }
  if (!s.isOk()) {
    post([this, p, s] { markLost(p, s, /*queue_event=*/false); });
    return s;
  }
  return p->id;
}

StatusOr<Transfer> UcxAgent::postWrite(PeerId peer, std::vector<WriteOp> ops) {
  auto p = findWelcomedPeer(peer);
  if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
  if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
  uint64_t total = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      const WriteOp& op = ops[i];
      ASSIGN_OR_RETURN(auto regions,
                       detail::findOpRegions(i, op, peer, regions_, p->remote_regions));
      const auto& [local, remote] = regions;
      RETURN_IF_ERROR(detail::validateOp(i, op, local->region->length(), remote->length));
      total += op.bytes;
    }
  }
  if (ops.empty()) return detail::finishedTransfer(OkStatus());
  if (ops.size() > UINT32_MAX) {
    return InvalidArgument("batch of " + std::to_string(ops.size()) + " ops exceeds 2^32-1");
  }
  auto core = std::make_shared<TransferCore>(total, ops.size());
  const uint64_t tid = next_transfer_.fetch_add(1);
  const bool small = ops.size() <= kInlineWriteOps && total <= kInlineWriteBytes;
  postHere(small, [this, p, tid, core, ops = std::move(ops)]() mutable {
    startWrite(p, tid, core, std::move(ops));
  });
  return Transfer(core);
}

void UcxAgent::onConnRequest(ucp_conn_request_h req) {
  if (stopping_) {
    ucp_listener_reject(listener_, req);
    return;
  }
  std::erase_if(pending_auth_, [](const std::shared_ptr<UcxPeer>& q) {
    return q->lost || q->handshake == Handshake::kDone;
  });
  if (pending_auth_.size() >= config_.max_unauthenticated) {
    // The oldest unauthenticated connection makes room. Rejecting the newcomer instead let a
    // flood of silent connections, re-opened as soon as rejected, hold out every honest peer,
    // and ucp_listener_reject in such a loop aborts UCX 1.13 (tcp_sockcm_ep.c assertion).
    std::shared_ptr<UcxPeer> oldest = pending_auth_.front();
    pending_auth_.erase(pending_auth_.begin());
    const uint64_t n = ++connections_refused_;
    const Status why =
        ResourceExhausted("closed for a newer connection: max_unauthenticated=" +
                          std::to_string(config_.max_unauthenticated) + " were authenticating");
    uint64_t held = 0;
    if (unauth_log_.admit(&held)) {
      HXFER_LOG_WARN(
          "ucx {}: closing the oldest unauthenticated connection (peer {}) for a new one: "
          "max_unauthenticated={} are authenticating ({} closed so far; {} lines like this "
          "held back)",
          config_.label, oldest->id, config_.max_unauthenticated, n, held);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (oldest->handshake_error.isOk()) oldest->handshake_error = why;
    }
    dropPeer(oldest, why);
  }
  auto p = addPeer(nullptr, /*incoming=*/true);
  p->handshake = Handshake::kAwaitHello;
  p->auth_deadline = Clock::now() + config_.auth_timeout;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  ep.conn_request = req;
  auto r = createEp(p, ep);
  if (!r.isOk()) {
    HXFER_LOG_WARN("ucx {}: accepting a connection failed: {}", config_.label,
                   r.status().toString());
    markLost(p, r.status());
    return;
  }
  pending_auth_.push_back(p);
}

void UcxAgent::expireHandshakes() {
  const auto now = Clock::now();
  std::vector<std::shared_ptr<UcxPeer>> expired;
  std::erase_if(pending_auth_, [&](const std::shared_ptr<UcxPeer>& p) {
    if (p->lost || p->handshake == Handshake::kDone) return true;
    if (now < p->auth_deadline) return false;
    expired.push_back(p);
    return true;
  });
  for (auto& p : expired) {
    if (p->handshake == Handshake::kRefused) {  // counted when refused
      markLost(p, PermissionDenied("incoming peer " + std::to_string(p->id) + " was refused"));
      continue;
    }
    failHandshake(p, Timeout("incoming peer " + std::to_string(p->id) +
                             " did not authenticate within auth_timeout=" +
                             std::to_string(config_.auth_timeout.count()) + "ms"));
  }
}

void UcxAgent::dropStalledSenders() {
  const auto now = Clock::now();
  if (config_.send_stall_timeout.count() <= 0 || now < next_stall_check_) return;
  next_stall_check_ = now + std::clamp(config_.send_stall_timeout / 4, std::chrono::milliseconds(1),
                                       std::chrono::milliseconds(250));
  std::vector<std::shared_ptr<UcxPeer>> stalled;
  for (const auto& [ep, p] : ep_peers_) {
    if (!p->lost && p->messages_in_flight != 0 &&
        now - p->message_progress >= config_.send_stall_timeout) {
      stalled.push_back(p);
    }
  }
  for (const auto& p : stalled) {
    ++peers_over_limit_;
    const std::string why =
        "peer " + std::to_string(p->id) + " took none of its " +
        std::to_string(p->messages_in_flight) + " outstanding messages (" +
        std::to_string(p->queued_bytes.load()) +
        " bytes) for send_stall_timeout=" + std::to_string(config_.send_stall_timeout.count()) +
        " ms";
    HXFER_LOG_WARN("ucx {}: disconnecting peer {}: {}", config_.label, p->id, why);
    markLost(p, Unavailable(why));
  }
}

void UcxAgent::onEpError(UcxPeer* raw, ucp_ep_h ep, ucs_status_t st) {
  auto p = peerOfEp(ep);
  if (!p) return;
  markLost(p, ucxError("ucx endpoint of peer " + std::to_string(p->id) + " failed", st));
}

void UcxAgent::markLost(const std::shared_ptr<UcxPeer>& p, const Status& why, bool queue_event) {
  if (p->lost.exchange(true)) return;
  // A peer nobody was told about leaves no trace: no event, no id kept (a flood of failed
  // handshakes must not grow the peer table).
  if (!p->announced) {
    // A connection that ends in its handshake for any reason failed to authenticate (those
    // failHandshake / refuse dropped are counted there already).
    if (!p->dropping && p->handshake != Handshake::kRefused) ++auth_failures_;
    queue_event = false;
    std::lock_guard<std::mutex> lock(mu_);
    peers_.erase(p->id);
  }
  // Pending writes fail with `why`, but only once UCX handed back every request of theirs (the
  // forced close below cancels them): a terminal transfer never has memory access in flight.
  for (auto& [tid, t] : p->out) {
    if (t.first_error.isOk()) t.first_error = why;
    t.remote_done = true;
  }
  // Incoming transfers are forgotten, but their rendezvous receives still count in
  // recvs_in_flight until UCX hands them back (the close below cancels them).
  p->in.clear();
  p->reorder.clear();
  p->reorder_bytes = 0;
  {
    // Later postWrite / addRemoteRegion find nothing; the rkeys go once the puts are terminal.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : p->remote_regions) {
      if (r.rkey != nullptr) p->retired_rkeys.push_back(r.rkey);
    }
    p->remote_regions.clear();
  }
  ack_cv_.notify_all();
  if (p->ep != nullptr) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    ep_peers_.erase(p->ep);
    p->ep = nullptr;
  }
  std::vector<uint64_t> tids;
  for (auto& [tid, t] : p->out) tids.push_back(tid);
  for (uint64_t tid : tids) maybeFinishOut(p, tid);
  if (!p->out.empty()) {
    draining_.push_back({p, Clock::now() + std::chrono::seconds(5)});
  } else {
    destroyRetiredRkeys(*p);
  }
  std::erase_if(closing_, [](void* r) {
    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    ucp_request_free(r);
    return true;
  });
  HXFER_LOG_DEBUG("ucx {}: peer {} lost: {}", config_.label, p->id, why.toString());
  if (!queue_event) return;
  if (p->recvs_in_flight != 0) {
    p->pending_lost = why;  // onRecvDone queues it when the last receive is handed back
    return;
  }
  pushEvent(Event{Event::Kind::kPeerLost, p->id, {}, why});
}

void UcxAgent::destroyRetiredRkeys(UcxPeer& p) {
  for (ucp_rkey_h rkey : p.retired_rkeys) ucp_rkey_destroy(rkey);
  p.retired_rkeys.clear();
}

void UcxAgent::decideMode(const std::shared_ptr<UcxPeer>& p) {
  std::string reason;
  if (config_.ucx_mode == UcxMode::kPut) {
    p->use_put = true;
    reason = "forced by config";
  } else if (config_.ucx_mode == UcxMode::kAm) {
    p->use_put = false;
    reason = "forced by config";
  } else if (!accepts_put_) {
    p->use_put = false;
    reason = "no real RMA transport here, RMA left off";
  } else {
    p->use_put = lanesDoRealRma(printed([&](FILE* f) { ucp_ep_print_info(p->ep, f); }));
    reason = p->use_put ? "the endpoint's RMA lanes are real RMA"
                        : "put would be emulated on these lanes (tcp / shared memory)";
  }
  HXFER_LOG_INFO("ucx {}: peer {} data mode {} ({})", config_.label, p->id,
                 p->use_put ? "put" : "am", reason);
}

void UcxAgent::sendAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Bytes header,
                      const void* data, size_t length, std::shared_ptr<void> keep, uint32_t flags,
                      uint64_t transfer) {
  auto* ctx = new ReqCtx{this, p->id, transfer, std::move(header), std::move(keep)};
  if (id == kAmMessage) {
    ctx->message = true;
    if (p->messages_in_flight++ == 0) p->message_progress = Clock::now();
  }
  if (p->ep == nullptr) {
    onSendDone(ctx, UCS_ERR_NOT_CONNECTED);
    return;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = flags | UCP_AM_SEND_FLAG_REPLY;
  rp.cb.send = sendCallback;
  rp.user_data = ctx;
  void* req = ucp_am_send_nbx(p->ep, id, ctx->header.data(), ctx->header.size(), data, length, &rp);
  if (req == nullptr) {
    onSendDone(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    onSendDone(ctx, UCS_PTR_STATUS(req));
  }
}

void UcxAgent::startWrite(const std::shared_ptr<UcxPeer>& p, uint64_t tid,
                          std::shared_ptr<TransferCore> core, std::vector<WriteOp> ops) {
  if (p->lost || p->ep == nullptr) {
    core->complete(Unavailable("peer " + std::to_string(p->id) + " is gone"));
    return;
  }
  struct Resolved {
    const uint8_t* src;
    uint64_t remote_address;
    ucp_rkey_h rkey;
  };
  std::vector<Resolved> resolved;
  resolved.reserve(ops.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      auto l = regions_.find(ops[i].local_region);
      auto r = p->remote_regions.find(ops[i].remote_region);
      if (l == regions_.end() || r == p->remote_regions.end()) {
        core->complete(NotFound("op " + std::to_string(i) +
                                ": a region was deregistered before the write started"));
        return;
      }
      if (p->use_put && r->second.rkey == nullptr) {
        core->complete(Internal("op " + std::to_string(i) + ": no rkey for remote region " +
                                std::to_string(ops[i].remote_region)));
        return;
      }
      resolved.push_back({l->second.region->data() + ops[i].local_offset,
                          r->second.address + ops[i].remote_offset, r->second.rkey});
    }
  }
  OutTransfer& out = p->out[tid];
  out.core = std::move(core);
  out.sends_outstanding = ops.size();
  const uint32_t count = static_cast<uint32_t>(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (p->lost) break;  // markLost failed the transfer; the rest is moot
    if (p->use_put) {
      auto* ctx = new ReqCtx{this, p->id, tid, {}, nullptr};
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = sendCallback;
      rp.user_data = ctx;
      void* req = ucp_put_nbx(p->ep, resolved[i].src, ops[i].bytes, resolved[i].remote_address,
                              resolved[i].rkey, &rp);
      if (req == nullptr) {
        onSendDone(ctx, UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        onSendDone(ctx, UCS_PTR_STATUS(req));
      }
    } else {
      Bytes header;
      header.reserve(kAmWriteHeaderBytes);
      putFixed64(header, tid);
      putFixed32(header, count);
      putFixed32(header, ops[i].remote_region);
      putFixed64(header, ops[i].remote_offset);
      putFixed64(header, ops[i].bytes);
      putFixed64(header, p->next_write_seq++);
      seal(*p, kAmWrite, header, {});
      sendAm(p, kAmWrite, std::move(header), resolved[i].src, ops[i].bytes, nullptr, 0, tid);
    }
  }
  if (p->use_put && !p->lost && p->ep != nullptr) {
    auto* ctx = new ReqCtx{this, p->id, tid, {}, nullptr};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = flushCallback;
    rp.user_data = ctx;
    void* req = ucp_ep_flush_nbx(p->ep, &rp);
    if (req == nullptr) {
      onFlushDone(ctx, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      onFlushDone(ctx, UCS_PTR_STATUS(req));
    }
  }
}

void UcxAgent::maybeFinishOut(const std::shared_ptr<UcxPeer>& p, uint64_t tid) {
  auto it = p->out.find(tid);
  if (it == p->out.end()) return;
  OutTransfer& t = it->second;
  if (t.sends_outstanding != 0 || !t.remote_done) return;
  Status s = t.first_error;
  if (s.isOk() && t.core->cancelRequested()) {
    s = Cancelled("transfer cancelled; its in-flight writes finished first");
  }
  t.core->complete(std::move(s));
  p->out.erase(it);
}

void UcxAgent::maybeAckIn(const std::shared_ptr<UcxPeer>& p, uint64_t tid) {
  auto it = p->in.find(tid);
  if (it == p->in.end()) return;
  InTransfer& t = it->second;
  if (t.accounted < t.op_count || t.in_flight != 0) return;
  Bytes header;
  putFixed64(header, tid);
  putFixed32(header, static_cast<uint32_t>(t.first_error.code()));
  auto msg = std::make_shared<std::string>(t.first_error.message());
  p->in.erase(it);
  seal(*p, kAmWriteAck, header,
       std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg->data()), msg->size()));
  sendAm(p, kAmWriteAck, std::move(header), msg->data(), msg->size(), msg, UCP_AM_SEND_FLAG_EAGER,
         0);
}

void UcxAgent::deliverMessages(const std::shared_ptr<UcxPeer>& p) {
  for (auto it = p->reorder.find(p->next_recv_seq); it != p->reorder.end();
       it = p->reorder.find(p->next_recv_seq)) {
    p->reorder_bytes -= it->second.size();
    pushEvent(Event{Event::Kind::kMessage, p->id, std::move(it->second), OkStatus()});
    p->reorder.erase(it);
    ++p->next_recv_seq;
  }
}

void UcxAgent::onSendDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  if (ctx->message) {
    if (auto p = findPeer(ctx->peer); p && p->messages_in_flight != 0) {
      --p->messages_in_flight;
      p->message_progress = Clock::now();
    }
  }
  if (ctx->transfer == 0) {
    if (st != UCS_OK && st != UCS_ERR_CANCELED) {
      HXFER_LOG_DEBUG("ucx {}: control message to peer {} failed: {}", config_.label, ctx->peer,
                      ucs_status_string(st));
    }
    return;
  }
  auto p = findPeer(ctx->peer);
  if (!p) return;
  auto it = p->out.find(ctx->transfer);
  if (it == p->out.end()) return;
  --it->second.sends_outstanding;
  if (st != UCS_OK) {
    if (it->second.first_error.isOk()) {
      it->second.first_error = ucxError("write to peer " + std::to_string(p->id), st);
    }
    it->second.remote_done = true;  // no ack will come for a write that never left
  }
  maybeFinishOut(p, ctx->transfer);
}

void UcxAgent::onFlushDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  auto p = findPeer(ctx->peer);
  if (!p) return;
  auto it = p->out.find(ctx->transfer);
  if (it == p->out.end()) return;
  it->second.remote_done = true;
  if (st != UCS_OK && it->second.first_error.isOk()) {
    it->second.first_error = ucxError("flush to peer " + std::to_string(p->id), st);
  }
  maybeFinishOut(p, ctx->transfer);
}

void UcxAgent::onRecvDone(ReqCtx* ctx, ucs_status_t st) {
  std::unique_ptr<ReqCtx> own(ctx);
  // The peer itself rides in the context: a lost peer may be gone from peers_ already, and its
  // kPeerLost waits for exactly this.
  auto p = std::static_pointer_cast<UcxPeer>(ctx->keep);
  --p->recvs_in_flight;
  if (p->lost) {
    if (p->recvs_in_flight == 0 && p->pending_lost) {
      pushEvent(Event{Event::Kind::kPeerLost, p->id, {}, *p->pending_lost});
      p->pending_lost.reset();
    }
    return;
  }
  auto it = p->in.find(ctx->transfer);
  if (it == p->in.end()) return;
  --it->second.in_flight;
  ++it->second.accounted;
  if (st != UCS_OK && it->second.first_error.isOk()) {
    it->second.first_error = ucxError("receiving a write from peer " + std::to_string(p->id), st);
  }
  maybeAckIn(p, ctx->transfer);
}

ucs_status_t UcxAgent::onAm(unsigned id, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucp_ep_h ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  auto p = peerOfEp(ep);
  if (!p) {
    // Not attributable to any connection (no reply endpoint, or one we already closed).
    ++unauthenticated_dropped_;
    HXFER_LOG_DEBUG("ucx {}: dropping active message {} from an unknown endpoint", config_.label,
                    id);
    return UCS_OK;  // for rendezvous: the descriptor is released, nothing lands
  }
  if (p->lost || p->dropping) {
    if (!p->proven) ++unauthenticated_dropped_;
    return UCS_OK;
  }
  if (p->handshake == Handshake::kRefused) {  // told why already; anything more ends it now
    ++unauthenticated_dropped_;
    dropPeer(p, PermissionDenied("refused peer " + std::to_string(p->id) + " kept sending"));
    return UCS_OK;
  }
  Decoder d(std::span<const uint8_t>(static_cast<const uint8_t*>(header), header_length));
  switch (id) {
    case kAmHello:
    case kAmChallenge:
    case kAmProof:
    case kAmWelcome:
    case kAmRefused:
      return onHandshakeAm(p, id, d, data, length, rndv);
    default:
      break;
  }
  if (!p->proven) {
    // Nothing of an unauthenticated peer is read, least of all a write's target.
    ++unauthenticated_dropped_;
    failHandshake(p, PermissionDenied(describe(*p) + " sent active message id=" +
                                      std::to_string(id) + " before authenticating"));
    return UCS_OK;  // for rendezvous: no ucp_am_recv_data_nbx, the descriptor is released
  }
  auto protocolError = [&](const Status& s) {
    HXFER_LOG_ERROR("ucx {}: bad active message {} from peer {}: {}", config_.label, id, p->id,
                    s.toString());
    dropPeer(p,
             Unavailable("peer " + std::to_string(p->id) + " broke the protocol: " + s.toString()));
    return UCS_OK;
  };
  // Only the authenticated peer holds the key: anything else on this endpoint (a relay's own
  // messages, writes or acks, or ones it altered) fails here, before a field is read.
  const std::span<const uint8_t> whole(static_cast<const uint8_t*>(header), header_length);
  if (header_length < auth::kMacBytes) {
    return protocolError(Corruption("active message id=" + std::to_string(id) + " header of " +
                                    std::to_string(header_length) + " bytes has no MAC"));
  }
  const auto fields = whole.first(header_length - auth::kMacBytes);
  const std::span<const uint8_t> covered =
      id == kAmWrite || rndv ? std::span<const uint8_t>()
                             : std::span<const uint8_t>(static_cast<const uint8_t*>(data), length);
  if (!checkSeal(*p, id, fields, covered, whole.last(auth::kMacBytes))) {
    ++unauthenticated_dropped_;
    return protocolError(PermissionDenied("active message id=" + std::to_string(id) +
                                          " failed its MAC: not from the authenticated peer"));
  }
  d = Decoder(fields);
  switch (id) {
    case kAmMessage: {
      uint64_t seq = 0;
      Status s = d.getFixed64("message.seq", &seq);
      if (s.isOk() && (rndv || seq < p->next_recv_seq || p->reorder.count(seq) != 0)) {
        s = Corruption("message seq=" + std::to_string(seq) +
                       " unexpected (next=" + std::to_string(p->next_recv_seq) + ")");
      }
      if (s.isOk() && seq != p->next_recv_seq) {
        if (p->reorder.size() >= kMaxReorderMessages ||
            p->reorder_bytes + length > kMaxReorderBytes) {
          return overLimit(p, "reorder buffer holds " + std::to_string(p->reorder.size()) +
                                  " messages / " + std::to_string(p->reorder_bytes) +
                                  " bytes waiting for seq=" + std::to_string(p->next_recv_seq) +
                                  "; bounds are " + std::to_string(kMaxReorderMessages) +
                                  " messages / " + std::to_string(kMaxReorderBytes) + " bytes");
        }
        if (seq - p->next_recv_seq > kMaxReorderMessages) {
          s = Corruption("message seq=" + std::to_string(seq) + " is more than " +
                         std::to_string(kMaxReorderMessages) +
                         " ahead of next=" + std::to_string(p->next_recv_seq));
        }
      }
      if (!s.isOk()) return protocolError(s);
      auto* bytes = static_cast<const uint8_t*>(data);
      p->reorder[seq] = std::vector<uint8_t>(bytes, bytes + length);
      p->reorder_bytes += length;
      deliverMessages(p);
      return UCS_OK;
    }
    case kAmWrite: {
      uint64_t tid = 0, offset = 0, bytes = 0;
      uint32_t count = 0, region = 0;
      Status s = d.getFixed64("write.transfer", &tid);
      if (s.isOk()) s = d.getFixed32("write.op_count", &count);
      if (s.isOk()) s = d.getFixed32("write.region", &region);
      if (s.isOk()) s = d.getFixed64("write.offset", &offset);
      if (s.isOk()) s = d.getFixed64("write.bytes", &bytes);
      uint64_t seq = 0;
      if (s.isOk()) s = d.getFixed64("write.seq", &seq);
      if (s.isOk() && count == 0) s = Corruption("write.op_count=0");
      if (s.isOk()) s = acceptWriteSeq(*p, seq);
      if (!s.isOk()) return protocolError(s);
      auto [in_it, inserted] = p->in.try_emplace(tid);
      if (inserted && p->in.size() > kMaxInTransfers) {
        p->in.erase(in_it);
        return overLimit(p, "incoming transfers in flight=" + std::to_string(p->in.size() + 1) +
                                " exceed the bound=" + std::to_string(kMaxInTransfers));
      }
      InTransfer& t = in_it->second;
      if (t.op_count == 0) t.op_count = count;
      // The receiver's own terms: the write must fall inside one of OUR regions registered as
      // kRemoteWritable. A source region answers exactly like an unknown one.
      uint8_t* dst = nullptr;
      Status bad = OkStatus();
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = regions_.find(region);
        if (it == regions_.end() || it->second.access != RegionAccess::kRemoteWritable ||
            (grants_required_ && !p->granted)) {
          bad = NotFound("incoming write to region id=" + std::to_string(region) +
                         ", which is not registered here");
        } else if (bytes == 0 || bytes != length || !it->second.region->contains(offset, bytes)) {
          bad = InvalidArgument("incoming write offset=" + std::to_string(offset) + " bytes=" +
                                std::to_string(bytes) + " (payload " + std::to_string(length) +
                                ") does not fit region id=" + std::to_string(region) +
                                " length=" + std::to_string(it->second.region->length()));
        } else {
          dst = it->second.region->data() + offset;
        }
      }
      if (count != t.op_count) {
        bad = Corruption("write.op_count=" + std::to_string(count) + " changed within transfer " +
                         std::to_string(tid));
      }
      if (!bad.isOk()) {
        HXFER_LOG_WARN("ucx {}: refusing a write from peer {}: {}", config_.label, p->id,
                       bad.toString());
        if (t.first_error.isOk()) t.first_error = bad.withContext("refused by the receiver");
        ++t.accounted;
        maybeAckIn(p, tid);
        return UCS_OK;  // a rendezvous descriptor is dropped: nothing lands
      }
      if (!rndv) {
        std::memcpy(dst, data, bytes);
        ++t.accounted;
        maybeAckIn(p, tid);
        return UCS_OK;
      }
      auto* ctx = new ReqCtx{this, p->id, tid, {}, p};  // keeps the peer: see onRecvDone
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = recvCallback;
      rp.user_data = ctx;
      ++t.in_flight;
      ++p->recvs_in_flight;
      void* req = ucp_am_recv_data_nbx(worker_, data, dst, bytes, &rp);
      if (req == nullptr) {
        onRecvDone(ctx, UCS_OK);
      } else if (UCS_PTR_IS_ERR(req)) {
        onRecvDone(ctx, UCS_PTR_STATUS(req));
      }
      return UCS_OK;
    }
    case kAmWriteAck: {
      uint64_t tid = 0;
      uint32_t code = 0;
      Status s = d.getFixed64("write_ack.transfer", &tid);
      if (s.isOk()) s = d.getFixed32("write_ack.status", &code);
      if (s.isOk() && (rndv || code > static_cast<uint32_t>(StatusCode::kPermissionDenied))) {
        s = Corruption("write_ack.status=" + std::to_string(code) + " is not a status code");
      }
      if (!s.isOk()) return protocolError(s);
      auto it = p->out.find(tid);
      if (it == p->out.end()) return UCS_OK;  // failed or finished already
      it->second.remote_done = true;
      if (code != 0 && it->second.first_error.isOk()) {
        it->second.first_error = Status(static_cast<StatusCode>(code),
                                        std::string(static_cast<const char*>(data), length));
      }
      maybeFinishOut(p, tid);
      return UCS_OK;
    }
    default:
      return protocolError(Corruption("unknown active message id"));
  }
}

// The handshake of transport/auth.h, one step per message; anything out of turn drops the
// connection (counted in auth_failures while the peer is unauthenticated).
ucs_status_t UcxAgent::onHandshakeAm(const std::shared_ptr<UcxPeer>& p, unsigned id, Decoder& d,
                                     const void* data, size_t length, bool rndv) {
  const std::string who = describe(*p);
  const Handshake state = p->handshake;
  bool in_turn = false;
  switch (id) {
    case kAmHello:
      in_turn = state == Handshake::kAwaitHello;
      break;
    case kAmProof:
      in_turn = state == Handshake::kAwaitProof;
      break;
    case kAmChallenge:
      in_turn = state == Handshake::kAwaitChallenge;
      break;
    case kAmWelcome:
      in_turn = state == Handshake::kAwaitWelcome;
      break;
    case kAmRefused:
      in_turn = state == Handshake::kAwaitChallenge || state == Handshake::kAwaitWelcome;
      break;
  }
  if (!in_turn || rndv) {
    const Status why =
        PermissionDenied(who + " broke the handshake: message id=" + std::to_string(id) +
                         (rndv ? " by rendezvous" : "") + " out of turn (" +
                         std::string(handshakeName(state)) + ")");
    if (p->handshake == Handshake::kDone) {
      HXFER_LOG_ERROR("ucx {}: {}", config_.label, why.toString());
      dropPeer(p, Unavailable(why.message()));
    } else {
      failHandshake(p, why);
    }
    return UCS_OK;
  }
  switch (id) {
    case kAmHello: {
      uint32_t version = 0;
      Status s = d.getFixed32("hello.version", &version);
      if (s.isOk() && version != kProtocolVersion) {
        refuse(p, "ucx protocol version=" + std::to_string(version) +
                      " is not ours=" + std::to_string(kProtocolVersion));
        return UCS_OK;
      }
      if (s.isOk() && d.remaining() != auth::kNonceBytes) {
        s = Corruption("hello.nonce has " + std::to_string(d.remaining()) + " bytes, expected " +
                       std::to_string(auth::kNonceBytes));
      }
      if (!s.isOk()) {
        failHandshake(p, PermissionDenied(who + " sent a bad hello: " + s.toString()));
        return UCS_OK;
      }
      std::memcpy(p->nonce_c.data(), d.rest().data(), auth::kNonceBytes);
      auto nonce_l = auth::randomNonce();
      if (!nonce_l.isOk()) {
        failHandshake(p, nonce_l.status());
        return UCS_OK;
      }
      p->nonce_l = *nonce_l;
      const auth::Proof proof_l =
          auth::prove(config_.auth_token, auth::Role::kListener, p->nonce_c, p->nonce_l, "");
      Bytes challenge;
      putFixed32(challenge, kProtocolVersion);
      challenge.insert(challenge.end(), p->nonce_l.begin(), p->nonce_l.end());
      challenge.insert(challenge.end(), proof_l.begin(), proof_l.end());
      p->handshake = Handshake::kAwaitProof;
      sendAm(p, kAmChallenge, std::move(challenge), nullptr, 0, nullptr, UCP_AM_SEND_FLAG_EAGER, 0);
      return UCS_OK;
    }
    case kAmProof: {
      if (!auth::verify(config_.auth_token, auth::Role::kConnector, p->nonce_c, p->nonce_l, "",
                        d.rest())) {
        refuse(p, "the connector's proof failed: it does not hold our token");
        return UCS_OK;
      }
      p->handshake = Handshake::kDone;
      setSessionKeys(*p, auth::sessionKeys(config_.auth_token, auth::Role::kListener, p->nonce_c,
                                           p->nonce_l, ""));
      p->proven = true;
      p->announced = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        p->welcomed = true;
      }
      sendAm(p, kAmWelcome, Bytes{}, nullptr, 0, nullptr, UCP_AM_SEND_FLAG_EAGER, 0);
      decideMode(p);
      pushEvent(Event{Event::Kind::kPeerConnected, p->id, {}, OkStatus()});
      return UCS_OK;
    }
    case kAmChallenge: {
      uint32_t version = 0;
      Status s = d.getFixed32("challenge.version", &version);
      if (s.isOk() && version != kProtocolVersion) {
        failHandshake(p,
                      Incompatible(who + " speaks ucx protocol version=" + std::to_string(version) +
                                   ", ours=" + std::to_string(kProtocolVersion)));
        return UCS_OK;
      }
      if (s.isOk() && d.remaining() != auth::kNonceBytes + auth::kProofBytes) {
        s = Corruption("challenge has " + std::to_string(d.remaining()) +
                       " bytes after the version, expected " +
                       std::to_string(auth::kNonceBytes + auth::kProofBytes));
      }
      if (!s.isOk()) {
        failHandshake(p, PermissionDenied(who + " sent a bad challenge: " + s.toString()));
        return UCS_OK;
      }
      const std::span<const uint8_t> rest = d.rest();
      std::memcpy(p->nonce_l.data(), rest.data(), auth::kNonceBytes);
      // The listener proves itself first: a squatter on the address learns nothing from us.
      if (!auth::verify(config_.auth_token, auth::Role::kListener, p->nonce_c, p->nonce_l, "",
                        rest.subspan(auth::kNonceBytes))) {
        failHandshake(p, PermissionDenied(who + " does not hold our token (its proof failed)"));
        return UCS_OK;
      }
      setSessionKeys(*p, auth::sessionKeys(config_.auth_token, auth::Role::kConnector, p->nonce_c,
                                           p->nonce_l, ""));
      p->proven = true;
      const auth::Proof proof_c =
          auth::prove(config_.auth_token, auth::Role::kConnector, p->nonce_c, p->nonce_l, "");
      p->handshake = Handshake::kAwaitWelcome;
      sendAm(p, kAmProof, Bytes(proof_c.begin(), proof_c.end()), nullptr, 0, nullptr,
             UCP_AM_SEND_FLAG_EAGER, 0);
      return UCS_OK;
    }
    case kAmWelcome: {
      if (d.remaining() != 0) {
        failHandshake(p, PermissionDenied(who + " sent a welcome of " +
                                          std::to_string(d.remaining()) + " bytes, expected 0"));
        return UCS_OK;
      }
      p->handshake = Handshake::kDone;
      p->announced = true;
      decideMode(p);
      {
        std::lock_guard<std::mutex> lock(mu_);
        p->welcomed = true;
      }
      ack_cv_.notify_all();
      return UCS_OK;
    }
    case kAmRefused: {
      const std::string reason(static_cast<const char*>(data), std::min(length, kMaxReasonBytes));
      failHandshake(p,
                    PermissionDenied("connect to " + p->address + " refused by peer: " + reason));
      return UCS_OK;
    }
  }
  return UCS_OK;
}

void UcxAgent::seal(UcxPeer& p, unsigned id, Bytes& header, std::span<const uint8_t> covered) {
  const uint8_t lead = static_cast<uint8_t>(id);
  const auth::Mac m = p.send_mac.mac({{&lead, 1}, header}, covered);
  header.insert(header.end(), m.begin(), m.end());
}

bool UcxAgent::checkSeal(UcxPeer& p, unsigned id, std::span<const uint8_t> fields,
                         std::span<const uint8_t> covered, std::span<const uint8_t> tag) {
  const uint8_t lead = static_cast<uint8_t>(id);
  return p.receive_mac.check({{&lead, 1}, fields}, covered, tag);
}

void UcxAgent::setSessionKeys(UcxPeer& p, const auth::SessionKeys& keys) {
  p.send_mac = auth::MacKey(keys.send);
  p.receive_mac = auth::MacKey(keys.receive);
}

Status UcxAgent::acceptWriteSeq(UcxPeer& p, uint64_t seq) {
  if (seq == 0) return Corruption("write.seq=0");
  if (seq > p.write_seq_top) {
    const uint64_t shift = seq - p.write_seq_top;
    p.write_seq_seen =
        shift >= kWriteSeqWindow ? std::bitset<kWriteSeqWindow>() : p.write_seq_seen << shift;
    p.write_seq_seen.set(0);
    p.write_seq_top = seq;
    return OkStatus();
  }
  const uint64_t behind = p.write_seq_top - seq;
  if (behind >= kWriteSeqWindow) {
    return Corruption("write.seq=" + std::to_string(seq) + " is " + std::to_string(behind) +
                      " behind the newest (window " + std::to_string(kWriteSeqWindow) + ")");
  }
  if (p.write_seq_seen.test(behind)) {
    return Corruption("write.seq=" + std::to_string(seq) + " arrived twice (a replay)");
  }
  p.write_seq_seen.set(behind);
  return OkStatus();
}

void UcxAgent::failHandshake(const std::shared_ptr<UcxPeer>& p, const Status& why) {
  ++auth_failures_;
  uint64_t held = 0;
  if (!p->incoming || unauth_log_.admit(&held)) {
    HXFER_LOG_WARN(
        "ucx {}: closing {} connection (peer {}) before authentication: {} ({} lines like this "
        "held back)",
        config_.label, p->incoming ? "an incoming" : "an outgoing", p->id, why.toString(), held);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p->handshake_error.isOk()) p->handshake_error = why;
  }
  dropPeer(p, why);
}

void UcxAgent::dropPeer(const std::shared_ptr<UcxPeer>& p, const Status& why) {
  if (p->dropping) return;
  p->dropping = true;
  post([this, p, why] { markLost(p, why); });
}

// Tells a connector why it was refused, then closes after kRefusedGrace (or sooner, when it
// closes first or sends anything more).
void UcxAgent::refuse(const std::shared_ptr<UcxPeer>& p, const std::string& reason) {
  ++auth_failures_;
  uint64_t held = 0;
  if (unauth_log_.admit(&held)) {
    HXFER_LOG_WARN("ucx {}: refusing incoming peer {}: {} ({} lines like this held back)",
                   config_.label, p->id, reason, held);
  }
  auto text = std::make_shared<std::string>(reason);
  sendAm(p, kAmRefused, Bytes{}, text->data(), text->size(), text, UCP_AM_SEND_FLAG_EAGER, 0);
  p->handshake = Handshake::kRefused;
  p->auth_deadline = std::min(p->auth_deadline, Clock::now() + kRefusedGrace);
}

ucs_status_t UcxAgent::overLimit(const std::shared_ptr<UcxPeer>& p, const std::string& what) {
  ++peers_over_limit_;
  HXFER_LOG_WARN("ucx {}: disconnecting peer {}: {}", config_.label, p->id, what);
  dropPeer(p, Unavailable("peer " + std::to_string(p->id) + " exceeded a bound: " + what));
  return UCS_OK;
}

}  // namespace

StatusOr<std::unique_ptr<Agent>> createUcxAgent(const AgentConfig& config) {
  auto agent = std::make_unique<UcxAgent>(config);
  RETURN_IF_ERROR(agent->init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace hxfer::transport
