// Hostile peers against the shm transport: raw Unix-socket clients and listeners that speak
// the frame format of shm.cc by hand and break the handshake, the bounds and the seals. Each
// case is one finding of the security review (docs/reliability.md, "Threat model"): before the
// authenticated handshake, a process that knew only the socket name received every region's
// memfd, frames were accepted before hello, memfds could be shrunk under a writer, a sparse
// memfd was pre-faulted at its announced size, and nothing bounded a silent connection.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/region.h"
#include "common/coding.h"
#include "device/fake_device.h"
#include "transport/auth.h"
#include "transport/transport.h"

namespace hxfer::transport {
namespace {

using namespace std::chrono_literals;

// The frame types of shm.cc (kept in step by hand: a raw peer is the point of these tests).
enum : uint32_t {
  kHello = 1,
  kChallenge = 2,
  kRegion = 3,
  kMessage = 5,
  kProof = 6,
  kWelcome = 7,
  kRefused = 8,
  kDeviceRegion = 9,
};
constexpr uint32_t kVersion = 3;
constexpr uint32_t kCudaVersion = kVersion | (1u << 16);
constexpr char kToken[] = "the-right-token";

std::string uniqueName(const std::string& what) {
  static int n = 0;
  return "hxfer-hostile-" + what + "-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

sockaddr_un abstractAddr(const std::string& name, socklen_t* len) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return sa;
}

struct Frame {
  uint32_t type = 0;
  std::vector<uint8_t> payload;
  std::vector<int> fds;
};

// One raw connection. Every read is bounded by a timeout; nothing here can hang a test.
class RawPeer {
 public:
  explicit RawPeer(int fd) : fd_(fd) {}
  ~RawPeer() {
    if (fd_ >= 0) close(fd_);
    for (int fd : fds_) close(fd);
  }
  static std::unique_ptr<RawPeer> connectTo(const std::string& address) {
    const std::string name = address.substr(address.find('@') + 1);  // shm:@ or cuda:@
    socklen_t len = 0;
    sockaddr_un sa = abstractAddr(name, &len);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      if (fd >= 0) close(fd);
      return nullptr;
    }
    return std::make_unique<RawPeer>(fd);
  }

  bool send(uint32_t type, const std::vector<uint8_t>& payload, int fd = -1) {
    std::vector<uint8_t> buf(8);
    storeFixed32(buf.data(), type);
    storeFixed32(buf.data() + 4, static_cast<uint32_t>(payload.size()));
    buf.insert(buf.end(), payload.begin(), payload.end());
    iovec iov{buf.data(), buf.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    return sendmsg(fd_, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(buf.size());
  }

  // The next whole frame, or nullopt on EOF / error / timeout (`eof()` tells which).
  std::optional<Frame> read(std::chrono::milliseconds timeout = 3000ms) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (rx_.size() >= 8) {
        const uint32_t len = loadFixed32(rx_.data() + 4);
        if (rx_.size() >= 8 + len) {
          Frame f;
          f.type = loadFixed32(rx_.data());
          f.payload.assign(rx_.begin() + 8, rx_.begin() + 8 + len);
          rx_.erase(rx_.begin(), rx_.begin() + 8 + len);
          if (f.type == kRegion && !fds_.empty()) {
            f.fds.push_back(fds_.front());
            fds_.erase(fds_.begin());
          }
          return f;
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      timeval tv{0, static_cast<suseconds_t>(std::min<int64_t>(left.count(), 900) * 1000)};
      setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      uint8_t buf[4096];
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 8)];
      iovec iov{buf, sizeof(buf)};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      ssize_t r = recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); r > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t k = 0; k < n; ++k) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
            fds_.push_back(fd);
            ++fds_received_;
          }
        }
      }
      if (r <= 0) {
        eof_ = true;
        return std::nullopt;
      }
      rx_.insert(rx_.end(), buf, buf + r);
    }
  }

  // Reads until EOF (true) or the timeout (false), dropping frames.
  bool waitForEof(std::chrono::milliseconds timeout = 3000ms) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!read(100ms) && eof_) return true;
    }
    return false;
  }

  std::vector<uint8_t> hello(const auth::Nonce& nonce, uint32_t version = kVersion) {
    std::vector<uint8_t> p(4);
    storeFixed32(p.data(), version);
    p.insert(p.end(), nonce.begin(), nonce.end());
    return p;
  }

  // Runs the connector's side of the handshake with `token`; true on welcome.
  bool authenticate(const std::string& token, std::vector<uint8_t>* proof_sent = nullptr,
                    uint32_t version = kVersion) {
    auto nonce = auth::randomNonce();
    if (!nonce.isOk() || !send(kHello, hello(*nonce, version))) return false;
    auto ch = read();
    if (!ch || ch->type != kChallenge || ch->payload.size() != 4 + 32 + 32) return false;
    auth::Nonce listener{};
    std::memcpy(listener.data(), ch->payload.data() + 4, 32);
    const auth::Proof proof =
        auth::prove(token, auth::Role::kConnector, *nonce, listener, binding());
    if (proof_sent) proof_sent->assign(proof.begin(), proof.end());
    if (!send(kProof, std::vector<uint8_t>(proof.begin(), proof.end()))) return false;
    auto w = read();
    return w && w->type == kWelcome;
  }

  // What both ends bind their proofs to: the listener's name and ours (unbound: empty).
  std::string binding() const { return auth::shmBinding(name(true), name(false)); }
  std::string name(bool peer) const {
    sockaddr_un sa{};
    socklen_t len = sizeof(sa);
    const int r = peer ? getpeername(fd_, reinterpret_cast<sockaddr*>(&sa), &len)
                       : getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    const socklen_t head = offsetof(sockaddr_un, sun_path);
    return r != 0 || len <= head ? std::string() : std::string(sa.sun_path, len - head);
  }

  int fd() const { return fd_; }
  size_t fdsReceived() const { return fds_received_; }
  bool eof() const { return eof_; }

 private:
  int fd_;
  std::vector<uint8_t> rx_;
  std::vector<int> fds_;
  size_t fds_received_ = 0;
  bool eof_ = false;
};

AgentConfig config(const std::string& label, const std::string& token = kToken) {
  AgentConfig c;
  c.backend = "shm";
  c.label = label;
  c.auth_token = token;
  c.auth_timeout = 2000ms;
  c.connect_timeout = 2000ms;
  return c;
}

std::unique_ptr<Agent> agentOrDie(const AgentConfig& c) {
  auto a = createAgent(c);
  EXPECT_TRUE(a.isOk()) << a.status().toString();
  return a.isOk() ? std::move(*a) : nullptr;
}

std::unique_ptr<Region> memfdRegion(uint32_t id, uint64_t bytes, uint8_t fill) {
  auto r = Region::allocate(id, bytes, Region::Backing::kMemfd, "hostile");
  EXPECT_TRUE(r.isOk());
  std::memset((*r)->data(), fill, bytes);
  return std::move(*r);
}

template <typename Cond>
bool eventually(Cond cond, std::chrono::milliseconds timeout = 3000ms) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return cond();
}

// Finding 1: a process that knew only the socket name mapped a context rank's pools.
TEST(ShmHostile, HelloAloneGetsNoRegionFdAndAWrongProofIsRefused) {
  auto agent = agentOrDie(config("victim"));
  auto region = memfdRegion(1, 1 << 20, 0x5a);
  ASSERT_TRUE(agent->registerRegion(*region, RegionAccess::kRemoteWritable).isOk());
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  auto nonce = auth::randomNonce();
  ASSERT_TRUE(nonce.isOk());
  ASSERT_TRUE(raw->send(kHello, raw->hello(*nonce)));
  auto ch = raw->read();
  ASSERT_TRUE(ch.has_value());
  EXPECT_EQ(ch->type, kChallenge);
  // A proof made with a guessed token: refused, the connection closed, no fd ever sent.
  auth::Nonce listener{};
  std::memcpy(listener.data(), ch->payload.data() + 4, 32);
  const auth::Proof guess =
      auth::prove("guess", auth::Role::kConnector, *nonce, listener, raw->binding());
  ASSERT_TRUE(raw->send(kProof, std::vector<uint8_t>(guess.begin(), guess.end())));
  auto refused = raw->read();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->type, kRefused);
  EXPECT_TRUE(raw->waitForEof());
  EXPECT_EQ(raw->fdsReceived(), 0u);
  EXPECT_TRUE(eventually([&] { return agent->agentStats().auth_failures >= 1; }));
  EXPECT_FALSE(agent->pollEvent(50ms).has_value()) << "no kPeerConnected for a refused peer";
}

// Finding 1 (and the old protocol): a version-1 hello, as the old exploit sent it, gets nothing.
TEST(ShmHostile, OldHelloIsRefusedWithoutAnyFd) {
  auto agent = agentOrDie(config("victim"));
  auto region = memfdRegion(1, 1 << 16, 0);
  ASSERT_TRUE(agent->registerRegion(*region, RegionAccess::kRemoteWritable).isOk());
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  std::vector<uint8_t> v1(4);
  storeFixed32(v1.data(), 1);
  ASSERT_TRUE(raw->send(kHello, v1));
  EXPECT_TRUE(raw->waitForEof());
  EXPECT_EQ(raw->fdsReceived(), 0u);
}

// Finding 1: context ranks exported their own pools, which no peer needs: even an
// authenticated peer receives no fd of a kLocalSource region.
TEST(ShmHostile, LocalSourceRegionsAreNeverExported) {
  auto agent = agentOrDie(config("ctx"));
  auto pool = memfdRegion(1, 1 << 16, 0x11);
  ASSERT_TRUE(agent->registerRegion(*pool, RegionAccess::kLocalSource).isOk());
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->authenticate(kToken));
  auto late = memfdRegion(2, 1 << 16, 0x22);
  ASSERT_TRUE(agent->registerRegion(*late, RegionAccess::kLocalSource).isOk());
  auto exported = memfdRegion(3, 1 << 16, 0x33);
  ASSERT_TRUE(agent->registerRegion(*exported, RegionAccess::kRemoteWritable).isOk());
  auto f = raw->read();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->type, kRegion);
  EXPECT_EQ(loadFixed32(f->payload.data()), 3u) << "only the writable region is exported";
  EXPECT_FALSE(raw->read(200ms).has_value());
  EXPECT_EQ(raw->fdsReceived(), 1u);
}

// Finding 1: region and message frames were accepted before hello.
TEST(ShmHostile, FramesBeforeTheHandshakeAreDroppedWithTheConnection) {
  auto agent = agentOrDie(config("victim"));
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->send(kMessage, {1, 2, 3}));
  EXPECT_TRUE(raw->waitForEof());
  EXPECT_FALSE(agent->pollEvent(100ms).has_value()) << "the message must not be delivered";
  EXPECT_GE(agent->agentStats().unauthenticated_dropped, 1u);
  // A region frame with an fd before hello: dropped too, nothing mapped.
  auto raw2 = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw2, nullptr);
  auto mine = memfdRegion(9, 1 << 16, 0);
  std::vector<uint8_t> region(12);
  storeFixed32(region.data(), 9);
  storeFixed32(region.data() + 4, 1 << 16);
  ASSERT_TRUE(raw2->send(kRegion, region, mine->fd()));
  EXPECT_TRUE(raw2->waitForEof());
  EXPECT_GE(agent->agentStats().unauthenticated_dropped, 2u);
}

// Finding 3: fds parked without region frames are bounded. An authenticated peer sends 17
// fds on message frames (which take none); past kMaxPendingFds (16) it is dropped, counted in
// peers_over_limit, and the fds it parked are closed with it.
TEST(ShmHostile, FdsParkedWithoutRegionFramesAreBoundedAndClosedWithThePeer) {
  auto agent = agentOrDie(config("victim"));
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->authenticate(kToken));
  auto parked = memfdRegion(9, 1 << 12, 0);
  struct stat st {};
  ASSERT_EQ(fstat(parked->fd(), &st), 0);
  // How many descriptors of this process refer to the parked memfd's inode. By path
  // (/proc/self/fd/N), not fstat(N): the victim's thread closes those fds meanwhile, and an
  // fstat racing that close is a data race on the descriptor (ThreadSanitizer reports it).
  auto openCopies = [&] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) {
      struct stat s2 {};
      const std::string path = "/proc/self/fd/" + std::to_string(fd);
      if (stat(path.c_str(), &s2) == 0 && s2.st_ino == st.st_ino && s2.st_dev == st.st_dev) ++n;
    }
    return n;
  };
  const int before = openCopies();
  for (int i = 0; i < 17; ++i) {
    if (!raw->send(kMessage, {static_cast<uint8_t>(i)}, parked->fd())) break;
  }
  EXPECT_TRUE(raw->waitForEof());
  EXPECT_TRUE(eventually([&] { return agent->agentStats().peers_over_limit >= 1; }));
  EXPECT_TRUE(eventually([&] { return openCopies() == before; }))
      << openCopies() - before << " parked fds still open in the victim";
}

// Finding 3: a header announcing a huge frame before authentication is refused at once,
// instead of buffering up to 64 MiB per connection.
TEST(ShmHostile, HugeFrameBeforeAuthenticationIsRefusedAtTheHeader) {
  auto agent = agentOrDie(config("victim"));
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  std::vector<uint8_t> header(8);
  storeFixed32(header.data(), kHello);
  storeFixed32(header.data() + 4, 60u << 20);
  ASSERT_EQ(::send(raw->fd(), header.data(), header.size(), MSG_NOSIGNAL), 8);
  EXPECT_TRUE(raw->waitForEof(1000ms));
}

// Finding 6: a squatter on the address received the memfds and the token.
TEST(ShmHostile, SquatterOnTheAddressGetsNeitherTokenNorRegions) {
  const std::string name = uniqueName("squat");
  socklen_t len = 0;
  sockaddr_un sa = abstractAddr(name, &len);
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(lfd, 0);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&sa), len), 0);
  ASSERT_EQ(listen(lfd, 4), 0);
  std::vector<uint8_t> seen;
  size_t fds_seen = 0;
  std::thread squatter([&] {
    int cfd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (cfd < 0) return;
    RawPeer peer(cfd);
    auto hello = peer.read();
    if (!hello) return;
    seen = hello->payload;
    // Answers with a challenge whose proof it cannot make.
    std::vector<uint8_t> ch(4 + 32 + 32, 0x42);
    storeFixed32(ch.data(), kVersion);
    peer.send(kChallenge, ch);
    while (auto f = peer.read(1000ms))
      seen.insert(seen.end(), f->payload.begin(), f->payload.end());
    fds_seen = peer.fdsReceived();
  });
  auto honest = agentOrDie(config("gen"));
  auto pool = memfdRegion(1, 1 << 16, 0x77);
  ASSERT_TRUE(honest->registerRegion(*pool, RegionAccess::kRemoteWritable).isOk());
  auto peer = honest->connect("shm:@" + name);
  EXPECT_EQ(peer.status().code(), StatusCode::kPermissionDenied) << peer.status().toString();
  EXPECT_NE(peer.status().message().find("does not hold our token"), std::string::npos);
  squatter.join();
  close(lfd);
  EXPECT_EQ(fds_seen, 0u);
  const std::string bytes(seen.begin(), seen.end());
  EXPECT_EQ(bytes.find(kToken), std::string::npos) << "the token must never travel";
}

// Relays every byte (and every fd riding on it) between two connected sockets until one end
// closes or `stop`; counts the fds that crossed it.
void relayBytes(int a, int b, const std::atomic<bool>& stop, std::atomic<size_t>* fds_seen) {
  while (!stop) {
    pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    if (poll(p, 2, 50) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (p[i].revents == 0) continue;
      const int from = i == 0 ? a : b, to = i == 0 ? b : a;
      uint8_t buf[65536];
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
      iovec iov{buf, sizeof(buf)};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
      const ssize_t r = recvmsg(from, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (r <= 0) return;
      std::vector<int> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t k = 0; k < n; ++k) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
            fds.push_back(fd);
          }
        }
      }
      *fds_seen += fds.size();
      msghdr out{};
      iovec oiov{buf, static_cast<size_t>(r)};
      out.msg_iov = &oiov;
      out.msg_iovlen = 1;
      alignas(cmsghdr) char obuf[CMSG_SPACE(sizeof(int) * 16)] = {};
      if (!fds.empty()) {
        out.msg_control = obuf;
        out.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&out);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
      }
      if (sendmsg(to, &out, MSG_NOSIGNAL) != r) return;
      for (int fd : fds) close(fd);
    }
  }
}

// Round 3, finding 1: a process on an address the generation rank connects to relayed the
// hello, challenge and proof between it and the real context rank (or reflected them off the
// generation rank's own listener), passed as authenticated and received the generation rank's
// pool memfds read-write. The proofs are now bound to the sockets' names: the two connections
// of a relay have different ones, so neither end's proof verifies and no fd crosses.
TEST(ShmHostile, RelayOrReflectionOfTheHandshakeIsRefusedAndGetsNoRegion) {
  auto ctx = agentOrDie(config("ctx"));
  auto gen = agentOrDie(config("gen"));
  auto pool = memfdRegion(1, 1 << 16, 0x77);
  ASSERT_TRUE(gen->registerRegion(*pool, RegionAccess::kRemoteWritable).isOk());
  for (Agent* target : {ctx.get(), gen.get()}) {
    const std::string name = uniqueName("relay");
    socklen_t len = 0;
    sockaddr_un sa = abstractAddr(name, &len);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(lfd, 0);
    ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&sa), len), 0);
    ASSERT_EQ(listen(lfd, 4), 0);
    std::atomic<bool> stop{false};
    std::atomic<size_t> fds_seen{0};
    std::thread relay([&] {
      int in = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (in < 0) return;
      auto out = RawPeer::connectTo(target->localAddress());
      if (out) relayBytes(in, out->fd(), stop, &fds_seen);
      close(in);
    });
    const uint64_t failures_before = target->agentStats().auth_failures;
    auto peer = gen->connect("shm:@" + name);
    EXPECT_EQ(peer.status().code(), StatusCode::kPermissionDenied) << peer.status().toString();
    stop = true;
    relay.join();
    close(lfd);
    EXPECT_EQ(fds_seen.load(), 0u) << "a region fd reached the relay";
    EXPECT_TRUE(eventually([&] { return target->agentStats().auth_failures > failures_before; }));
  }
  // The same agents, connected directly, authenticate.
  EXPECT_TRUE(gen->connect(ctx->localAddress()).isOk());
}

// Finding 6: the token was a replayable bearer secret. A recorded proof fails against the
// fresh nonce of the next connection.
TEST(ShmHostile, ReplayedProofIsRefused) {
  auto agent = agentOrDie(config("victim"));
  std::vector<uint8_t> recorded;
  {
    auto first = RawPeer::connectTo(agent->localAddress());
    ASSERT_NE(first, nullptr);
    ASSERT_TRUE(first->authenticate(kToken, &recorded));
  }
  auto replay = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(replay, nullptr);
  auto nonce = auth::randomNonce();
  ASSERT_TRUE(nonce.isOk());
  ASSERT_TRUE(replay->send(kHello, replay->hello(*nonce)));
  ASSERT_TRUE(replay->read().has_value());
  ASSERT_TRUE(replay->send(kProof, recorded));
  auto answer = replay->read();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->type, kRefused);
  EXPECT_TRUE(replay->waitForEof());
}

// Honest agents with different tokens never connect, in either role.
TEST(ShmHostile, AgentsWithDifferentTokensRefuseEachOther) {
  auto listener = agentOrDie(config("ctx", "one"));
  auto connector = agentOrDie(config("gen", "two"));
  auto peer = connector->connect(listener->localAddress());
  EXPECT_EQ(peer.status().code(), StatusCode::kPermissionDenied) << peer.status().toString();
  EXPECT_TRUE(eventually([&] { return listener->agentStats().auth_failures >= 1; }));
  EXPECT_FALSE(listener->pollEvent(50ms).has_value());
  auto same = agentOrDie(config("gen2", "one"));
  auto ok = same->connect(listener->localAddress());
  EXPECT_TRUE(ok.isOk()) << ok.status().toString();
}

// A raw peer that authenticates, then shares the given fd as region `id` of `length` bytes,
// then sends one message so the agent has provably handled the region frame.
struct Sharer {
  std::unique_ptr<RawPeer> raw;
  bool share(Agent& agent, int fd, uint32_t id, uint64_t length) {
    raw = RawPeer::connectTo(agent.localAddress());
    if (!raw || !raw->authenticate(kToken)) return false;
    std::vector<uint8_t> p;
    putFixed32(p, id);
    putFixed64(p, length);
    if (!raw->send(kRegion, p, fd)) return false;
    (void)raw->send(kMessage, {7});  // fails when the agent already dropped us: that is fine
    return true;
  }
};

// Finding 5: an authenticated peer shrank its memfd and killed the writer with SIGBUS. Our
// own memfds are sealed; an unsealed one is refused on import.
TEST(ShmHostile, UnsealedMemfdIsRefusedAndOurOwnCannotShrink) {
  auto ours = memfdRegion(1, 1 << 16, 0);
  EXPECT_NE(ftruncate(ours->fd(), 4096), 0) << "our memfds are sealed against shrinking";
  EXPECT_EQ(errno, EPERM);

  auto agent = agentOrDie(config("ctx"));
  int fd = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 16), 0);
  Sharer s;
  ASSERT_TRUE(s.share(*agent, fd, 5, 1 << 16));
  auto connected = agent->pollEvent(2000ms);
  ASSERT_TRUE(connected.has_value());
  ASSERT_EQ(connected->kind, Event::Kind::kPeerConnected);
  const PeerId peer = connected->peer;
  EXPECT_TRUE(s.raw->waitForEof()) << "the peer is dropped";
  EXPECT_EQ(agent->addRemoteRegion(peer, 5, 1 << 16, {}).code(), StatusCode::kUnavailable);
  close(fd);
}

uint64_t rssBytes() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      uint64_t kb = 0;
      f >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

// Finding 3: a sparse 1 GiB memfd was mapped with MAP_POPULATE and charged 1 GB to the victim.
TEST(ShmHostile, SparseMemfdIsMappedLazily) {
  constexpr uint64_t kGiB = 1ull << 30;
  auto agent = agentOrDie(config("ctx"));
  int fd = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kGiB), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  const uint64_t before = rssBytes();
  Sharer s;
  ASSERT_TRUE(s.share(*agent, fd, 5, kGiB));
  auto connected = agent->pollEvent(2000ms);
  ASSERT_TRUE(connected.has_value() && connected->kind == Event::Kind::kPeerConnected);
  auto msg = agent->pollEvent(5000ms);
  ASSERT_TRUE(msg.has_value());
  ASSERT_EQ(msg->kind, Event::Kind::kMessage) << "the region frame was handled before it";
  EXPECT_TRUE(agent->addRemoteRegion(connected->peer, 5, kGiB, {}).isOk());
  EXPECT_LT(rssBytes(), before + (64ull << 20)) << "a sparse region must not be populated";
  close(fd);
}

// Finding 3: no limit or timeout for connections that never say hello.
TEST(ShmHostile, SilentConnectionsAreClosedAndCapped) {
  AgentConfig c = config("victim");
  c.auth_timeout = 300ms;
  c.max_unauthenticated = 3;
  auto agent = agentOrDie(c);
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 8; ++i) {
    silent.push_back(RawPeer::connectTo(agent->localAddress()));
    ASSERT_NE(silent.back(), nullptr);
  }
  EXPECT_TRUE(eventually([&] { return agent->agentStats().connections_refused >= 5; }))
      << agent->agentStats().connections_refused;
  for (auto& s : silent) EXPECT_TRUE(s->waitForEof(3000ms)) << "closed at accept or timeout";
  EXPECT_GE(agent->agentStats().auth_failures, 3u) << "the three admitted ones timed out";
  // With the silent ones gone an honest peer gets in.
  auto honest = agentOrDie(config("gen"));
  EXPECT_TRUE(honest->connect(agent->localAddress()).isOk());
}

// A silent connection accepted by a caller serving the sockets in pollEvent, while the socket
// thread sleeps its one-second timer, is still closed at its 300 ms handshake deadline: the
// accept wakes the socket thread to take the short timer (without it, the close came at that
// thread's next wake-up, about a second after it began to sleep).
TEST(ShmHostile, ASilentConnectionAcceptedByAPollingCallerClosesOnTime) {
  AgentConfig c = config("victim");
  c.auth_timeout = 300ms;
  auto agent = agentOrDie(c);
  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop) (void)agent->pollEvent(2000ms);
  });
  std::this_thread::sleep_for(50ms);
  auto silent = RawPeer::connectTo(agent->localAddress());
  EXPECT_NE(silent, nullptr);
  if (silent) {
    EXPECT_TRUE(silent->waitForEof(750ms)) << "not closed within 750 ms of connecting";
  }
  stop = true;
  agent->wakeEventWaiter();
  poller.join();
  EXPECT_GE(agent->agentStats().auth_failures, 1u);
}

// Whether the other end of `fd` closed it (checked without waiting).
bool closedByTheListener(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  char b;
  return (p.revents & (POLLHUP | POLLERR)) != 0 || recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// Round 3, finding 7: 40 silent connections, each re-opened as soon as it is closed, locked
// every honest peer out while newcomers were refused. The oldest unauthenticated connection now
// makes room, so an honest peer that authenticates promptly gets in during the flood.
TEST(ShmHostile, SilentConnectionFloodDoesNotLockOutAnHonestPeer) {
  auto agent = agentOrDie(config("victim"));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reopened{0};
  std::thread flood([&] {
    std::vector<std::unique_ptr<RawPeer>> silent(40);
    while (!stop) {
      for (auto& r : silent) {
        if (r && !closedByTheListener(r->fd())) continue;
        r = RawPeer::connectTo(agent->localAddress());
        ++reopened;
      }
      std::this_thread::sleep_for(1ms);
    }
  });
  int honest = 0;
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < end) {
    AgentConfig c = config("gen");
    c.connect_timeout = 2000ms;
    auto gen = agentOrDie(c);
    if (gen->connect(agent->localAddress()).isOk()) ++honest;
    std::this_thread::sleep_for(200ms);
  }
  stop = true;
  flood.join();
  EXPECT_GT(reopened.load(), 80u) << "the flood never got going";
  EXPECT_GT(agent->agentStats().connections_refused, 40u);
  EXPECT_GE(honest, 3) << "honest peers were locked out";
}

// Finding 3: at the fd limit the listener spun at 100 % CPU (the pending connection stays
// queued and the listening socket stays readable) and the queued connections were never
// answered. Now the agent spends its spare fd to take each one off the queue and close it,
// counted in connections_refused; once fds are free again an honest peer gets in.
TEST(ShmHostile, ConnectionsAtTheFdLimitAreClosedNotLeftQueued) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizer runtimes open files of their own (UBSan reads /proc/self/maps to check a
  // vptr), so they fail spuriously while the process is out of descriptors.
  GTEST_SKIP() << "needs a build without sanitizers: their runtimes need file descriptors";
#endif
  auto agent = agentOrDie(config("victim"));
  const std::string name = agent->localAddress().substr(std::string("shm:@").size());
  const uint64_t refused_before = agent->agentStats().connections_refused;
  // Client sockets first: once the process is out of fds none could be made.
  std::vector<int> clients;
  for (int i = 0; i < 3; ++i) {
    clients.push_back(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_GE(clients.back(), 0);
  }
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  // Fill every free descriptor below a low soft limit.
  std::vector<int> filler;
  int highest = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (fcntl(fd, F_GETFD) != -1) highest = fd;
  }
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(highest + 16);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  for (;;) {
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    filler.push_back(fd);
  }
  ASSERT_EQ(errno, EMFILE);
  for (int fd : clients) {
    socklen_t len = 0;
    sockaddr_un sa = abstractAddr(name, &len);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), len), 0) << strerror(errno);
  }
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int fd : clients) peers.push_back(std::make_unique<RawPeer>(fd));
  for (auto& p : peers) EXPECT_TRUE(p->waitForEof(3000ms)) << "left queued at the fd limit";
  EXPECT_GE(agent->agentStats().connections_refused, refused_before + clients.size());
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  // Once fds are free an honest peer gets in. The victim may still be finishing the refusals
  // of the queued connections when it first tries (a reset), so it may take a second attempt;
  // it must not take more than a few.
  auto honest = agentOrDie(config("gen"));
  Status last;
  int attempts = 0;
  for (; attempts < 5; ++attempts) {
    auto c = honest->connect(agent->localAddress());
    if (c.isOk()) break;
    last = c.status();
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_LT(attempts, 5) << last.toString();
}

// Finding 4: a peer that stops reading wedged the context rank. Engine sends went out under
// the engine lock over blocking sockets, so every send to that peer waited out connect_timeout
// while the progress thread, markReady and every other peer's messages queued behind the lock.
// Now a send never waits: what the peer does not read is queued, a queue over
// max_send_queue_bytes disconnects the peer, and an honest peer sharing the "engine lock"
// keeps its round trips going the whole time.
TEST(ShmHostile, PeerThatStopsReadingIsDroppedAtItsQueueBoundWhileOthersKeepTalking) {
  AgentConfig c = config("ctx");
  c.max_send_queue_bytes = 8 << 20;
  c.send_stall_timeout = 120s;  // only the byte bound acts here
  auto victim = agentOrDie(c);
  auto honest = agentOrDie(config("gen"));
  ASSERT_TRUE(victim && honest);
  auto to_victim = honest->connect(victim->localAddress());
  ASSERT_TRUE(to_victim.isOk()) << to_victim.status().toString();
  auto first = victim->pollEvent(2000ms);
  ASSERT_TRUE(first.has_value() && first->kind == Event::Kind::kPeerConnected);
  const PeerId honest_peer = first->peer;
  auto raw = RawPeer::connectTo(victim->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->authenticate(kToken));
  auto second = victim->pollEvent(2000ms);
  ASSERT_TRUE(second.has_value() && second->kind == Event::Kind::kPeerConnected);
  const PeerId silent_peer = second->peer;

  // The victim's "engine": one lock around every send, one thread answering the honest peer.
  std::mutex engine_mu;
  std::atomic<bool> stop{false};
  std::atomic<bool> silent_lost{false};
  std::atomic<bool> honest_lost{false};
  std::thread echo([&] {
    while (!stop) {
      auto e = victim->pollEvent(50ms);
      if (!e) continue;
      if (e->kind == Event::Kind::kPeerLost)
        (e->peer == silent_peer ? silent_lost : honest_lost) = true;
      if (e->kind == Event::Kind::kMessage && e->peer == honest_peer) {
        std::lock_guard<std::mutex> lock(engine_mu);
        (void)victim->sendMessage(honest_peer, e->payload);
      }
    }
  });
  std::atomic<bool> stop_ping{false};  // the pinger stops first: its last pong still comes
  std::atomic<int> round_trips{0};
  std::atomic<int64_t> slowest_ms{0};
  std::atomic<bool> honest_failed{false};
  std::thread pinger([&] {
    for (uint32_t i = 0; !stop_ping; ++i) {
      std::vector<uint8_t> ping(4);
      storeFixed32(ping.data(), i);
      const auto start = std::chrono::steady_clock::now();
      if (!honest->sendMessage(*to_victim, ping).isOk()) {
        honest_failed = true;
        return;
      }
      auto pong = honest->pollEvent(5000ms);
      if (!pong || pong->kind != Event::Kind::kMessage || pong->payload != ping) {
        honest_failed = true;
        return;
      }
      const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now() - start)
                             .count();
      slowest_ms = std::max<int64_t>(slowest_ms, ms);
      ++round_trips;
    }
  });

  // Flood the silent peer under the same lock. No call may wait for it.
  const std::vector<uint8_t> big(1 << 20, 0xab);
  Status s = OkStatus();
  int sent = 0;
  auto slowest_send = std::chrono::steady_clock::duration::zero();
  for (; sent < 1000 && s.isOk(); ++sent) {
    const auto start = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(engine_mu);
      s = victim->sendMessage(silent_peer, big);
    }
    slowest_send = std::max(slowest_send, std::chrono::steady_clock::now() - start);
  }
  EXPECT_LT(slowest_send, 1s) << "a send waited for a peer that does not read";
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
  EXPECT_NE(s.message().find("max_send_queue_bytes"), std::string::npos) << s.toString();
  EXPECT_LE(sent, 64) << "the bound (8 MiB of 1 MiB messages) should have acted long before";
  EXPECT_EQ(victim->agentStats().peers_over_limit, 1u);
  EXPECT_EQ(victim->sendMessage(silent_peer, big).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(eventually([&] { return silent_lost.load(); }, 10000ms)) << "kPeerLost follows";
  EXPECT_TRUE(raw->waitForEof(10000ms)) << "the silent peer is disconnected";
  // The honest peer kept going through all of it, and still does.
  const int before = round_trips;
  EXPECT_TRUE(eventually([&] { return round_trips >= before + 20 || honest_failed; }, 20000ms));
  stop_ping = true;
  pinger.join();
  stop = true;
  echo.join();
  EXPECT_FALSE(honest_failed) << "the honest peer's exchange broke";
  EXPECT_FALSE(honest_lost) << "the honest peer must not be dropped";
  EXPECT_GE(round_trips, 20);
  EXPECT_LT(slowest_ms, 2000) << "an honest round trip waited behind the silent peer";
}

// Finding 4, the stopped honest rank (SIGSTOP): it reads nothing, but the victim sends too
// little to reach the byte bound. The peer is dropped once send_stall_timeout passes with no
// byte of its queue read, and the send that queued never waited.
TEST(ShmHostile, PeerThatReadsNothingForTheStallTimeoutIsDropped) {
  AgentConfig c = config("ctx");
  c.send_stall_timeout = 500ms;
  auto victim = agentOrDie(c);
  auto raw = RawPeer::connectTo(victim->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->authenticate(kToken));
  auto connected = victim->pollEvent(2000ms);
  ASSERT_TRUE(connected.has_value() && connected->kind == Event::Kind::kPeerConnected);
  const std::vector<uint8_t> big(4 << 20, 0xcd);  // more than a socket buffer holds
  const auto start = std::chrono::steady_clock::now();
  Status s = victim->sendMessage(connected->peer, big);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the send waited for the peer";
  EXPECT_TRUE(s.isOk()) << s.toString();
  std::optional<Event> lost;
  EXPECT_TRUE(eventually(
      [&] {
        lost = victim->pollEvent(10ms);
        return lost && lost->kind == Event::Kind::kPeerLost;
      },
      20000ms));
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->peer, connected->peer);
  EXPECT_NE(lost->status.message().find("send_stall_timeout"), std::string::npos)
      << lost->status.toString();
  EXPECT_EQ(victim->agentStats().peers_over_limit, 1u);
  EXPECT_EQ(victim->sendMessage(connected->peer, big).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(raw->waitForEof(10000ms));
}

// Finding 7: when the side that exported a region dropped the connection itself, its
// kPeerLost (which ends the engine's page fences) came at once while the writer's copy thread
// was still inside a segment: thousands of ops landed in released pages. Now kPeerLost waits
// until the writer closed its end, which it does only after its copies stopped.
TEST(ShmHostile, NoWriteLandsAfterTheExporterSawPeerLost) {
  constexpr uint64_t kBytes = 128ull << 20;  // one segment: ~20 ms of memcpy (seconds in TSan)
  constexpr uint64_t kTail = 1 << 20;
  constexpr uint8_t kSentinel = 0xee;
  // Regions first: they outlive the agents, whose copy thread may still read them on a failure.
  auto src = memfdRegion(1, kBytes, 0x01);
  auto dst = memfdRegion(2, kBytes, 0x00);
  auto writer = agentOrDie(config("ctx"));
  auto exporter = agentOrDie(config("gen"));
  ASSERT_TRUE(writer->registerRegion(*src, RegionAccess::kLocalSource).isOk());
  ASSERT_TRUE(exporter->registerRegion(*dst, RegionAccess::kRemoteWritable).isOk());
  auto to_writer = exporter->connect(writer->localAddress());
  ASSERT_TRUE(to_writer.isOk()) << to_writer.status().toString();
  auto connected = writer->pollEvent(2000ms);
  ASSERT_TRUE(connected.has_value() && connected->kind == Event::Kind::kPeerConnected);
  // The region frame follows the welcome: the engine waits for the Hello; here, for the fd.
  ASSERT_TRUE(
      eventually([&] { return writer->addRemoteRegion(connected->peer, 2, kBytes, {}).isOk(); }));
  auto t = writer->postWrite(connected->peer, {WriteOp{1, 0, 2, 0, kBytes}});
  ASSERT_TRUE(t.isOk());
  ASSERT_TRUE(exporter->disconnect(*to_writer).isOk());
  // It comes once the copy ended: allow for a slow (sanitized) memcpy.
  auto lost = exporter->pollEvent(120000ms);
  ASSERT_TRUE(lost.has_value());
  ASSERT_EQ(lost->kind, Event::Kind::kPeerLost);
  // The engine would now release the pages and hand them to the next request.
  std::memset(dst->data() + kBytes - kTail, kSentinel, kTail);
  (void)t->waitFor(120000ms);
  EXPECT_NE(t->poll(), TransferState::kInProgress);
  std::this_thread::sleep_for(20ms);
  const uint64_t overwritten = std::count_if(dst->data() + kBytes - kTail, dst->data() + kBytes,
                                             [](uint8_t b) { return b != kSentinel; });
  EXPECT_EQ(overwritten, 0u) << "bytes written into released pages after kPeerLost";
}

// Same uid unless configured: a process of another uid is refused at accept (root only: the
// test drops to nobody in a forked child).
TEST(ShmHostile, ProcessOfAnotherUidIsRefused) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  // Fork before any agent thread exists; the child learns the address through a pipe.
  int addr_pipe[2];
  ASSERT_EQ(pipe(addr_pipe), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(addr_pipe[1]);
    char buf[256];
    const ssize_t n = ::read(addr_pipe[0], buf, sizeof(buf));
    if (n <= 0) _exit(9);
    const std::string address(buf, static_cast<size_t>(n));
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    auto raw = RawPeer::connectTo(address);
    if (!raw) _exit(11);
    auto nonce = auth::randomNonce();
    if (!nonce.isOk()) _exit(12);
    raw->send(kHello, raw->hello(*nonce));
    // Closed without a challenge: exit 0. A challenge means the uid check is missing.
    auto f = raw->read(2000ms);
    _exit(f.has_value() ? 13 : (raw->eof() ? 0 : 14));
  }
  close(addr_pipe[0]);
  auto agent = agentOrDie(config("victim"));
  auto region = memfdRegion(1, 1 << 16, 0);
  ASSERT_TRUE(agent->registerRegion(*region, RegionAccess::kRemoteWritable).isOk());
  const std::string address = agent->localAddress();
  ASSERT_EQ(::write(addr_pipe[1], address.data(), address.size()),
            static_cast<ssize_t>(address.size()));
  close(addr_pipe[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(eventually([&] { return agent->agentStats().auth_failures >= 1; }));
}

// The cuda backend's device-region frame from an authenticated but hostile peer: every field
// that does not parse or does not fit is refused before anything is mapped, the peer is
// dropped, its fd is closed, and no region of it becomes a write target. A well-formed frame
// (the control) is mapped.
TEST(CudaHostile, DeviceRegionFramesThatDoNotParseOrFitAreRefused) {
  auto fake = std::make_shared<device::FakeDevice>();
  AgentConfig c = config("cuda-victim");
  c.backend = "cuda";
  c.device = fake;
  auto agent = agentOrDie(c);
  ASSERT_NE(agent, nullptr);
  constexpr uint64_t kAlloc = 1 << 16;
  auto memory = fake->allocate(0, kAlloc);
  ASSERT_TRUE(memory.isOk());

  struct Case {
    std::string name;
    uint32_t kind = 1;
    uint64_t length = 4096, allocation = kAlloc, offset = 0;
    size_t handle_bytes = 0;
    bool with_fd = true;
    bool truncated = false;
    bool trailing = false;
    bool mapped = false;  // the control
  };
  const std::vector<Case> cases = {
      {"well formed", 1, 4096, kAlloc, 0, 0, true, false, false, true},
      {"handle kind 7", 7},
      {"handle kind 0", 0},
      {"handle of 65 bytes", 1, 4096, kAlloc, 0, 65},
      {"posix fd without its fd", 1, 4096, kAlloc, 0, 0, false},
      {"range past its allocation", 1, kAlloc, kAlloc, 4096},
      {"allocation larger than the fd", 1, 4096, kAlloc * 4, 0},
      {"offset overflowing", 1, 4096, kAlloc, UINT64_MAX - 10},
      {"truncated before the uuid", 1, 4096, kAlloc, 0, 0, true, true},
      {"trailing bytes", 1, 4096, kAlloc, 0, 0, true, false, true},
      {"legacy IPC on the fake", 2, 4096, kAlloc, 0, 64, false},
  };
  uint32_t id = 100;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    auto raw = RawPeer::connectTo(agent->localAddress());
    ASSERT_NE(raw, nullptr);
    ASSERT_TRUE(raw->authenticate(kToken, nullptr, kCudaVersion));
    auto connected = agent->pollEvent(2000ms);
    while (connected && connected->kind == Event::Kind::kPeerLost) {  // an earlier case's
      connected = agent->pollEvent(2000ms);
    }
    ASSERT_TRUE(connected.has_value() && connected->kind == Event::Kind::kPeerConnected);
    std::vector<uint8_t> p;
    putFixed32(p, ++id);
    putFixed64(p, k.length);
    putFixed32(p, k.kind);
    putFixed64(p, k.allocation);
    putFixed64(p, k.offset);
    if (!k.truncated) {
      p.resize(p.size() + 16, 0xfa);
      putLengthPrefixed(p, std::vector<uint8_t>(k.handle_bytes, 0x11));
      if (k.trailing) p.push_back(0);
    }
    int fd = -1;
    if (k.with_fd) {
      auto range = fake->exportRange((*memory)->data(), 4096);
      ASSERT_TRUE(range.isOk());
      fd = dup(range->fd);
    }
    ASSERT_TRUE(raw->send(kDeviceRegion, p, fd));
    if (fd >= 0) close(fd);  // the agent holds its own copy now, or closed it
    // A refused frame may drop the peer before this send: only the control must get it out.
    const bool sent = raw->send(kMessage, {7});
    if (k.mapped) {
      ASSERT_TRUE(sent);
      auto msg = agent->pollEvent(2000ms);
      ASSERT_TRUE(msg.has_value() && msg->kind == Event::Kind::kMessage);
      EXPECT_TRUE(agent->addRemoteRegion(connected->peer, id, k.length, {}).isOk());
      continue;
    }
    EXPECT_TRUE(raw->waitForEof()) << "the peer is dropped";
    EXPECT_NE(agent->addRemoteRegion(connected->peer, id, k.length, {}).code(), StatusCode::kOk);
  }
  // A host region frame (a memfd) is no device region: refused as well.
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  ASSERT_TRUE(raw->authenticate(kToken, nullptr, kCudaVersion));
  auto host = memfdRegion(9, 4096, 0);
  std::vector<uint8_t> p;
  putFixed32(p, 9);
  putFixed64(p, 4096);
  ASSERT_TRUE(raw->send(kRegion, p, host->fd()));
  EXPECT_TRUE(raw->waitForEof());
}

// A shm hello at a cuda agent (and the reverse) is answered with the listener's version only:
// no nonce, no proof, no fd, and the connection closes.
TEST(CudaHostile, AHelloOfTheOtherBackendGetsOnlyTheVersion) {
  AgentConfig c = config("cuda-listener");
  c.backend = "cuda";
  c.device = std::make_shared<device::FakeDevice>();
  auto agent = agentOrDie(c);
  ASSERT_NE(agent, nullptr);
  auto raw = RawPeer::connectTo(agent->localAddress());
  ASSERT_NE(raw, nullptr);
  auto nonce = auth::randomNonce();
  ASSERT_TRUE(nonce.isOk());
  ASSERT_TRUE(raw->send(kHello, raw->hello(*nonce, kVersion)));
  auto ch = raw->read();
  ASSERT_TRUE(ch.has_value());
  EXPECT_EQ(ch->type, kChallenge);
  ASSERT_EQ(ch->payload.size(), 4u + 32 + 32);
  EXPECT_EQ(loadFixed32(ch->payload.data()), kCudaVersion);
  EXPECT_TRUE(
      std::all_of(ch->payload.begin() + 4, ch->payload.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(raw->waitForEof());
  EXPECT_EQ(raw->fdsReceived(), 0u);
}

}  // namespace
}  // namespace hxfer::transport
