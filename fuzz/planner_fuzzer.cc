// libFuzzer target: the planner on random pairs of parallel layouts, including layouts a
// hostile or broken peer could publish. The input chooses a model (one of the wire examples,
// with shapes, dtypes, tokens per block and layer count edited), a context instance and a
// generation rank (tp, pp, stage split, state layout, capacities), optionally flips bytes of the
// generation rank's encoded RankInfo (what a peer sends; used when it still decodes), and then a
// request (block ids, slot, first block) that may be out of range or repeat ids.
//
// Contract checked beyond "never crashes, never reads out of bounds" (ASan, UBSan):
//   * Planner::create / plan either succeed or return an error; nothing in between;
//   * an accepted plan writes exactly expectedBytes(range) bytes, every op inside the
//     regions of both layouts, no destination byte twice;
//   * a context rank planning alone (createForSource) emits the very same ops;
//   * when the request's ids are valid and the pools are small, executing the plan on memory
//     filled by the oracle reproduces every destination byte.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <tuple>
#include <vector>

#include "cache/layout.h"
#include "plan/memory.h"
#include "plan/oracle.h"
#include "plan/planner.h"
#include "wire/examples.h"
#include "wire/rank_info.h"

namespace {

using namespace hxfer;

constexpr uint64_t kMaxExecutedBytes = 8ull << 20;  // oracle run only below this much memory

void editModel(FuzzedDataProvider& in, ModelSpec& m) {
  const int edits = in.ConsumeIntegralInRange(0, 3);
  for (int e = 0; e < edits && !m.layers.empty(); ++e) {
    LayerSpec& l = m.layers[in.ConsumeIntegralInRange<size_t>(0, m.layers.size() - 1)];
    switch (in.ConsumeIntegralInRange(0, 8)) {
      case 0:
        if (l.attention) l.attention->n_kv_heads = in.ConsumeIntegralInRange<uint32_t>(0, 16);
        break;
      case 1:
        if (l.attention) l.attention->head_dim = in.ConsumeIntegralInRange<uint32_t>(0, 32);
        break;
      case 2:
        l.mamba2.n_groups = in.ConsumeIntegralInRange<uint32_t>(0, 8);
        break;
      case 3:
        l.mamba2.n_heads = in.ConsumeIntegralInRange<uint32_t>(0, 16);
        break;
      case 4:
        l.gdn.n_v_heads = in.ConsumeIntegralInRange<uint32_t>(0, 16);
        break;
      case 5:
        l.mamba1.d_inner = in.ConsumeIntegralInRange<uint32_t>(0, 64);
        break;
      case 6:
        if (l.attention) {
          l.attention.reset();
        } else {
          l.attention = AttentionShape{in.ConsumeIntegralInRange<uint32_t>(1, 8), 4};
        }
        break;
      case 7:
        l.recurrent = static_cast<LayerKind>(in.ConsumeIntegralInRange<uint8_t>(0, 4));
        break;
      default:
        l.mamba2.d_conv = in.ConsumeIntegralInRange<uint32_t>(0, 5);
        break;
    }
  }
  if (in.ConsumeBool()) m.tokens_per_block = in.ConsumeIntegralInRange<uint32_t>(0, 64);
  if (in.ConsumeBool())
    m.kv_dtype = static_cast<DType>(in.ConsumeIntegralInRange<uint8_t>(0, kMaxDType));
  if (in.ConsumeBool())
    m.ssm_dtype = static_cast<DType>(in.ConsumeIntegralInRange<uint8_t>(0, kMaxDType));
  if (in.ConsumeBool() && m.layers.size() > 1) {
    m.layers.resize(in.ConsumeIntegralInRange<size_t>(1, m.layers.size()));
  }
}

ParallelConfig pickParallel(FuzzedDataProvider& in, uint32_t num_layers) {
  static constexpr uint32_t kTps[] = {1, 2, 4, 1, 2, 3, 8, 16};
  ParallelConfig pc;
  pc.tp = kTps[in.ConsumeIntegralInRange<size_t>(0, 7)];
  pc.pp = in.ConsumeIntegralInRange<uint32_t>(1, 4);
  if (in.ConsumeIntegralInRange(0, 3) == 0) {  // an explicit (maybe wrong) stage split
    uint32_t left = num_layers;
    for (uint32_t s = 0; s < pc.pp; ++s) {
      const uint32_t n = s + 1 == pc.pp ? left : in.ConsumeIntegralInRange<uint32_t>(0, left);
      pc.layers_per_stage.push_back(n);
      left -= n;
    }
    if (in.ConsumeBool() && !pc.layers_per_stage.empty()) pc.layers_per_stage.back() += 1;
  }
  return pc;
}

StateLayout pickLayout(FuzzedDataProvider& in) {
  return in.ConsumeBool() ? StateLayout::kPaged : StateLayout::kLayerMajor;
}

// What a peer would send: the layout inside an encoded RankInfo with a few bytes flipped. The
// decoder either refuses it (then the planner never sees it) or returns a layout that passed
// checkRankInfo.
RankLayout throughTheWire(FuzzedDataProvider& in, const RankLayout& layout) {
  wire::RankInfo info;
  info.instance_id = "fuzz";
  info.role = wire::InstanceRole::kGeneration;
  info.layout = layout;
  if (!wire::checkRankInfo(info).isOk()) return layout;
  Bytes bytes = wire::encodeRankInfo(info);
  const int flips = in.ConsumeIntegralInRange(1, 4);
  for (int f = 0; f < flips && !bytes.empty(); ++f) {
    bytes[in.ConsumeIntegralInRange<size_t>(0, bytes.size() - 1)] ^= in.ConsumeIntegral<uint8_t>();
  }
  auto decoded = wire::decodeRankInfo(bytes);
  if (!decoded.isOk()) return layout;
  if (!wire::checkRankInfo(*decoded).isOk()) std::abort();  // the decoder's own promise
  return decoded->layout;
}

std::vector<uint32_t> pickIds(FuzzedDataProvider& in, size_t n, uint32_t pool) {
  std::vector<uint32_t> ids;
  for (size_t i = 0; i < n; ++i) ids.push_back(in.ConsumeIntegralInRange<uint32_t>(0, pool + 1));
  return ids;
}

bool distinct(std::vector<uint32_t> v) {
  std::sort(v.begin(), v.end());
  return std::adjacent_find(v.begin(), v.end()) == v.end();
}

uint64_t regionBytes(const RankLayout& l) {
  uint64_t n = 0;
  for (const RegionSpec& r : l.regions) n += r.length;
  return n;
}

struct Buffers {
  std::vector<std::vector<uint8_t>> storage;
  RankMemory mem;
  explicit Buffers(const RankLayout& l) {
    uint32_t max_id = 0;
    for (const RegionSpec& r : l.regions) max_id = std::max(max_id, r.id);
    mem.resize(max_id + 1);
    for (const RegionSpec& r : l.regions) {
      storage.emplace_back(r.length, 0);
      mem[r.id] = {storage.back().data(), r.length};
    }
  }
};

void checkPlan(const Planner& planner, const RequestPlan& plan, BlockRange range) {
  const auto& ctx = planner.ctxLayouts();
  const RankLayout& gen = planner.genLayout();
  if (plan.total_bytes != planner.expectedBytes(range)) std::abort();
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> dst;
  uint64_t total = 0;
  for (size_t i = 0; i < plan.ranks.size(); ++i) {
    uint64_t rank_bytes = 0;
    for (const CopyOp& op : plan.ranks[i].ops) {
      const RegionSpec* s = ctx[i].findRegion(op.src_region);
      const RegionSpec* d = gen.findRegion(op.dst_region);
      if (op.bytes == 0 || s == nullptr || d == nullptr) std::abort();
      if (op.src_offset > s->length || op.bytes > s->length - op.src_offset) std::abort();
      if (op.dst_offset > d->length || op.bytes > d->length - op.dst_offset) std::abort();
      dst.emplace_back(op.dst_region, op.dst_offset, op.bytes);
      rank_bytes += op.bytes;
    }
    if (rank_bytes != plan.ranks[i].bytes) std::abort();
    total += rank_bytes;
  }
  if (total != plan.total_bytes) std::abort();
  std::sort(dst.begin(), dst.end());
  for (size_t i = 1; i < dst.size(); ++i) {
    const auto& [r0, o0, b0] = dst[i - 1];
    const auto& [r1, o1, b1] = dst[i];
    if (r0 == r1 && o0 + b0 > o1) std::abort();  // one destination byte written twice
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const auto models = wire::examples::models();
  ModelSpec ctx_model = models[in.ConsumeIntegralInRange<size_t>(0, models.size() - 1)];
  if (in.ConsumeBool()) editModel(in, ctx_model);
  ModelSpec gen_model = ctx_model;
  if (in.ConsumeIntegralInRange(0, 3) == 0) editModel(in, gen_model);  // a different model

  const ParallelConfig ctx_pc = pickParallel(in, ctx_model.numLayers());
  const ParallelConfig gen_pc = pickParallel(in, gen_model.numLayers());
  const StateLayout ctx_layout = pickLayout(in), gen_layout = pickLayout(in);
  const uint32_t ctx_blocks = in.ConsumeIntegralInRange<uint32_t>(0, 12);
  const uint32_t gen_blocks = in.ConsumeIntegralInRange<uint32_t>(0, 12);
  const uint32_t ctx_slots = in.ConsumeIntegralInRange<uint32_t>(0, 3);
  const uint32_t gen_slots = in.ConsumeIntegralInRange<uint32_t>(0, 3);
  if (ctx_pc.worldSize() > 32) return 0;

  std::vector<RankLayout> ctx;
  for (uint32_t r = 0; r < ctx_pc.worldSize(); ++r) {
    auto l = buildRankLayout(ctx_model, ctx_pc, r % ctx_pc.tp, r / ctx_pc.tp, ctx_layout,
                             ctx_blocks, ctx_slots);
    if (!l.isOk()) return 0;  // refused: fine
    ctx.push_back(std::move(*l));
  }
  const uint32_t gen_rank = in.ConsumeIntegralInRange<uint32_t>(0, gen_pc.worldSize());
  auto gen_built = buildRankLayout(gen_model, gen_pc, gen_rank % gen_pc.tp, gen_rank / gen_pc.tp,
                                   gen_layout, gen_blocks, gen_slots);
  if (!gen_built.isOk()) return 0;
  RankLayout gen = in.ConsumeBool() ? throughTheWire(in, *gen_built) : *gen_built;

  auto planner = Planner::create(ctx, gen);
  if (!planner.isOk()) return 0;

  // A request, possibly with bad ids.
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, gen.num_blocks + 2);
  RankIds dst{pickIds(in, n, gen.num_blocks),
              in.ConsumeIntegralInRange<uint32_t>(0, gen.num_slots)};
  const uint32_t first = in.ConsumeIntegralInRange<uint32_t>(0, static_cast<uint32_t>(n) + 1);
  const BlockRange range{first, static_cast<uint32_t>(n) - std::min<uint32_t>(first, n)};
  std::vector<RankIds> src;
  for (const RankLayout& c : ctx) {
    src.push_back(
        {pickIds(in, n, c.num_blocks), in.ConsumeIntegralInRange<uint32_t>(0, c.num_slots)});
  }
  auto plan = planner->plan(src, dst, range);
  if (!plan.isOk()) return 0;
  checkPlan(*planner, *plan, range);

  // Each context rank planning alone gets the same ops.
  for (uint32_t i = 0; i < ctx.size(); ++i) {
    auto alone = Planner::createForSource(ctx[i], gen);
    if (!alone.isOk()) std::abort();
    auto p = alone->planRank(0, src[i], dst, range);
    if (!p.isOk() || p->ops != plan->ranks[i].ops) std::abort();
  }

  // Small enough and ids that name distinct pages: run it and check every byte.
  uint64_t bytes = regionBytes(gen);
  for (const RankLayout& c : ctx) bytes += regionBytes(c);
  if (bytes > kMaxExecutedBytes || !distinct(dst.blocks)) return 0;
  for (const RankIds& s : src) {
    if (!distinct(s.blocks)) return 0;
  }
  constexpr uint64_t kRequest = 42;
  Buffers gen_mem(gen);
  for (uint32_t i = 0; i < ctx.size(); ++i) {
    if (plan->ranks[i].ops.empty()) continue;
    Buffers ctx_mem(ctx[i]);
    if (!fillRank(ctx[i], ctx_mem.mem, src[i], kRequest).isOk()) return 0;
    if (!executeOps(plan->ranks[i].ops, ctx_mem.mem, gen_mem.mem).isOk()) std::abort();
  }
  auto report = checkRank(gen, gen_mem.mem, dst, kRequest, range);
  if (report.isOk() && !report->ok()) std::abort();
  return 0;
}
