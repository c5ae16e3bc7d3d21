#include "transport/shm.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/coding.h"
#include "common/logging.h"
#include "transport/local_common.h"

namespace hxfer::transport {
namespace {

using detail::CopyJob;
using detail::CopySegment;
using detail::CopyWorker;
using detail::EventQueue;
using detail::RegionGuard;
using detail::TransferCore;

constexpr std::string_view kScheme = "shm:@";
constexpr uint32_t kProtocolVersion = 1;
constexpr uint64_t kMaxMessageBytes = 64ull << 20;
constexpr size_t kHeaderBytes = 8;  // fixed32 type, fixed32 payload length

// Frame types on the control socket (docs/transport.md).
enum FrameType : uint32_t {
  kHello = 1,       // connector -> listener: fixed32 version
  kHelloAck = 2,    // listener -> connector: fixed32 version
  kRegion = 3,      // fixed32 id, fixed64 length; the memfd rides along (SCM_RIGHTS)
  kRegionGone = 4,  // fixed32 id
  kMessage = 5,     // the user's payload
};

std::string errnoText(std::string_view what) {
  return std::string(what) + ": " + std::strerror(errno);
}

struct ShmPeer {
  PeerId id = 0;
  bool incoming = false;
  std::atomic<bool> lost{false};
  std::atomic<bool> acked{false};

  std::mutex send_mu;
  int fd = -1;  // guarded by send_mu for writers; closed only by the progress thread

  // Progress thread only.
  std::vector<uint8_t> rx;
  std::deque<int> rx_fds;
  bool hello_seen = false;

  // Guarded by the agent's mu_.
  bool ready = false;  // region fds are sent to ready peers
  std::map<uint32_t, std::shared_ptr<RegionGuard>> imported;
  std::map<uint32_t, std::shared_ptr<RegionGuard>> declared;
};

struct LocalRegion {
  const Region* region = nullptr;
};

class ShmAgent final : public Agent {
 public:
  ShmAgent(std::string name, int listen_fd, int epoll_fd, int wake_fd)
      : name_(std::move(name)), listen_fd_(listen_fd), epoll_fd_(epoll_fd), wake_fd_(wake_fd) {
    caps_.name = "shm";
    caps_.same_host_only = true;
    caps_.one_sided = true;
    caps_.many_small_ops_cheap = true;
    caps_.needs_memfd_regions = true;
    caps_.max_message_bytes = kMaxMessageBytes;
    progress_ = std::thread([this] { progressLoop(); });
  }

  ~ShmAgent() override {
    stop_ = true;
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    progress_.join();
    std::vector<std::shared_ptr<ShmPeer>> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) peers.push_back(p);
      peers_.clear();
      fd_peers_.clear();
    }
    const Status gone = Unavailable("shm agent '" + name_ + "' shut down");
    for (auto& p : peers) {
      p->lost = true;
      std::lock_guard<std::mutex> lock(p->send_mu);
      if (p->fd >= 0) close(p->fd);
      p->fd = -1;
      for (int fd : p->rx_fds) close(fd);
      p->rx_fds.clear();
    }
    close(listen_fd_);
    close(epoll_fd_);
    close(wake_fd_);
    // copy_ (declared last) is destroyed first: queued jobs fail, the running one finishes.
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string localAddress() const override { return std::string(kScheme) + name_; }

  StatusOr<std::vector<uint8_t>> registerRegion(const Region& region) override {
    if (region.fd() < 0) {
      return InvalidArgument("region id=" + std::to_string(region.id()) +
                             " is anonymous; the shm backend needs memfd-backed regions");
    }
    std::vector<std::shared_ptr<ShmPeer>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!regions_.emplace(region.id(), LocalRegion{&region}).second) {
        return InvalidArgument("region id=" + std::to_string(region.id()) +
                               " is already registered");
      }
      for (auto& [id, p] : peers_) {
        if (p->ready && !p->lost && !sendRegion(*p, region).isOk()) failed.push_back(p);
      }
    }
    for (auto& p : failed) markLost(p, Unavailable("peer socket failed while sending a region"));
    return std::vector<uint8_t>{};
  }

  Status deregisterRegion(uint32_t region_id) override {
    std::vector<std::shared_ptr<ShmPeer>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (regions_.erase(region_id) == 0) {
        return NotFound("region id=" + std::to_string(region_id) + " is not registered");
      }
      Bytes payload;
      putFixed32(payload, region_id);
      for (auto& [id, p] : peers_) {
        if (p->ready && !p->lost && !sendFrame(*p, kRegionGone, payload).isOk()) {
          failed.push_back(p);
        }
      }
    }
    for (auto& p : failed) markLost(p, Unavailable("peer socket failed while retiring a region"));
    return OkStatus();
  }

  StatusOr<PeerId> connect(const std::string& address) override {
    if (!address.starts_with(kScheme)) {
      return InvalidArgument("shm address '" + address + "' does not start with 'shm:@'");
    }
    const std::string name = address.substr(kScheme.size());
    sockaddr_un sa{};
    socklen_t len = 0;
    RETURN_IF_ERROR(abstractAddress(name, &sa, &len));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ResourceExhausted(errnoText("socket(AF_UNIX)"));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      Status s = Unavailable(errnoText("connect to shm agent '" + name + "'"));
      close(fd);
      return s;
    }
    auto p = std::make_shared<ShmPeer>();
    p->fd = fd;
    Status sent = OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->id = next_peer_++;
      peers_.emplace(p->id, p);
      fd_peers_.emplace(fd, p);
      Bytes hello;
      putFixed32(hello, kProtocolVersion);
      sent = sendFrame(*p, kHello, hello);
      for (auto& [id, r] : regions_) {
        if (sent.isOk()) sent = sendRegion(*p, *r.region);
      }
      p->ready = true;
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      if (sent.isOk() && epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        sent = ResourceExhausted(errnoText("epoll_ctl(ADD)"));
      }
    }
    if (sent.isOk()) {
      std::unique_lock<std::mutex> lock(mu_);
      ack_cv_.wait_for(lock, connect_timeout_, [&] { return p->acked || p->lost; });
      if (!p->acked) sent = Unavailable("shm agent '" + name + "' did not answer the hello");
    }
    if (!sent.isOk()) {
      markLost(p, sent, /*queue_event=*/false);
      return sent;
    }
    return p->id;
  }

  Status disconnect(PeerId peer) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    markLost(p, Unavailable("peer " + std::to_string(peer) + " was disconnected"));
    return OkStatus();
  }

  Status addRemoteRegion(PeerId peer, uint32_t region_id, uint64_t length,
                         std::span<const uint8_t> key) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
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
    p->declared[region_id] = it->second;
    return OkStatus();
  }

  StatusOr<Transfer> postWrite(PeerId peer, std::vector<WriteOp> ops) override {
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    CopyJob job;
    uint64_t total = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job.segments.reserve(ops.size());
      for (size_t i = 0; i < ops.size(); ++i) {
        const WriteOp& op = ops[i];
        ASSIGN_OR_RETURN(auto regions, detail::findOpRegions(i, op, peer, regions_, p->declared));
        const auto& [local, remote] = regions;
        RETURN_IF_ERROR(detail::validateOp(i, op, local->region->length(), (*remote)->length));
        job.segments.push_back(CopySegment{local->region->data() + op.local_offset, *remote,
                                           op.remote_offset, op.bytes});
        total += op.bytes;
      }
    }
    return detail::submitCopy(copy_, std::move(job), total, ops.size(), p, peer);
  }

  Status sendMessage(PeerId peer, std::span<const uint8_t> payload) override {
    RETURN_IF_ERROR(detail::checkMessageSize(payload.size(), kMaxMessageBytes));
    auto p = findPeer(peer);
    if (!p) return NotFound("peer " + std::to_string(peer) + " is not known");
    if (p->lost) return Unavailable("peer " + std::to_string(peer) + " is gone");
    Status s = sendFrame(*p, kMessage, payload);
    if (!s.isOk()) markLost(p, s);
    return s;
  }

  std::optional<Event> pollEvent(std::chrono::milliseconds timeout) override {
    return events_.pop(timeout);
  }
  void wakeEventWaiter() override { events_.wake(); }

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

  void setConnectTimeout(std::chrono::milliseconds t) { connect_timeout_ = t; }

 private:
  std::shared_ptr<ShmPeer> findPeer(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second;
  }

  // Writes one frame (and optionally one fd) fully. Blocking; serialised per peer.
  Status sendFrame(ShmPeer& p, uint32_t type, std::span<const uint8_t> payload, int fd = -1) {
    uint8_t header[kHeaderBytes];
    storeFixed32(header, type);
    storeFixed32(header + 4, static_cast<uint32_t>(payload.size()));
    std::lock_guard<std::mutex> lock(p.send_mu);
    if (p.fd < 0 || p.lost) return Unavailable("peer " + std::to_string(p.id) + " is gone");
    iovec iov[2] = {{header, kHeaderBytes}, {const_cast<uint8_t*>(payload.data()), payload.size()}};
    size_t total = kHeaderBytes + payload.size();
    size_t sent = 0;
    bool fd_pending = fd >= 0;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
    while (sent < total) {
      // Skip what was sent already.
      iovec cur[2];
      int n = 0;
      size_t skip = sent;
      for (auto& v : iov) {
        if (skip >= v.iov_len) {
          skip -= v.iov_len;
          continue;
        }
        cur[n++] = {static_cast<uint8_t*>(v.iov_base) + skip, v.iov_len - skip};
        skip = 0;
      }
      msghdr msg{};
      msg.msg_iov = cur;
      msg.msg_iovlen = n;
      if (fd_pending) {
        std::memset(cbuf, 0, sizeof(cbuf));
        msg.msg_control = cbuf;
        msg.msg_controllen = sizeof(cbuf);
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
      }
      ssize_t r = sendmsg(p.fd, &msg, MSG_NOSIGNAL);
      if (r < 0) {
        if (errno == EINTR) continue;
        return Unavailable(errnoText("send to peer " + std::to_string(p.id)));
      }
      fd_pending = false;
      sent += static_cast<size_t>(r);
    }
    return OkStatus();
  }

  Status sendRegion(ShmPeer& p, const Region& region) {
    Bytes payload;
    putFixed32(payload, region.id());
    putFixed64(payload, region.length());
    return sendFrame(p, kRegion, payload, region.fd());
  }

  // Fails everything pending for the peer, forgets its regions and queues kPeerLost. The
  // socket is shut down here and closed by the progress thread.
  void markLost(const std::shared_ptr<ShmPeer>& p, const Status& why, bool queue_event = true) {
    if (p->lost.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->imported.clear();
      p->declared.clear();
    }
    ack_cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(p->send_mu);
      if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
    }
    if (queue_event) events_.push(Event{Event::Kind::kPeerLost, p->id, {}, why});
    HXFER_LOG_DEBUG("shm {}: peer {} lost: {}", name_, p->id, why.toString());
  }

  void closePeerFd(const std::shared_ptr<ShmPeer>& p) {
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> send_lock(p->send_mu);
    if (p->fd < 0) return;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p->fd, nullptr);
    fd_peers_.erase(p->fd);
    close(p->fd);
    p->fd = -1;
    for (int fd : p->rx_fds) close(fd);
    p->rx_fds.clear();
  }

  void progressLoop() {
    epoll_event evs[16];
    while (!stop_) {
      int n = epoll_wait(epoll_fd_, evs, 16, 1000);
      if (n < 0 && errno != EINTR) {
        HXFER_LOG_ERROR("shm {}: epoll_wait failed: {}", name_, std::strerror(errno));
        return;
      }
      for (int i = 0; i < n && !stop_; ++i) {
        const int fd = evs[i].data.fd;
        if (fd == wake_fd_) continue;
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
        if (p) readPeer(p);
      }
    }
  }

  void acceptPeers() {
    for (;;) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN (listener is non-blocking) or a transient error
      auto p = std::make_shared<ShmPeer>();
      p->fd = fd;
      p->incoming = true;
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
      }
    }
  }

  void readPeer(const std::shared_ptr<ShmPeer>& p) {
    Status why = OkStatus();
    for (;;) {
      uint8_t buf[64 * 1024];
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
      iovec iov{buf, sizeof(buf)};
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
      if (r == 0) {
        why = Unavailable("peer " + std::to_string(p->id) + " closed the connection");
        break;
      }
      p->rx.insert(p->rx.end(), buf, buf + r);
      why = parseFrames(p);
      if (!why.isOk()) break;
    }
    if (!why.isOk() || p->lost) {
      if (!why.isOk()) markLost(p, why);
      closePeerFd(p);
    }
  }

  Status parseFrames(const std::shared_ptr<ShmPeer>& p) {
    size_t pos = 0;
    Status s = OkStatus();
    while (p->rx.size() - pos >= kHeaderBytes) {
      const uint32_t type = loadFixed32(p->rx.data() + pos);
      const uint32_t len = loadFixed32(p->rx.data() + pos + 4);
      if (len > kMaxMessageBytes + 64) {
        s = Corruption("peer " + std::to_string(p->id) + " sent a frame of " + std::to_string(len) +
                       " bytes (max " + std::to_string(kMaxMessageBytes) + ")");
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

  Status handleFrame(const std::shared_ptr<ShmPeer>& p, uint32_t type,
                     std::span<const uint8_t> payload) {
    Decoder d(payload);
    switch (type) {
      case kHello: {
        uint32_t version = 0;
        RETURN_IF_ERROR(d.getFixed32("hello.version", &version));
        if (version != kProtocolVersion) {
          return Incompatible("peer shm protocol version=" + std::to_string(version) +
                              " != ours=" + std::to_string(kProtocolVersion));
        }
        if (!p->incoming || p->hello_seen) return Corruption("unexpected hello frame");
        p->hello_seen = true;
        {
          std::lock_guard<std::mutex> lock(mu_);
          Bytes ack;
          putFixed32(ack, kProtocolVersion);
          RETURN_IF_ERROR(sendFrame(*p, kHelloAck, ack));
          for (auto& [id, r] : regions_) RETURN_IF_ERROR(sendRegion(*p, *r.region));
          p->ready = true;
        }
        events_.push(Event{Event::Kind::kPeerConnected, p->id, {}, OkStatus()});
        return OkStatus();
      }
      case kHelloAck: {
        uint32_t version = 0;
        RETURN_IF_ERROR(d.getFixed32("hello_ack.version", &version));
        if (p->incoming || version != kProtocolVersion) {
          return Incompatible("unexpected hello_ack (version=" + std::to_string(version) + ")");
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          p->acked = true;
        }
        ack_cv_.notify_all();
        return OkStatus();
      }
      case kRegion: {
        uint32_t id = 0;
        uint64_t length = 0;
        RETURN_IF_ERROR(d.getFixed32("region.id", &id));
        RETURN_IF_ERROR(d.getFixed64("region.length", &length));
        if (p->rx_fds.empty()) {
          return Corruption("region frame id=" + std::to_string(id) + " arrived without its fd");
        }
        int fd = p->rx_fds.front();
        p->rx_fds.pop_front();
        ASSIGN_OR_RETURN(std::shared_ptr<Region> mapped, Region::mapFd(id, fd, length));
        auto g = std::make_shared<RegionGuard>();
        g->id = id;
        g->base = mapped->data();
        g->length = length;
        g->owner = mapped;
        std::shared_ptr<RegionGuard> old;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto& slot = p->imported[id];
          old = std::move(slot);
          slot = g;
        }
        if (old) old->retire();
        return OkStatus();
      }
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
        if (old) old->retire();
        return OkStatus();
      }
      case kMessage:
        events_.push(Event{Event::Kind::kMessage, p->id,
                           std::vector<uint8_t>(payload.begin(), payload.end()), OkStatus()});
        return OkStatus();
      default:
        return Corruption("peer " + std::to_string(p->id) +
                          " sent unknown frame type=" + std::to_string(type));
    }
  }

  Capabilities caps_;
  const std::string name_;
  const int listen_fd_;
  const int epoll_fd_;
  const int wake_fd_;
  std::chrono::milliseconds connect_timeout_{10000};
  std::atomic<bool> stop_{false};

  std::mutex mu_;
  std::condition_variable ack_cv_;
  std::map<uint32_t, LocalRegion> regions_;                     // guarded by mu_
  std::unordered_map<PeerId, std::shared_ptr<ShmPeer>> peers_;  // guarded by mu_
  std::unordered_map<int, std::shared_ptr<ShmPeer>> fd_peers_;  // guarded by mu_
  PeerId next_peer_ = 1;                                        // guarded by mu_
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
  if (efd < 0 || wfd < 0) {
    Status s = ResourceExhausted(errnoText("epoll_create1/eventfd"));
    close(lfd);
    if (efd >= 0) close(efd);
    if (wfd >= 0) close(wfd);
    return s;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = lfd;
  epoll_ctl(efd, EPOLL_CTL_ADD, lfd, &ev);
  ev.data.fd = wfd;
  epoll_ctl(efd, EPOLL_CTL_ADD, wfd, &ev);
  auto agent = std::make_unique<ShmAgent>(name, lfd, efd, wfd);
  agent->setConnectTimeout(config.connect_timeout);
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace hxfer::transport
