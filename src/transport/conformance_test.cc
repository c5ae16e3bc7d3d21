// Conformance suite: the same contract tests (transport.h) over every backend: inproc, shm,
// cuda over the host fake of the device seam (its regions allocated as fake device memory),
// ucx with active messages and ucx with put, both over TCP (set through the agent config, not
// the environment, so the tests are hermetic). Deadlines are generous and nothing is timed:
// these run on loaded machines.
#include <dirent.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

#include <algorithm>

#include "common/coding.h"
#include "device/fake_device.h"
#include "transport/local_common.h"
#include "transport/transport.h"

namespace hxfer::transport {
namespace {

using namespace std::chrono_literals;

constexpr auto kDeadline = 30s;

struct BackendCase {
  std::string name;  // test-name suffix
  std::string backend;
  UcxMode mode = UcxMode::kAuto;
  bool device = false;  // regions are device memory (of a FakeDevice)
};

AgentConfig plainConfig(const std::string& backend) {
  AgentConfig config;
  config.backend = backend;
  return config;
}

AgentConfig configFor(const BackendCase& c, const std::string& label,
                      std::shared_ptr<device::FakeDevice> fake = nullptr) {
  AgentConfig config;
  config.backend = c.backend;
  config.device = std::move(fake);
  config.label = label;
  config.ucx_mode = c.mode;
  if (c.backend == "ucx") config.ucx_options = {{"TLS", "tcp"}};
  // Every agent of the suite shares one token, so the authenticating backends (shm, ucx) run
  // their real handshake in every case.
  config.auth_token = "conformance-token";
  return config;
}

// A test's region; device memory stays allocated until the region is gone.
struct RegionDeleter {
  std::shared_ptr<Region> allocation;  // the fake device's memory a borrowed region lies in
  void operator()(Region* r) const { delete r; }
};
using TestRegion = std::unique_ptr<Region, RegionDeleter>;

// Host memory (memfd), or device memory of `fake` when given.
TestRegion allocateRegion(uint32_t id, uint64_t length, device::FakeDevice* fake = nullptr) {
  if (fake == nullptr) {
    auto r = Region::allocate(id, length, Region::Backing::kMemfd, "conformance");
    EXPECT_TRUE(r.isOk()) << r.status().toString();
    return TestRegion(r.isOk() ? std::move(r).value().release() : nullptr);
  }
  auto a = fake->allocate(0, length);
  EXPECT_TRUE(a.isOk()) << a.status().toString();
  if (!a.isOk()) return nullptr;
  auto r = Region::borrow(id, (*a)->data(), length);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  return TestRegion(r.isOk() ? std::move(r).value().release() : nullptr, RegionDeleter{*a});
}

TestRegion makeRegion(uint32_t id, uint64_t length) { return allocateRegion(id, length); }

void fillPattern(Region& r, uint8_t salt) {
  for (uint64_t i = 0; i < r.length(); ++i) r.data()[i] = static_cast<uint8_t>(i * 131 + salt);
}

std::optional<Event> waitForEvent(Agent& agent, Event::Kind kind,
                                  std::chrono::milliseconds timeout = kDeadline) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto e = agent.pollEvent(100ms);
    if (e && e->kind == kind) return e;
  }
  return std::nullopt;
}

// Publishes (id, length, key) of a region, the way the engine does inside RankInfo.
Bytes encodeRegionKey(const Region& r, const std::vector<uint8_t>& key) {
  Bytes out;
  putFixed32(out, r.id());
  putFixed64(out, r.length());
  putLengthPrefixed(out, std::span<const uint8_t>(key));
  return out;
}

struct RegionKey {
  uint32_t id = 0;
  uint64_t length = 0;
  Bytes key;
};

RegionKey decodeRegionKey(const std::vector<uint8_t>& bytes) {
  RegionKey k;
  Decoder d(bytes);
  EXPECT_TRUE(d.getFixed32("id", &k.id).isOk());
  EXPECT_TRUE(d.getFixed64("length", &k.length).isOk());
  EXPECT_TRUE(d.getBytes("key", 1 << 20, &k.key).isOk());
  return k;
}

size_t countOpenFds() {
  size_t n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

class Conformance : public ::testing::TestWithParam<BackendCase> {
 protected:
  // The device of the cuda case: declared first, so it outlives the agents and regions.
  std::shared_ptr<device::FakeDevice> fake_ = std::make_shared<device::FakeDevice>();

  device::FakeDevice* deviceOrNull() const { return GetParam().device ? fake_.get() : nullptr; }
  AgentConfig config(const std::string& label) const {
    return configFor(GetParam(), label, GetParam().device ? fake_ : nullptr);
  }
  TestRegion makeRegion(uint32_t id, uint64_t length) const {
    return allocateRegion(id, length, deviceOrNull());
  }

  std::unique_ptr<Agent> makeAgent(const std::string& label) {
    auto a = createAgent(config(label));
    EXPECT_TRUE(a.isOk()) << a.status().toString();
    return a.isOk() ? std::move(a).value() : nullptr;
  }

  // writer -> receiver connection; the receiver learns the writer from kPeerConnected.
  void connectPair() {
    writer_ = makeAgent("writer");
    receiver_ = makeAgent("receiver");
    ASSERT_TRUE(writer_ && receiver_);
    auto peer = writer_->connect(receiver_->localAddress());
    ASSERT_TRUE(peer.isOk()) << peer.status().toString();
    to_receiver_ = *peer;
    auto e = waitForEvent(*receiver_, Event::Kind::kPeerConnected);
    ASSERT_TRUE(e.has_value());
    to_writer_ = e->peer;
  }

  // The receiver registers `r` and sends its key; the writer adds it on arrival.
  void shareRegion(const Region& r, uint64_t declared_length = 0) {
    auto key = receiver_->registerRegion(r, RegionAccess::kRemoteWritable);
    ASSERT_TRUE(key.isOk()) << key.status().toString();
    Bytes msg = encodeRegionKey(r, *key);
    ASSERT_TRUE(receiver_->sendMessage(to_writer_, msg).isOk());
    auto e = waitForEvent(*writer_, Event::Kind::kMessage);
    ASSERT_TRUE(e.has_value());
    RegionKey k = decodeRegionKey(e->payload);
    EXPECT_EQ(k.id, r.id());
    Status s = writer_->addRemoteRegion(to_receiver_, k.id,
                                        declared_length ? declared_length : k.length, k.key);
    ASSERT_TRUE(s.isOk()) << s.toString();
  }

  void setUpRegions(uint64_t length) {
    src_ = makeRegion(1, length);
    dst_ = makeRegion(7, length);
    fillPattern(*src_, 3);
    std::memset(dst_->data(), 0, dst_->length());
    ASSERT_TRUE(writer_->registerRegion(*src_, RegionAccess::kLocalSource).isOk());
    shareRegion(*dst_);
  }

  std::unique_ptr<Agent> writer_, receiver_;
  PeerId to_receiver_ = 0, to_writer_ = 0;
  TestRegion src_, dst_;
};

TEST_P(Conformance, WriteIsVisibleAtTheDestinationOnceDone) {
  connectPair();
  setUpRegions(1 << 20);
  auto t = writer_->postWrite(to_receiver_, {{1, 4096, 7, 8192, 100000}});
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(t->poll(), TransferState::kDone);
  EXPECT_EQ(t->bytes(), 100000u);
  EXPECT_EQ(std::memcmp(dst_->data() + 8192, src_->data() + 4096, 100000), 0);
  EXPECT_EQ(dst_->data()[8191], 0);
  EXPECT_EQ(dst_->data()[8192 + 100000], 0);
}

TEST_P(Conformance, ManySmallOpsAndFewLargeOpsLandTheSameBytes) {
  connectPair();
  constexpr uint64_t kLen = 2 << 20;
  setUpRegions(kLen);
  // Small ops scatter 512-byte records in reverse order; large ops move 4 quarters.
  constexpr uint64_t kRec = 512;
  std::vector<WriteOp> small;
  for (uint64_t i = 0; i < kLen / kRec; ++i) {
    small.push_back({1, i * kRec, 7, kLen - (i + 1) * kRec, kRec});
  }
  auto t = writer_->postWrite(to_receiver_, small);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(t->opCount(), kLen / kRec);
  for (uint64_t i = 0; i < kLen / kRec; ++i) {
    ASSERT_EQ(std::memcmp(dst_->data() + kLen - (i + 1) * kRec, src_->data() + i * kRec, kRec), 0)
        << "record " << i;
  }
  std::vector<WriteOp> large;
  for (uint64_t q = 0; q < 4; ++q) large.push_back({1, q * kLen / 4, 7, q * kLen / 4, kLen / 4});
  auto u = writer_->postWrite(to_receiver_, large);
  ASSERT_TRUE(u.isOk());
  ASSERT_TRUE(u->wait(Clock::now() + kDeadline).isOk()) << u->status().toString();
  EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), kLen), 0);
}

// A batch above the parallel-copy threshold (memcpy backends cut it into parts copied by
// several threads) lands every byte once: odd op sizes, ops in reverse order, parts cut inside
// ops; and the bytes just outside the written range stay untouched.
TEST_P(Conformance, LargeBatchWithOddOpsLandsEveryByteOnce) {
  connectPair();
  constexpr uint64_t kLen = 24 << 20;
  setUpRegions(kLen + 8192);
  std::vector<WriteOp> ops;
  uint64_t off = 4096, size = 777;
  while (off < kLen) {
    const uint64_t n = std::min(size, kLen - off);
    ops.push_back({1, off, 7, off, n});
    off += n;
    size = size * 3 % 1000003 + 513;  // 513 .. ~1 MB, irregular
  }
  std::reverse(ops.begin(), ops.end());
  auto t = writer_->postWrite(to_receiver_, ops);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(t->bytes(), kLen - 4096);
  EXPECT_EQ(std::memcmp(dst_->data() + 4096, src_->data() + 4096, kLen - 4096), 0);
  for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(dst_->data()[i], 0) << i;
  for (uint64_t i = kLen; i < kLen + 8192; ++i) ASSERT_EQ(dst_->data()[i], 0) << i;
}

TEST_P(Conformance, EmptyBatchIsDoneAtOnce) {
  connectPair();
  setUpRegions(4096);
  auto t = writer_->postWrite(to_receiver_, {});
  ASSERT_TRUE(t.isOk());
  EXPECT_EQ(t->poll(), TransferState::kDone);
}

TEST_P(Conformance, ZeroByteAndOutOfRangeOpsAreRejectedAndMoveNothing) {
  connectPair();
  setUpRegions(64 * 1024);
  const uint64_t len = 64 * 1024;
  struct Bad {
    WriteOp op;
    StatusCode code;
    std::string says;  // the refused field and value, and which op of the batch
  };
  const std::vector<Bad> bad = {
      {{1, 0, 7, 0, 0},
       StatusCode::kInvalidArgument,
       "op 1 (local region 1, remote region 7): bytes=0"},
      {{1, len - 10, 7, 0, 11},
       StatusCode::kInvalidArgument,
       "local_offset=65526 + bytes=11 exceeds local region length=65536"},
      {{1, 0, 7, len - 10, 11},
       StatusCode::kInvalidArgument,
       "remote_offset=65526 + bytes=11 exceeds remote region length=65536"},
      {{1, 0, 7, UINT64_MAX - 5, 10},
       StatusCode::kInvalidArgument,
       "remote_offset=18446744073709551610"},
      {{9, 0, 7, 0, 10}, StatusCode::kNotFound, "op 1: local region id=9"},
      {{1, 0, 8, 0, 10}, StatusCode::kNotFound, "op 1: remote region id=8"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    // A good op first: a bad op anywhere rejects the whole batch.
    auto t = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 100}, bad[i].op});
    ASSERT_FALSE(t.isOk()) << "case " << i;
    EXPECT_EQ(t.status().code(), bad[i].code) << "case " << i << ": " << t.status().toString();
    EXPECT_NE(t.status().message().find(bad[i].says), std::string::npos)
        << "case " << i << ": " << t.status().toString();
  }
  EXPECT_EQ(writer_->postWrite(999, {{1, 0, 7, 0, 10}}).status().code(), StatusCode::kNotFound);
  for (uint64_t i = 0; i < len; ++i) ASSERT_EQ(dst_->data()[i], 0) << "byte " << i;
}

TEST_P(Conformance, RemoteRegionDeclaredLongerThanThePeerRegisteredIsRefused) {
  connectPair();
  auto dst = makeRegion(7, 4096);
  auto key = receiver_->registerRegion(*dst, RegionAccess::kRemoteWritable);
  ASSERT_TRUE(key.isOk());
  ASSERT_TRUE(receiver_->sendMessage(to_writer_, encodeRegionKey(*dst, *key)).isOk());
  auto e = waitForEvent(*writer_, Event::Kind::kMessage);
  ASSERT_TRUE(e.has_value());
  RegionKey k = decodeRegionKey(e->payload);
  Status s = writer_->addRemoteRegion(to_receiver_, k.id, 8192, k.key);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
  EXPECT_TRUE(writer_->addRemoteRegion(to_receiver_, k.id, 4096, k.key).isOk());
}

// Writes are checked against the length the writer declared, not the (longer) one the peer
// registered: "inside the remote region as declared" (transport.h).
TEST_P(Conformance, WritesPastTheDeclaredLengthAreRefusedThoughThePeerRegisteredMore) {
  connectPair();
  src_ = makeRegion(1, 4096);
  fillPattern(*src_, 5);
  ASSERT_TRUE(writer_->registerRegion(*src_, RegionAccess::kLocalSource).isOk());
  dst_ = makeRegion(7, 4096);
  std::memset(dst_->data(), 0, dst_->length());
  shareRegion(*dst_, /*declared_length=*/1024);
  auto past = writer_->postWrite(to_receiver_, {{1, 0, 7, 1024, 10}});
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument) << past.status().toString();
  auto across = writer_->postWrite(to_receiver_, {{1, 0, 7, 1020, 8}});
  EXPECT_EQ(across.status().code(), StatusCode::kInvalidArgument) << across.status().toString();
  auto inside = writer_->postWrite(to_receiver_, {{1, 0, 7, 1014, 10}});
  ASSERT_TRUE(inside.isOk()) << inside.status().toString();
  ASSERT_TRUE(inside->wait(Clock::now() + kDeadline).isOk()) << inside->status().toString();
  EXPECT_EQ(std::memcmp(dst_->data() + 1014, src_->data(), 10), 0);
  for (uint64_t i = 1024; i < 4096; ++i) ASSERT_EQ(dst_->data()[i], 0) << "byte " << i;
}

TEST_P(Conformance, RegistrationsAreReleasedAndIdsReusable) {
  connectPair();
  auto r = makeRegion(3, 4096);
  ASSERT_TRUE(receiver_->registerRegion(*r, RegionAccess::kRemoteWritable).isOk());
  EXPECT_EQ(receiver_->registerRegion(*r, RegionAccess::kRemoteWritable).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(receiver_->deregisterRegion(3).isOk());
  EXPECT_EQ(receiver_->deregisterRegion(3).code(), StatusCode::kNotFound);
  EXPECT_TRUE(receiver_->registerRegion(*r, RegionAccess::kRemoteWritable).isOk());
  EXPECT_TRUE(receiver_->deregisterRegion(3).isOk());
}

TEST_P(Conformance, ConcurrentTransfersFromSeveralThreadsAllLand) {
  connectPair();
  constexpr uint64_t kLen = 4 << 20;
  setUpRegions(kLen);
  constexpr int kThreads = 4, kPerThread = 16;
  constexpr uint64_t kChunk = kLen / (kThreads * kPerThread);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::vector<Transfer> ts;
      for (int i = 0; i < kPerThread; ++i) {
        const uint64_t off = (th * kPerThread + i) * kChunk;
        auto t = writer_->postWrite(
            to_receiver_,
            {{1, off, 7, off, kChunk / 2}, {1, off + kChunk / 2, 7, off + kChunk / 2, kChunk / 2}});
        if (!t.isOk()) {
          ++failures;
          continue;
        }
        ts.push_back(*t);
      }
      for (auto& t : ts) {
        if (!t.wait(Clock::now() + kDeadline).isOk()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), kLen), 0);
}

TEST_P(Conformance, MessagesArriveInSendOrderBothWays) {
  connectPair();
  constexpr uint32_t kCount = 300;
  for (uint32_t i = 0; i < kCount; ++i) {
    Bytes m;
    putFixed32(m, i);
    m.resize(4 + (i % 7) * 1000, static_cast<uint8_t>(i));  // mixed sizes
    ASSERT_TRUE(writer_->sendMessage(to_receiver_, m).isOk());
    ASSERT_TRUE(receiver_->sendMessage(to_writer_, m).isOk());
  }
  for (Agent* a : {receiver_.get(), writer_.get()}) {
    for (uint32_t i = 0; i < kCount; ++i) {
      auto e = waitForEvent(*a, Event::Kind::kMessage);
      ASSERT_TRUE(e.has_value()) << "message " << i;
      ASSERT_EQ(e->payload.size(), 4 + (i % 7) * 1000u);
      EXPECT_EQ(loadFixed32(e->payload.data()), i);
      EXPECT_EQ(e->peer, a == receiver_.get() ? to_writer_ : to_receiver_);
    }
  }
  std::vector<uint8_t> too_big(writer_->capabilities().max_message_bytes + 1);
  EXPECT_EQ(writer_->sendMessage(to_receiver_, too_big).code(), StatusCode::kInvalidArgument);
}

// A caller in one long pollEvent gets what arrives while it waits, at once: where the caller
// serves the agent's sockets or worker itself (shm, ucx), nothing else watches them meanwhile,
// and a serve that failed to take the message would leave it to the progress thread's next
// timer (shm: up to a second later). Both directions; one message sent before the poll began,
// nine sent 20 ms after it; the median lateness must stay under 250 ms (with shm's serve taken
// out it was 981 ms).
TEST_P(Conformance, ALongPollGetsAMessageSentWhileItWaits) {
  connectPair();
  for (Agent* a : {receiver_.get(), writer_.get()}) {
    Agent* other = a == receiver_.get() ? writer_.get() : receiver_.get();
    const PeerId to = a == receiver_.get() ? to_receiver_ : to_writer_;
    std::vector<Clock::duration> late;
    for (int round = 0; round < 10; ++round) {
      const auto delay = std::chrono::milliseconds(round == 0 ? 0 : 20);
      const auto start = Clock::now();
      std::thread sender([&] {
        std::this_thread::sleep_until(start + delay);
        EXPECT_TRUE(other->sendMessage(to, Bytes{1, 2, static_cast<uint8_t>(round)}).isOk());
      });
      auto e = a->pollEvent(std::chrono::seconds(20));
      const auto waited = Clock::now() - start;
      sender.join();
      ASSERT_TRUE(e.has_value()) << "nothing within the poll's 20 s, round " << round;
      EXPECT_EQ(e->kind, Event::Kind::kMessage);
      EXPECT_EQ(e->payload, (Bytes{1, 2, static_cast<uint8_t>(round)}));
      if (round > 0) late.push_back(waited - delay);
    }
    std::nth_element(late.begin(), late.begin() + late.size() / 2, late.end());
    EXPECT_LT(late[late.size() / 2], std::chrono::milliseconds(250))
        << "median lateness of a message a long poll waited for";
  }
}

// Messages from several threads at once, each thread alternating large ones and small ones,
// while the receiver polls: each thread's messages arrive in the order it sent them. (ucx posts
// a small message on the caller's thread when nothing is queued before it, and a large one on
// its progress thread: a small one must never overtake a large one sent before it.)
TEST_P(Conformance, SmallMessagesNeverOvertakeLargeOnesSentBeforeThem) {
  connectPair();
  constexpr uint32_t kThreads = 3, kPerThread = 40;
  std::atomic<int> failures{0};
  std::vector<std::thread> senders;
  for (uint32_t th = 0; th < kThreads; ++th) {
    senders.emplace_back([&, th] {
      for (uint32_t i = 0; i < kPerThread; ++i) {
        Bytes m;
        putFixed32(m, th);
        putFixed32(m, i);
        m.resize(i % 2 == 0 ? (256u << 10) : 16u, static_cast<uint8_t>(i));
        if (!writer_->sendMessage(to_receiver_, m).isOk()) ++failures;
      }
    });
  }
  std::vector<uint32_t> next(kThreads, 0);
  for (uint32_t n = 0; n < kThreads * kPerThread; ++n) {
    auto e = waitForEvent(*receiver_, Event::Kind::kMessage);
    if (!e.has_value() || e->payload.size() < 8) {
      ADD_FAILURE() << "message " << n << " did not arrive whole";
      break;
    }
    const uint32_t th = loadFixed32(e->payload.data());
    const uint32_t i = loadFixed32(e->payload.data() + 4);
    if (th >= kThreads) {
      ADD_FAILURE() << "message " << n << " names thread " << th;
      break;
    }
    EXPECT_EQ(i, next[th]) << "thread " << th;
    EXPECT_EQ(e->payload.size(), i % 2 == 0 ? (256u << 10) : 16u);
    next[th] = i + 1;
  }
  for (auto& t : senders) t.join();  // the senders never wait on the receiver
  EXPECT_EQ(failures.load(), 0);
}

// Nobody waits on the 100 ms fallback timer of a progress thread: the receiver polls all along
// (ucx: it serves the worker itself) while regions come and go on another thread (commands of
// its progress thread); the writer polls once between writes and then only waits on the
// transfer, so its agent must see the acknowledgement on its own, whether the write was posted
// on the caller's thread (4 KiB) or on the progress thread (1 MiB). A wait that fell to
// the timer would take up to 100 ms, 50 ms on average: the median must stay under half that
// (a healthy write takes about a millisecond here, a few under a sanitizer).
TEST_P(Conformance, WritesCompleteWithoutWaitingForAProgressTimer) {
  connectPair();
  constexpr uint64_t kLen = 1 << 20;
  setUpRegions(kLen);
  std::atomic<bool> stop{false};
  std::thread receiver_poll([&] {
    while (!stop) receiver_->pollEvent(100ms);
  });
  std::thread registrations([&] {
    for (uint32_t id = 100; !stop; id = id == 199 ? 100 : id + 1) {
      auto r = makeRegion(id, 4096);
      if (r && receiver_->registerRegion(*r, RegionAccess::kLocalSource).isOk()) {
        (void)receiver_->deregisterRegion(id);
      }
      std::this_thread::sleep_for(2ms);
    }
  });
  std::vector<double> ms;
  for (int i = 0; i < 40; ++i) {
    writer_->pollEvent(2ms);
    const uint64_t bytes = i % 2 == 0 ? 4096 : kLen;
    const auto start = Clock::now();
    auto t = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, bytes}});
    if (!t.isOk() || !t->wait(Clock::now() + kDeadline).isOk()) {
      ADD_FAILURE() << "write " << i << " failed";
      break;
    }
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  stop = true;
  receiver_poll.join();
  registrations.join();
  ASSERT_EQ(ms.size(), 40u);
  std::sort(ms.begin(), ms.end());
  EXPECT_LT(ms[20], 25.0) << "median of 40 writes, ms; the slowest " << ms[39] << " ms";
  EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), kLen), 0);
}

// Sends do not wait for the peer (shm queues what the socket does not take): large messages
// queued ahead of a region announcement and of the message carrying its key still arrive in
// order, and the region is usable the moment its key arrives.
TEST_P(Conformance, RegionSharedBehindQueuedLargeMessagesIsUsableWhenItsKeyArrives) {
  connectPair();
  constexpr uint32_t kBig = 12;
  for (uint32_t i = 0; i < kBig; ++i) {
    Bytes m;
    putFixed32(m, i);
    m.resize(4 << 20, static_cast<uint8_t>(i));
    ASSERT_TRUE(receiver_->sendMessage(to_writer_, m).isOk());
  }
  auto dst = makeRegion(7, 1 << 20);
  auto key = receiver_->registerRegion(*dst, RegionAccess::kRemoteWritable);
  ASSERT_TRUE(key.isOk()) << key.status().toString();
  ASSERT_TRUE(receiver_->sendMessage(to_writer_, encodeRegionKey(*dst, *key)).isOk());
  for (uint32_t i = 0; i < kBig; ++i) {
    auto e = waitForEvent(*writer_, Event::Kind::kMessage);
    ASSERT_TRUE(e.has_value()) << "message " << i;
    ASSERT_EQ(e->payload.size(), 4u << 20);
    EXPECT_EQ(loadFixed32(e->payload.data()), i);
  }
  auto e = waitForEvent(*writer_, Event::Kind::kMessage);
  ASSERT_TRUE(e.has_value());
  RegionKey k = decodeRegionKey(e->payload);
  ASSERT_EQ(k.id, 7u);
  Status s = writer_->addRemoteRegion(to_receiver_, k.id, k.length, k.key);
  EXPECT_TRUE(s.isOk()) << "the region was announced before the key message: " << s.toString();
}

TEST_P(Conformance, CancelledTransferStillReachesATerminalState) {
  connectPair();
  constexpr uint64_t kLen = 16 << 20;
  setUpRegions(kLen);
  std::vector<WriteOp> ops;
  for (uint64_t off = 0; off < kLen; off += 64 * 1024) ops.push_back({1, off, 7, off, 64 * 1024});
  auto t = writer_->postWrite(to_receiver_, ops);
  ASSERT_TRUE(t.isOk());
  t->cancel();
  t->cancel();  // idempotent
  Status s = t->wait(Clock::now() + kDeadline);
  const TransferState st = t->poll();
  ASSERT_TRUE(st == TransferState::kDone || st == TransferState::kCancelled)
      << transferStateName(st) << " " << s.toString();
  if (st == TransferState::kCancelled) {
    EXPECT_EQ(s.code(), StatusCode::kCancelled);
  } else {
    EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), kLen), 0);
  }
  // Cancel after completion changes nothing.
  auto u = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 4096}});
  ASSERT_TRUE(u.isOk());
  ASSERT_TRUE(u->wait(Clock::now() + kDeadline).isOk());
  u->cancel();
  EXPECT_EQ(u->poll(), TransferState::kDone);
  EXPECT_TRUE(u->status().isOk());
}

TEST_P(Conformance, DisconnectFailsLaterCallsAndTellsThePeer) {
  connectPair();
  setUpRegions(1 << 20);
  ASSERT_TRUE(writer_->disconnect(to_receiver_).isOk());
  auto lost = waitForEvent(*receiver_, Event::Kind::kPeerLost);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->peer, to_writer_);
  EXPECT_EQ(lost->status.code(), StatusCode::kUnavailable);
  auto local = waitForEvent(*writer_, Event::Kind::kPeerLost);
  ASSERT_TRUE(local.has_value());
  EXPECT_EQ(writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 10}}).status().code(),
            StatusCode::kUnavailable);
  Bytes m = {1, 2, 3};
  EXPECT_EQ(writer_->sendMessage(to_receiver_, m).code(), StatusCode::kUnavailable);
  // The receiver's side fails too once it learned.
  EXPECT_EQ(receiver_->sendMessage(to_writer_, m).code(), StatusCode::kUnavailable);
}

TEST_P(Conformance, DestroyedPeerFailsPendingTransfersWithinADeadline) {
  connectPair();
  constexpr uint64_t kLen = 16 << 20;
  setUpRegions(kLen);
  std::vector<Transfer> pending;
  for (int i = 0; i < 8; ++i) {
    auto t = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, kLen}});
    ASSERT_TRUE(t.isOk());
    pending.push_back(*t);
  }
  receiver_.reset();
  for (auto& t : pending) {
    Status s = t.wait(Clock::now() + kDeadline);
    const TransferState st = t.poll();
    ASSERT_NE(st, TransferState::kInProgress) << s.toString();
    if (st != TransferState::kDone) {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
    }
  }
  auto lost = waitForEvent(*writer_, Event::Kind::kPeerLost);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->peer, to_receiver_);
  EXPECT_EQ(writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 10}}).status().code(),
            StatusCode::kUnavailable);
}

// Once a peer is gone the agent left behind sleeps: its threads do not spin on a wake-up that
// was never consumed (a level-triggered eventfd left unread makes every later wait return at
// once). CPU time, not wall time: a spinning thread burns about a core whatever the load; an
// idle agent wakes for its timers only.
TEST_P(Conformance, AnAgentIdlesOnceItsPeerIsLost) {
  connectPair();
  setUpRegions(1 << 20);
  auto t = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 1 << 20}});
  ASSERT_TRUE(t.isOk());
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk());
  receiver_.reset();
  ASSERT_TRUE(waitForEvent(*writer_, Event::Kind::kPeerLost).has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // closing the socket settles
  auto cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  };
  const auto before = cpu();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto used = std::chrono::duration_cast<std::chrono::milliseconds>(cpu() - before);
  EXPECT_LT(used.count(), 200) << "CPU time of the process over one idle second";
}

TEST_P(Conformance, NoFdsLeakAfterAFullCycle) {
  auto cycle = [&] {
    connectPair();
    setUpRegions(1 << 20);
    auto t = writer_->postWrite(to_receiver_, {{1, 0, 7, 0, 1 << 20}});
    ASSERT_TRUE(t.isOk());
    ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk());
    ASSERT_TRUE(receiver_->deregisterRegion(7).isOk());
    ASSERT_TRUE(writer_->deregisterRegion(1).isOk());
    writer_.reset();
    receiver_.reset();
    src_.reset();
    dst_.reset();
  };
  cycle();  // warm-up: a library may keep process-wide fds from its first use
  const size_t before = countOpenFds();
  cycle();
  cycle();
  EXPECT_EQ(countOpenFds(), before);
}

std::vector<BackendCase> allBackends() {
  std::vector<BackendCase> cases = {
      {"inproc", "inproc"}, {"shm", "shm"}, {"cuda_fake", "cuda", UcxMode::kAuto, true}};
  for (const auto& b : availableBackends()) {
    if (b == "ucx") {
      cases.push_back({"ucx_am", "ucx", UcxMode::kAm});
      cases.push_back({"ucx_put", "ucx", UcxMode::kPut});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::ValuesIn(allBackends()),
                         [](const auto& info) { return info.param.name; });

// Backends whose peers live in other processes (all but inproc).
class CrossProcess : public Conformance {};

// A peer in another process that dies mid-transfer: every later write and send fails with
// Unavailable within the deadline, and kPeerLost arrives. Fork first, then create agents in
// each process (agents do not survive fork).
TEST_P(CrossProcess, PeerProcessKilledMidTransferFailsWithUnavailable) {
  constexpr uint64_t kLen = 8 << 20;
  int addr_pipe[2];
  ASSERT_EQ(pipe(addr_pipe), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(addr_pipe[0]);
    auto fake = GetParam().device ? std::make_shared<device::FakeDevice>() : nullptr;
    auto agent = createAgent(configFor(GetParam(), "child", fake));
    if (!agent.isOk()) _exit(2);
    TestRegion region = allocateRegion(7, kLen, fake.get());
    if (!region) _exit(3);
    auto key = (*agent)->registerRegion(*region, RegionAccess::kRemoteWritable);
    if (!key.isOk()) _exit(4);
    const std::string addr = (*agent)->localAddress();
    if (write(addr_pipe[1], addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) {
      _exit(5);
    }
    close(addr_pipe[1]);
    PeerId parent = 0;
    for (;;) {
      auto e = (*agent)->pollEvent(30s);
      if (!e) _exit(6);
      if (e->kind == Event::Kind::kPeerConnected) {
        parent = e->peer;
        if (!(*agent)->sendMessage(parent, encodeRegionKey(*region, *key)).isOk()) _exit(7);
      } else if (e->kind == Event::Kind::kMessage) {
        _exit(0);  // "go": die while the parent is writing, without any goodbye
      }
    }
  }
  close(addr_pipe[1]);
  std::string addr(256, '\0');
  ssize_t n = read(addr_pipe[0], addr.data(), addr.size());
  close(addr_pipe[0]);
  ASSERT_GT(n, 0);
  addr.resize(static_cast<size_t>(n));

  auto agent = createAgent(config("parent"));
  ASSERT_TRUE(agent.isOk()) << agent.status().toString();
  auto src = makeRegion(1, kLen);
  ASSERT_TRUE((*agent)->registerRegion(*src, RegionAccess::kLocalSource).isOk());
  auto peer = (*agent)->connect(addr);
  ASSERT_TRUE(peer.isOk()) << peer.status().toString();
  auto e = waitForEvent(**agent, Event::Kind::kMessage);
  ASSERT_TRUE(e.has_value());
  RegionKey k = decodeRegionKey(e->payload);
  ASSERT_TRUE((*agent)->addRemoteRegion(*peer, k.id, k.length, k.key).isOk());
  Bytes go = {1};
  ASSERT_TRUE((*agent)->sendMessage(*peer, go).isOk());

  // Keep writing until the loss shows; every transfer must end, none may hang.
  bool saw_unavailable = false;
  const auto deadline = Clock::now() + kDeadline;
  while (!saw_unavailable && Clock::now() < deadline) {
    auto t = (*agent)->postWrite(*peer, {{1, 0, 7, 0, kLen}});
    if (!t.isOk()) {
      EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status().toString();
      saw_unavailable = true;
      break;
    }
    Status s = t->wait(Clock::now() + kDeadline);
    ASSERT_NE(t->poll(), TransferState::kInProgress) << "transfer hung: " << s.toString();
    if (!s.isOk()) {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
      saw_unavailable = true;
    }
  }
  EXPECT_TRUE(saw_unavailable);
  auto lost = waitForEvent(**agent, Event::Kind::kPeerLost);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->peer, *peer);
  EXPECT_EQ(lost->status.code(), StatusCode::kUnavailable);
  EXPECT_EQ((*agent)->sendMessage(*peer, go).code(), StatusCode::kUnavailable);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

std::vector<BackendCase> crossProcessBackends() {
  auto cases = allBackends();
  std::erase_if(cases, [](const BackendCase& c) { return c.backend == "inproc"; });
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Backends, CrossProcess, ::testing::ValuesIn(crossProcessBackends()),
                         [](const auto& info) { return info.param.name; });

// --- backend-specific contract points ---

// The popper serves a readable fd itself: on_ready runs on its thread and what it pushes is
// returned; a quiet fd is never served; wake() ends the wait; once on_ready gives up, the fd
// is no longer watched (the popper does not spin on it).
TEST(EventQueue, APopperServesAReadableFdAndReturnsWhatItPushed) {
  detail::EventQueue q;
  const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ASSERT_GE(fd, 0);
  int served = 0;
  const std::thread::id popper = std::this_thread::get_id();
  auto on_ready = [&] {
    ++served;
    EXPECT_EQ(std::this_thread::get_id(), popper);
    uint64_t v = 0;
    if (read(fd, &v, sizeof(v)) == sizeof(v)) q.push(Event{Event::Kind::kMessage, 42, {7}, {}});
    return true;
  };
  EXPECT_FALSE(q.popOrServe(20ms, fd, on_ready).has_value());
  EXPECT_EQ(served, 0);
  std::thread poke([fd] {
    std::this_thread::sleep_for(50ms);
    const uint64_t one = 1;
    EXPECT_EQ(write(fd, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
  });
  auto e = q.popOrServe(kDeadline, fd, on_ready);
  poke.join();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->peer, 42u);
  EXPECT_EQ(e->payload, std::vector<uint8_t>{7});
  EXPECT_EQ(served, 1);
  std::thread waker([&q] {
    std::this_thread::sleep_for(50ms);
    q.wake();
  });
  EXPECT_FALSE(q.popOrServe(kDeadline, fd, on_ready).has_value());
  waker.join();
  EXPECT_EQ(served, 1);
  // A server that gives up (returns false) leaves the fd readable; it is not called again.
  const uint64_t one = 1;
  ASSERT_EQ(write(fd, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
  int gave_up = 0;
  EXPECT_FALSE(q.popOrServe(100ms, fd, [&] { return ++gave_up, false; }).has_value());
  EXPECT_EQ(gave_up, 1);
  close(fd);
}

// pollServing takes the served fd out of the progress thread's epoll set only while a caller
// serves it, and puts it back however the wait ends: on an event, when serve leaves work (the
// progress thread is woken to go on) and when serve throws (else the progress thread would
// stop watching the fd for good; it is woken too).
TEST(PollServing, TheProgressThreadWatchesTheFdAgainHoweverTheWaitEnds) {
  const int progress_epoll = epoll_create1(EPOLL_CLOEXEC);
  const int fd = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);  // readable throughout
  ASSERT_GE(progress_epoll, 0);
  ASSERT_GE(fd, 0);
  detail::ServedFd served;
  served.watch(progress_epoll, fd);  // the progress thread's set holds it now
  auto watched = [&] {
    epoll_event out{};
    return epoll_wait(progress_epoll, &out, 1, 0) == 1;
  };
  detail::EventQueue q;
  std::mutex drive_mu;
  int wakes = 0;
  auto wake = [&] { ++wakes; };

  // Served: out of the set while serving; the event serve pushed is returned.
  int calls = 0;
  auto e = detail::pollServing(
      q, kDeadline, drive_mu, served,
      [&] {
        EXPECT_FALSE(watched());
        if (++calls == 2) q.push(Event{Event::Kind::kMessage, 7, {1}, {}});
        return true;
      },
      wake);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->peer, 7u);
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(watched());
  EXPECT_EQ(wakes, 0);

  // Work left: handed back at once, the progress thread woken, the wait goes on unserved.
  calls = 0;
  EXPECT_FALSE(detail::pollServing(
                   q, 50ms, drive_mu, served, [&] { return ++calls, false; }, wake)
                   .has_value());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(wakes, 1);
  EXPECT_TRUE(watched());

  // serve throws: the exception reaches the caller, the fd and the lock are given back, and
  // the progress thread is woken (the worker may be left unarmed, its fd silent).
  EXPECT_THROW(detail::pollServing(
                   q, kDeadline, drive_mu, served,
                   []() -> bool { throw std::runtime_error("serve failed"); }, wake),
               std::runtime_error);
  EXPECT_EQ(wakes, 2);
  EXPECT_TRUE(watched());
  EXPECT_TRUE(drive_mu.try_lock());
  drive_mu.unlock();

  // The lock held elsewhere (the progress thread at work): never served, the set untouched.
  std::promise<void> held, release;
  std::thread progress([&] {
    std::lock_guard<std::mutex> lock(drive_mu);
    held.set_value();
    release.get_future().wait();
  });
  held.get_future().wait();
  calls = 0;
  EXPECT_FALSE(detail::pollServing(
                   q, 30ms, drive_mu, served, [&] { return ++calls, true; }, wake)
                   .has_value());
  EXPECT_EQ(calls, 0);
  EXPECT_TRUE(watched());
  release.set_value();
  progress.join();
  close(fd);
  close(progress_epoll);
}

// A small host job that finds the copy worker idle is copied by the submitting thread before
// submit returns (no wake of the worker, no wake back); a larger one, or one behind a job still
// running, goes to the worker thread as before.
TEST(CopyWorker, ASmallJobOnAnIdleWorkerIsCopiedByItsSubmitter) {
  detail::CopyWorker worker;
  std::vector<uint8_t> src(2 * detail::kInlineCopyBytes, 0x5A);
  std::vector<uint8_t> dst(src.size(), 0);
  auto guard = std::make_shared<detail::RegionGuard>();
  guard->base = dst.data();
  guard->length = dst.size();
  const std::thread::id me = std::this_thread::get_id();
  // Submits `bytes` and returns the job's transfer and the thread that finished it.
  auto submit = [&](uint64_t bytes, std::function<Status()> check) {
    detail::CopyJob job;
    job.core = std::make_shared<detail::TransferCore>(bytes, 1);
    job.add(src.data(), guard, 0, bytes);
    job.check = std::move(check);
    auto finisher = std::make_shared<std::promise<std::thread::id>>();
    job.core->notifyWhenTerminal([finisher] { finisher->set_value(std::this_thread::get_id()); });
    Transfer t(job.core);
    worker.prepare(job);
    worker.submit(std::move(job));
    return std::make_pair(t, finisher->get_future());
  };

  auto [small, small_by] = submit(detail::kInlineCopyBytes, nullptr);
  EXPECT_EQ(small.poll(), TransferState::kDone);  // before submit returned
  EXPECT_EQ(small_by.get(), me);
  EXPECT_EQ(dst[detail::kInlineCopyBytes - 1], 0x5A);

  auto [large, large_by] = submit(detail::kInlineCopyBytes + 1, nullptr);
  EXPECT_NE(large_by.get(), me);
  EXPECT_TRUE(large.wait(Clock::now() + kDeadline).isOk());

  // The worker busy with a job (its check holds it): a small job queues behind it.
  std::promise<void> entered, release;
  auto release_f = release.get_future().share();
  bool first = true;
  auto [busy, busy_by] = submit(detail::kInlineCopyBytes + 1, [&]() -> Status {
    if (first) {
      first = false;
      entered.set_value();
      release_f.wait();
    }
    return OkStatus();
  });
  entered.get_future().wait();
  auto [queued, queued_by] = submit(64, nullptr);
  EXPECT_EQ(queued.poll(), TransferState::kInProgress);
  release.set_value();
  EXPECT_NE(queued_by.get(), me);
  EXPECT_TRUE(queued.wait(Clock::now() + kDeadline).isOk());
  EXPECT_TRUE(busy.wait(Clock::now() + kDeadline).isOk());
}

TEST(ShmTransport, RefusesAnonymousRegions) {
  auto a = createAgent(plainConfig("shm"));
  ASSERT_TRUE(a.isOk());
  EXPECT_TRUE((*a)->capabilities().needs_memfd_regions);
  auto r = Region::allocate(1, 4096, Region::Backing::kAnonymous, "anon");
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ((*a)->registerRegion(**r, RegionAccess::kRemoteWritable).status().code(),
            StatusCode::kInvalidArgument);
}

// disconnect() right after sends that the socket could not take at once (the engine refuses a
// peer with an Error message, then disconnects): the queued messages still arrive before the
// peer sees kPeerLost.
TEST(ShmTransport, MessagesQueuedBeforeDisconnectStillArrive) {
  AgentConfig c = configFor(BackendCase{"shm", "shm"}, "a");
  auto a = createAgent(c);
  auto b = createAgent(configFor(BackendCase{"shm", "shm"}, "b"));
  ASSERT_TRUE(a.isOk() && b.isOk());
  auto peer = (*a)->connect((*b)->localAddress());
  ASSERT_TRUE(peer.isOk()) << peer.status().toString();
  auto connected = waitForEvent(**b, Event::Kind::kPeerConnected);
  ASSERT_TRUE(connected.has_value());
  constexpr uint32_t kCount = 8;
  for (uint32_t i = 0; i < kCount; ++i) {
    Bytes m;
    putFixed32(m, i);
    m.resize(4 << 20, 0x42);
    ASSERT_TRUE((*a)->sendMessage(*peer, m).isOk());
  }
  ASSERT_TRUE((*a)->disconnect(*peer).isOk());
  for (uint32_t i = 0; i < kCount; ++i) {
    auto e = (*b)->pollEvent(kDeadline);
    ASSERT_TRUE(e.has_value()) << "message " << i;
    ASSERT_EQ(e->kind, Event::Kind::kMessage) << "message " << i << ": " << e->status.toString();
    EXPECT_EQ(loadFixed32(e->payload.data()), i);
  }
  auto lost = waitForEvent(**b, Event::Kind::kPeerLost);
  EXPECT_TRUE(lost.has_value());
}

// A connected cuda pair over one fake device: the writer's source and the receiver's
// destination are device allocations, the destination exported and mapped by the writer.
struct CudaPair {
  explicit CudaPair(device::FakeDeviceOptions options = {}, uint64_t length = 1 << 20)
      : fake(std::make_shared<device::FakeDevice>(options)) {
    const BackendCase c{"cuda", "cuda", UcxMode::kAuto, true};
    auto w = createAgent(configFor(c, "writer", fake));
    auto r = createAgent(configFor(c, "receiver", fake));
    EXPECT_TRUE(w.isOk() && r.isOk());
    if (!w.isOk() || !r.isOk()) return;
    writer = std::move(w).value();
    receiver = std::move(r).value();
    src = allocateRegion(1, length, fake.get());
    dst = allocateRegion(7, length, fake.get());
    fillPattern(*src, 9);
    std::memset(dst->data(), 0, length);
    EXPECT_TRUE(writer->registerRegion(*src, RegionAccess::kLocalSource).isOk());
    EXPECT_TRUE(receiver->registerRegion(*dst, RegionAccess::kRemoteWritable).isOk());
    auto peer = writer->connect(receiver->localAddress());
    EXPECT_TRUE(peer.isOk()) << peer.status().toString();
    if (!peer.isOk()) return;
    to_receiver = *peer;
    // The region frame precedes any message: one round trip makes sure it was mapped.
    auto connected = waitForEvent(*receiver, Event::Kind::kPeerConnected);
    EXPECT_TRUE(connected.has_value());
    if (!connected) return;
    to_writer = connected->peer;
    EXPECT_TRUE(receiver->sendMessage(to_writer, Bytes{1}).isOk());
    EXPECT_TRUE(waitForEvent(*writer, Event::Kind::kMessage).has_value());
    Status added = writer->addRemoteRegion(to_receiver, 7, length, {});
    EXPECT_TRUE(added.isOk()) << added.toString();
  }
  std::shared_ptr<device::FakeDevice> fake;
  std::unique_ptr<Agent> writer, receiver;
  TestRegion src, dst;
  PeerId to_receiver = 0, to_writer = 0;
};

TEST(CudaTransport, NeedsADeviceRuntimeAndRefusesHostMemory) {
  auto none = createAgent(plainConfig("cuda"));
  ASSERT_FALSE(none.isOk());
  EXPECT_EQ(none.status().code(), StatusCode::kIncompatible) << none.status().toString();
  EXPECT_NE(none.status().message().find("AgentConfig::device"), std::string::npos);

  auto fake = std::make_shared<device::FakeDevice>();
  auto a = createAgent(configFor({"cuda", "cuda", UcxMode::kAuto, true}, "a", fake));
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_TRUE((*a)->capabilities().device_memory);
  EXPECT_FALSE((*a)->capabilities().needs_memfd_regions);
  EXPECT_EQ((*a)->capabilities().name, "cuda");
  EXPECT_TRUE((*a)->localAddress().starts_with("cuda:@")) << (*a)->localAddress();
  auto host = makeRegion(3, 4096);
  auto s = (*a)->registerRegion(*host, RegionAccess::kRemoteWritable);
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("region id=3 is host memory"), std::string::npos)
      << s.status().toString();
  // A range that starts in device memory and runs past its allocation is named too.
  auto dev = fake->allocate(0, 8192);
  ASSERT_TRUE(dev.isOk());
  auto past = Region::borrow(4, (*dev)->data() + 4096, 8192);
  ASSERT_TRUE(past.isOk());
  auto t = (*a)->registerRegion(**past, RegionAccess::kLocalSource);
  ASSERT_FALSE(t.isOk());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("region id=4"), std::string::npos) << t.status().toString();
}

// The storm case: thousands of ops of one batch are one batched copy on the device, not one
// call per op, and every record lands where its op says.
TEST(CudaTransport, ABatchOfManyOpsIsOneDeviceCopy) {
  CudaPair pair;
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  constexpr uint64_t kLen = 1 << 20, kRec = 256;
  std::vector<WriteOp> ops;
  for (uint64_t i = 0; i < kLen / kRec; ++i)
    ops.push_back({1, i * kRec, 7, kLen - (i + 1) * kRec, kRec});
  const uint64_t before = pair.fake->opsRun();
  auto t = pair.writer->postWrite(pair.to_receiver, ops);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(pair.fake->opsRun() - before, 1u) << "one launch for " << ops.size() << " ops";
  for (uint64_t i = 0; i < kLen / kRec; ++i) {
    ASSERT_EQ(
        std::memcmp(pair.dst->data() + kLen - (i + 1) * kRec, pair.src->data() + i * kRec, kRec), 0)
        << "record " << i;
  }
}

// A device copy that fails fails its transfer with the device's error; the stream and the
// connection go on, and the next transfer lands.
TEST(CudaTransport, AFailedDeviceCopyFailsItsTransferAndTheNextOneLands) {
  device::FakeDeviceOptions options;
  options.fail_every = 2;
  CudaPair pair(options);
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  std::vector<Status> results;
  for (int i = 0; i < 3; ++i) {
    auto t = pair.writer->postWrite(pair.to_receiver, {{1, 0, 7, 0, 4096}});
    ASSERT_TRUE(t.isOk()) << t.status().toString();
    results.push_back(t->wait(Clock::now() + kDeadline));
  }
  EXPECT_TRUE(results[0].isOk()) << results[0].toString();
  EXPECT_EQ(results[1].code(), StatusCode::kInternal) << results[1].toString();
  EXPECT_NE(results[1].message().find("fake device: op"), std::string::npos);
  EXPECT_TRUE(results[2].isOk()) << results[2].toString();
  EXPECT_EQ(std::memcmp(pair.dst->data(), pair.src->data(), 4096), 0);
  EXPECT_TRUE(pair.writer->sendMessage(pair.to_receiver, Bytes{2}).isOk());
}

// The receiver retires its region while the writer's copy runs on the device (slowed to 300
// ms): the writer's mapping of it is released only after that copy finished, and later writes
// to it are refused.
// Posts a 1 MiB write into the receiver's region 7, waits `launched` (the slowed fake device is
// inside the copy by then) and retires region 7 at the receiver.
StatusOr<Transfer> retireDuringACopy(CudaPair& pair, std::chrono::milliseconds launched) {
  auto t = pair.writer->postWrite(pair.to_receiver, {{1, 0, 7, 0, 1 << 20}});
  if (!t.isOk()) return t.status();
  std::this_thread::sleep_for(launched);
  RETURN_IF_ERROR(pair.receiver->deregisterRegion(7));
  return t;
}

TEST(CudaTransport, ARetiredRegionStaysMappedUntilTheCopiesIntoItFinished) {
  CudaPair pair(device::FakeDeviceOptions{.op_delay = 300ms});
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  auto t = retireDuringACopy(pair, 50ms);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  Status s = t->wait(Clock::now() + kDeadline);
  if (s.isOk()) {
    EXPECT_EQ(std::memcmp(pair.dst->data(), pair.src->data(), 1 << 20), 0);
  } else {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
  }
  const auto deadline = Clock::now() + kDeadline;
  StatusCode code = StatusCode::kOk;
  while (Clock::now() < deadline) {
    auto u = pair.writer->postWrite(pair.to_receiver, {{1, 0, 7, 0, 16}});
    code = u.isOk() ? StatusCode::kOk : u.status().code();
    if (!u.isOk()) break;
    (void)u->wait(Clock::now() + kDeadline);
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(code, StatusCode::kNotFound) << "the retired region is no write target";
}

// The receiver retires its region while the writer's device copy into it runs (2 s on the
// slowed fake device). The writer's socket thread does not wait for that copy: a message the
// receiver sends after retiring arrives while the copy is still running, and the copy still
// finishes into its mapping.
TEST(CudaTransport, ARetiredRegionDoesNotHoldUpTheSocketDuringADeviceCopy) {
  CudaPair pair(device::FakeDeviceOptions{.op_delay = 2000ms});
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  auto t = retireDuringACopy(pair, 200ms);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_TRUE(pair.receiver->sendMessage(pair.to_writer, Bytes{9}).isOk());
  auto m = waitForEvent(*pair.writer, Event::Kind::kMessage);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(t->poll(), TransferState::kInProgress)
      << "the message waited for the device copy into the retired region";
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(std::memcmp(pair.dst->data(), pair.src->data(), 1 << 20), 0);
  auto u = pair.writer->postWrite(pair.to_receiver, {{1, 0, 7, 0, 16}});
  EXPECT_EQ(u.status().code(), StatusCode::kNotFound) << "the retired region is no write target";
}

bool allZero(const Region& r) {
  return std::all_of(r.data(), r.data() + r.length(), [](uint8_t b) { return b == 0; });
}

// vLLM's overwrite race, at the transport: a write fenced on the engine's event moves nothing
// while the event is pending (100 ms here), and lands once it is signalled.
TEST(CudaTransport, AWriteBehindAPendingFenceMovesNothingUntilItIsDone) {
  CudaPair pair;
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  auto fence = std::make_shared<device::ManualEvent>();
  auto t = pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 1 << 20}}, fence);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  EXPECT_EQ(t->wait(Clock::now() + 100ms).code(), StatusCode::kTimeout);
  EXPECT_EQ(t->poll(), TransferState::kInProgress);
  EXPECT_TRUE(allZero(*pair.dst)) << "a byte moved before the fence";
  fence->signal();
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(std::memcmp(pair.dst->data(), pair.src->data(), 1 << 20), 0);
}

// A write behind a pending fence holds up no other write of the agent: one posted after it,
// unfenced or behind a fence already done, lands first.
TEST(CudaTransport, AWritePostedAfterAFencedOneDoesNotWaitForItsFence) {
  CudaPair pair;
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  auto pending = std::make_shared<device::ManualEvent>();
  auto done = std::make_shared<device::ManualEvent>();
  done->signal();
  auto held = pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 4096}}, pending);
  auto plain = pair.writer->postWrite(pair.to_receiver, {{1, 4096, 7, 4096, 4096}});
  auto fenced = pair.writer->postWriteAfter(pair.to_receiver, {{1, 8192, 7, 8192, 4096}}, done);
  ASSERT_TRUE(held.isOk() && plain.isOk() && fenced.isOk());
  EXPECT_TRUE(plain->wait(Clock::now() + kDeadline).isOk()) << plain->status().toString();
  EXPECT_TRUE(fenced->wait(Clock::now() + kDeadline).isOk()) << fenced->status().toString();
  EXPECT_EQ(held->poll(), TransferState::kInProgress);
  EXPECT_TRUE(std::all_of(pair.dst->data(), pair.dst->data() + 4096, [](uint8_t b) {
    return b == 0;
  })) << "the fenced write landed before its fence";
  EXPECT_EQ(std::memcmp(pair.dst->data() + 4096, pair.src->data() + 4096, 8192), 0);
  pending->signal();
  ASSERT_TRUE(held->wait(Clock::now() + kDeadline).isOk()) << held->status().toString();
  EXPECT_EQ(std::memcmp(pair.dst->data(), pair.src->data(), 4096), 0);
}

// A fenced write that is cancelled, or whose peer is lost, while its fence is pending ends at
// once and never writes, even when the fence is signalled afterwards; a fence that fails
// fails its write, naming the fence. Host backends take no fence.
TEST(CudaTransport, AFencedWriteCancelledLostOrFailedNeverWrites) {
  CudaPair pair;
  ASSERT_TRUE(pair.writer && pair.to_receiver);
  auto failing = std::make_shared<device::ManualEvent>();
  failing->signal(Internal("engine step 12 failed"));
  auto f = pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 4096}}, failing);
  ASSERT_TRUE(f.isOk());
  Status fs = f->wait(Clock::now() + kDeadline);
  EXPECT_EQ(fs.code(), StatusCode::kInternal) << fs.toString();
  EXPECT_NE(fs.message().find("fence failed: engine step 12 failed"), std::string::npos)
      << fs.toString();

  auto a = std::make_shared<device::ManualEvent>();
  auto b = std::make_shared<device::ManualEvent>();
  auto ta = pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 1 << 20}}, a);
  auto tb = pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 1 << 20}}, b);
  ASSERT_TRUE(ta.isOk() && tb.isOk());
  ta->cancel();
  EXPECT_EQ(ta->wait(Clock::now() + kDeadline).code(), StatusCode::kCancelled);
  ASSERT_TRUE(pair.writer->disconnect(pair.to_receiver).isOk());
  EXPECT_EQ(tb->wait(Clock::now() + kDeadline).code(), StatusCode::kUnavailable);
  a->signal();
  b->signal();
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(allZero(*pair.dst)) << "a cancelled or orphaned fenced write landed";
  EXPECT_EQ(pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 16}}, a).status().code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(
      pair.writer->postWriteAfter(pair.to_receiver, {{1, 0, 7, 0, 16}}, nullptr).status().code(),
      StatusCode::kInvalidArgument);

  auto shm = createAgent(plainConfig("shm"));
  ASSERT_TRUE(shm.isOk());
  auto refused = (*shm)->postWriteAfter(1, {{1, 0, 7, 0, 16}}, a);
  EXPECT_EQ(refused.status().code(), StatusCode::kIncompatible) << refused.status().toString();
}

// A shm agent and a cuda agent share the socket protocol but not the memory: each refuses the
// other in the handshake, and connect() says so.
TEST(CudaTransport, ShmAndCudaAgentsRefuseEachOtherNamingBoth) {
  auto fake = std::make_shared<device::FakeDevice>();
  auto cuda = createAgent(configFor({"cuda", "cuda", UcxMode::kAuto, true}, "c", fake));
  auto shm = createAgent(configFor({"shm", "shm"}, "s"));
  ASSERT_TRUE(cuda.isOk() && shm.isOk());
  const std::string shm_name = (*shm)->localAddress().substr(std::string("shm:@").size());
  const std::string cuda_name = (*cuda)->localAddress().substr(std::string("cuda:@").size());
  auto a = (*cuda)->connect("cuda:@" + shm_name);
  ASSERT_FALSE(a.isOk());
  EXPECT_EQ(a.status().code(), StatusCode::kIncompatible) << a.status().toString();
  EXPECT_NE(a.status().message().find("the peer is a shm agent and this one is a cuda agent"),
            std::string::npos)
      << a.status().toString();
  auto b = (*shm)->connect("shm:@" + cuda_name);
  ASSERT_FALSE(b.isOk());
  EXPECT_EQ(b.status().code(), StatusCode::kIncompatible) << b.status().toString();
  EXPECT_NE(b.status().message().find("the peer is a cuda agent and this one is a shm agent"),
            std::string::npos)
      << b.status().toString();
  EXPECT_EQ((*cuda)->connect((*shm)->localAddress()).status().code(), StatusCode::kInvalidArgument);
}

TEST(Transport, UnknownBackendAndBadAddressesAreErrors) {
  EXPECT_EQ(createAgent(plainConfig("rdma")).status().code(), StatusCode::kInvalidArgument);
  for (const char* b : {"inproc", "shm"}) {
    auto a = createAgent(plainConfig(b));
    ASSERT_TRUE(a.isOk());
    EXPECT_EQ((*a)->connect("nonsense").status().code(), StatusCode::kInvalidArgument) << b;
    EXPECT_EQ((*a)->connect(std::string(b) + ":@no-such-agent-here").status().code(),
              StatusCode::kUnavailable)
        << b;
  }
  EXPECT_EQ(parseUcxMode("rdma").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*parseUcxMode("am"), UcxMode::kAm);
}

#ifdef HXFER_WITH_UCX
// With active messages the receiver checks every write against its own regions: a writer that
// was handed a forged key (a longer length) passes its own checks, and the receiver refuses.
TEST(UcxTransport, ReceiverRefusesAmWritesOutsideItsRegions) {
  BackendCase c{"ucx_am", "ucx", UcxMode::kAm};
  auto w = createAgent(configFor(c, "writer"));
  auto r = createAgent(configFor(c, "receiver"));
  ASSERT_TRUE(w.isOk() && r.isOk());
  auto src = makeRegion(1, 64 * 1024);
  auto dst = makeRegion(7, 4096);
  fillPattern(*src, 9);
  std::memset(dst->data(), 0, dst->length());
  ASSERT_TRUE((*w)->registerRegion(*src, RegionAccess::kLocalSource).isOk());
  auto key = (*r)->registerRegion(*dst, RegionAccess::kRemoteWritable);
  ASSERT_TRUE(key.isOk());
  auto peer = (*w)->connect((*r)->localAddress());
  ASSERT_TRUE(peer.isOk()) << peer.status().toString();
  Bytes forged = *key;
  storeFixed32(forged.data() + 8, 64 * 1024);  // key bytes 8..15: the region length (LE)
  ASSERT_TRUE((*w)->addRemoteRegion(*peer, 7, 64 * 1024, forged).isOk());
  auto t = (*w)->postWrite(*peer, {{1, 0, 7, 0, 1024}, {1, 0, 7, 8192, 1024}});
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  Status s = t->wait(Clock::now() + kDeadline);
  EXPECT_EQ(t->poll(), TransferState::kFailed);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
  EXPECT_NE(s.message().find("refused by the receiver"), std::string::npos) << s.toString();
  // The in-range op landed; nothing was written past the region.
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), 1024), 0);
  // The connection stays usable.
  auto u = (*w)->postWrite(*peer, {{1, 0, 7, 2048, 1024}});
  ASSERT_TRUE(u.isOk());
  EXPECT_TRUE(u->wait(Clock::now() + kDeadline).isOk());
}

TEST(UcxTransport, ListenerReportsTheRealPortAndAutoModePicksAmOverTcp) {
  BackendCase c{"ucx_auto", "ucx", UcxMode::kAuto};
  auto a = createAgent(configFor(c, "a"));
  auto b = createAgent(configFor(c, "b"));
  ASSERT_TRUE(a.isOk() && b.isOk());
  EXPECT_TRUE((*b)->localAddress().starts_with("ucx:127.0.0.1:"));
  EXPECT_NE((*b)->localAddress(), "ucx:127.0.0.1:0");
  auto peer = (*a)->connect((*b)->localAddress());
  ASSERT_TRUE(peer.isOk()) << peer.status().toString();
  // Over TCP put is emulated; auto must still move bytes correctly (through am).
  auto src = makeRegion(1, 1 << 20);
  auto dst = makeRegion(2, 1 << 20);
  fillPattern(*src, 5);
  ASSERT_TRUE((*a)->registerRegion(*src, RegionAccess::kLocalSource).isOk());
  auto key = (*b)->registerRegion(*dst, RegionAccess::kRemoteWritable);
  ASSERT_TRUE(key.isOk());
  ASSERT_TRUE((*a)->addRemoteRegion(*peer, 2, 1 << 20, *key).isOk());
  auto t = (*a)->postWrite(*peer, {{1, 0, 2, 0, 1 << 20}});
  ASSERT_TRUE(t.isOk());
  ASSERT_TRUE(t->wait(Clock::now() + kDeadline).isOk()) << t->status().toString();
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), 1 << 20), 0);
}

#endif

}  // namespace
}  // namespace hxfer::transport
