#include "transport/shm.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/coding.h"
#include "common/logging.h"
#include "device/device_api.h"
#include "transport/auth.h"
#include "transport/local_common.h"

namespace hxfer::transport {
namespace {

using detail::CopyJob;
using detail::CopySegment;
using detail::CopyWorker;
using detail::EventQueue;
using detail::pollServing;
using detail::RegionGuard;
using detail::ServedFd;
using detail::TransferCore;

constexpr std::string_view kShmScheme = "shm:@";
constexpr std::string_view kCudaScheme = "cuda:@";
// 2: authenticated handshake, sealed memfds. 3: proofs bound to the sockets' names.
constexpr uint32_t kProtocolVersion = 3;
// A cuda agent speaks the same protocol over device memory; its hello and challenge carry the
// version with this bit, so that a shm agent and a cuda agent refuse each other at once.
constexpr uint32_t kCudaFlavor = 1u << 16;
// A device handle's bytes (legacy IPC and fabric handles are 64 bytes).
constexpr uint64_t kMaxDeviceHandleBytes = 64;
constexpr uint64_t kMaxMessageBytes = 64ull << 20;
constexpr size_t kHeaderBytes = 8;  // fixed32 type, fixed32 payload length
// Bounds on what one peer can make us hold. Before authentication a frame is at most a
// handshake frame and no fd may arrive; after it, fds arrive one per region frame and are
// consumed as the frame is parsed, so a handful pending means a broken or hostile peer.
constexpr uint32_t kMaxHandshakeFrameBytes = 512;
constexpr size_t kMaxPendingFds = 16;
constexpr size_t kMaxImportedRegions = 4096;

// Frame types on the control socket (docs/transport.md). Until `welcome` only the handshake
// (hello, challenge, proof, welcome / refused) may cross; see transport/auth.h.
enum FrameType : uint32_t {
  kHello = 1,       // connector -> listener: fixed32 version, nonce_c[32]
  kChallenge = 2,   // listener -> connector: fixed32 version, nonce_l[32], proof_l[32]
  kRegion = 3,      // fixed32 id, fixed64 length; the memfd rides along (SCM_RIGHTS)
  kRegionGone = 4,  // fixed32 id
  kMessage = 5,     // the user's payload
  kProof = 6,       // connector -> listener: proof_c[32]
  kWelcome = 7,     // listener -> connector: empty; both sides are authenticated
  kRefused = 8,     // listener -> connector: reason (text); the listener then closes
  // cuda only: fixed32 id, fixed64 length, fixed32 handle kind, fixed64 allocation bytes,
  // fixed64 offset, uuid[16] of the exporting device, length-prefixed handle bytes (at most
  // 64); a posix-fd handle's fd rides along (SCM_RIGHTS).
  kDeviceRegion = 9,
};

enum class AuthState { kAwaitHello, kAwaitProof, kAwaitChallenge, kAwaitWelcome, kDone };

std::string errnoText(std::string_view what) {
  return std::string(what) + ": " + std::strerror(errno);
}

// The name of a Unix socket's own end (getsockname) or its peer's (getpeername), as the kernel
// reports it: the sun_path bytes, an abstract name with its leading NUL; empty when unbound.
std::string socketName(int fd, bool peer) {
  sockaddr_un sa{};
  socklen_t len = sizeof(sa);
  const int r = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len)
                     : getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  const socklen_t head = offsetof(sockaddr_un, sun_path);
  if (r != 0 || len <= head) return {};
  return std::string(sa.sun_path, std::min<size_t>(len - head, sizeof(sa.sun_path)));
}

// Bytes of one frame not yet written to the peer's socket, and the fd that rides on its first
// byte (a dup of the region's fd, ours until it is sent: the region may go meanwhile).
struct OutFrame {
  std::vector<uint8_t> bytes;
  size_t sent = 0;
  int fd = -1;
};

struct ShmPeer {
  PeerId id = 0;
  bool incoming = false;
  std::atomic<bool> lost{false};
  // Both ends proved the token; only then is anything but the handshake accepted or sent, and
  // only then does the peer exist for the user (kPeerConnected / connect() returning).
  std::atomic<bool> authenticated{false};

  std::mutex send_mu;
  int fd = -1;  // guarded by send_mu for writers; closed only by the progress thread

  // Sending never waits for the peer (docs/transport.md, "Sending"): a frame goes straight to
  // the socket when nothing is queued and the socket takes it, else (what is left of it) joins
  // this queue, which the progress thread writes out when the socket is writable. Frames and
  // their fds stay one ordered stream, so a region announced before a message is still mapped
  // at the peer before that message is delivered. Guarded by send_mu.
  std::deque<OutFrame> out;
  uint64_t out_bytes = 0;          // unsent bytes in `out`, at most max_send_queue_bytes
  Clock::time_point out_progress;  // when `out` last became non-empty or shrank
  bool in_epoll = false;           // fd is in the agent's epoll set
  bool want_write = false;         // ... with EPOLLOUT
  bool linger = false;             // disconnect(): write out `out` before our end shuts

  // Progress thread only.
  std::vector<uint8_t> rx;
  std::deque<int> rx_fds;
  AuthState auth = AuthState::kAwaitHello;
  auth::Nonce connector_nonce{};
  auth::Nonce listener_nonce{};
  std::string binding;  // auth::shmBinding of this connection's two socket names
  Clock::time_point auth_deadline;

  // Ending the connection without a write after release (docs/reliability.md): our copies
  // into the peer stop before the peer can see our end close, and when the peer may write
  // into regions we exported, its kPeerLost waits until it closed its end (which it does only
  // once its own copies stopped, or by dying). Progress thread only.
  bool peer_closed = false;            // EOF or an error on its socket; out of epoll
  bool half_closed = false;            // our shutdown is done
  std::optional<Status> pending_lost;  // the kPeerLost to queue once peer_closed

  // Guarded by the agent's mu_.
  Status refusal;                  // why the handshake failed (what connect() returns)
  bool ready = false;              // authenticated (connect() returns)
  bool granted = false;            // our exported regions' fds go to it (grantWrites)
  std::vector<Transfer> outgoing;  // our transfers to it, pruned once terminal
  std::map<uint32_t, std::shared_ptr<RegionGuard>> imported;
  std::map<uint32_t, detail::DeclaredRegion> declared;
};

struct LocalRegion {
  const Region* region = nullptr;
  bool exported = false;  // RegionAccess::kRemoteWritable: its fd goes to authenticated peers
  // cuda: the device whose memory the region is, and (exported) the handle peers map.
  int device = -1;
  std::shared_ptr<const device::ExportedRange> range;
};

// The device streams of a cuda agent, one per device ordinal, made on first use. Shared with
// the copy jobs (a transfer's waiter may run its job after the agent is gone). A stream is
// used by one thread at a time: queueing on it takes mu.
struct DeviceLane {
  std::shared_ptr<device::DeviceApi> api;
  // The device of the first region registered here: a peer's regions are mapped for its
  // kernels (the writer's copies run on its source region's device). -1 until then.
  std::atomic<int> copy_device{-1};
  std::mutex mu;
  std::map<int, std::unique_ptr<device::Stream>> streams;  // guarded by mu

  // Queues `runs` as one batched copy on `ordinal`'s stream.
  StatusOr<std::shared_ptr<device::Event>> copy(int ordinal,
                                                std::span<const device::CopyRun> runs) {
    ASSIGN_OR_RETURN(device::HostCopyTable table, device::copyTable(runs));
    std::lock_guard<std::mutex> lock(mu);
    auto& stream = streams[ordinal];
    if (!stream) {
      auto made = api->createStream(ordinal);
      if (!made.isOk()) {
        streams.erase(ordinal);
        return made.status();
      }
      stream = std::move(made).value();
    }
    return stream->copy(table);
  }

  // The job's segments as one copy per source device (`devices[i]` is segment i's); returns
  // once every copy finished, with the first error.
  Status run(const std::vector<CopySegment>& segments, const std::vector<int>& devices) {
    std::map<int, std::vector<device::CopyRun>> by_device;
    std::vector<device::CopyRun>* runs_of = nullptr;  // the last segment's device's
    for (size_t i = 0; i < segments.size(); ++i) {
      const CopySegment& seg = segments[i];
      if (runs_of == nullptr || devices[i] != devices[i - 1]) {
        runs_of = &by_device[devices[i]];
        if (runs_of->empty()) runs_of->reserve(segments.size() - i);  // most jobs: one device
      }
      runs_of->push_back(device::CopyRun{reinterpret_cast<uint64_t>(seg.src),
                                         reinterpret_cast<uint64_t>(seg.dst->base + seg.dst_offset),
                                         seg.bytes});
    }
    std::vector<std::shared_ptr<device::Event>> events;
    Status first = OkStatus();
    for (auto& [ordinal, runs] : by_device) {
      auto e = copy(ordinal, runs);
      if (!e.isOk()) {
        first = e.status();
        break;
      }
      events.push_back(std::move(e).value());
    }
    // What was queued is waited for even after an error: the destinations stay held until no
    // copy of this job can still write.
    for (const auto& e : events) {
      while (!e->done()) (void)e->wait(std::chrono::milliseconds(1000));
      if (first.isOk()) first = e->status();
    }
    return first;
  }
};

class ShmAgent final : public Agent {
 public:
  ShmAgent(const AgentConfig& config, std::string name, int listen_fd, int epoll_fd, int wake_fd,
           int progress_epoll_fd)
      : config_(config),
        name_(std::move(name)),
        listen_fd_(listen_fd),
        epoll_fd_(epoll_fd),
        wake_fd_(wake_fd),
        progress_epoll_fd_(progress_epoll_fd),
        spare_fd_(open("/dev/null", O_RDONLY | O_CLOEXEC)) {
    const bool cuda = config_.backend == "cuda";
    caps_.name = cuda ? "cuda" : "shm";
    caps_.same_host_only = true;
    caps_.one_sided = true;
    caps_.many_small_ops_cheap = true;  // cuda: one batched copy per batch, whatever its ops
    caps_.needs_memfd_regions = !cuda;
    caps_.device_memory = cuda;
    caps_.max_message_bytes = kMaxMessageBytes;
    if (cuda) {
      lane_ = std::make_shared<DeviceLane>();
      lane_->api = config_.device;
    }
    log_name_ = caps_.name + " " + name_;
    if (config_.auth_token.empty()) {
      HXFER_LOG_WARN(
          "{}: no auth token configured: any process of an allowed uid that finds the socket "
          "can connect and write into exported regions",
          log_name_);
    }
    served_.watch(progress_epoll_fd_, epoll_fd_);
    progress_ = std::thread([this] { progressLoop(); });
  }

  ~ShmAgent() override {
    stop_ = true;
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    progress_.join();
    // Destroying an agent while a caller is inside pollEvent is undefined use (Agent); the lock
    // only keeps the state below ordered after the progress thread's last hold of it.
    std::lock_guard<std::mutex> driving(drive_mu_);
    std::vector<std::shared_ptr<ShmPeer>> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) peers.push_back(p);
      peers_.clear();
      fd_peers_.clear();
    }
    // Our copies stop at their next stretch; close no socket while one still writes into a
    // peer (its end closing is what tells the peer that nothing of ours can land any more).
    for (auto& p : peers) p->lost = true;
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    for (auto& p : peers) {
      std::vector<Transfer> outgoing;
      {
        std::lock_guard<std::mutex> lock(mu_);
        outgoing.swap(p->outgoing);
      }
      for (const Transfer& t : outgoing) (void)t.wait(deadline);
    }
    for (auto& p : peers) {
      std::lock_guard<std::mutex> lock(p->send_mu);
      dropQueueLocked(*p);
      if (p->fd >= 0) close(p->fd);
      p->fd = -1;
      for (int fd : p->rx_fds) close(fd);
      p->rx_fds.clear();
    }
    close(listen_fd_);
    close(epoll_fd_);
    close(progress_epoll_fd_);
    close(wake_fd_);
    if (spare_fd_ >= 0) close(spare_fd_);
    // copy_ (declared last) is destroyed first: queued jobs fail, the running one finishes.
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return std::string(scheme()) + name_; }

  AgentStats agentStats() const override {
    AgentStats s;
    s.token_configured = !config_.auth_token.empty();
    s.auth_failures = auth_failures_.load();
    s.unauthenticated_dropped = unauthenticated_dropped_.load();
    s.connections_refused = connections_refused_.load();
    s.peers_over_limit = peers_over_limit_.load();
    return s;
  }

  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region,
                                                RegionAccess access) override {
    const bool exported = access == RegionAccess::kRemoteWritable;
    LocalRegion local{&region, exported, -1, nullptr};
    if (lane_) {
      ASSIGN_OR_RETURN(local, deviceRegion(region, exported));
    } else if (region.fd() < 0) {
      return InvalidArgument("region id=" + std::to_string(region.id()) +
                             " is anonymous; the shm backend needs memfd-backed regions");
    }
    std::vector<std::shared_ptr<ShmPeer>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, added] = regions_.emplace(region.id(), std::move(local));
      if (!added) {
        return InvalidArgument("region id=" + std::to_string(region.id()) +
                               " is already registered");
      }
      if (exported) {
        for (auto& [id, p] : peers_) {
          if (p->granted && !p->lost && !sendRegion(*p, it->second).isOk()) failed.push_back(p);
        }
      }
    }
    for (auto& p : failed) markLost(p, Unavailable("peer socket failed while sending a region"));
    return std::vector<uint8_t>{};
  }

  // cuda: which device owns `region`, and the handle peers will map when it is exported.
  StatusOr<LocalRegion> deviceRegion(const Region& region, bool exported) {
    const std::string what = "region id=" + std::to_string(region.id());
    auto owner = lane_->api->owner(region.data(), region.length());
    if (!owner.isOk()) {
      if (owner.status().code() == StatusCode::kNotFound) {
        return InvalidArgument(what +
                               " is host memory; the cuda backend moves device memory (host pools "
                               "go over shm): " +
                               owner.status().message());
      }
      return Status(owner.status().code(), what + ": " + owner.status().message());
    }
    LocalRegion local{&region, exported, owner->ordinal, nullptr};
    int none = -1;
    lane_->copy_device.compare_exchange_strong(none, owner->ordinal);
    if (exported) {
      auto range = lane_->api->exportRange(region.data(), region.length());
      if (!range.isOk()) {
        return Status(range.status().code(), what + ": export: " + range.status().message());
      }
      local.range = std::make_shared<const device::ExportedRange>(std::move(range).value());
    }
    return local;
  }

  Status deregisterRegion(uint32_t region_id) override {
    std::vector<std::shared_ptr<ShmPeer>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(region_id);
      if (it == regions_.end()) {
        return NotFound("region id=" + std::to_string(region_id) + " is not registered");
      }
      const bool exported = it->second.exported;
      regions_.erase(it);
      Bytes payload;
      putFixed32(payload, region_id);
      for (auto& [id, p] : peers_) {
        if (exported && p->granted && !p->lost && !sendFrame(*p, kRegionGone, payload).isOk()) {
          failed.push_back(p);
        }
      }
    }
    for (auto& p : failed) markLost(p, Unavailable("peer socket failed while retiring a region"));
    return OkStatus();
  }

  StatusOr<PeerId> connect(const std::string& address) override {
    if (!address.starts_with(scheme())) {
      return InvalidArgument(caps_.name + " address '" + address + "' does not start with '" +
                             std::string(scheme()) + "'");
    }
    const std::string name = address.substr(scheme().size());
    sockaddr_un sa{};
    socklen_t len = 0;
    RETURN_IF_ERROR(abstractAddress(name, &sa, &len));
    // Non-blocking connect: a listener whose backlog is full (hung, or flooded) answers EAGAIN
    // at once instead of parking this thread in the kernel.
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return ResourceExhausted(errnoText("socket(AF_UNIX)"));
    // A name of our own (the kernel picks a unique abstract one): the listener sees it, and
    // both ends bind their proofs to the two names (transport/auth.h).
    sockaddr_un self{};
    self.sun_family = AF_UNIX;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&self), sizeof(sa_family_t)) != 0) {
      Status s = ResourceExhausted(errnoText("bind(AF_UNIX, autobind)"));
      close(fd);
      return s;
    }
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      Status s = errno == EAGAIN
                     ? Unavailable("shm agent '" + name + "' is not accepting (backlog full)")
                     : Unavailable(errnoText("connect to shm agent '" + name + "'"));
      close(fd);
      return s;
    }
    if (Status s = prepareSocket(fd, "the shm agent '" + name + "'"); !s.isOk()) {
      close(fd);
      return s;
    }
    auto nonce = auth::randomNonce();
    if (!nonce.isOk()) {
      close(fd);
      return nonce.status();
    }
    auto p = std::make_shared<ShmPeer>();
    p->fd = fd;
    p->auth = AuthState::kAwaitChallenge;
    p->connector_nonce = *nonce;
    p->binding = auth::shmBinding(socketName(fd, /*peer=*/true), socketName(fd, /*peer=*/false));
    Status sent = OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->id = next_peer_++;
      peers_.emplace(p->id, p);
      fd_peers_.emplace(fd, p);
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        sent = ResourceExhausted(errnoText("epoll_ctl(ADD)"));
      } else {
        p->in_epoll = true;
        Bytes hello;
        putFixed32(hello, protocolVersion());
        hello.insert(hello.end(), p->connector_nonce.begin(), p->connector_nonce.end());
        sent = sendFrame(*p, kHello, hello);
      }
      if (!sent.isOk()) {
        // Never reached the progress thread: close here.
        peers_.erase(p->id);
        fd_peers_.erase(fd);
        p->lost = true;
        std::lock_guard<std::mutex> send_lock(p->send_mu);
        if (p->in_epoll) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
        dropQueueLocked(*p);
        close(p->fd);
        p->fd = -1;
        return sent;
      }
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      ack_cv_.wait_for(lock, config_.connect_timeout, [&] { return p->ready || p->lost; });
      if (!p->ready) {
        sent = !p->refusal.isOk()
                   ? p->refusal
                   : Unavailable("shm agent '" + name + "' did not complete the handshake within " +
                                 std::to_string(config_.connect_timeout.count()) + " ms");
      }
    }
    if (!sent.isOk()) {
      markLost(p, sent, /*queue_event=*/false);
      return sent;
    }
    return p->id;
  }

  Status disconnect(PeerId peer) override {
    auto p = findPeer(peer);
    if (!p) return isGone(peer) ? OkStatus() : missingPeer(peer);
    {
      // What the user sent before disconnecting (an Error saying why, typically) still goes.
      std::lock_guard<std::mutex> lock(p->send_mu);
      p->linger = true;
    }
    markLost(p, Unavailable("peer " + std::to_string(peer) + " was disconnected"));
    return OkStatus();
  }

  Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                         std::span<const uint8_t> key) override {
    auto p = findPeer(peer);
    if (!p) return missingPeer(peer);
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = p->imported.find(region_id);
    if (it == p->imported.end()) {
      return NotFound("peer " + std::to_string(peer) +
                      " has not shared region id=" + std::to_string(region_id) +
                      " (it must be registered before the peer sends its key)");
    }
    if (length > it->second->length) {
      return InvalidArgument(
          "remote region id=" + std::to_string(region_id) + " length=" + std::to_string(length) +
          " exceeds the peer's registered length=" + std::to_string(it->second->length));
    }
    p->declared[region_id] = detail::DeclaredRegion{it->second, length};
    return OkStatus();
  }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override {
    return post(peer, std::move(ops), nullptr);
  }

  StatusOr<Transfer> postWriteAfter(PeerId peer, std::vector<WriteOp> ops,
                                    std::shared_ptr<const device::Event> ready) override {
    if (!lane_) return Agent::postWriteAfter(peer, std::move(ops), std::move(ready));
    if (!ready) return InvalidArgument("postWriteAfter without a fence event");
    return post(peer, std::move(ops), std::move(ready));
  }

  StatusOr<Transfer> post(PeerId peer, std::vector<WriteOp> ops,
                          std::shared_ptr<const device::Event> ready) {
    auto p = findPeer(peer);
    if (!p) return missingPeer(peer);
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    CopyJob job;
    uint64_t total = 0;
    std::vector<int> devices;  // cuda: the source device of each segment
    {
      std::lock_guard<std::mutex> lock(mu_);
      job.segments.reserve(ops.size());
      if (lane_) devices.reserve(ops.size());
      for (size_t i = 0; i < ops.size(); ++i) {
        const WriteOp& op = ops[i];
        ASSIGN_OR_RETURN(auto regions, detail::findOpRegions(i, op, peer, regions_, p->declared));
        const auto& [local, remote] = regions;
        RETURN_IF_ERROR(detail::validateOp(i, op, local->region->length(), remote->length));
        job.add(local->region->data() + op.local_offset, remote->guard, op.remote_offset, op.bytes);
        if (lane_) devices.push_back(local->device);
        total += op.bytes;
      }
    }
    if (lane_) {
      job.device_copy = [lane = lane_,
                         devices = std::move(devices)](const std::vector<CopySegment>& segments) {
        return lane->run(segments, devices);
      };
      job.ready = std::move(ready);
    }
    if (ops.empty()) return detail::finishedTransfer(OkStatus());
    Transfer t = detail::prepareCopy(copy_, job, total, ops.size(), p, peer);
    {
      // Outgoing before the copy can start (a small one runs within submit): finishClosing
      // shuts the socket only once no copy into the peer can run any more.
      std::lock_guard<std::mutex> lock(mu_);
      if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
      std::erase_if(p->outgoing, [](const Transfer& o) { return terminal(o); });
      p->outgoing.push_back(t);
    }
    copy_.submit(std::move(job));
    return t;
  }

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    RETURN_IF_ERROR(detail::checkMessageSize(payload.size(), kMaxMessageBytes));
    auto p = findPeer(peer);
    if (!p) return missingPeer(peer);
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    Status s = sendFrame(*p, kMessage, payload);
    if (!s.isOk()) markLost(p, s);
    return s;
  }

  // A waiting caller serves the agent's sockets itself while the socket thread sleeps
  // (pollServing; docs/transport.md, "Who handles the sockets"). The socket thread still runs
  // its timers meanwhile. A zero timeout, or an event already queued, only takes what is
  // queued.
  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0 || events_.ready()) return events_.pop(timeout);
    return pollServing(events_, timeout, drive_mu_, served_, [this] { return serveSockets(); }, {});
  }
  void wakeEventWaiter() override { events_.wake(); }

  std::string_view scheme() const { return lane_ ? kCudaScheme : kShmScheme; }
  uint32_t protocolVersion() const { return kProtocolVersion | (lane_ ? kCudaFlavor : 0u); }

  static Status abstractAddress(const std::string& name, sockaddr_un* sa, socklen_t* len) {
    if (name.empty() || name.size() + 1 > sizeof(sa->sun_path)) {
      return InvalidArgument("shm socket name '" + name + "' must have 1.." +
                             std::to_string(sizeof(sa->sun_path) - 1) + " characters");
    }
    sa->sun_family = AF_UNIX;
    sa->sun_path[0] = '\0';  // abstract namespace: nothing to unlink, gone with the process
    std::memcpy(sa->sun_path + 1, name.data(), name.size());
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return OkStatus();
  }

  // Authenticated peers only: a connection still in its handshake does not exist for the user.
 private:
  std::shared_ptr<ShmPeer> findPeer(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(id);
    return it == peers_.end() || !it->second->authenticated ? nullptr : it->second;
  }
  bool isGone(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    return id != 0 && id < next_peer_;
  }
  // A peer id we handed out whose connection is closed (and forgotten) is Unavailable, as the
  // interface promises; any other id is NotFound.
  Status missingPeer(PeerId id) {
    if (isGone(id)) return Unavailable("peer " + std::to_string(id) + " is gone");
    return NotFound("peer " + std::to_string(id) + " is not known");
  }

  bool uidAllowed(uid_t uid) const {
    if (uid == getuid()) return true;
    for (uint32_t u : config_.allowed_uids) {
      if (u == uid) return true;
    }
    return false;
  }

  // Checks who is at the other end (SO_PEERCRED). The socket stays non-blocking: nothing here
  // ever waits for the peer (sendFrame).
  Status prepareSocket(int fd, const std::string& who) {
    ucred cred{};
    socklen_t clen = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
      return Unavailable(errnoText("SO_PEERCRED of " + who));
    }
    if (!uidAllowed(cred.uid)) {
      return PermissionDenied(who + " runs as uid " + std::to_string(cred.uid) + " (pid " +
                              std::to_string(cred.pid) + "); allowed: uid " +
                              std::to_string(getuid()) +
                              (config_.allowed_uids.empty() ? "" : " and allowed_uids"));
    }
    return OkStatus();
  }

  // One non-blocking sendmsg of `iov` with `fd` (when >= 0) on its first byte. Returns the
  // bytes written: 0 when the socket is full (nothing, the fd included, was sent).
  static StatusOr<size_t> writeSome(const ShmPeer& p, iovec* iov, int iov_count, int fd) {
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iov_count);
    if (fd >= 0) {
      std::memset(cbuf, 0, sizeof(cbuf));
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    for (;;) {
      const ssize_t r = sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r >= 0) return static_cast<size_t>(r);
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
      return Unavailable(errnoText("send to peer " + std::to_string(p.id)));
    }
  }

  // Sends one frame (and optionally one fd) without waiting for the peer: written at once as
  // far as the socket takes it when nothing is queued, the rest queued for the progress
  // thread. Unavailable when the peer is gone or the queue would exceed max_send_queue_bytes
  // (the caller then drops the peer). Safe under mu_ (REQUIRES: not p.send_mu).
  Status sendFrame(ShmPeer& p, uint32_t type, std::span<const uint8_t> payload, int fd = -1) {
    uint8_t header[kHeaderBytes];
    storeFixed32(header, type);
    storeFixed32(header + 4, static_cast<uint32_t>(payload.size()));
    const uint64_t frame_bytes = kHeaderBytes + payload.size();
    std::lock_guard<std::mutex> lock(p.send_mu);
    if (p.fd < 0 || p.lost) return Unavailable("peer " + std::to_string(p.id) + " is gone");
    size_t sent = 0;
    if (p.out.empty()) {
      iovec iov[2] = {{header, kHeaderBytes},
                      {const_cast<uint8_t*>(payload.data()), payload.size()}};
      ASSIGN_OR_RETURN(sent, writeSome(p, iov, payload.empty() ? 1 : 2, fd));
      if (sent == frame_bytes) return OkStatus();
    } else if (p.out_bytes + frame_bytes > config_.max_send_queue_bytes) {
      ++peers_over_limit_;
      const std::string why =
          "peer " + std::to_string(p.id) + " is not reading: " + std::to_string(p.out_bytes) +
          " bytes queued for it and a frame of " + std::to_string(frame_bytes) +
          " would exceed max_send_queue_bytes=" + std::to_string(config_.max_send_queue_bytes);
      HXFER_LOG_WARN("{}: disconnecting peer {}: {}", log_name_, p.id, why);
      return Unavailable(why);
    }
    // Queue what the socket did not take; an fd already went with the first byte.
    OutFrame f;
    f.bytes.resize(frame_bytes - sent);
    const size_t from_header = sent < kHeaderBytes ? kHeaderBytes - sent : 0;
    std::memcpy(f.bytes.data(), header + (kHeaderBytes - from_header), from_header);
    if (!payload.empty()) {
      const size_t payload_from = sent - (kHeaderBytes - from_header);
      std::memcpy(f.bytes.data() + from_header, payload.data() + payload_from,
                  payload.size() - payload_from);
    }
    if (fd >= 0 && sent == 0) {
      f.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (f.fd < 0)
        return ResourceExhausted(errnoText("dup of region fd for peer " + std::to_string(p.id)));
    }
    if (p.out.empty()) p.out_progress = Clock::now();
    p.out_bytes += f.bytes.size();
    p.out.push_back(std::move(f));
    setWriteInterestLocked(p, true);
    return OkStatus();
  }

  // Progress thread: writes queued frames while the socket takes them. A write error drops the
  // queue and is returned (the caller marks the peer lost). REQUIRES: p.send_mu held.
  Status flushLocked(ShmPeer& p) {
    Status s = OkStatus();
    while (!p.out.empty() && p.fd >= 0) {
      OutFrame& f = p.out.front();
      iovec iov{f.bytes.data() + f.sent, f.bytes.size() - f.sent};
      StatusOr<size_t> r = writeSome(p, &iov, 1, f.fd);
      if (!r.isOk()) {
        s = r.status();
        dropQueueLocked(p);
        break;
      }
      if (*r == 0) break;
      if (f.fd >= 0) close(f.fd);
      f.fd = -1;
      f.sent += *r;
      p.out_bytes -= *r;
      p.out_progress = Clock::now();
      if (f.sent == f.bytes.size()) p.out.pop_front();
    }
    setWriteInterestLocked(p, !p.out.empty());
    return s;
  }

  // Forgets what is queued for the peer (it will not be sent). REQUIRES: p.send_mu held.
  void dropQueueLocked(ShmPeer& p) {
    for (OutFrame& f : p.out) {
      if (f.fd >= 0) close(f.fd);
    }
    p.out.clear();
    p.out_bytes = 0;
    setWriteInterestLocked(p, false);
  }

  // Watches the socket for writability while frames are queued. REQUIRES: p.send_mu held.
  void setWriteInterestLocked(ShmPeer& p, bool on) {
    if (p.want_write == on || p.fd < 0 || !p.in_epoll) return;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (on ? EPOLLOUT : 0u);
    ev.data.fd = p.fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, p.fd, &ev) == 0) p.want_write = on;
    if (on) {
      uint64_t one = 1;  // the progress thread may sleep with a long timeout: recompute it
      (void)!write(wake_fd_, &one, sizeof(one));
    }
  }

  // Progress thread: the socket of `p` is writable.
  void flushPeer(const std::shared_ptr<ShmPeer>& p) {
    Status s = OkStatus();
    {
      std::lock_guard<std::mutex> lock(p->send_mu);
      s = flushLocked(*p);
    }
    if (!s.isOk()) markLost(p, s);
  }

  // Progress thread: drops peers that read nothing of their queue for send_stall_timeout.
  // Returns whether any peer has frames queued (the loop then wakes often enough to notice).
  bool expireStalledSends() {
    const auto now = Clock::now();
    std::vector<std::pair<std::shared_ptr<ShmPeer>, uint64_t>> stalled;
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) {
        std::lock_guard<std::mutex> send_lock(p->send_mu);
        if (p->out.empty()) continue;
        queued = true;
        if (!p->lost && p->authenticated && now - p->out_progress >= config_.send_stall_timeout) {
          stalled.emplace_back(p, p->out_bytes);
        }
      }
    }
    for (auto& [p, bytes] : stalled) {
      ++peers_over_limit_;
      const std::string why =
          "peer " + std::to_string(p->id) + " read none of the " + std::to_string(bytes) +
          " bytes queued for it within " +
          "send_stall_timeout=" + std::to_string(config_.send_stall_timeout.count()) + " ms";
      HXFER_LOG_WARN("{}: disconnecting peer {}: {}", log_name_, p->id, why);
      markLost(p, Unavailable(why));
    }
    return queued;
  }

  Status sendRegion(ShmPeer& p, const LocalRegion& local) {
    const Region& region = *local.region;
    Bytes payload;
    putFixed32(payload, region.id());
    putFixed64(payload, region.length());
    if (!local.range) return sendFrame(p, kRegion, payload, region.fd());
    const device::ExportedRange& r = *local.range;
    putFixed32(payload, static_cast<uint32_t>(r.kind));
    putFixed64(payload, r.allocation_bytes);
    putFixed64(payload, r.offset);
    payload.insert(payload.end(), r.device.uuid.begin(), r.device.uuid.end());
    putLengthPrefixed(payload, std::span<const uint8_t>(r.handle));
    return sendFrame(p, kDeviceRegion, payload, r.kind == device::HandleKind::kPosixFd ? r.fd : -1);
  }

  static bool terminal(const Transfer& t) { return t.poll() != TransferState::kInProgress; }

  // Fails everything pending for the peer (our copies stop at their next stretch) and forgets
  // its regions. The progress thread then ends the connection (finishClosing): kPeerLost is
  // queued at once for a peer that could not write into our memory, and only after the peer
  // closed its end for one we exported regions to, so that when the user sees kPeerLost no
  // copy of the peer into those regions can still run.
  // Peers that never authenticated were never announced: they leave no kPeerLost either.
  void markLost(const std::shared_ptr<ShmPeer>& p, const Status& why, bool queue_event = true) {
    bool exported = false;
    {
      // `lost` and the deferred announcement change together under mu_: the progress thread
      // (finishClosing) must never see a lost peer whose kPeerLost is not recorded yet, or it
      // closes the peer without one and the user keeps a connection that is gone.
      std::lock_guard<std::mutex> lock(mu_);
      if (p->lost.exchange(true)) return;
      if (!p->authenticated) ++auth_failures_;  // a handshake that ended before it succeeded
      queue_event = queue_event && p->authenticated;
      if (p->refusal.isOk()) p->refusal = why;
      p->imported.clear();
      p->declared.clear();
      exported = p->granted && std::any_of(regions_.begin(), regions_.end(),
                                           [](const auto& r) { return r.second.exported; });
      if (queue_event && exported) lost_pending_[p->id] = why;
    }
    {
      std::lock_guard<std::mutex> lock(p->send_mu);
      if (!p->linger) dropQueueLocked(*p);
    }
    ack_cv_.notify_all();
    if (queue_event && !exported) events_.push(Event{Event::Kind::kPeerLost, p->id, {}, why});
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    HXFER_LOG_DEBUG("{}: peer {} lost: {}", log_name_, p->id, why.toString());
  }

  // Progress thread: moves lost peers towards closed. Our end is shut only once none of our
  // copies into the peer can run; the socket is closed (and the peer forgotten) once the peer
  // closed its end too, or at once when it could not write into our memory. Returns whether a
  // peer still waits for our copies (the loop then polls quickly).
  bool finishClosing() {
    std::vector<std::shared_ptr<ShmPeer>> lost;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) {
        if (p->lost) lost.push_back(p);
      }
    }
    bool waiting = false;
    for (auto& p : lost) {
      bool copies_done = false;
      bool announce_later = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::erase_if(p->outgoing, [](const Transfer& o) { return terminal(o); });
        copies_done = p->outgoing.empty();
        if (auto it = lost_pending_.find(p->id); it != lost_pending_.end()) {
          if (!p->pending_lost) p->pending_lost = it->second;
          lost_pending_.erase(it);
        }
        announce_later = p->pending_lost.has_value();
      }
      if (!copies_done) {
        waiting = true;
        continue;
      }
      if (!p->half_closed) {
        std::lock_guard<std::mutex> lock(p->send_mu);
        // disconnect(): what was queued before it still goes, unless the peer stalls.
        if (p->linger && !p->out.empty() && p->fd >= 0 && !p->peer_closed &&
            Clock::now() - p->out_progress < config_.send_stall_timeout) {
          continue;
        }
        dropQueueLocked(*p);
        p->half_closed = true;
        // Keep reading when the peer may still write into our regions: its EOF is the proof.
        if (p->fd >= 0) shutdown(p->fd, announce_later ? SHUT_WR : SHUT_RDWR);
      }
      if (announce_later && !p->peer_closed) continue;
      if (p->pending_lost) {
        events_.push(Event{Event::Kind::kPeerLost, p->id, {}, *p->pending_lost});
        p->pending_lost.reset();
      }
      closePeerFd(p);
    }
    return waiting;
  }

  // The peer's end is closed (or broken): nothing more will be read from it.
  void peerClosed(const std::shared_ptr<ShmPeer>& p) {
    if (p->peer_closed) return;
    p->peer_closed = true;
    std::lock_guard<std::mutex> lock(p->send_mu);
    if (p->fd >= 0 && p->in_epoll) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p->fd, nullptr);
    p->in_epoll = false;
  }

  // Closes the socket and forgets the peer: nothing it sent stays buffered here. Transfers
  // still running hold what they need (their destination guards); their check sees `lost`.
  void closePeerFd(const std::shared_ptr<ShmPeer>& p) {
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> send_lock(p->send_mu);
    if (p->fd >= 0) {
      if (p->in_epoll) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p->fd, nullptr);
      p->in_epoll = false;
      fd_peers_.erase(p->fd);
      close(p->fd);
      p->fd = -1;
    }
    dropQueueLocked(*p);
    for (int fd : p->rx_fds) close(fd);
    p->rx_fds.clear();
    std::vector<uint8_t>().swap(p->rx);
    p->imported.clear();
    p->declared.clear();
    peers_.erase(p->id);
  }

  // Closes incoming connections that did not authenticate in time (progress thread).
  void expireHandshakes() {
    const auto now = Clock::now();
    std::vector<std::shared_ptr<ShmPeer>> late;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) {
        if (p->incoming && !p->authenticated && !p->lost && now >= p->auth_deadline) {
          late.push_back(p);
        }
      }
    }
    for (auto& p : late) {
      uint64_t held = 0;
      if (unauth_log_.admit(&held)) {
        HXFER_LOG_WARN(
            "{}: closing connection {}: no authentication within {} ms ({} lines like this "
            "held back)",
            log_name_, p->id, config_.auth_timeout.count(), held);
      }
      markLost(p, PermissionDenied("no authentication within " +
                                   std::to_string(config_.auth_timeout.count()) + " ms"));
      closePeerFd(p);
    }
  }

  size_t unauthenticatedIncomingLocked() const {
    size_t n = 0;
    for (auto& [id, p] : peers_) n += p->incoming && !p->authenticated && !p->lost;
    return n;
  }

  // Handles what the sockets have ready now (the listener's connections, peers' frames, room
  // to write queued frames); always true, as the sockets are level-triggered and whatever is
  // left wakes the next to wait on them. REQUIRES: drive_mu_ held.
  bool serveSockets() {
    epoll_event evs[16];
    const int n = epoll_wait(epoll_fd_, evs, 16, 0);
    for (int i = 0; i < n && !stop_; ++i) {
      const int fd = evs[i].data.fd;
      if (fd == listen_fd_) {
        acceptPeers();
        continue;
      }
      std::shared_ptr<ShmPeer> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = fd_peers_.find(fd);
        if (it != fd_peers_.end()) p = it->second;
      }
      if (!p) continue;
      if (evs[i].events & EPOLLOUT) flushPeer(p);
      if (evs[i].events & ~static_cast<uint32_t>(EPOLLOUT)) readPeer(p);
    }
    return true;
  }

  void progressLoop() {
    std::unique_lock<std::mutex> driving(drive_mu_);  // released while it sleeps
    epoll_event evs[2];
    while (!stop_) {
      // Wake often enough to end handshakes and stalled sends on time while any is pending.
      int wait_ms = closing_wait_ ? 2 : 1000;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (wait_ms > 2 && unauthenticatedIncomingLocked() > 0) {
          wait_ms = static_cast<int>(std::clamp<int64_t>(config_.auth_timeout.count() / 4, 1, 250));
        }
      }
      if (sends_queued_ && wait_ms > 2) {
        wait_ms = std::min(wait_ms, static_cast<int>(std::clamp<int64_t>(
                                        config_.send_stall_timeout.count() / 4, 1, 250)));
      }
      driving.unlock();
      const int n = epoll_wait(progress_epoll_fd_, evs, 2, wait_ms);
      const int err = errno;
      driving.lock();
      if (n < 0 && err != EINTR) {
        HXFER_LOG_ERROR("{}: epoll_wait failed: {}", log_name_, std::strerror(err));
        return;
      }
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.fd != wake_fd_) continue;
        // Level-triggered: left unread, every later wait would return at once.
        uint64_t v;
        while (read(wake_fd_, &v, sizeof(v)) > 0) {
        }
      }
      // Also when a serving caller has the sockets: after it returned, what it left readable
      // is taken here at once; a non-blocking look costs one call when nothing is.
      serveSockets();
      expireHandshakes();
      sends_queued_ = expireStalledSends();
      closing_wait_ = finishClosing();
    }
  }

  void acceptPeers() {
    for (;;) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of fds the pending connection stays queued and the listener stays readable:
          // epoll would spin. Spend the spare fd to take it off the queue and close it.
          ++connections_refused_;
          uint64_t held = 0;
          if (unauth_log_.admit(&held)) {
            HXFER_LOG_WARN(
                "{}: refusing a connection: out of file descriptors ({} lines like this held "
                "back)",
                log_name_, held);
          }
          if (spare_fd_ >= 0) {
            close(spare_fd_);
            int victim = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (victim >= 0) close(victim);
            spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
            continue;
          }
        }
        return;  // EAGAIN (listener is non-blocking) or a transient error
      }
      if (Status s = prepareSocket(fd, "a connecting process"); !s.isOk()) {
        ++auth_failures_;
        uint64_t held = 0;
        if (unauth_log_.admit(&held)) {
          HXFER_LOG_WARN("{}: refusing a connection: {} ({} lines like this held back)", log_name_,
                         s.toString(), held);
        }
        close(fd);
        continue;
      }
      // The oldest unauthenticated connection makes room for this one: refusing newcomers let
      // a flood of silent connections, re-opened at once, lock every honest peer out.
      std::shared_ptr<ShmPeer> oldest;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (unauthenticatedIncomingLocked() >= config_.max_unauthenticated) {
          for (auto& [id, q] : peers_) {
            if (q->incoming && !q->authenticated && !q->lost &&
                (!oldest || q->auth_deadline < oldest->auth_deadline)) {
              oldest = q;
            }
          }
        }
      }
      if (oldest) {
        const uint64_t n = ++connections_refused_;
        uint64_t held = 0;
        if (unauth_log_.admit(&held)) {
          HXFER_LOG_WARN(
              "{}: closing the oldest unauthenticated connection ({}) for a new one: "
              "max_unauthenticated={} are authenticating ({} closed so far; {} lines like this "
              "held back)",
              log_name_, oldest->id, config_.max_unauthenticated, n, held);
        }
        markLost(oldest, ResourceExhausted("closed for a newer connection: max_unauthenticated=" +
                                           std::to_string(config_.max_unauthenticated)));
        closePeerFd(oldest);
      }
      auto p = std::make_shared<ShmPeer>();
      p->fd = fd;
      p->incoming = true;
      p->binding = auth::shmBinding(socketName(fd, /*peer=*/false), socketName(fd, /*peer=*/true));
      p->auth = AuthState::kAwaitHello;
      p->auth_deadline = Clock::now() + config_.auth_timeout;
      std::lock_guard<std::mutex> lock(mu_);
      p->id = next_peer_++;
      peers_.emplace(p->id, p);
      fd_peers_.emplace(fd, p);
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        fd_peers_.erase(fd);
        peers_.erase(p->id);
        close(fd);
        continue;
      }
      p->in_epoll = true;
      // Its handshake deadline needs the progress thread's short timer, and a caller serving
      // the sockets (pollEvent) may have accepted it while that thread sleeps a long one.
      uint64_t one = 1;
      (void)!write(wake_fd_, &one, sizeof(one));
    }
  }

  void readPeer(const std::shared_ptr<ShmPeer>& p) {
    if (p->lost) {
      drainLostPeer(p);
      return;
    }
    Status why = OkStatus();
    bool closed = false;
    for (;;) {
      uint8_t* buf = rx_buf_.get();
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
      iovec iov{buf, kRxBufBytes};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      ssize_t r = recvmsg(p->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        why = Unavailable(errnoText("receive from peer " + std::to_string(p->id)));
        closed = true;
        break;
      }
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t k = 0; k < count; ++k) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
            p->rx_fds.push_back(fd);
          }
        }
      }
      if (msg.msg_flags & MSG_CTRUNC) {
        why = Corruption("peer " + std::to_string(p->id) + " sent more fds than expected");
        break;
      }
      // Before authentication an fd maps nothing: region frames are refused until then, and
      // a failed handshake closes what is pending. The cap below bounds what a peer can park.
      if (p->rx_fds.size() > kMaxPendingFds) {
        ++peers_over_limit_;
        why = ResourceExhausted(
            "peer " + std::to_string(p->id) + " has " + std::to_string(p->rx_fds.size()) +
            " fds pending without region frames (max " + std::to_string(kMaxPendingFds) + ")");
        break;
      }
      if (r == 0) {
        why = Unavailable("peer " + std::to_string(p->id) + " closed the connection");
        closed = true;
        break;
      }
      p->rx.insert(p->rx.end(), buf, buf + r);
      why = parseFrames(p);
      if (!why.isOk()) break;
    }
    if (closed) peerClosed(p);
    if (!why.isOk()) markLost(p, why);
    if (p->lost) closing_wait_ = finishClosing();
  }

  // A lost peer's socket is only read to see its end close; what it still sends is dropped.
  void drainLostPeer(const std::shared_ptr<ShmPeer>& p) {
    for (;;) {
      uint8_t buf[16 * 1024];
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
      iovec iov{buf, sizeof(buf)};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      ssize_t r = recvmsg(p->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (r < 0 && errno == EINTR) continue;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); r > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t k = 0; k < count; ++k) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
            close(fd);
          }
        }
      }
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (r <= 0) break;
    }
    peerClosed(p);
    closing_wait_ = finishClosing();
  }

  Status parseFrames(const std::shared_ptr<ShmPeer>& p) {
    size_t pos = 0;
    Status s = OkStatus();
    while (p->rx.size() - pos >= kHeaderBytes) {
      const uint32_t type = loadFixed32(p->rx.data() + pos);
      const uint32_t len = loadFixed32(p->rx.data() + pos + 4);
      const uint64_t max = p->authenticated ? kMaxMessageBytes + 64 : kMaxHandshakeFrameBytes;
      if (len > max) {
        if (!p->authenticated) ++unauthenticated_dropped_;
        s = Corruption("peer " + std::to_string(p->id) + " sent a frame of " + std::to_string(len) +
                       " bytes (max " + std::to_string(max) +
                       (p->authenticated ? ")" : " before authenticating)"));
        break;
      }
      if (p->rx.size() - pos - kHeaderBytes < len) break;
      s = handleFrame(p, type, std::span<const uint8_t>(p->rx.data() + pos + kHeaderBytes, len));
      pos += kHeaderBytes + len;
      if (!s.isOk()) break;
    }
    p->rx.erase(p->rx.begin(), p->rx.begin() + static_cast<std::ptrdiff_t>(pos));
    return s;
  }

  // The handshake frames (transport/auth.h). Anything else before authentication, or a
  // handshake frame out of turn, drops the connection.
  Status handleHandshake(const std::shared_ptr<ShmPeer>& p, uint32_t type,
                         std::span<const uint8_t> payload) {
    // Fixed-size frames: version (fixed32) first, then nonces and proofs of fixed length.
    auto expectSize = [&](const char* frame, size_t want) -> Status {
      if (payload.size() != want) {
        return Corruption(std::string(frame) + " frame has " + std::to_string(payload.size()) +
                          " bytes, expected " + std::to_string(want));
      }
      if (want >= 4 && type != kProof && loadFixed32(payload.data()) != protocolVersion()) {
        const uint32_t theirs = loadFixed32(payload.data());
        if ((theirs & ~kCudaFlavor) == kProtocolVersion) {
          const std::string kind = theirs & kCudaFlavor ? "cuda" : "shm";
          return Incompatible("the peer is a " + kind + " agent and this one is a " + caps_.name +
                              " agent: both ends of a connection use the same backend");
        }
        return Incompatible("peer " + caps_.name + " protocol version=" + std::to_string(theirs) +
                            " != ours=" + std::to_string(protocolVersion()));
      }
      return OkStatus();
    };
    constexpr size_t kN = auth::kNonceBytes;
    const std::string conn = "connection " + std::to_string(p->id);
    if (type == kHello && p->auth == AuthState::kAwaitHello) {
      if (Status v = expectSize("hello", 4 + kN); !v.isOk()) {
        if (v.code() == StatusCode::kIncompatible) {
          // Our version and nothing else (no nonce, no proof), so that the connector's
          // connect() names the mismatch instead of a closed connection.
          Bytes who;
          putFixed32(who, protocolVersion());
          who.resize(4 + kN + auth::kProofBytes, 0);
          (void)sendFrame(*p, kChallenge, who);
        }
        return v;
      }
      std::memcpy(p->connector_nonce.data(), payload.data() + 4, kN);
      ASSIGN_OR_RETURN(p->listener_nonce, auth::randomNonce());
      const auth::Proof proof = auth::prove(config_.auth_token, auth::Role::kListener,
                                            p->connector_nonce, p->listener_nonce, p->binding);
      Bytes challenge;
      putFixed32(challenge, protocolVersion());
      challenge.insert(challenge.end(), p->listener_nonce.begin(), p->listener_nonce.end());
      challenge.insert(challenge.end(), proof.begin(), proof.end());
      p->auth = AuthState::kAwaitProof;
      return sendFrame(*p, kChallenge, challenge);
    }
    if (type == kProof && p->auth == AuthState::kAwaitProof) {
      if (!auth::verify(config_.auth_token, auth::Role::kConnector, p->connector_nonce,
                        p->listener_nonce, p->binding, payload)) {
        const std::string reason = "token proof did not verify";
        (void)sendFrame(*p, kRefused,
                        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(reason.data()),
                                                 reason.size()));
        return PermissionDenied(conn + ": " + reason);
      }
      RETURN_IF_ERROR(sendFrame(*p, kWelcome, {}));
      finishHandshake(p);
      events_.push(Event{Event::Kind::kPeerConnected, p->id, {}, OkStatus()});
      return OkStatus();
    }
    if (type == kChallenge && p->auth == AuthState::kAwaitChallenge) {
      RETURN_IF_ERROR(expectSize("challenge", 4 + kN + auth::kProofBytes));
      std::memcpy(p->listener_nonce.data(), payload.data() + 4, kN);
      const auto theirs = payload.subspan(4 + kN);
      if (!auth::verify(config_.auth_token, auth::Role::kListener, p->connector_nonce,
                        p->listener_nonce, p->binding, theirs)) {
        return PermissionDenied(
            "the shm agent at this address does not hold our token (its "
            "proof did not verify): not the rank we meant to reach");
      }
      const auth::Proof ours = auth::prove(config_.auth_token, auth::Role::kConnector,
                                           p->connector_nonce, p->listener_nonce, p->binding);
      p->auth = AuthState::kAwaitWelcome;
      return sendFrame(*p, kProof, ours);
    }
    if (type == kWelcome && p->auth == AuthState::kAwaitWelcome) {
      RETURN_IF_ERROR(expectSize("welcome", 0));
      finishHandshake(p);
      return OkStatus();
    }
    if (type == kRefused && p->auth == AuthState::kAwaitWelcome) {
      return PermissionDenied(
          "refused by the peer: " +
          std::string(reinterpret_cast<const char*>(payload.data()), payload.size()));
    }
    ++unauthenticated_dropped_;
    return PermissionDenied(conn + " sent frame type=" + std::to_string(type) +
                            " before authenticating");
  }

  // Both ends are authenticated: send our exported regions (before anything the user sends
  // next, so the peer maps them before it sees a later message) and release connect().
  void finishHandshake(const std::shared_ptr<ShmPeer>& p) {
    p->auth = AuthState::kDone;
    Status sent = OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->authenticated = true;
      if (!grants_required_) sent = grantLocked(*p);
      p->ready = sent.isOk();
    }
    ack_cv_.notify_all();
    if (!sent.isOk()) markLost(p, sent);
  }

  // Sends our exported regions to `p` (from now on, later registrations too).
  Status grantLocked(ShmPeer& p) {
    if (p.granted) return OkStatus();
    p.granted = true;
    for (auto& [id, r] : regions_) {
      if (r.exported) RETURN_IF_ERROR(sendRegion(p, r));
    }
    return OkStatus();
  }

  void requireWriteGrants() override {
    std::lock_guard<std::mutex> lock(mu_);
    grants_required_ = true;
  }

  Status grantWrites(PeerId peer) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    Status sent = OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
      sent = grantLocked(*p);
    }
    if (!sent.isOk()) markLost(p, sent);
    return sent;
  }

  Status handleFrame(const std::shared_ptr<ShmPeer>& p, uint32_t type,
                     std::span<const uint8_t> payload) {
    if (!p->authenticated) {
      Status s = handleHandshake(p, type, payload);
      if (!s.isOk()) {
        std::lock_guard<std::mutex> lock(mu_);
        p->refusal = s;
      }
      return s;
    }
    Decoder d(payload);
    switch (type) {
      case kRegion: {
        uint32_t id = 0;
        uint64_t length = 0;
        RETURN_IF_ERROR(d.getFixed32("region.id", &id));
        RETURN_IF_ERROR(d.getFixed64("region.length", &length));
        if (lane_) {
          return Corruption("peer " + std::to_string(p->id) +
                            " shared host region id=" + std::to_string(id) + " with a cuda agent");
        }
        if (p->rx_fds.empty()) {
          return Corruption("region frame id=" + std::to_string(id) + " arrived without its fd");
        }
        int fd = p->rx_fds.front();
        p->rx_fds.pop_front();
        if (Status room = roomForImport(*p, id); !room.isOk()) {
          close(fd);
          return room;
        }
        ASSIGN_OR_RETURN(std::shared_ptr<Region> mapped, Region::mapFd(id, fd, length));
        installImport(*p, id, mapped->data(), length, mapped);
        return OkStatus();
      }
      case kDeviceRegion:
        return importDeviceRegion(*p, d);
      case kRegionGone: {
        uint32_t id = 0;
        RETURN_IF_ERROR(d.getFixed32("region_gone.id", &id));
        std::shared_ptr<RegionGuard> old;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = p->imported.find(id);
          if (it != p->imported.end()) {
            old = it->second;
            p->imported.erase(it);
          }
          p->declared.erase(id);
        }
        if (old) retireImport(*old);
        return OkStatus();
      }
      case kMessage:
        events_.push(Event{Event::Kind::kMessage, p->id,
                           std::vector<uint8_t>(payload.begin(), payload.end()), OkStatus()});
        return OkStatus();
      default:
        return Corruption("peer " + std::to_string(p->id) + " sent frame type=" +
                          std::to_string(type) + " (unknown, or a handshake frame after it)");
    }
  }

  // Whether `p` may share region `id` (a replacement always may). REQUIRES: not mu_.
  Status roomForImport(const ShmPeer& p, uint32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.imported.size() >= kMaxImportedRegions && p.imported.count(id) == 0) {
      ++peers_over_limit_;
      return ResourceExhausted("peer " + std::to_string(p.id) + " shared more than " +
                               std::to_string(kMaxImportedRegions) + " regions");
    }
    return OkStatus();
  }

  // Makes region `id` of `p` a write target at `base`, kept mapped by `owner`; a region it
  // replaces is retired (its copies in flight finish first).
  void installImport(ShmPeer& p, uint32_t id, uint8_t* base, uint64_t length,
                     std::shared_ptr<void> owner) {
    auto g = std::make_shared<RegionGuard>();
    g->id = id;
    g->base = base;
    g->length = length;
    g->owner = std::move(owner);
    std::shared_ptr<RegionGuard> old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& slot = p.imported[id];
      old = std::move(slot);
      slot = g;
    }
    if (old) retireImport(*old);
  }

  // A peer's region that is no write target any more. shm waits for a memcpy into it to
  // finish; the cuda agent does not wait on its socket thread for a device copy: the copy
  // holds the mapping until it finished, and no copy starts into the region after this.
  void retireImport(RegionGuard& g) {
    if (lane_) {
      g.retireWithoutWaiting();
    } else {
      g.retire();
    }
  }

  // cuda: a peer's exported device range, mapped here through the device runtime. Every field
  // is checked before anything is mapped; the runtime checks the range against its allocation.
  Status importDeviceRegion(ShmPeer& p, Decoder& d) {
    if (!lane_) {
      return Corruption("peer " + std::to_string(p.id) +
                        " shared a device region with a shm agent");
    }
    uint32_t id = 0, kind = 0;
    uint64_t length = 0;
    device::ExportedRange range;
    std::span<const uint8_t> uuid, handle;
    RETURN_IF_ERROR(d.getFixed32("device_region.id", &id));
    RETURN_IF_ERROR(d.getFixed64("device_region.length", &length));
    RETURN_IF_ERROR(d.getFixed32("device_region.kind", &kind));
    RETURN_IF_ERROR(d.getFixed64("device_region.allocation_bytes", &range.allocation_bytes));
    RETURN_IF_ERROR(d.getFixed64("device_region.offset", &range.offset));
    if (d.remaining() < range.device.uuid.size()) {
      return Corruption("truncated reading device_region.uuid");
    }
    std::memcpy(range.device.uuid.data(), d.rest().data(), range.device.uuid.size());
    Decoder rest(d.rest().subspan(range.device.uuid.size()));
    RETURN_IF_ERROR(rest.getLengthPrefixed("device_region.handle", kMaxDeviceHandleBytes, &handle));
    const std::string what =
        "device region id=" + std::to_string(id) + " of peer " + std::to_string(p.id);
    if (!rest.done()) {
      return Corruption(what + ": " + std::to_string(rest.remaining()) + " trailing bytes");
    }
    if (kind < static_cast<uint32_t>(device::HandleKind::kPosixFd) ||
        kind > static_cast<uint32_t>(device::HandleKind::kFabric)) {
      return Corruption(what + ": handle kind=" + std::to_string(kind) + " is not 1..3");
    }
    range.kind = static_cast<device::HandleKind>(kind);
    range.bytes = length;
    range.handle.assign(handle.begin(), handle.end());
    if (range.kind == device::HandleKind::kPosixFd) {
      if (p.rx_fds.empty()) return Corruption(what + ": arrived without its fd");
      range.fd = p.rx_fds.front();  // owned by `range` from here
      p.rx_fds.pop_front();
    }
    RETURN_IF_ERROR(roomForImport(p, id));
    auto mapped = lane_->api->importRange(std::move(range), lane_->copy_device.load());
    if (!mapped.isOk()) {
      return Status(mapped.status().code(), what + ": " + mapped.status().message());
    }
    std::shared_ptr<device::Mapping> mapping(std::move(mapped).value());
    installImport(p, id, reinterpret_cast<uint8_t*>(mapping->address()), length, mapping);
    return OkStatus();
  }

  Capabilities caps_;
  const AgentConfig config_;
  const std::string name_;
  std::string log_name_;  // "<backend> <name>", set once in the constructor
  // cuda: the device runtime and its streams; null for shm.
  std::shared_ptr<DeviceLane> lane_;
  const int listen_fd_;
  const int epoll_fd_;  // the sockets: the listener and every peer's
  const int wake_fd_;
  // What the progress thread sleeps on: wake_fd_, and epoll_fd_ while no caller serves it.
  const int progress_epoll_fd_;
  // Held by whoever handles the sockets: the progress thread while it is awake, or a caller
  // serving them while it waits for an event (pollEvent). The state marked "progress thread"
  // below belongs to the holder.
  std::mutex drive_mu_;
  ServedFd served_;  // epoll_fd_, served by waiting callers (pollEvent)
  // readPeer's receive buffer, held by whoever holds drive_mu_: off the stack, as a caller
  // serving the sockets reads with it on its own thread.
  static constexpr size_t kRxBufBytes = 64 * 1024;
  std::unique_ptr<uint8_t[]> rx_buf_ = std::make_unique<uint8_t[]>(kRxBufBytes);
  int spare_fd_;  // progress thread; given up to shed a connection when out of fds
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> auth_failures_{0};
  std::atomic<uint64_t> unauthenticated_dropped_{0};
  std::atomic<uint64_t> connections_refused_{0};
  bool grants_required_ = false;  // guarded by mu_ (requireWriteGrants)
  // Lines about connections that never authenticated: any local process can cause them.
  LogLimiter unauth_log_;
  std::atomic<uint64_t> peers_over_limit_{0};

  std::mutex mu_;
  std::condition_variable ack_cv_;
  std::map<uint32_t, LocalRegion> regions_;                     // guarded by mu_
  std::unordered_map<PeerId, std::shared_ptr<ShmPeer>> peers_;  // guarded by mu_
  std::unordered_map<int, std::shared_ptr<ShmPeer>> fd_peers_;  // guarded by mu_
  std::unordered_map<PeerId, Status> lost_pending_;             // guarded by mu_
  bool closing_wait_ = false;  // progress thread: a lost peer waits for our copies
  bool sends_queued_ = false;  // progress thread: some peer has frames queued
  PeerId next_peer_ = 1;       // guarded by mu_
  EventQueue events_;
  std::thread progress_;
  CopyWorker copy_;
};

}  // namespace

StatusOr<std::unique_ptr<Agent>> createShmAgent(const AgentConfig& config) {
  static std::atomic<uint64_t> counter{0};
  std::string name = config.listen;
  if (name.starts_with("@")) name = name.substr(1);
  if (name.empty()) {
    name = "hxfer-" + config.label + "-" + std::to_string(getpid()) + "-" +
           std::to_string(counter.fetch_add(1));
  }
  sockaddr_un sa{};
  socklen_t len = 0;
  RETURN_IF_ERROR(ShmAgent::abstractAddress(name, &sa, &len));
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (lfd < 0) return ResourceExhausted(errnoText("socket(AF_UNIX)"));
  if (bind(lfd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
    Status s = Unavailable(errnoText("bind shm socket '@" + name + "'"));
    close(lfd);
    return s;
  }
  if (listen(lfd, 128) != 0) {
    Status s = Unavailable(errnoText("listen on shm socket '@" + name + "'"));
    close(lfd);
    return s;
  }
  int efd = epoll_create1(EPOLL_CLOEXEC);
  int wfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int pfd = epoll_create1(EPOLL_CLOEXEC);
  if (efd < 0 || wfd < 0 || pfd < 0) {
    Status s = ResourceExhausted(errnoText("epoll_create1/eventfd"));
    close(lfd);
    for (int fd : {efd, wfd, pfd}) {
      if (fd >= 0) close(fd);
    }
    return s;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = lfd;
  epoll_ctl(efd, EPOLL_CTL_ADD, lfd, &ev);
  ev.data.fd = wfd;
  epoll_ctl(pfd, EPOLL_CTL_ADD, wfd, &ev);  // efd joins it when the agent watches it (ServedFd)
  return std::unique_ptr<Agent>(std::make_unique<ShmAgent>(config, name, lfd, efd, wfd, pfd));
}

}  // namespace hxfer::transport
