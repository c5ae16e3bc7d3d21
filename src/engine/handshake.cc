#include "engine/handshake.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

namespace hxfer::engine {

StatusOr<RankLayout> shapeLayout(const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank,
                                 uint32_t pp_rank, StateLayout state_layout) {
  RETURN_IF_ERROR(pc.validate(model.numLayers()));
  ASSIGN_OR_RETURN(LayerRange stage, stageLayers(pc, model.numLayers(), pp_rank));
  uint32_t blocks = 0, slots = 0;
  for (uint32_t l = stage.first; l < stage.end(); ++l) {
    if (model.layers[l].hasAttention()) blocks = 1;
    if (model.layers[l].hasRecurrent()) slots = 1;
  }
  return buildRankLayout(model, pc, tp_rank, pp_rank, state_layout, blocks, slots);
}

StatusOr<std::vector<uint32_t>> overlappingContextRanks(const ModelSpec& model,
                                                        const ParallelConfig& ctx_pc,
                                                        const RankLayout& gen) {
  std::vector<RankLayout> ctx;
  for (uint32_t p = 0; p < ctx_pc.pp; ++p) {
    for (uint32_t t = 0; t < ctx_pc.tp; ++t) {
      ASSIGN_OR_RETURN(RankLayout l, shapeLayout(model, ctx_pc, t, p, StateLayout::kPaged));
      ctx.push_back(std::move(l));
    }
  }
  // Which ranks overlap depends on layers and units only, never on how either side orders its
  // bytes: both sides in hxfer's own layout (an engine layout of the real one may order
  // elements differently, which only a transfer plan must handle).
  ASSIGN_OR_RETURN(RankLayout gen_shape,
                   shapeLayout(model, {gen.tp, gen.pp, gen.layers_per_stage}, gen.tp_rank,
                               gen.pp_rank, StateLayout::kPaged));
  ASSIGN_OR_RETURN(Planner planner, Planner::create(std::move(ctx), gen_shape));
  std::vector<uint32_t> out;
  for (const auto& s : planner.sources()) {
    const RankLayout& c = planner.ctxLayouts()[s.ctx_index];
    out.push_back(c.pp_rank * c.tp + c.tp_rank);
  }
  std::sort(out.begin(), out.end());
  return out;
}

StatusOr<std::vector<uint32_t>> overlappingGenerationRanks(const ModelSpec& model,
                                                           const RankLayout& ctx,
                                                           const RankLayout& gen_any) {
  ParallelConfig gen_pc{gen_any.tp, gen_any.pp, gen_any.layers_per_stage};
  // As above: shapes on both sides.
  ASSIGN_OR_RETURN(RankLayout ctx_shape,
                   shapeLayout(model, {ctx.tp, ctx.pp, ctx.layers_per_stage}, ctx.tp_rank,
                               ctx.pp_rank, StateLayout::kPaged));
  // Stages whose layers miss ours write nothing here: skipped without a plan. A peer's claim
  // (tp and pp up to 4096 each) must not buy it millions of plans on this rank.
  RETURN_IF_ERROR(gen_pc.validate(model.numLayers()));
  const LayerRange mine = ctx_shape.stageLayers();
  std::vector<uint32_t> stages;
  for (uint32_t p = 0; p < gen_pc.pp; ++p) {
    ASSIGN_OR_RETURN(LayerRange theirs, stageLayers(gen_pc, model.numLayers(), p));
    if (theirs.first < mine.end() && mine.first < theirs.end()) stages.push_back(p);
  }
  const uint64_t candidates = uint64_t{stages.size()} * gen_pc.tp;
  if (candidates > kMaxOverlapCandidates) {
    return ResourceExhausted("generation instance of tp=" + std::to_string(gen_pc.tp) + " pp=" +
                             std::to_string(gen_pc.pp) + " has " + std::to_string(candidates) +
                             " ranks on the stages overlapping this rank's layers, more than " +
                             std::to_string(kMaxOverlapCandidates));
  }
  std::vector<uint32_t> out;
  for (uint32_t p : stages) {
    for (uint32_t t = 0; t < gen_pc.tp; ++t) {
      ASSIGN_OR_RETURN(RankLayout g, shapeLayout(model, gen_pc, t, p, StateLayout::kPaged));
      ASSIGN_OR_RETURN(Planner planner, Planner::createForSource(ctx_shape, std::move(g)));
      if (!planner.sources().empty()) out.push_back(p * gen_pc.tp + t);
    }
  }
  return out;
}

int deviceOrdinal(device::DeviceApi* device, const HybridCacheManager& cache) {
  if (device == nullptr || cache.regions().empty()) return -1;
  auto id = device->owner(cache.regions().front()->data(), 1);
  return id.isOk() ? id->ordinal : -1;
}

Status checksumsPossible(bool checksum, bool device_memory, const std::string& agent) {
  if (!checksum || !device_memory) return OkStatus();
  return Incompatible(
      "checksum=true: checksums read the pools on the host, and these pools are device memory (" +
      agent + " agent); give checksum=false");
}

StatusOr<uint64_t> checksumOps(std::vector<CopyOp> ops, const RankMemory& mem, bool source,
                               std::span<const uint8_t> scratch) {
  std::sort(ops.begin(), ops.end(), [](const CopyOp& a, const CopyOp& b) {
    return a.dst_region != b.dst_region ? a.dst_region < b.dst_region : a.dst_offset < b.dst_offset;
  });
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) {
    return Internal("xxh3 state could not be created");
  }
  for (const CopyOp& op : ops) {
    const uint8_t* p = nullptr;
    if (source) {
      ASSIGN_OR_RETURN(p, sourceBytes(mem, scratch, op));
    } else {
      ASSIGN_OR_RETURN(p, regionBytes(mem, op.dst_region, op.dst_offset, op.bytes));
    }
    XXH3_64bits_update(state.get(), p, op.bytes);
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

RankMemory cacheMemory(const HybridCacheManager& cache) {
  RankMemory mem;
  for (const auto& r : cache.regions()) {
    if (mem.size() <= r->id()) mem.resize(r->id() + 1);
    mem[r->id()] = {r->data(), r->length()};
  }
  return mem;
}

std::string rankName(const RankLayout& layout) {
  return "(tp " + std::to_string(layout.tp_rank) + ", pp " + std::to_string(layout.pp_rank) + ")";
}

uint64_t newIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

StatusOr<std::string> instanceName(const std::string& given, std::string_view role, uint64_t ranks,
                                   std::string_view field) {
  if (!given.empty()) return given;
  if (ranks > 1) {
    return InvalidArgument(std::string(field) + " is empty, and the instance has " +
                           std::to_string(ranks) +
                           " ranks: they must share one name (each process's default is its own)");
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "host");
  char suffix[16];
  std::snprintf(suffix, sizeof(suffix), "%06x", static_cast<unsigned>(newIncarnation() & 0xffffff));
  return std::string(role) + "-" + host + "-" + std::to_string(::getpid()) + "-" + suffix;
}

}  // namespace hxfer::engine
