// Property suite: random tiny models over every tp pair in {1,2,4,8} that the model shards at,
// pp in {1,2,4} with random stage splits, both state layouts on each side, random block ids
// and prefixes. Every case executes the plan with memcpy and proves, for every generation
// rank, that each destination byte was written exactly once, nothing else was written, and
// every byte holds what the oracle says.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>

#include <random>
#include <string>

#include "cache/engine_layout.h"
#include "plan/local_transfer.h"
#include "plan/plan_test_util.h"

namespace hxfer {
namespace {

using testing::randomModel;
using testing::randomSplit;

std::string describe(const ModelSpec& m, const LocalTransferOptions& o) {
  std::string s = "layers:";
  for (const LayerSpec& l : m.layers) s += " " + l.kindName();
  s += " T=" + std::to_string(m.tokens_per_block) + " ctx tp" + std::to_string(o.ctx.tp) + " pp" +
       std::to_string(o.ctx.pp) + " " + std::string(stateLayoutName(o.ctx_layout)) + " -> gen tp" +
       std::to_string(o.gen.tp) + " pp" + std::to_string(o.gen.pp) + " " +
       std::string(stateLayoutName(o.gen_layout)) + " tokens " + std::to_string(o.tokens) +
       " prefix " + std::to_string(o.prefix_tokens);
  return s;
}

// One request between two engine layouts at the given tp and pp; heap memory.
LocalTransferOptions enginePair(const EngineLayout& ce, const EngineLayout& ge, uint32_t ctp,
                                uint32_t cpp, uint32_t gtp, uint32_t gpp) {
  LocalTransferOptions o;
  o.use_regions = false;
  o.ctx = {ctp, cpp, {}};
  o.gen = {gtp, gpp, {}};
  o.ctx_engine = ce;
  o.gen_engine = ge;
  return o;
}

// "vllm(kv=nhd,conv=sd) T16 tp2 pp1 -> sglang T32 tp1 pp1" (T only when the sides differ).
std::string pairName(const LocalTransferOptions& o) {
  const bool by_token = o.ctx_tokens_per_block != o.gen_tokens_per_block;
  auto side = [&](const EngineLayout& e, uint32_t t, const ParallelConfig& pc) {
    return e.toString() + (by_token ? " T" + std::to_string(t) : "") + " tp" +
           std::to_string(pc.tp) + " pp" + std::to_string(pc.pp);
  };
  return side(*o.ctx_engine, o.ctx_tokens_per_block, o.ctx) + " -> " +
         side(*o.gen_engine, o.gen_tokens_per_block, o.gen);
}

// Runs one engine-pair case and expects every byte verified. False (nothing expected) when a
// vllm side's page is too small for the Mamba page at its block size: vLLM refuses that too.
bool runVerified(const ModelSpec& model, const LocalTransferOptions& o, const std::string& what) {
  auto r = runLocalTransfer(model, o);
  if (!r.isOk() && r.status().message().find("vLLM raises the block size") != std::string::npos) {
    return false;
  }
  EXPECT_TRUE(r.isOk()) << what << ": " << r.status().toString();
  if (r.isOk()) {
    EXPECT_TRUE(r->verified()) << what << ": " << r->oracle.toString() << " / "
                               << r->first_coverage_error << " bytes " << r->total_bytes
                               << " expected " << r->expected_bytes;
  }
  return true;
}

TEST(PlannerProperty, RandomModelsEveryTpPairPpAndLayoutMoveEveryByteExactlyOnce) {
  std::mt19937_64 rng(20240611);
  const uint32_t tps[] = {1, 2, 4, 8};
  const uint32_t pps[] = {1, 2, 4};
  int cases = 0;
  int kinds_seen[5] = {0, 0, 0, 0, 0};
  for (int model_i = 0; model_i < 24; ++model_i) {
    const ModelSpec model = randomModel(rng);
    ASSERT_TRUE(model.validate().isOk()) << model.validate().toString();
    for (const LayerSpec& l : model.layers) {
      kinds_seen[static_cast<int>(l.recurrent)]++;
      if (l.hasAttention()) kinds_seen[static_cast<int>(LayerKind::kAttention)]++;
    }
    for (uint32_t ctx_tp : tps) {
      for (uint32_t gen_tp : tps) {
        LocalTransferOptions o;
        o.use_regions = false;
        o.ctx.tp = ctx_tp;
        o.gen.tp = gen_tp;
        if (!checkShardable(model, o.ctx).isOk() || !checkShardable(model, o.gen).isOk()) continue;
        auto pick = [&](uint32_t n) {
          return std::uniform_int_distribution<uint32_t>(0, n - 1)(rng);
        };
        o.ctx.pp = std::min(pps[pick(3)], model.numLayers());
        o.gen.pp = std::min(pps[pick(3)], model.numLayers());
        o.ctx.layers_per_stage = randomSplit(rng, model.numLayers(), o.ctx.pp);
        o.gen.layers_per_stage = randomSplit(rng, model.numLayers(), o.gen.pp);
        o.ctx_layout = pick(2) ? StateLayout::kPaged : StateLayout::kLayerMajor;
        o.gen_layout = pick(2) ? StateLayout::kPaged : StateLayout::kLayerMajor;
        o.tokens = 1 + pick(6 * model.tokens_per_block);
        o.prefix_tokens = pick(3) == 0 ? 0 : pick(o.tokens + 1);
        o.shuffle_blocks = pick(4) != 0;
        o.spare_blocks = pick(4);
        o.seed = rng();
        o.request_id = rng();
        auto r = runLocalTransfer(model, o);
        ASSERT_TRUE(r.isOk()) << describe(model, o) << ": " << r.status().toString();
        EXPECT_EQ(r->coverage_errors, 0u) << describe(model, o) << ": " << r->first_coverage_error;
        EXPECT_TRUE(r->oracle.ok()) << describe(model, o) << ": " << r->oracle.toString();
        EXPECT_EQ(r->total_bytes, r->expected_bytes) << describe(model, o);
        EXPECT_EQ(r->oracle.bytes_checked, r->expected_bytes) << describe(model, o);
        ASSERT_TRUE(r->verified()) << describe(model, o);
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 200);
  for (int k = 1; k < 5; ++k) EXPECT_GT(kinds_seen[k], 0) << "layer kind " << k << " never drawn";
}

// Same as above at a fixed model that has every kind, including a parallel attention + mamba2
// layer and replicated units (1 kv head, 1 B/C group) at every tp > 1, over every pair.
TEST(PlannerProperty, EveryKindWithReplicationEveryTpPairBothLayouts) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 3, 1, 5, 4);
  hybrid.attention = AttentionShape{2, 3};
  const ModelSpec model = makeModel(
      {attentionLayer(1, 5), mamba2Layer(8, 3, 1, 5, 4), gdnLayer(2, 4, 3, 2, 3),
       mamba1Layer(8, 3, 4), hybrid, LayerSpec{}, attentionLayer(1, 5), mamba2Layer(8, 3, 1, 5, 4)},
      3);
  int cases = 0;
  for (uint32_t ctx_tp : {1u, 2u, 4u, 8u}) {
    for (uint32_t gen_tp : {1u, 2u, 4u, 8u}) {
      for (uint32_t pp : {1u, 2u, 4u}) {
        for (int layouts = 0; layouts < 4; ++layouts) {
          LocalTransferOptions o;
          o.use_regions = false;
          o.ctx = {ctx_tp, pp, {}};
          o.gen = {gen_tp, pp == 1 ? 2u : 1u, {}};
          o.ctx_layout = (layouts & 1) ? StateLayout::kLayerMajor : StateLayout::kPaged;
          o.gen_layout = (layouts & 2) ? StateLayout::kLayerMajor : StateLayout::kPaged;
          o.tokens = 10;
          o.prefix_tokens = 4;
          o.seed = cases;
          auto r = runLocalTransfer(model, o);
          ASSERT_TRUE(r.isOk()) << describe(model, o) << ": " << r.status().toString();
          EXPECT_TRUE(r->verified()) << describe(model, o) << ": " << r->oracle.toString() << " / "
                                     << r->first_coverage_error << " bytes " << r->total_bytes
                                     << " expected " << r->expected_bytes;
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 4 * 3 * 4);
}

// Runs every pair over the tp and pp pairs engines deploy (6 x 3), each case a 37-token
// request (with a 16-token prefix in one case of three) that `vary(case, options)` may change,
// and expects every byte verified. Returns the cases run before the first failure.
int runOverTpAndPpPairs(const ModelSpec& model,
                        const std::vector<std::pair<EngineLayout, EngineLayout>>& pairs,
                        const std::function<void(int, LocalTransferOptions&)>& vary) {
  const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {4, 1}, {1, 4}, {2, 4}};
  const std::pair<uint32_t, uint32_t> pps[] = {{1, 1}, {2, 1}, {1, 2}};
  int cases = 0;
  for (const auto& [ce, ge] : pairs) {
    for (const auto& [ctp, gtp] : tps) {
      for (const auto& [cpp, gpp] : pps) {
        LocalTransferOptions o = enginePair(ce, ge, ctp, cpp, gtp, gpp);
        o.tokens = 37;
        o.prefix_tokens = cases % 3 == 0 ? 16 : 0;
        o.seed = cases;
        vary(cases, o);
        if (!runVerified(model, o, pairName(o)) || ::testing::Test::HasFailure()) return cases;
        ++cases;
      }
    }
  }
  return cases;
}

// Every engine layout pair (docs/layouts.md) over the tp and pp pairs engines deploy: attention,
// mamba2 (groups replicated at tp 4) and mamba1 layers, every destination byte exactly once
// from the right unit, nothing else written (padding and gaps included). vLLM's SD conv state
// against DS goes through the staging phase (below).
TEST(PlannerProperty, EveryEnginePairTpPairAndPpPairMovesEveryByteExactlyOnce) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  const ModelSpec model =
      makeModel({attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4), mamba1Layer(8, 4, 3), hybrid,
                 attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4)},
                16);
  std::vector<std::pair<EngineLayout, EngineLayout>> pairs;
  for (const EngineLayout& a : allEngineLayouts()) {
    for (const EngineLayout& b : allEngineLayouts()) pairs.push_back({a, b});
  }
  const int cases = runOverTpAndPpPairs(model, pairs, [](int, LocalTransferOptions&) {});
  EXPECT_EQ(cases, static_cast<int>(allEngineLayouts().size() * allEngineLayouts().size()) * 6 * 3);
}

// vLLM's CPU attention orders (per head K then V; the vec kernels' K transposed, and the AMX
// packing with split token and dim): each moves between two ranks of its own order over every
// tp and pp pair, per-layer and shared tensors both ways, with token ranges in some cases
// (cpu) and prefixes, every byte once. The AMX order needs bf16 and multiples of 32.
TEST(PlannerProperty, VllmCpuAttentionOrdersMoveEveryByteExactlyOnceBetweenRanksOfTheirOrder) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 32};
  ModelSpec model =
      makeModel({attentionLayer(4, 32), mamba2Layer(8, 2, 2, 4, 4), hybrid, attentionLayer(4, 32),
                 mamba2Layer(8, 2, 2, 4, 4), mamba2Layer(8, 2, 2, 4, 4)},
                32);
  model.kv_dtype = DType::kBf16;
  std::vector<std::pair<EngineLayout, EngineLayout>> pairs;
  for (const EngineLayout& a : cpuEngineLayouts()) {
    for (const EngineLayout& b : cpuEngineLayouts()) {
      if (a.kv == b.kv) pairs.push_back({a, b});
    }
  }
  const int cases = runOverTpAndPpPairs(model, pairs, [](int i, LocalTransferOptions& o) {
    if (i % 4 == 1 && o.ctx_engine->kv == KvOrder::kCpu) {
      o.ctx_tokens_per_block = 32;
      o.gen_tokens_per_block = 64;
    }
  });
  EXPECT_EQ(cases, static_cast<int>(pairs.size()) * 6 * 3);
  // Against another kv order every run is one element: refused, naming the staging limit.
  LocalTransferOptions o =
      enginePair(*parseEngineLayout("vllm", "cpu"), *parseEngineLayout("vllm", "nhd"), 1, 1, 1, 1);
  o.tokens = 37;
  auto r = runLocalTransfer(model, o);
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible) << r.status().toString();
  EXPECT_NE(r.status().message().find("staging is built for state records only"), std::string::npos)
      << r.status().toString();
}

// vLLM's shared per-group tensors (a block id is an attention page of one layer and a Mamba
// state of others; a request has a state id per group of Mamba layers, drawn from the block
// pool) to and from every engine layout and itself, over every tp and pp pair, with token
// ranges and layer ranges in some cases: every destination byte exactly once from the right
// unit and nothing else, the records of other groups sharing the pages included.
TEST(PlannerProperty, VllmSharedTensorsMoveEveryByteExactlyOnceToAndFromEveryEngineLayout) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  const LayerSpec mamba = mamba2Layer(8, 2, 2, 4, 4);
  // vLLM's groups: attention {0, 3}; Mamba {1, 5}, {2, 6}, {3, 7}, {4}: two shared tensors.
  const ModelSpec model =
      makeModel({attentionLayer(4, 8), mamba, mamba, hybrid, mamba, mamba, mamba, mamba}, 16);
  std::vector<std::pair<EngineLayout, EngineLayout>> pairs;
  for (const EngineLayout& s : sharedEngineLayouts()) {
    for (const EngineLayout& e : allEngineLayouts()) {
      pairs.push_back({s, e});
      pairs.push_back({e, s});
    }
    for (const EngineLayout& e : sharedEngineLayouts()) pairs.push_back({s, e});
  }
  const int cases = runOverTpAndPpPairs(model, pairs, [](int i, LocalTransferOptions& o) {
    if (i % 4 == 1) o.gen_tokens_per_block = 32;
    if (i % 5 == 2) o.layer_cuts = {2, 4, 5};
  });
  const int shared = static_cast<int>(sharedEngineLayouts().size());
  EXPECT_EQ(cases, shared * (2 * static_cast<int>(allEngineLayouts().size()) + shared) * 6 * 3);
}

// vLLM's grouping over random hybrid models: random counts and orders of attention, Mamba-2 and
// hybrid layers (and layers without a cache) make groups of every size, padded last groups,
// and pp stages holding some layers of some groups; a shared side against a random layout,
// both ways. Every byte exactly once; models whose attention layers make several groups are
// refused naming that, and counted.
TEST(PlannerProperty, VllmSharedTensorsOfRandomModelsMoveEveryByteExactlyOnce) {
  using namespace testing;
  std::mt19937_64 rng(20261205);
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  const LayerSpec kinds[] = {attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4), hybrid, LayerSpec{}};
  std::vector<EngineLayout> layouts = allEngineLayouts();
  for (const EngineLayout& e : sharedEngineLayouts()) layouts.push_back(e);
  int cases = 0, refused = 0;
  while (cases < 300) {
    std::vector<LayerSpec> layers(2 * (2 + rng() % 7));
    bool cache = false;
    for (LayerSpec& l : layers) {
      // Attention rarer than Mamba, as in the hybrids engines serve.
      const uint64_t k = rng() % 10;
      l = kinds[k < 2 ? 0 : k < 8 ? 1 : k < 9 ? 2 : 3];
      cache |= l.hasCache();
    }
    if (!cache) continue;
    const ModelSpec model = makeModel(layers, 16);
    const EngineLayout shared = sharedEngineLayouts()[rng() % 2];
    const EngineLayout other = layouts[rng() % layouts.size()];
    const bool shared_ctx = rng() % 2 == 0;
    LocalTransferOptions o =
        enginePair(shared_ctx ? shared : other, shared_ctx ? other : shared,
                   static_cast<uint32_t>(1 + rng() % 2), static_cast<uint32_t>(1 + rng() % 2),
                   static_cast<uint32_t>(1 + rng() % 2), static_cast<uint32_t>(1 + rng() % 2));
    o.tokens = 1 + static_cast<uint32_t>(rng() % 70);
    o.seed = rng();
    auto r = runLocalTransfer(model, o);
    if (!r.isOk() && r.status().message().find("KV cache groups of") != std::string::npos) {
      ++refused;
      continue;
    }
    ASSERT_TRUE(r.isOk()) << pairName(o) << ": " << r.status().toString();
    ASSERT_TRUE(r->verified()) << pairName(o) << ": " << r->oracle.toString() << " / "
                               << r->first_coverage_error;
    ++cases;
  }
  std::printf("[ vllm shared ] %d random models verified, %d refused (several attention groups)\n",
              cases, refused);
  EXPECT_LT(refused, cases);
}

// Streaming (LayerRange): a request planned per range of layers, the ranges' plans run
// together, is the whole request: every engine pair, tp and pp pair, random cuts (one range
// per layer at times, cuts past a stage's layers at others), one case in three by token ranges.
TEST(PlannerProperty, LayerRangesTogetherMoveEveryByteExactlyOnceForEveryEnginePair) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  const ModelSpec model =
      makeModel({attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4), gdnLayer(2, 4, 2, 3, 3), hybrid,
                 mamba1Layer(8, 4, 3), attentionLayer(4, 8)},
                16);
  const uint32_t n = static_cast<uint32_t>(model.layers.size());
  const std::pair<uint32_t, uint32_t> tps[] = {{2, 1}, {1, 2}, {4, 1}};
  const std::pair<uint32_t, uint32_t> pps[] = {{1, 1}, {2, 1}, {1, 2}};
  std::mt19937_64 rng(20261205);
  int cases = 0, refused = 0;
  for (const EngineLayout& ce : allEngineLayouts()) {
    for (const EngineLayout& ge : allEngineLayouts()) {
      for (const auto& [ctp, gtp] : tps) {
        for (const auto& [cpp, gpp] : pps) {
          LocalTransferOptions o = enginePair(ce, ge, ctp, cpp, gtp, gpp);
          o.tokens = 37;
          o.prefix_tokens = cases % 4 == 0 ? 16 : 0;
          o.seed = cases;
          if (cases % 3 == 0) {
            o.ctx_tokens_per_block = 16;
            o.gen_tokens_per_block = 32;
          }
          if (cases % 2 == 0) {
            for (uint32_t l = 1; l < n; ++l) o.layer_cuts.push_back(l);
          } else {
            for (uint32_t l = 1; l <= n; ++l) {
              if (rng() % 2 == 0) o.layer_cuts.push_back(l);
            }
          }
          if (!runVerified(model, o, pairName(o))) {
            ++refused;
            continue;
          }
          ASSERT_FALSE(HasFailure());
          ++cases;
        }
      }
    }
  }
  EXPECT_LT(refused, cases / 4);
}

// Tokens per block that differ between the sides (vLLM picks large pages for hybrids, SGLang
// often 1, TensorRT-LLM 32): kv moves by token ranges, each a run of tokens inside one context
// block and one generation block, for every engine layout pair, tp pair and pp pair, with
// requests that end inside a block and prefixes that start inside a context block. Every
// destination token row the request fills is written exactly once from the right unit and
// token; rows past the request's end and everything else stay untouched.
TEST(PlannerProperty, DifferentTokensPerBlockMoveEveryTokenExactlyOnceForEveryEnginePair) {
  using namespace testing;
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  const ModelSpec model = makeModel(
      {attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4), hybrid, attentionLayer(2, 8)}, 16);
  const std::pair<uint32_t, uint32_t> tpbs[] = {{16, 32}, {32, 16}, {8, 24},
                                                {24, 8},  {12, 20}, {64, 16}};
  const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {2, 4}};
  const std::pair<uint32_t, uint32_t> pps[] = {{1, 1}, {2, 1}};
  std::mt19937_64 rng(20261204);
  int cases = 0, refused = 0;
  for (const EngineLayout& ce : allEngineLayouts()) {
    for (const EngineLayout& ge : allEngineLayouts()) {
      for (const auto& [ct, gt] : tpbs) {
        for (const auto& [ctp, gtp] : tps) {
          const auto [cpp, gpp] = pps[(cases + refused) % 2];
          LocalTransferOptions o = enginePair(ce, ge, ctp, cpp, gtp, gpp);
          o.ctx_tokens_per_block = ct;
          o.gen_tokens_per_block = gt;
          o.tokens = 1 + static_cast<uint32_t>(rng() % 150);
          o.prefix_tokens = rng() % 2 ? static_cast<uint32_t>(rng() % o.tokens) : 0;
          o.seed = rng();
          const std::string what = pairName(o) + ", " + std::to_string(o.tokens) +
                                   " tokens, prefix " + std::to_string(o.prefix_tokens);
          if (!runVerified(model, o, what)) {
            ++refused;
            continue;
          }
          ASSERT_FALSE(HasFailure());
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 2000);
  EXPECT_LT(refused, cases / 4);
}

// Op counts by token ranges are the runs contiguous on both sides: 64 tokens in blocks of 16 on
// one side and of 32 on the other make 4 pieces. NHD halves (token, head, dim) keep a piece's
// tokens of every head contiguous on both sides: one op per piece and half of each layer. hxfer's
// [K|V][head][token][dim] keeps one head's tokens contiguous: one op per piece, half and head.
// Block ids are consecutive on both sides here, so where both layouts put block i + 1 right
// after block i (vllm-0.25's per-layer tensors: V of block i, then K of block i + 1; hxfer's
// [block][layer]) the last run of one block and the first of the next continue on both sides
// and merge: one op fewer per layer for vllm-0.25, one in all for hxfer. vLLM 0.32 keeps K and V
// side by side per (token, head): its whole 64 tokens of a layer are one run on both sides, and
// against NHD halves every (token, head, K or V) is a run of its own.
TEST(PlannerTokens, OpsAreOneRunPerPieceAndHalfForNhdAndPerHeadForHnd) {
  using namespace testing;
  const ModelSpec model =
      makeModel({attentionLayer(4, 8), attentionLayer(4, 8), attentionLayer(4, 8)}, 16);
  struct Case {
    EngineLayout ctx, gen;
    uint64_t ops;
  };
  const Case cases[] = {
      {*parseEngineLayout("vllm-0.25", "nhd"), *parseEngineLayout("vllm-0.25", "nhd"),
       3 * 4 * 2 - 3},
      {*parseEngineLayout("trtllm-v2", "nhd"), *parseEngineLayout("vllm-0.25", "nhd"), 3 * 4 * 2},
      {*parseEngineLayout("hxfer"), *parseEngineLayout("hxfer"), 3 * 4 * 2 * 4 - 1},
      {*parseEngineLayout("vllm-0.25", "hnd"), *parseEngineLayout("trtllm-v1"), 3 * 4 * 2 * 4},
      {*parseEngineLayout("vllm", "nhd"), *parseEngineLayout("vllm", "nhd"), 3},
      {*parseEngineLayout("trtllm-v2", "nhd"), *parseEngineLayout("vllm", "nhd"), 3 * 64 * 4 * 2},
  };
  for (const Case& k : cases) {
    for (const auto& [ct, gt] : {std::pair{16u, 32u}, std::pair{32u, 16u}}) {
      LocalTransferOptions o;
      o.use_regions = false;
      o.ctx_engine = k.ctx;
      o.gen_engine = k.gen;
      o.ctx_tokens_per_block = ct;
      o.gen_tokens_per_block = gt;
      o.tokens = 64;
      o.shuffle_blocks = false;
      auto r = runLocalTransfer(model, o);
      const std::string what = k.ctx.toString() + " T" + std::to_string(ct) + " -> " +
                               k.gen.toString() + " T" + std::to_string(gt);
      ASSERT_TRUE(r.isOk()) << what << ": " << r.status().toString();
      EXPECT_TRUE(r->verified()) << what << ": " << r->oracle.toString();
      EXPECT_EQ(r->total_ops, k.ops) << what;
      EXPECT_EQ(r->total_bytes, 64u * 3 * 2 * 4 * 8 * 2) << what;
    }
  }
}

// Where the element order inside a unit differs (vLLM's SD conv state against DS, vLLM's gdn
// ssm (head_v, head_k) against hxfer's (key, value)), a run contiguous on both sides is one
// element. Such state records are staged: the context rank packs them, in the destination's
// element order, into a staging area (pack ops, element-sized locally) and writes runs
// contiguous in the destination from there. Every byte verifies, and no transfer op is one
// element; kv records are never staged (a head_dim of 1 against another kv order is refused).
TEST(PlannerProperty, ElementOrderThatDiffersInsideUnitsIsStagedOnTheContextRank) {
  using namespace testing;
  const ModelSpec mamba = makeModel({attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4)}, 16);
  const ModelSpec gdn = makeModel({attentionLayer(4, 8), gdnLayer(2, 4, 4, 6, 3)}, 16);
  struct Case {
    const ModelSpec* model;
    EngineLayout ctx, gen;
  };
  const Case cases[] = {
      {&mamba, *parseEngineLayout("vllm"), *parseEngineLayout("hxfer")},
      {&mamba, *parseEngineLayout("hxfer", "", "", "layer-major"), *parseEngineLayout("vllm")},
      {&mamba, *parseEngineLayout("vllm", "hnd", "sd"), *parseEngineLayout("vllm", "nhd", "ds")},
      {&gdn, *parseEngineLayout("vllm", "", "ds"), *parseEngineLayout("hxfer")},
      {&gdn, *parseEngineLayout("sglang"), *parseEngineLayout("vllm")},
  };
  const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {2, 4}};
  int staged = 0;
  for (const Case& k : cases) {
    for (const auto& [ctp, gtp] : tps) {
      const std::string what = k.ctx.toString() + " tp" + std::to_string(ctp) + " -> " +
                               k.gen.toString() + " tp" + std::to_string(gtp);
      LocalTransferOptions o;
      o.use_regions = false;
      o.ctx = {ctp, 1, {}};
      o.gen = {gtp, 1, {}};
      o.ctx_engine = k.ctx;
      o.gen_engine = k.gen;
      o.tokens = 20;
      auto r = runLocalTransfer(*k.model, o);
      ASSERT_TRUE(r.isOk()) << what << ": " << r.status().toString();
      ASSERT_TRUE(r->verified()) << what << ": " << r->oracle.toString() << " / "
                                 << r->first_coverage_error;
      EXPECT_GT(r->total_pack_ops, 0u) << what;
      // The ops themselves, per (context rank, generation rank).
      for (uint32_t g = 0; g < gtp; ++g) {
        auto gl = buildEngineLayout(*k.model, o.gen, g, 0, k.gen, 4, 2);
        ASSERT_TRUE(gl.isOk()) << gl.status().toString();
        for (uint32_t c = 0; c < ctp; ++c) {
          auto cl = buildEngineLayout(*k.model, o.ctx, c, 0, k.ctx, 4, 2);
          ASSERT_TRUE(cl.isOk()) << cl.status().toString();
          auto planner = Planner::createForSource(*cl, *gl);
          ASSERT_TRUE(planner.isOk()) << what << ": " << planner.status().toString();
          auto plan = planner->planRank(0, {{0, 1}, 1}, {{3, 2}, 0}, {0, 2});
          ASSERT_TRUE(plan.isOk()) << what << ": " << plan.status().toString();
          uint64_t from_scratch = 0;
          for (const CopyOp& op : plan->ops) {
            EXPECT_GT(op.bytes, 4u) << what << ": an element-sized transfer op";
            if (op.src_region == kScratchRegion) from_scratch += op.bytes;
          }
          uint64_t packed = 0;
          for (const PackOp& op : plan->pack_ops) packed += op.bytes();
          EXPECT_EQ(packed, plan->scratch_bytes) << what;
          EXPECT_EQ(from_scratch, plan->scratch_bytes) << what;
          staged += plan->scratch_bytes != 0;
        }
      }
    }
  }
  EXPECT_GT(staged, 20);

  // kv with one element per head row: NHD against HND moves one element per run.
  const ModelSpec tiny_heads = makeModel({attentionLayer(4, 1)}, 16);
  LocalTransferOptions o;
  o.use_regions = false;
  o.ctx_engine = *parseEngineLayout("vllm", "nhd", "");
  o.gen_engine = *parseEngineLayout("trtllm-v2", "hnd", "");
  o.tokens = 20;
  auto r = runLocalTransfer(tiny_heads, o);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible);
  EXPECT_NE(r.status().message().find("the element order inside a unit differs"), std::string::npos)
      << r.status().toString();
  EXPECT_NE(r.status().message().find("staging is built for state records only"), std::string::npos)
      << r.status().toString();
}

// NHD at a TP mismatch: every op is one token's run of the heads both ranks share, K and V
// side by side (vLLM 0.32; per K and per V half in vllm-0.25), and no more ops than that (runs
// that continue on both sides merge).
TEST(PlannerProperty, NhdAtATpMismatchMovesOneRunPerTokenAndHalf) {
  using namespace testing;
  const ModelSpec m = makeModel({attentionLayer(4, 8)}, 16);
  LocalTransferOptions o;
  o.use_regions = false;
  o.ctx = {1, 1, {}};
  o.gen = {2, 1, {}};
  o.ctx_engine = *parseEngineLayout("vllm");
  o.gen_engine = *parseEngineLayout("vllm");
  o.tokens = 48;  // 3 blocks
  o.shuffle_blocks = true;
  auto r = runLocalTransfer(m, o);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_TRUE(r->verified());
  // Per gen rank: 3 blocks x 16 tokens runs of 2 heads x [K|V] x 8 x 2 bytes.
  EXPECT_EQ(r->total_ops, 2u * 3 * 16);
  EXPECT_EQ(r->total_bytes, 2u * 3 * 2 * 16 * 32);
  o.ctx_engine = o.gen_engine = *parseEngineLayout("vllm-0.25");
  r = runLocalTransfer(m, o);
  ASSERT_TRUE(r.isOk() && r->verified());
  // Per gen rank: 3 blocks x 2 halves x 16 tokens runs of 2 heads x 8 x 2 bytes.
  EXPECT_EQ(r->total_ops, 2u * 3 * 2 * 16);
  o.ctx_engine = o.gen_engine = *parseEngineLayout("vllm");
  // Same tp: one op per block (the whole page continues on both sides).
  o.gen = {1, 1, {}};
  r = runLocalTransfer(m, o);
  ASSERT_TRUE(r.isOk() && r->verified());
  EXPECT_EQ(r->total_ops, 3u);
}

}  // namespace
}  // namespace hxfer
