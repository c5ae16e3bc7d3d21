// The CUDA launches on a GPU: the storm through the batched copy and an engine pair's pack and
// copy, checked against the host emulation and the oracle. Skipped where no GPU is.
#include "device/kernels.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "cache/engine_layout.h"
#include "device/cuda_device.h"
#include "plan/local_transfer.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"

namespace hxfer::device {
namespace {

using namespace hxfer::testing;

#define SKIP_WITHOUT_GPU()                                \
  do {                                                    \
    auto n = cudaDevices();                               \
    if (!n.isOk()) GTEST_SKIP() << n.status().toString(); \
  } while (0)

// Device memory of `bytes`, freed with the object.
struct DeviceBuffer {
  explicit DeviceBuffer(uint64_t bytes) : bytes(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr); }
  void* ptr = nullptr;
  uint64_t bytes = 0;
};

TEST(DeviceGpu, AStormOfRunsIsOneLaunchAndMovesEveryRun) {
  SKIP_WITHOUT_GPU();
  constexpr uint32_t kRuns = 262'528;
  constexpr uint64_t kRun = 512;
  std::vector<uint8_t> host(kRuns * kRun), back(kRuns * kRun);
  std::mt19937_64 rng(11);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  DeviceBuffer src(host.size()), dst(host.size());
  ASSERT_EQ(cudaMemcpy(src.ptr, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst.ptr, 0, dst.bytes), cudaSuccess);
  const ShuffledRuns storm = shuffledRuns(reinterpret_cast<uint64_t>(src.data()),
                                          reinterpret_cast<uint64_t>(dst.data()), kRuns, kRun, 11);
  auto t = copyTable(storm.runs);
  ASSERT_TRUE(t.isOk());
  ASSERT_TRUE(copyOnDevice(*t).isOk());
  ASSERT_EQ(cudaMemcpy(back.data(), dst.ptr, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint32_t i = 0; i < kRuns; ++i) {
    ASSERT_EQ(std::memcmp(back.data() + storm.destinationOffset(i),
                          host.data() + uint64_t{i} * kRun, kRun),
              0)
        << "run " << i;
  }
}

// vLLM's conv sd at tp 4 into SGLang at tp 1 and back: the pack kernel's staging area is the
// host's bit for bit, and the batched copy leaves the generation pages as the oracle wants.
TEST(DeviceGpu, PackAndCopyOfEngineLayoutsMatchTheOracle) {
  SKIP_WITHOUT_GPU();
  const ModelSpec model = enginePairModel();
  int checked = 0;
  for (const EngineLayout& ce : allEngineLayouts()) {
    for (const EngineLayout& ge : allEngineLayouts()) {
      LocalTransferOptions o;
      o.use_regions = false;
      o.ctx = {4, 1, {}};
      o.gen = {1, 1, {}};
      o.tokens = 45;
      const uint32_t blocks = 3;
      auto ctx = makeLocalInstance(model, o.ctx, ce, blocks, o, 1, true);
      auto gen = makeLocalInstance(model, o.gen, ge, blocks, o, 2, true);
      if (!ctx.isOk() || !gen.isOk()) continue;
      const std::string what = ce.toString() + " -> " + ge.toString();
      LocalRank& g = (*gen)[0];
      // Device copies of every region of each side, and device views of them.
      std::vector<std::unique_ptr<DeviceBuffer>> held;
      auto upload = [&](const RankMemory& m) {
        RankMemory d = m;
        for (size_t i = 0; i < m.size(); ++i) {
          if (m[i].data == nullptr) continue;
          held.push_back(std::make_unique<DeviceBuffer>(m[i].length));
          EXPECT_EQ(cudaMemcpy(held.back()->ptr, m[i].data, m[i].length, cudaMemcpyHostToDevice),
                    cudaSuccess);
          d[i].data = held.back()->data();
        }
        return d;
      };
      const RankMemory gdev = upload(g.mem);
      for (LocalRank& c : *ctx) {
        ASSERT_TRUE(fillRank(c.layout, c.mem, c.ids, o.request_id).isOk());
        const RankMemory cdev = upload(c.mem);
        auto planner = Planner::createForSource(c.layout, g.layout);
        ASSERT_TRUE(planner.isOk()) << what;
        auto plan = planner->planRank(0, c.ids, g.ids, BlockRange{0, blocks, o.tokens});
        ASSERT_TRUE(plan.isOk()) << what;
        std::vector<uint8_t> want(plan->scratch_bytes), got(plan->scratch_bytes);
        ASSERT_TRUE(packScratch(*plan, c.mem, want).isOk());
        DeviceBuffer scratch(std::max<uint64_t>(plan->scratch_bytes, 1));
        auto pack =
            packTable(*plan, cdev, reinterpret_cast<uint64_t>(scratch.ptr), plan->scratch_bytes);
        ASSERT_TRUE(pack.isOk()) << what;
        ASSERT_TRUE(packOnDevice(*pack).isOk()) << what;
        ASSERT_EQ(cudaMemcpy(got.data(), scratch.ptr, got.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(got, want) << what;
        auto copy = copyTable(plan->ops, cdev, gdev,
                              std::span<const uint8_t>(scratch.data(), plan->scratch_bytes));
        ASSERT_TRUE(copy.isOk()) << what;
        ASSERT_TRUE(copyOnDevice(*copy).isOk()) << what;
      }
      for (size_t i = 0; i < g.mem.size(); ++i) {
        if (g.mem[i].data == nullptr) continue;
        ASSERT_EQ(cudaMemcpy(g.mem[i].data, gdev[i].data, g.mem[i].length, cudaMemcpyDeviceToHost),
                  cudaSuccess);
      }
      auto report = checkRank(g.layout, g.mem, g.ids, o.request_id, {0, blocks, o.tokens});
      ASSERT_TRUE(report.isOk()) << report.status().toString();
      EXPECT_TRUE(report->ok()) << what << ": " << report->toString();
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

// Without a driver the CUDA device says why it cannot be had (this one runs where there is no
// GPU, and skips where there is).
TEST(CudaDevice, WithoutADriverSaysWhy) {
  if (cudaDevices().isOk()) GTEST_SKIP() << "a GPU is here";
  auto d = createCudaDevice();
  ASSERT_FALSE(d.isOk());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status().toString();
  EXPECT_NE(d.status().message().find("no CUDA device"), std::string::npos);
}

// The seam over CUDA in one process: ownership and its errors, a legacy IPC export of
// cudaMalloc memory at an offset, a batched copy on a stream waited for by its event, and host
// registration.
TEST(CudaDevice, OwnsExportsAndCopiesOnAStream) {
  SKIP_WITHOUT_GPU();
  auto made = createCudaDevice();
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  DeviceApi& dev = **made;
  constexpr uint64_t kLen = 1 << 20;
  DeviceBuffer a(kLen), b(kLen);
  auto owner = dev.owner(a.data() + 100, 1000);
  ASSERT_TRUE(owner.isOk()) << owner.status().toString();
  EXPECT_EQ(owner->ordinal, 0);
  std::vector<uint8_t> host(kLen);
  std::iota(host.begin(), host.end(), 0);
  EXPECT_EQ(dev.owner(host.data(), 16).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(dev.owner(a.data() + 4096, kLen).status().code(), StatusCode::kInvalidArgument);

  auto range = dev.exportRange(a.data() + 4096, 8192);
  ASSERT_TRUE(range.isOk()) << range.status().toString();
  EXPECT_EQ(range->kind, HandleKind::kLegacyIpc);
  EXPECT_EQ(range->handle.size(), 64u);
  EXPECT_EQ(range->offset, 4096u);
  EXPECT_GE(range->allocation_bytes, kLen);

  ASSERT_EQ(cudaMemcpy(a.ptr, host.data(), kLen, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(b.ptr, 0, kLen), cudaSuccess);
  const ShuffledRuns storm = shuffledRuns(reinterpret_cast<uint64_t>(a.data()),
                                          reinterpret_cast<uint64_t>(b.data()), 2048, 512, 5);
  auto table = copyTable(storm.runs);
  ASSERT_TRUE(table.isOk());
  auto stream = dev.createStream(0);
  ASSERT_TRUE(stream.isOk()) << stream.status().toString();
  auto done = (*stream)->copy(*table);
  ASSERT_TRUE(done.isOk());
  ASSERT_TRUE((*done)->wait(std::chrono::seconds(60)).isOk()) << (*done)->status().toString();
  std::vector<uint8_t> got(kLen);
  ASSERT_EQ(cudaMemcpy(got.data(), b.ptr, kLen, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint32_t i = 0; i < 2048; ++i) {
    ASSERT_EQ(std::memcmp(got.data() + storm.destinationOffset(i), host.data() + i * 512, 512), 0)
        << "run " << i;
  }
  auto pinned = dev.registerHost(host.data(), kLen);
  EXPECT_TRUE(pinned.isOk()) << pinned.status().toString();
}

}  // namespace
}  // namespace hxfer::device
