// Transport interface: the one contract every backend (inproc, shm, ucx, and the fault
// decorator) implements. Small and NIXL-like: an Agent per rank process registers the regions
// its pools live in, connects to peers, posts batches of one-sided writes into a peer's
// registered regions, and exchanges small ordered control messages.
//
// Life of a transfer (both sides):
//   receiver: registerRegion(r) -> key bytes; publish localAddress() + (region id, length, key)
//             to the writer (the engine does this inside RankInfo, over sendMessage).
//   writer:   peer = connect(address) (or learn it from a kPeerConnected event);
//             addRemoteRegion(peer, id, length, key);
//             t = postWrite(peer, ops); poll / wait until terminal.
//   When t reaches kDone every byte of every op is visible in the destination region (flush
//   semantics), so a control message sent after that (e.g. TransferDone) never overtakes data.
//
// Backends ("inproc", "shm", "ucx") are created with createAgent(config); per backend notes:
//   inproc: peers live in the same process and are found through a process-local registry by
//           address. Keys are empty. Regions may be of any backing.
//   shm:    same host. Regions MUST be memfd-backed (Region::Backing::kMemfd) and sealed
//           against growing and shrinking. Each agent listens on an abstract Unix-domain
//           socket. Once a connection has authenticated (uid + token, below), the fds of the
//           kRemoteWritable regions travel to that peer over the socket (SCM_RIGHTS), on
//           connect and on every later registerRegion, and are mapped there once (lazily, no
//           pre-faulting; an fd without the seals or shorter than announced is refused). Keys
//           are empty (the fd is the key); addRemoteRegion checks that the peer's fd arrived
//           and its length. Regions registered before a sendMessage are always mapped at the
//           peer before that message is delivered, so "register, then send the RankInfo" needs
//           no extra sync.
//   cuda:   same host, device memory: the shm agent's authenticated socket, over a device
//           runtime (AgentConfig::device, the seam in device/device_api.h). Regions are device
//           memory (DeviceApi::owner must know them; host memory is refused). A kRemoteWritable
//           region is exported once (DeviceApi::exportRange) and its handle travels to each
//           granted peer in a device-region frame, a POSIX fd riding along with SCM_RIGHTS;
//           the peer maps it (importRange) when the frame arrives. postWrite is one batched
//           copy per source device on that device's stream (created on first use); the
//           transfer is kDone once the copy's event is, and a mapping is released only after
//           the copies into it finished. Address "cuda:@name". A cuda agent and a shm agent
//           refuse each other in the handshake (Incompatible, naming both).
//   ucx:    UCP worker + listener on ip:port (port 0 picks one; localAddress has the real one).
//           Control = active messages. Data mode (AgentConfig::ucx_mode): kPut = ucp_put_nbx
//           with the rkey from the key bytes + ucp_ep_flush_nbx; kAm = active-message
//           rendezvous received straight into the destination region, and the receiver
//           validates every incoming write against ITS OWN registered regions (bad ones are
//           refused and fail the transfer with InvalidArgument; only kRemoteWritable regions
//           are targets, only for authenticated peers); kAuto = put only when the
//           endpoint's RMA lanes are real RMA (RDMA, cuda_ipc), else am. The choice is logged.
//           UCX_* environment variables are honoured; AgentConfig::ucx_options are applied on
//           top (hermetic tests use them instead of the environment).
//
// Authentication (shm, ucx; transport/auth.h): connect() returns only after both ends proved
// they hold AgentConfig::auth_token (and, on shm, run under an allowed uid); a listener reports
// kPeerConnected only then. Until then nothing but the handshake crosses: a peer that sends
// anything else, or does not finish within auth_timeout, is dropped. connect() to a peer that
// refuses us or fails its own proof returns PermissionDenied (final: retrying will not help).
//
// Errors (see common/status.h):
//   PermissionDenied the peer failed authentication or refused ours (connect).

//   InvalidArgument  zero-byte op, op outside a local or remote region, unknown backend option,
//                    region not memfd on shm, message too large.
//   NotFound         unknown peer id or region id (local or remote).
//   Unavailable      the peer is gone (lost or disconnected) or unreachable: every pending
//                    transfer to it fails with Unavailable and so does every later postWrite /
//                    sendMessage to it. Never a hang.
//   Cancelled        Transfer::cancel() won before completion.
//
// Thread-safety: every Agent method and every Transfer method may be called from any thread
// concurrently. Each agent runs its own internal progress thread(s); nothing needs driving from
// outside. A Transfer handle may outlive its Agent (it then fails with Unavailable if pending).
// Fork: create agents AFTER fork(); an agent does not survive into a child process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cache/region.h"
#include "common/status.h"

namespace hxfer::device {
class DeviceApi;
class Event;
}  // namespace hxfer::device

namespace hxfer::transport {

using Clock = std::chrono::steady_clock;

// Locally assigned, unique per agent, never reused. 0 is never a valid peer.
using PeerId = uint64_t;

// What a backend can do; the engine's routing reads these (DESIGN §8).
struct Capabilities {
  std::string name;                   // "inproc", "shm", "ucx", or "fault(<inner>)"
  bool same_host_only = false;        // peers must share the host (inproc: the process)
  bool one_sided = false;             // data lands without receiver CPU work (shm, inproc, put)
  bool many_small_ops_cheap = false;  // per-op cost ~ a memcpy call, fine for paged layouts
  bool needs_memfd_regions = false;   // registerRegion refuses anonymous regions
  uint64_t max_message_bytes = 0;     // sendMessage refuses larger payloads
  bool device_memory = false;         // regions are device memory (cuda), not host memory
  // addRemoteRegion needs the key the owner's registerRegion returned (ucx: the rkey); a
  // region declared without one cannot be written.
  bool remote_regions_need_keys = false;
};

enum class UcxMode { kAuto, kPut, kAm };
std::string_view ucxModeName(UcxMode mode);
StatusOr<UcxMode> parseUcxMode(std::string_view name);  // "auto" | "put" | "am"

struct AgentConfig {
  std::string backend;  // "inproc" | "shm" | "cuda" | "ucx"
  // cuda: the device runtime the agent exports, maps and copies through (required; tests
  // give it device::FakeDevice). Other backends ignore it.
  std::shared_ptr<device::DeviceApi> device;
  // Where to listen. inproc: a unique name (empty: generated). shm, cuda: abstract socket name
  // (empty: generated from pid and a counter). ucx: "ip:port" (empty: "127.0.0.1:0").
  std::string listen;
  std::string label = "agent";  // used in log lines and memfd/socket names only
  UcxMode ucx_mode = UcxMode::kAuto;
  // UCX config overrides applied with ucp_config_modify after reading the environment, e.g.
  // {{"TLS", "tcp"}} (names without the UCX_ prefix).
  std::vector<std::pair<std::string, std::string>> ucx_options;
  // How long connect() waits for the peer to answer (connection and authentication).
  std::chrono::milliseconds connect_timeout{10000};

  // Authentication (transport/auth.h, docs/reliability.md). Both ends of every connection
  // prove they hold this secret before any region, key or message crosses; it never travels.
  // Empty: no token. The exchange still runs and same-host peers are still checked for uid, but
  // anyone who can reach the address may connect: the agent logs a warning at creation and
  // reports it in AgentStats::token_configured.
  std::string auth_token;
  // shm: uids other than our own allowed to connect or to listen where we connect (checked
  // with SO_PEERCRED on both ends).
  std::vector<uint32_t> allowed_uids;
  // A connection that has not completed authentication within this time is closed.
  std::chrono::milliseconds auth_timeout{5000};
  // At most this many accepted connections may be authenticating at once: a newcomer past it
  // closes the oldest of them (counted in AgentStats::connections_refused), so that silent
  // connections re-opened in a loop cannot hold out a peer that authenticates promptly. Lines
  // about unauthenticated connections are logged at most once a second, with a count.
  size_t max_unauthenticated = 32;

  // Sending never waits for a peer (sendMessage below). What a peer has not read yet waits in
  // a per-peer queue of at most this many bytes (frames and region announcements; a frame is
  // always accepted onto an empty queue, so one message of max_message_bytes always fits).
  // A send that would exceed it disconnects the peer (AgentStats::peers_over_limit).
  uint64_t max_send_queue_bytes = 64ull << 20;
  // A peer with bytes queued for it that reads none of them for this long is disconnected
  // (AgentStats::peers_over_limit): a stopped or wedged peer goes after a bounded time.
  std::chrono::milliseconds send_stall_timeout{10000};
};

// What a registered region is for.
enum class RegionAccess {
  kLocalSource,     // read by our own postWrite only: never exported, never written by a peer
  kRemoteWritable,  // exported to authenticated peers, which may write into it
};

// Counters of what an agent refused; monotonic. The engine folds them into its metrics.
struct AgentStats {
  bool token_configured = false;
  uint64_t auth_failures = 0;            // handshakes refused: bad proof, uid, timeout, protocol
  uint64_t unauthenticated_dropped = 0;  // frames / messages from a peer not yet authenticated
  uint64_t connections_refused = 0;      // closed over max_unauthenticated, or at the fd limit
  uint64_t peers_over_limit = 0;         // peers disconnected for exceeding a per-peer bound
  // ucx: the context has UCP_FEATURE_RMA, so its worker answers puts (ucx_mode put, or auto
  // where a real RMA transport exists). Over tcp or shared memory UCX emulates put with a
  // handler that writes wherever its sender says: only on a network of trusted hosts.
  bool accepts_put = false;
};

// One write: bytes from (local region, offset) to (remote region, offset) on one peer.
struct WriteOp {
  uint32_t local_region = 0;
  uint64_t local_offset = 0;
  uint32_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
};

enum class TransferState { kInProgress, kDone, kFailed, kCancelled };
std::string_view transferStateName(TransferState state);

namespace detail {
class TransferCore;
}

// Handle to one posted batch. Copyable (copies share the transfer); thread-safe.
// Cancellation is best effort: cancel() asks the backend to stop, but bytes already in flight
// may still land and the transfer may still reach kDone or kFailed. Callers must keep polling
// (or wait) until a terminal state; only then may the destination pages be reused.
class Transfer {
 public:
  Transfer() = default;  // an empty handle: poll() returns kFailed, status() is Internal
  explicit Transfer(std::shared_ptr<detail::TransferCore> core) : core_(std::move(core)) {}

  TransferState poll() const;
  // Blocks until a terminal state or the deadline. Returns status() when terminal, Timeout
  // when the deadline passed first (the transfer keeps going; poll or wait again).
  Status wait(Clock::time_point deadline) const;
  Status waitFor(std::chrono::milliseconds timeout) const { return wait(Clock::now() + timeout); }
  void cancel() const;
  // Runs `fn` once when the transfer reaches a terminal state: at once in this thread when it
  // already has, else in the thread that finishes it (a backend thread; it must be quick, must
  // not block and must not call back into this transfer). Lets a thread that waits in
  // Agent::pollEvent be woken by a completion (Agent::wakeEventWaiter) instead of polling.
  void notifyWhenTerminal(std::function<void()> fn) const;
  // Ok when kDone, Cancelled when kCancelled, the error when kFailed; Ok while in progress.
  Status status() const;
  uint64_t bytes() const;  // total bytes in the batch
  size_t opCount() const;

  const std::shared_ptr<detail::TransferCore>& core() const { return core_; }

 private:
  std::shared_ptr<detail::TransferCore> core_;
};

struct Event {
  enum class Kind {
    kPeerConnected,  // a peer connected to our listener (connect() callers get no event)
    kMessage,        // payload holds one message from `peer`, in send order
    kPeerLost,       // the peer is gone; status says why (always Unavailable)
  };
  Kind kind = Kind::kMessage;
  PeerId peer = 0;
  std::vector<uint8_t> payload;
  Status status;
};
std::string_view eventKindName(Event::Kind kind);

class Agent {
 public:
  virtual ~Agent() = default;
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  virtual const Capabilities& capabilities() const = 0;
  // Bytes (printable) a peer passes to connect(), e.g. "shm:@hxfer-123-0", "ucx:127.0.0.1:4096".
  virtual std::string localAddress() const = 0;

  // Registers `region` under region.id(): as a source of our own postWrite ops, and with
  // kRemoteWritable also writable by authenticated peers (exported to each after its
  // handshake). Returns the key bytes peers pass to addRemoteRegion (may be empty; always
  // empty for kLocalSource). REQUIRES: `region` outlives its registration; ids unique.
  virtual StatusOr<std::vector<uint8_t>> registerRegion(const Region& region,
                                                        RegionAccess access) = 0;
  // After this returns no new incoming write lands in the region (pending local transfers that
  // read from it must have finished first: the caller's job). inproc and ucx: nor does a write
  // already running. shm and cuda map the region into the writing peer's process: this tells
  // the peer and returns, and a copy of that peer's already under way may still land until it
  // reads the notice (or its connection ends, after which kPeerLost says none runs); keep a
  // region that peers may be writing registered until their transfers into it are answered.
  virtual Status deregisterRegion(uint32_t region_id) = 0;

  // Connects to a listening agent of the same backend. Returns once the peer accepted (or
  // connect_timeout passed: Unavailable).
  virtual StatusOr<PeerId> connect(const std::string& address) = 0;
  // Closes the connection: pending transfers and later calls for `peer` fail Unavailable; the
  // remote side sees kPeerLost; locally a kPeerLost event is queued too.
  virtual Status disconnect(PeerId peer) = 0;

  // Declares a region of `peer` that postWrite may target. `length` is the peer's region length
  // (bounds are checked against it); `key` the bytes from the peer's registerRegion.
  virtual Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                                 std::span<const uint8_t> key) = 0;

  // Posts a batch of writes to `peer`. Every op is checked first (bytes > 0, inside the local
  // region, inside the remote region as declared); any bad op rejects the whole batch and
  // nothing moves. An empty batch yields a transfer that is already kDone.
  virtual StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) = 0;

  // A postWrite whose bytes move only once `ready` is done: a device event of the engine's
  // (its "these layers are written" on the sender's stream). The ops are checked at once as
  // for postWrite. Until the fence is done the transfer writes nothing: cancel() ends it
  // kCancelled and a lost peer ends it Unavailable, neither having written a byte; a fence
  // done with an error fails the transfer with that error, naming the fence. A write behind
  // a pending fence holds up no other: later writes of the agent may run before it.
  // Backends without device memory: Incompatible.
  virtual StatusOr<Transfer> postWriteAfter(PeerId peer, std::vector<WriteOp> ops,
                                            std::shared_ptr<const device::Event> ready);

  // Sends one message; messages to one peer are delivered in send order, after all writes of
  // transfers that were kDone when the message was sent. Never waits for the peer to read: the
  // message is written without blocking or queued for the agent's own thread, so a caller may
  // hold its locks across the call. A peer whose queue would exceed max_send_queue_bytes, or
  // that reads nothing for send_stall_timeout, is disconnected with a logged reason (counted
  // in AgentStats::peers_over_limit; kPeerLost follows): this call, and later ones, return
  // Unavailable. Ok means accepted, not delivered: a peer lost before reading it never sees it
  // (shm: disconnect() still sends what was queued before it, bounded by send_stall_timeout).
  virtual Status sendMessage(PeerId peer, std::span<const uint8_t> payload) = 0;

  // Next event, waiting up to `timeout`; nullopt when none arrived in time.
  virtual std::optional<Event> pollEvent(std::chrono::milliseconds timeout) = 0;
  // Makes the pollEvent that is blocked now, or else the next one, return at once (nullopt
  // when no event is queued). Wake-ups do not pile up: many calls before one pollEvent wake it
  // once. Lets one thread wait for messages and for other things (transfer completion) in a
  // single place. The default does nothing: callers must still bound their waits (inproc,
  // shm, ucx and fault implement it).
  virtual void wakeEventWaiter() {}

  // What this agent refused so far (all zero for backends that refuse nothing: inproc).
  virtual AgentStats agentStats() const { return {}; }

  // Write grants. By default an authenticated peer may write into every kRemoteWritable region
  // at once (shm sends it their fds right after the handshake). After requireWriteGrants(), a
  // peer that authenticates gets nothing until grantWrites(peer): no region fd (shm), no write
  // accepted (ucx: refused like one to an unregistered region), no addRemoteRegion of ours
  // (inproc). The engine grants a context rank only once its Hello matched what the generation
  // rank expects, so that whoever gets past the token alone (a compromised or misdirected peer
  // with another model, role or rank) holds no region. Regions of a grant reach the peer before
  // any message sent after it (shm), as for registerRegion. Call requireWriteGrants() before
  // the first connection; grantWrites is idempotent, NotFound for an unknown peer.
  virtual void requireWriteGrants() = 0;
  virtual Status grantWrites(PeerId peer) = 0;

 protected:
  Agent() = default;
};

// Creates an agent for config.backend ("inproc", "shm", "cuda", "ucx"). The ucx backend is
// present only when built with HXFER_WITH_UCX (NotFound otherwise); cuda needs config.device
// (Incompatible without one).
StatusOr<std::unique_ptr<Agent>> createAgent(const AgentConfig& config);
// Host-memory backend names compiled in, in preference order (cuda, which needs a device
// runtime, is not listed).
std::vector<std::string> availableBackends();

}  // namespace hxfer::transport
