// Planner benchmarks: planning one 32k-token request of a Nemotron-H-8B-shaped model (52
// layers: 24 mamba2, 4 attention, 24 MLP) across parallel layouts. The planner is built once
// per (context instance, generation rank), as the engine caches it per peer pair; the timed
// part is planning the request for every generation rank. Counters: ops and bytes per request.
// Target: under 1 ms per plan. Also: the oracle's fill and check throughput.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "model/presets.h"
#include "plan/oracle.h"
#include "plan/planner.h"

namespace hxfer {
namespace {

constexpr uint32_t kTokens = 32768;

// The preset when it is compiled in; otherwise the same shape built here.
ModelSpec nemotronH8b() {
  if (auto m = loadPreset("nemotron-h-8b"); m.isOk()) return *m;
  ModelSpec m;
  m.name = "nemotron-h-8b-like";
  const std::string pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
  for (char c : pattern) {
    LayerSpec l;
    if (c == 'M') {
      l.recurrent = LayerKind::kMamba2;
      l.mamba2 = {128, 64, 8, 128, 4};
    } else if (c == '*') {
      l.attention = AttentionShape{8, 128};
    }
    m.layers.push_back(l);
  }
  return m;
}

template <typename T>
T orDie(StatusOr<T> v) {
  if (!v.isOk()) {
    std::fprintf(stderr, "%s\n", v.status().toString().c_str());
    std::abort();
  }
  return std::move(v).value();
}

struct Setup {
  std::vector<Planner> planners;  // one per generation rank
  std::vector<RankIds> ctx_ids;
  std::vector<RankIds> gen_ids;
  BlockRange blocks;
};

// ids: contiguous (one run) or shuffled (every block its own run).
Setup makeSetup(uint32_t ctx_tp, uint32_t gen_tp, StateLayout ctx_layout, StateLayout gen_layout,
                bool shuffled) {
  const ModelSpec m = nemotronH8b();
  const uint32_t blocks = (kTokens + m.tokens_per_block - 1) / m.tokens_per_block;
  const uint32_t pool = 2 * blocks;
  Setup s;
  s.blocks = {0, blocks};
  auto ids = [&](uint32_t salt) {
    RankIds r;
    r.blocks.resize(pool);
    std::iota(r.blocks.begin(), r.blocks.end(), 0u);
    if (shuffled) {
      std::mt19937_64 rng(salt);
      std::shuffle(r.blocks.begin(), r.blocks.end(), rng);
    } else {
      for (uint32_t& b : r.blocks) b = (b + salt) % pool;
    }
    r.blocks.resize(blocks);
    r.slot = salt % 4;
    return r;
  };
  std::vector<RankLayout> ctx;
  for (uint32_t r = 0; r < ctx_tp; ++r) {
    ctx.push_back(orDie(buildRankLayout(m, {ctx_tp, 1, {}}, r, 0, ctx_layout, pool, 4)));
    s.ctx_ids.push_back(ids(r + 1));
  }
  for (uint32_t r = 0; r < gen_tp; ++r) {
    RankLayout gen = orDie(buildRankLayout(m, {gen_tp, 1, {}}, r, 0, gen_layout, pool, 4));
    s.planners.push_back(orDie(Planner::create(ctx, std::move(gen))));
    s.gen_ids.push_back(ids(100 + r));
  }
  return s;
}

// Args: ctx tp, gen tp, ctx layout, gen layout (0 paged, 1 layer-major), shuffled ids.
void BM_PlanRequest(benchmark::State& state) {
  const auto layout = [](int64_t v) { return v ? StateLayout::kLayerMajor : StateLayout::kPaged; };
  Setup s = makeSetup(static_cast<uint32_t>(state.range(0)), static_cast<uint32_t>(state.range(1)),
                      layout(state.range(2)), layout(state.range(3)), state.range(4) != 0);
  // One reused plan per generation rank, as an engine keeps per peer pair.
  std::vector<RequestPlan> plans(s.planners.size());
  uint64_t ops = 0, bytes = 0;
  for (auto _ : state) {
    ops = bytes = 0;
    for (size_t g = 0; g < s.planners.size(); ++g) {
      Status st = s.planners[g].planInto(s.ctx_ids, s.gen_ids[g], s.blocks, &plans[g]);
      if (!st.isOk()) {
        state.SkipWithError(st.toString().c_str());
        return;
      }
      ops += plans[g].total_ops;
      bytes += plans[g].total_bytes;
      benchmark::DoNotOptimize(plans[g].ranks.data());
    }
  }
  state.counters["ops"] = static_cast<double>(ops);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["blocks"] = s.blocks.num_blocks;
}

void planArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ctx_tp", "gen_tp", "ctx_lm", "gen_lm", "shuffled"});
  b->Args({4, 1, 0, 0, 0});
  b->Args({1, 4, 0, 0, 0});
  b->Args({1, 1, 0, 0, 0});
  b->Args({4, 4, 0, 0, 0});
  b->Args({1, 1, 0, 1, 0});
  b->Args({4, 1, 0, 0, 1});
  b->Args({1, 1, 0, 0, 1});
  b->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_PlanRequest)->Apply(planArgs);

// Planning into a fresh plan each time (allocation and first touch of the op vectors included).
void BM_PlanRequestFresh(benchmark::State& state) {
  Setup s = makeSetup(static_cast<uint32_t>(state.range(0)), static_cast<uint32_t>(state.range(1)),
                      StateLayout::kPaged, StateLayout::kPaged, false);
  uint64_t ops = 0;
  for (auto _ : state) {
    ops = 0;
    for (size_t g = 0; g < s.planners.size(); ++g) {
      auto plan = s.planners[g].plan(s.ctx_ids, s.gen_ids[g], s.blocks);
      if (!plan.isOk()) {
        state.SkipWithError(plan.status().toString().c_str());
        return;
      }
      ops += plan->total_ops;
      benchmark::DoNotOptimize(plan->ranks.data());
    }
  }
  state.counters["ops"] = static_cast<double>(ops);
}
BENCHMARK(BM_PlanRequestFresh)->Args({4, 1})->Args({1, 4})->Unit(benchmark::kMicrosecond);

// Building the layouts and planners (done once per peer pair, not per request).
void BM_CreatePlanners(benchmark::State& state) {
  for (auto _ : state) {
    Setup s =
        makeSetup(static_cast<uint32_t>(state.range(0)), static_cast<uint32_t>(state.range(1)),
                  StateLayout::kPaged, StateLayout::kPaged, false);
    benchmark::DoNotOptimize(s.planners.data());
  }
}
BENCHMARK(BM_CreatePlanners)->Args({4, 1})->Args({1, 4})->Unit(benchmark::kMicrosecond);

// Oracle throughput on one tp-1 rank of the model: 64 blocks and one slot (~110 MB).
struct OracleRank {
  RankLayout layout;
  std::vector<std::vector<uint8_t>> buffers;
  RankMemory mem;
  RankIds ids;
};

OracleRank makeOracleRank() {
  OracleRank r;
  r.layout = orDie(buildRankLayout(nemotronH8b(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 64, 1));
  for (const RegionSpec& spec : r.layout.regions) {
    if (r.mem.size() <= spec.id) r.mem.resize(spec.id + 1);
    r.buffers.emplace_back(spec.length, 0);
    r.mem[spec.id] = {r.buffers.back().data(), spec.length};
  }
  r.ids.blocks.resize(64);
  std::iota(r.ids.blocks.begin(), r.ids.blocks.end(), 0u);
  return r;
}

void BM_OracleFillRank(benchmark::State& state) {
  OracleRank r = makeOracleRank();
  for (auto _ : state) {
    Status st = fillRank(r.layout, r.mem, r.ids, 1);
    if (!st.isOk()) state.SkipWithError(st.toString().c_str());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          (64 * r.layout.kvBytesPerBlock() + r.layout.stateBytesPerSlot()));
}
BENCHMARK(BM_OracleFillRank)->Unit(benchmark::kMillisecond);

void BM_OracleCheckRank(benchmark::State& state) {
  OracleRank r = makeOracleRank();
  if (!fillRank(r.layout, r.mem, r.ids, 1).isOk()) state.SkipWithError("fill failed");
  for (auto _ : state) {
    auto report = checkRank(r.layout, r.mem, r.ids, 1, {0, 64});
    if (!report.isOk() || !report->ok()) state.SkipWithError("check failed");
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          (64 * r.layout.kvBytesPerBlock() + r.layout.stateBytesPerSlot()));
}
BENCHMARK(BM_OracleCheckRank)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace hxfer

BENCHMARK_MAIN();
