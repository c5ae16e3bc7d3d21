#include "plan/local_transfer.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

namespace hxfer {
namespace {

std::vector<uint32_t> blockIds(uint32_t request_blocks, uint32_t pool_blocks, uint64_t rank,
                               const LocalTransferOptions& o, uint64_t salt) {
  std::vector<uint32_t> ids(pool_blocks);
  if (o.shuffle_blocks) {
    std::iota(ids.begin(), ids.end(), 0u);
    std::mt19937_64 rng(o.seed * 1000003 + salt * 1009 + rank);
    std::shuffle(ids.begin(), ids.end(), rng);
  } else {
    const uint32_t start = static_cast<uint32_t>((rank + salt) % (o.spare_blocks + 1));
    std::iota(ids.begin(), ids.end(), start);
  }
  ids.resize(request_blocks);
  return ids;
}

// Proves that the ops wrote every byte of the request's destination records exactly once and
// nothing else: the ops' destination ranges must not overlap one another, and their union must
// equal the union of the records. Works on intervals, so it costs O(ops log ops), not O(bytes).
class Coverage {
 public:
  void add(const CopyOp& op) {
    if (op.bytes > 0) written_.push_back({op.dst_region, op.dst_offset, op.dst_offset + op.bytes});
  }
  // Returns the number of violations; the first one is described in *first (if empty). kv
  // token rows at or past `token_end` are not part of the request's records.
  uint64_t finish(const RankLayout& l, const RankIds& ids, BlockRange blocks, uint64_t token_end,
                  std::string* first) {
    std::vector<Range> expected;
    const uint64_t t = l.tokens_per_block;
    for (const PoolView& v : l.views) {
      const uint64_t lo = v.indexedByBlock() ? blocks.first_block : 0;
      const uint64_t hi = v.indexedByBlock() ? blocks.end() : 1;
      for (uint64_t pos = lo; pos < hi; ++pos) {
        const uint64_t index = v.indexedByBlock() ? ids.blocks[pos] : ids.stateId(v.state_group);
        const uint64_t rows =
            v.indexedByBlock() ? std::min(t, token_end - std::min(token_end, pos * t)) : 0;
        for (uint32_t li = 0; li < v.layers.size(); ++li) {
          const uint64_t off = v.offset(index, li);
          if (!v.record && (!v.indexedByBlock() || rows == t)) {
            expected.push_back({v.region_id, off, off + v.record_bytes});
            continue;
          }
          // A described record (or a kv block the request fills in part): its elements' bytes,
          // padding, gaps and token rows past the request excluded.
          const RecordLayout r = v.record ? *v.record : kvRecordLayout(l, v).value();
          const auto token_dims = std::count_if(
              r.dims.begin(), r.dims.end(), [](const RecordDim& d) { return d.name == "token"; });
          if (v.indexedByBlock() && token_dims > 1 && rows < t) {
            // A split token dim (mixed radix): the elements whose token index is below rows.
            std::vector<uint64_t> at(r.dims.size(), 0);
            for (;;) {
              uint64_t token = 0, addr = off;
              for (size_t i = 0; i < r.dims.size(); ++i) {
                if (r.dims[i].name == "token") token = token * r.dims[i].size + at[i];
                addr += at[i] * r.dims[i].stride;
              }
              if (token < rows) expected.push_back({v.region_id, addr, addr + r.element_bytes});
              size_t i = r.dims.size();
              while (i > 0 && ++at[i - 1] == r.dims[i - 1].size) at[--i] = 0;
              if (i == 0) break;
            }
            continue;
          }
          std::vector<BoxDim> box;
          for (const RecordDim& d : r.dims) {
            const uint64_t size =
                v.indexedByBlock() && d.name == "token" && token_dims == 1 ? rows : d.size;
            box.push_back({size, d.stride, d.stride});
          }
          forEachRun(box, r.element_bytes, 0, off, [&](uint64_t, uint64_t b, uint64_t n) {
            expected.push_back({v.region_id, b, b + n});
          });
        }
      }
    }
    uint64_t bad = 0;
    auto report = [&](const std::string& what) {
      ++bad;
      if (first->empty()) *first = what;
    };
    std::sort(written_.begin(), written_.end());
    for (size_t i = 1; i < written_.size(); ++i) {
      if (written_[i].region == written_[i - 1].region && written_[i].begin < written_[i - 1].end) {
        report("region " + std::to_string(written_[i].region) + " bytes [" +
               std::to_string(written_[i].begin) + ", " +
               std::to_string(std::min(written_[i].end, written_[i - 1].end)) +
               ") written more than once");
      }
    }
    const std::vector<Range> got = merged(written_);
    const std::vector<Range> want = merged(std::move(expected));
    if (got != want) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      auto text = [](const std::vector<Range>& v, size_t i) {
        if (i >= v.size()) return std::string("nothing");
        return "region " + std::to_string(v[i].region) + " [" + std::to_string(v[i].begin) + ", " +
               std::to_string(v[i].end) + ")";
      };
      report("written bytes differ from the request's records: written " + text(got, i) +
             ", records " + text(want, i));
    }
    written_.clear();
    return bad;
  }

 private:
  struct Range {
    uint32_t region;
    uint64_t begin, end;
    auto operator<=>(const Range&) const = default;
  };
  static std::vector<Range> merged(std::vector<Range> v) {
    std::sort(v.begin(), v.end());
    std::vector<Range> out;
    for (const Range& r : v) {
      if (!out.empty() && out.back().region == r.region && r.begin <= out.back().end) {
        out.back().end = std::max(out.back().end, r.end);
      } else {
        out.push_back(r);
      }
    }
    return out;
  }
  std::vector<Range> written_;
};

}  // namespace

StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   StateLayout layout, uint32_t request_blocks,
                                                   const LocalTransferOptions& o, uint64_t salt,
                                                   bool allocate) {
  EngineLayout e;
  e.state = layout;
  return makeLocalInstance(model, pc, e, request_blocks, o, salt, allocate);
}

StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   const EngineLayout& layout,
                                                   uint32_t request_blocks,
                                                   const LocalTransferOptions& o, uint64_t salt,
                                                   bool allocate) {
  auto build = [&layout](const ModelSpec& m, const ParallelConfig& p, uint32_t tp_rank,
                         uint32_t pp_rank, uint32_t num_blocks, uint32_t num_slots) {
    return buildEngineLayout(m, p, tp_rank, pp_rank, layout, num_blocks, num_slots);
  };
  return makeLocalInstance(model, pc, build, request_blocks, o, salt, allocate);
}

StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   const RankLayoutBuilder& build,
                                                   uint32_t request_blocks,
                                                   const LocalTransferOptions& o, uint64_t salt,
                                                   bool allocate) {
  std::vector<LocalRank> ranks;
  const uint32_t pool_blocks = request_blocks + o.spare_blocks;
  for (uint32_t pp = 0; pp < pc.pp; ++pp) {
    for (uint32_t tp = 0; tp < pc.tp; ++tp) {
      LocalRank r;
      ASSIGN_OR_RETURN(
          r.layout, build(model, pc, tp, pp, std::max(pool_blocks, 1u), std::max(o.num_slots, 1u)));
      const uint64_t k = uint64_t{pp} * pc.tp + tp;
      if (r.layout.joint_ids) {
        // Blocks and states share one pool: room for the request's blocks and one state per
        // group, the states on ids no block of the request has.
        const uint32_t groups = r.layout.state_groups;
        const uint32_t joint = std::max(pool_blocks, 1u) + groups;
        ASSIGN_OR_RETURN(r.layout, build(model, pc, tp, pp, joint, joint));
        r.ids.blocks = blockIds(request_blocks, joint, k, o, salt);
        std::vector<bool> used(joint, false);
        for (uint32_t b : r.ids.blocks) used[b] = true;
        std::vector<uint32_t> states;
        for (uint32_t i = 0; i < joint && states.size() < groups; ++i) {
          const uint32_t id = static_cast<uint32_t>((i + k + salt) % joint);
          if (used[id]) continue;
          states.push_back(id);
          used[id] = true;
        }
        r.ids.slot = states.front();
        r.ids.group_slots.assign(states.begin() + 1, states.end());
      } else {
        r.ids.blocks = blockIds(request_blocks, std::max(pool_blocks, 1u), k, o, salt);
        r.ids.slot = static_cast<uint32_t>((k + salt) % std::max(o.num_slots, 1u));
      }
      if (allocate) {
        for (const RegionSpec& spec : r.layout.regions) {
          if (r.mem.size() <= spec.id) r.mem.resize(spec.id + 1);
          if (o.use_regions) {
            ASSIGN_OR_RETURN(auto region, Region::allocate(spec.id, spec.length,
                                                           Region::Backing::kAnonymous, spec.name));
            r.mem[spec.id] = {region->data(), region->length()};
            r.regions.push_back(std::move(region));
          } else {
            r.buffers.emplace_back(spec.length);
            r.mem[spec.id] = {r.buffers.back().data(), spec.length};
          }
        }
      }
      ranks.push_back(std::move(r));
    }
  }
  return ranks;
}

uint64_t checkCoverage(const RequestPlan& plan, const RankLayout& gen, const RankIds& ids,
                       BlockRange blocks, std::string* first, uint64_t token_end) {
  Coverage coverage;
  for (const RankPlan& rp : plan.ranks) {
    for (const CopyOp& op : rp.ops) coverage.add(op);
  }
  return coverage.finish(gen, ids, blocks, token_end, first);
}

namespace {

// Replaces each rank's part of `plan` by the union of its plans per layer range (o.layer_cuts).
Status planByLayerRanges(const Planner& planner, const std::vector<RankIds>& ctx_ids,
                         const RankIds& gen_ids, BlockRange blocks, const LocalTransferOptions& o,
                         RequestPlan* plan) {
  std::vector<LayerRange> ranges;
  uint32_t begin = 0;
  for (uint32_t cut : o.layer_cuts) {
    if (cut < begin) return InvalidArgument("layer cuts must ascend");
    ranges.push_back({begin, cut - begin});
    begin = cut;
  }
  ranges.push_back({begin, UINT32_MAX - begin});
  plan->total_bytes = plan->total_ops = plan->total_pack_ops = 0;
  for (RankPlan& rp : plan->ranks) {
    RankPlan joined;
    joined.ctx_index = rp.ctx_index;
    joined.scratch_bytes = rp.scratch_bytes;
    for (const LayerRange& r : ranges) {
      ASSIGN_OR_RETURN(RankPlan part,
                       planner.planRank(rp.ctx_index, ctx_ids[rp.ctx_index], gen_ids, blocks, r));
      joined.ops.insert(joined.ops.end(), part.ops.begin(), part.ops.end());
      joined.pack_ops.insert(joined.pack_ops.end(), part.pack_ops.begin(), part.pack_ops.end());
      joined.bytes += part.bytes;
    }
    rp = std::move(joined);
    plan->total_bytes += rp.bytes;
    plan->total_ops += rp.ops.size();
    plan->total_pack_ops += rp.pack_ops.size();
  }
  return OkStatus();
}

}  // namespace

StatusOr<LocalTransferResult> runLocalTransfer(const ModelSpec& model,
                                               const LocalTransferOptions& o) {
  if (o.tokens == 0) return InvalidArgument("tokens=0 (a request has at least one token)");
  if (o.prefix_tokens > o.tokens) {
    return InvalidArgument("prefix_tokens=" + std::to_string(o.prefix_tokens) +
                           " > tokens=" + std::to_string(o.tokens));
  }
  ModelSpec ctx_model = model, gen_model = model;
  if (o.ctx_tokens_per_block != 0) ctx_model.tokens_per_block = o.ctx_tokens_per_block;
  if (o.gen_tokens_per_block != 0) gen_model.tokens_per_block = o.gen_tokens_per_block;
  const uint32_t tc = ctx_model.tokens_per_block, tg = gen_model.tokens_per_block;
  if (tc == 0 || tg == 0) return InvalidArgument("tokens_per_block=0");
  const uint32_t ctx_blocks = (o.tokens + tc - 1) / tc;
  const uint32_t request_blocks = (o.tokens + tg - 1) / tg;
  LocalTransferResult out;
  out.blocks.first_block = o.prefix_tokens / tg;
  out.blocks.num_blocks = request_blocks - out.blocks.first_block;
  out.blocks.num_tokens = o.tokens;

  EngineLayout ce, ge;
  ce.state = o.ctx_layout;
  ge.state = o.gen_layout;
  auto instance = [&](const ModelSpec& m, const ParallelConfig& pc, const RankLayoutBuilder& build,
                      const EngineLayout& engine, uint32_t blocks, uint64_t salt) {
    return build ? makeLocalInstance(m, pc, build, blocks, o, salt, o.execute)
                 : makeLocalInstance(m, pc, engine, blocks, o, salt, o.execute);
  };
  ASSIGN_OR_RETURN(std::vector<LocalRank> ctx, instance(ctx_model, o.ctx, o.ctx_builder,
                                                        o.ctx_engine.value_or(ce), ctx_blocks, 1));
  ASSIGN_OR_RETURN(
      std::vector<LocalRank> gen,
      instance(gen_model, o.gen, o.gen_builder, o.gen_engine.value_or(ge), request_blocks, 2));
  std::vector<RankLayout> ctx_layouts;
  std::vector<RankIds> ctx_ids;
  for (LocalRank& r : ctx) {
    if (o.execute) RETURN_IF_ERROR(fillRank(r.layout, r.mem, r.ids, o.request_id));
    ctx_layouts.push_back(r.layout);
    ctx_ids.push_back(r.ids);
  }
  out.executed = o.execute;
  for (LocalRank& g : gen) {
    ASSIGN_OR_RETURN(Planner planner, Planner::create(ctx_layouts, g.layout));
    ASSIGN_OR_RETURN(RequestPlan plan, planner.plan(ctx_ids, g.ids, out.blocks));
    if (!o.layer_cuts.empty())
      RETURN_IF_ERROR(planByLayerRanges(planner, ctx_ids, g.ids, out.blocks, o, &plan));
    out.expected_bytes += planner.expectedBytes(out.blocks);
    const uint64_t token_end = planner.kvTokens(out.blocks).second;
    out.total_bytes += plan.total_bytes;
    out.total_ops += plan.total_ops;
    out.total_pack_ops += plan.total_pack_ops;
    for (const RankPlan& rp : plan.ranks) {
      if (rp.ops.empty()) continue;
      const RankLayout& c = ctx_layouts[rp.ctx_index];
      out.pairs.push_back(
          {c.tp_rank, c.pp_rank, g.layout.tp_rank, g.layout.pp_rank, rp.ops.size(), rp.bytes});
    }
    if (!o.execute) continue;
    for (const RankPlan& rp : plan.ranks) {
      RETURN_IF_ERROR(executePlan(rp, ctx[rp.ctx_index].mem, g.mem));
    }
    if (o.check_coverage) {
      out.coverage_errors +=
          checkCoverage(plan, g.layout, g.ids, out.blocks, &out.first_coverage_error, token_end);
    }
    ASSIGN_OR_RETURN(OracleReport report,
                     checkRank(g.layout, g.mem, g.ids, o.request_id, out.blocks, token_end));
    out.oracle.merge(report);
  }
  return out;
}

}  // namespace hxfer
