// The fake device behind DeviceApi: ownership and its errors, ranges exported as fds and mapped
// elsewhere, streams running a real plan's pack and copy between device allocations, fences
// that hold work until the engine signals, failures and cancellation that leave nothing hung.
#include "device/fake_device.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "cache/engine_layout.h"
#include "plan/local_transfer.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"

namespace hxfer::device {
namespace {

using namespace hxfer::testing;
using namespace std::chrono_literals;

TEST(FakeDevice, OwnerNamesTheDeviceAndRefusesRangesPastTheAllocation) {
  FakeDevice dev(FakeDeviceOptions{.devices = 2});
  auto a = dev.allocate(1, 1 << 16);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  auto id = dev.owner((*a)->data() + 100, 1000);
  ASSERT_TRUE(id.isOk()) << id.status().toString();
  EXPECT_EQ(id->ordinal, 1);
  auto past = dev.owner((*a)->data() + 100, 1 << 16);
  ASSERT_FALSE(past.isOk());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("65536 bytes at offset 100 run past the end of an "
                                         "allocation of 65536 bytes on device 1"),
            std::string::npos)
      << past.status().toString();
  std::vector<uint8_t> host(64);
  EXPECT_EQ(dev.owner(host.data(), 64).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(dev.allocate(2, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.createStream(2).status().code(), StatusCode::kInvalidArgument);
  const uint8_t* gone = (*a)->data();
  a->reset();  // freed: no longer device memory
  EXPECT_EQ(dev.owner(gone, 1).status().code(), StatusCode::kNotFound);
}

TEST(FakeDevice, AnExportedRangeMapsTheSameBytesElsewhere) {
  FakeDevice dev;
  auto a = dev.allocate(0, 1 << 16);
  ASSERT_TRUE(a.isOk());
  std::iota((*a)->data(), (*a)->data() + (1 << 16), uint8_t{0});
  auto range = dev.exportRange((*a)->data() + 4096, 8192);
  ASSERT_TRUE(range.isOk()) << range.status().toString();
  EXPECT_EQ(range->kind, HandleKind::kPosixFd);
  EXPECT_GE(range->fd, 0);
  EXPECT_EQ(range->offset, 4096u);
  EXPECT_EQ(range->allocation_bytes, 1u << 16);
  auto mapped = dev.importRange(std::move(*range));
  ASSERT_TRUE(mapped.isOk()) << mapped.status().toString();
  auto* m = reinterpret_cast<uint8_t*>((*mapped)->address());
  EXPECT_NE(m, (*a)->data() + 4096) << "the import is a mapping of its own";
  EXPECT_EQ(std::memcmp(m, (*a)->data() + 4096, 8192), 0);
  m[0] = 0xEE;  // written through the peer's mapping, seen by the owner
  EXPECT_EQ((*a)->data()[4096], 0xEE);
}

TEST(FakeDevice, ImportsOfOtherKindsOrPastTheAllocationAreRefused) {
  FakeDevice dev;
  auto a = dev.allocate(0, 4096);
  ASSERT_TRUE(a.isOk());
  ExportedRange legacy;
  legacy.kind = HandleKind::kLegacyIpc;
  legacy.handle.assign(64, 1);
  auto r = dev.importRange(std::move(legacy));
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible);
  EXPECT_NE(r.status().message().find("legacy-ipc"), std::string::npos) << r.status().toString();
  auto range = dev.exportRange((*a)->data(), 4096);
  ASSERT_TRUE(range.isOk());
  range->bytes = 4097;
  r = dev.importRange(std::move(*range));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("runs past its allocation of 4096 bytes"), std::string::npos)
      << r.status().toString();
}

// A context rank's pools in fake device memory, a generation rank's pools exported and mapped
// as a peer maps them: the plan's pack and batched copy on one stream land what the oracle
// wants, for a pair that needs staging (vLLM's conv sd against ds) and one that does not.
TEST(FakeDevice, AStreamMovesAPlanBetweenDeviceAllocations) {
  const ModelSpec model = enginePairModel();
  FakeDevice dev;
  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk());
  int staged = 0, pairs = 0;
  for (const EngineLayout& ce : allEngineLayouts()) {
    for (const EngineLayout& ge : allEngineLayouts()) {
      LocalTransferOptions o;
      o.use_regions = false;
      o.ctx = {2, 1, {}};
      o.gen = {1, 1, {}};
      o.tokens = 40;
      auto ctx = makeLocalInstance(model, o.ctx, ce, 3, o, 1, true);
      auto gen = makeLocalInstance(model, o.gen, ge, 3, o, 2, true);
      if (!ctx.isOk() || !gen.isOk()) continue;
      const std::string what = ce.toString() + " -> " + ge.toString();
      LocalRank& g = (*gen)[0];
      std::vector<std::shared_ptr<Region>> allocations;
      std::vector<std::unique_ptr<Mapping>> mappings;
      // The generation pools: device allocations, exported, mapped by the context side.
      RankMemory gen_device = g.mem, gen_seen_by_ctx = g.mem;
      for (size_t i = 0; i < g.mem.size(); ++i) {
        if (g.mem[i].data == nullptr) continue;
        auto a = dev.allocate(0, g.mem[i].length);
        ASSERT_TRUE(a.isOk());
        allocations.push_back(*a);
        gen_device[i].data = (*a)->data();
        auto range = dev.exportRange((*a)->data(), g.mem[i].length);
        ASSERT_TRUE(range.isOk());
        auto m = dev.importRange(std::move(*range));
        ASSERT_TRUE(m.isOk());
        gen_seen_by_ctx[i].data = reinterpret_cast<uint8_t*>((*m)->address());
        mappings.push_back(std::move(*m));
      }
      std::vector<std::shared_ptr<Event>> events;
      std::vector<HostCopyTable> keep;
      for (LocalRank& c : *ctx) {
        ASSERT_TRUE(fillRank(c.layout, c.mem, c.ids, o.request_id).isOk());
        RankMemory ctx_device = c.mem;
        for (size_t i = 0; i < c.mem.size(); ++i) {
          if (c.mem[i].data == nullptr) continue;
          auto a = dev.allocate(0, c.mem[i].length);
          ASSERT_TRUE(a.isOk());
          std::memcpy((*a)->data(), c.mem[i].data, c.mem[i].length);
          allocations.push_back(*a);
          ctx_device[i].data = (*a)->data();
        }
        auto planner = Planner::createForSource(c.layout, g.layout);
        ASSERT_TRUE(planner.isOk()) << what;
        auto plan = planner->planRank(0, c.ids, g.ids, BlockRange{0, 3, o.tokens});
        ASSERT_TRUE(plan.isOk()) << what;
        auto scratch = dev.allocate(0, std::max<uint64_t>(plan->scratch_bytes, 1));
        ASSERT_TRUE(scratch.isOk());
        allocations.push_back(*scratch);
        auto pack = packTable(*plan, ctx_device, reinterpret_cast<uint64_t>((*scratch)->data()),
                              plan->scratch_bytes);
        ASSERT_TRUE(pack.isOk()) << what;
        auto copy = copyTable(plan->ops, ctx_device, gen_seen_by_ctx,
                              std::span<const uint8_t>((*scratch)->data(), plan->scratch_bytes));
        ASSERT_TRUE(copy.isOk()) << what;
        staged += !plan->pack_ops.empty();
        ASSERT_TRUE((*stream)->pack(*pack).isOk());
        auto done = (*stream)->copy(*copy);
        ASSERT_TRUE(done.isOk());
        events.push_back(*done);
      }
      auto all = (*stream)->record();
      ASSERT_TRUE(all.isOk());
      ASSERT_TRUE((*all)->wait(10s).isOk()) << what;
      for (auto& e : events) EXPECT_TRUE(e->done());
      for (size_t i = 0; i < g.mem.size(); ++i) {
        if (g.mem[i].data != nullptr) {
          std::memcpy(g.mem[i].data, gen_device[i].data, g.mem[i].length);
        }
      }
      auto report = checkRank(g.layout, g.mem, g.ids, o.request_id, {0, 3, o.tokens});
      ASSERT_TRUE(report.isOk()) << report.status().toString();
      EXPECT_TRUE(report->ok()) << what << ": " << report->toString();
      ++pairs;
    }
  }
  EXPECT_GT(pairs, 0);
  EXPECT_GT(staged, 0) << "no pair needed staging";
}

// One run of `n` bytes from `src` to `dst`.
HostCopyTable oneRun(const uint8_t* src, uint8_t* dst, uint64_t n) {
  const CopyRun r{reinterpret_cast<uint64_t>(src), reinterpret_cast<uint64_t>(dst), n};
  return std::move(copyTable(std::span<const CopyRun>(&r, 1))).value();
}

// The fence of the vLLM overwrite race: a write into pages the engine still uses waits for the
// engine's "pages free" event, and lands only after it.
// host_inaccessible: the host faults on device addresses, its own allocations' and imported
// ones', while a stream copies between them and hostView() shows the bytes.
TEST(FakeDevice, InaccessibleMemoryFaultsOnTheHostAndMovesOnAStream) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // sanitizers run threads of their own
  FakeDevice dev(FakeDeviceOptions{.host_inaccessible = true});
  auto a = dev.allocate(0, 1 << 16);
  auto b = dev.allocate(0, 1 << 16);
  ASSERT_TRUE(a.isOk() && b.isOk());
  uint8_t* a_view = dev.hostView((*a)->data());
  EXPECT_NE(a_view, (*a)->data()) << "the host reaches it through a mapping of its own";
  std::iota(a_view, a_view + (1 << 16), uint8_t{0});
  EXPECT_DEATH(
      {
        volatile uint8_t x = (*a)->data()[5];
        (void)x;
      },
      "")
      << "a host read of device memory must fault";
  EXPECT_DEATH({ (*b)->data()[5] = 1; }, "") << "a host write of device memory must fault";
  EXPECT_TRUE(dev.owner((*a)->data() + 10, 100).isOk());

  auto range = dev.exportRange((*b)->data() + 4096, 8192);
  ASSERT_TRUE(range.isOk()) << range.status().toString();
  auto mapped = dev.importRange(std::move(*range));
  ASSERT_TRUE(mapped.isOk()) << mapped.status().toString();
  auto* m = reinterpret_cast<uint8_t*>((*mapped)->address());
  EXPECT_DEATH({ m[0] = 1; }, "") << "an imported range is device memory too";

  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk());
  auto copied = (*stream)->copy(oneRun((*a)->data() + 100, m + 8, 5000));
  ASSERT_TRUE(copied.isOk());
  ASSERT_TRUE((*copied)->wait(5s).isOk()) << (*copied)->status().toString();
  const uint8_t* b_view = dev.hostView((*b)->data());
  for (uint32_t i = 0; i < 5000; ++i) {
    ASSERT_EQ(b_view[4096 + 8 + i], static_cast<uint8_t>(100 + i)) << "byte " << i;
  }
  EXPECT_EQ(b_view[4096 + 7], 0);
  EXPECT_EQ(b_view[4096 + 8 + 5000], 0);
  std::vector<uint8_t> host(16, 0x5A);
  EXPECT_EQ(dev.hostView(host.data()), host.data()) << "host memory is its own view";
}

TEST(FakeDevice, WorkBehindAFenceWaitsForTheEngineSignal) {
  FakeDevice dev;
  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk());
  std::vector<uint8_t> src(4096, 0x11), dst(4096, 0);
  auto pages_free = std::make_shared<ManualEvent>();
  ASSERT_TRUE((*stream)->waitFor(pages_free).isOk());
  auto copied = (*stream)->copy(oneRun(src.data(), dst.data(), 4096));
  ASSERT_TRUE(copied.isOk());
  EXPECT_EQ((*copied)->wait(100ms).code(), StatusCode::kTimeout);
  EXPECT_EQ(dst[0], 0) << "the write landed before the engine let go of the pages";
  pages_free->signal();
  ASSERT_TRUE((*copied)->wait(5s).isOk());
  EXPECT_EQ(dst[4095], 0x11);
}

TEST(FakeDevice, AFailedOpReportsItsErrorAndTheStreamGoesOn) {
  FakeDevice dev(FakeDeviceOptions{.fail_every = 2});
  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk());
  std::vector<uint8_t> src(64, 0x22), a(64, 0), b(64, 0), c(64, 0);
  auto first = (*stream)->copy(oneRun(src.data(), a.data(), 64));
  auto second = (*stream)->copy(oneRun(src.data(), b.data(), 64));
  auto third = (*stream)->copy(oneRun(src.data(), c.data(), 64));
  auto all = (*stream)->record();
  ASSERT_TRUE(first.isOk() && second.isOk() && third.isOk() && all.isOk());
  EXPECT_TRUE((*first)->wait(5s).isOk());
  const Status failed = (*second)->wait(5s);
  EXPECT_EQ(failed.code(), StatusCode::kInternal);
  EXPECT_NE(failed.message().find("op 2 failed"), std::string::npos) << failed.toString();
  EXPECT_TRUE((*third)->wait(5s).isOk());
  EXPECT_EQ(a[0], 0x22);
  EXPECT_EQ(b[0], 0) << "a failed op wrote";
  EXPECT_EQ(c[0], 0x22);
  EXPECT_EQ((*all)->wait(5s).code(), StatusCode::kInternal) << "record() hides the failure";
  EXPECT_EQ(dev.opsRun(), 3u);
}

// A stream destroyed while its work waits on an event nobody signals cancels that work: the
// events say so at once, nothing hangs and nothing is written afterwards.
TEST(FakeDevice, DestroyingAStreamCancelsWhatWaitsBehindAnUnsignalledFence) {
  FakeDevice dev;
  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk());
  std::vector<uint8_t> src(64, 0x33), dst(64, 0);
  auto never = std::make_shared<ManualEvent>();
  ASSERT_TRUE((*stream)->waitFor(never).isOk());
  auto copied = (*stream)->copy(oneRun(src.data(), dst.data(), 64));
  ASSERT_TRUE(copied.isOk());
  stream->reset();
  ASSERT_TRUE((*copied)->done());
  EXPECT_EQ((*copied)->status().code(), StatusCode::kCancelled);
  never->signal();
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(dst[0], 0);
  EXPECT_EQ(dev.opsRun(), 0u);
}

}  // namespace
}  // namespace hxfer::device
