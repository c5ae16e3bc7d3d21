// The fault-injection decorator over the inproc backend and over the cuda backend on the host
// fake of the device seam: every injected fault shows up the way the engine will see it, and a
// seed replays the same faults.
#include <cstring>

#include <gtest/gtest.h>

#include "common/coding.h"
#include "device/fake_device.h"
#include "transport/fault.h"
#include "transport/transport.h"

namespace hxfer::transport {
namespace {

using namespace std::chrono_literals;

constexpr auto kDeadline = 30s;

struct Pair {
  std::shared_ptr<device::FakeDevice> fake;  // cuda: the device memory below lives here
  std::shared_ptr<Region> src_memory, dst_memory;
  std::unique_ptr<Agent> writer, receiver;
  PeerId to_receiver = 0, to_writer = 0;
  std::unique_ptr<Region> src, dst;
};

// 64 KiB of host memory (memfd), or of the fake device's memory for cuda.
std::unique_ptr<Region> pairRegion(Pair& p, uint32_t id, std::shared_ptr<Region>* memory) {
  constexpr uint64_t kLen = 64 * 1024;
  if (!p.fake) return std::move(Region::allocate(id, kLen, Region::Backing::kMemfd, "r")).value();
  *memory = std::move(p.fake->allocate(0, kLen)).value();
  return std::move(Region::borrow(id, (*memory)->data(), kLen)).value();
}

// A writer wrapped with `policy` connected to a plain receiver of `backend`, with a 64 KiB
// region each.
Pair makePair(const FaultPolicy& policy, const std::string& backend) {
  Pair p;
  AgentConfig config;
  config.backend = backend;
  config.auth_token = "fault-token";
  if (backend == "cuda") {
    p.fake = std::make_shared<device::FakeDevice>();
    config.device = p.fake;
  }
  auto w = createAgent(config);
  auto r = createAgent(config);
  EXPECT_TRUE(w.isOk() && r.isOk());
  p.writer = wrapWithFaults(std::move(w).value(), policy);
  p.receiver = std::move(r).value();
  p.to_receiver = *p.writer->connect(p.receiver->localAddress());
  for (;;) {
    auto e = p.receiver->pollEvent(kDeadline);
    EXPECT_TRUE(e.has_value());
    if (!e) break;
    if (e->kind == Event::Kind::kPeerConnected) {
      p.to_writer = e->peer;
      break;
    }
  }
  p.src = pairRegion(p, 1, &p.src_memory);
  p.dst = pairRegion(p, 2, &p.dst_memory);
  for (uint64_t i = 0; i < p.src->length(); ++i) p.src->data()[i] = static_cast<uint8_t>(i + 1);
  std::memset(p.dst->data(), 0, p.dst->length());
  EXPECT_TRUE(p.writer->registerRegion(*p.src, RegionAccess::kLocalSource).isOk());
  auto key = p.receiver->registerRegion(*p.dst, RegionAccess::kRemoteWritable);
  EXPECT_TRUE(key.isOk());
  // The key's message: once it arrived the region's handle did too (cuda maps it on arrival).
  EXPECT_TRUE(p.receiver->sendMessage(p.to_writer, Bytes{0}).isOk());
  auto e = p.writer->pollEvent(kDeadline);
  EXPECT_TRUE(e.has_value() && e->kind == Event::Kind::kMessage);
  Status added = p.writer->addRemoteRegion(p.to_receiver, 2, p.dst->length(), *key);
  EXPECT_TRUE(added.isOk()) << added.toString();
  return p;
}

class FaultAgent : public ::testing::TestWithParam<std::string> {
 protected:
  Pair makePair(const FaultPolicy& policy) { return transport::makePair(policy, GetParam()); }
};

Status writeOnce(Pair& p, uint64_t offset) {
  auto t = p.writer->postWrite(p.to_receiver, {{1, offset, 2, offset, 1024}});
  if (!t.isOk()) return t.status();
  return t->wait(Clock::now() + kDeadline);
}

TEST_P(FaultAgent, NamesItselfAfterTheInnerBackend) {
  Pair p = makePair(FaultPolicy{});
  EXPECT_EQ(p.writer->capabilities().name, "fault(" + GetParam() + ")");
  EXPECT_TRUE(p.writer->capabilities().many_small_ops_cheap);
}

TEST_P(FaultAgent, FailsExactlyTheNthWriteAndMovesNoByteForIt) {
  FaultPolicy policy;
  policy.fail_nth_write = 3;
  Pair p = makePair(policy);
  for (uint64_t i = 0; i < 5; ++i) {
    Status s = writeOnce(p, i * 1024);
    if (i == 2) {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
      EXPECT_EQ(p.dst->data()[i * 1024], 0);
    } else {
      EXPECT_TRUE(s.isOk()) << i << ": " << s.toString();
      EXPECT_EQ(std::memcmp(p.dst->data() + i * 1024, p.src->data() + i * 1024, 1024), 0);
    }
  }
  EXPECT_EQ(faultStats(*p.writer).writes_failed, 1u);
}

TEST_P(FaultAgent, SameSeedFailsTheSameWrites) {
  auto failedIndices = [&](uint64_t seed) {
    FaultPolicy policy;
    policy.seed = seed;
    policy.fail_write_probability = 0.3;
    Pair p = makePair(policy);
    std::vector<int> failed;
    for (int i = 0; i < 40; ++i) {
      if (!writeOnce(p, 0).isOk()) failed.push_back(i);
    }
    return failed;
  };
  const auto a = failedIndices(42);
  EXPECT_EQ(a, failedIndices(42));
  EXPECT_FALSE(a.empty());
  EXPECT_LT(a.size(), 40u);
}

TEST_P(FaultAgent, DelayedWriteStillCompletesWithItsBytes) {
  FaultPolicy policy;
  policy.write_delay = 50ms;
  Pair p = makePair(policy);
  const auto start = Clock::now();
  ASSERT_TRUE(writeOnce(p, 0).isOk());
  EXPECT_GE(Clock::now() - start, 50ms);  // a lower bound only: never flaky on a slow box
  EXPECT_EQ(std::memcmp(p.dst->data(), p.src->data(), 1024), 0);
  EXPECT_EQ(faultStats(*p.writer).writes_delayed, 1u);
}

TEST_P(FaultAgent, DropsTheNthMessageAndKeepsTheOthersInOrder) {
  FaultPolicy policy;
  policy.drop_nth_message = 2;
  policy.message_delay = 5ms;
  Pair p = makePair(policy);
  for (uint32_t i = 0; i < 5; ++i) {
    Bytes m;
    putFixed32(m, i);
    ASSERT_TRUE(p.writer->sendMessage(p.to_receiver, m).isOk());
  }
  for (uint32_t want : {0u, 2u, 3u, 4u}) {
    auto e = p.receiver->pollEvent(kDeadline);
    ASSERT_TRUE(e.has_value());
    ASSERT_EQ(e->kind, Event::Kind::kMessage);
    EXPECT_EQ(loadFixed32(e->payload.data()), want);
  }
  EXPECT_FALSE(p.receiver->pollEvent(100ms).has_value());
  EXPECT_EQ(faultStats(*p.writer).messages_dropped, 1u);
  EXPECT_EQ(faultStats(*p.writer).messages_delayed, 4u);
}

TEST_P(FaultAgent, FailsTheNthMessageAsIfThePeerWereGone) {
  FaultPolicy policy;
  policy.fail_nth_message = 2;
  Pair p = makePair(policy);
  for (uint32_t i = 0; i < 3; ++i) {
    Bytes m;
    putFixed32(m, i);
    Status s = p.writer->sendMessage(p.to_receiver, m);
    EXPECT_EQ(s.code(), i == 1 ? StatusCode::kUnavailable : StatusCode::kOk) << s.toString();
  }
  for (uint32_t want : {0u, 2u}) {
    auto e = p.receiver->pollEvent(kDeadline);
    ASSERT_TRUE(e.has_value());
    ASSERT_EQ(e->kind, Event::Kind::kMessage);
    EXPECT_EQ(loadFixed32(e->payload.data()), want);
  }
  EXPECT_EQ(faultStats(*p.writer).messages_failed, 1u);
}

TEST_P(FaultAgent, ClosesThePeerAbruptlyAfterNWrites) {
  FaultPolicy policy;
  policy.close_peer_after_writes = 2;
  Pair p = makePair(policy);
  EXPECT_TRUE(writeOnce(p, 0).isOk());
  (void)writeOnce(p, 1024);  // the write that reaches the count: done or Unavailable
  auto e = p.receiver->pollEvent(kDeadline);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->kind, Event::Kind::kPeerLost);
  EXPECT_EQ(writeOnce(p, 2048).code(), StatusCode::kUnavailable);
  EXPECT_EQ(faultStats(*p.writer).peers_closed, 1u);
}

TEST_P(FaultAgent, ClosesTheNthConnectionRightAfterItWasAccepted) {
  FaultPolicy policy;
  policy.close_nth_connect = 1;
  AgentConfig config;
  config.backend = GetParam();
  config.auth_token = "fault-token";
  config.device = std::make_shared<device::FakeDevice>();
  auto writer = wrapWithFaults(std::move(createAgent(config)).value(), policy);
  auto receiver = std::move(createAgent(config)).value();
  // The connect returns a peer that is already gone: a kPeerLost for it is queued.
  auto dead = writer->connect(receiver->localAddress());
  ASSERT_TRUE(dead.isOk()) << dead.status().toString();
  auto lost = writer->pollEvent(kDeadline);
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->kind, Event::Kind::kPeerLost);
  EXPECT_EQ(lost->peer, *dead);
  EXPECT_EQ(writer->sendMessage(*dead, Bytes{1}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(faultStats(*writer).peers_closed, 1u);
  // The next connect is a normal one.
  auto again = writer->connect(receiver->localAddress());
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_NE(*again, *dead);
  ASSERT_TRUE(writer->sendMessage(*again, Bytes{2}).isOk());
  for (;;) {
    auto e = receiver->pollEvent(kDeadline);
    ASSERT_TRUE(e.has_value());
    if (e->kind != Event::Kind::kMessage) continue;
    EXPECT_EQ(e->payload, Bytes{2});
    break;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultAgent, ::testing::Values("inproc", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace hxfer::transport
