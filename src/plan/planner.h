// The transfer planner: which bytes of which context rank go where on one generation rank
// (DESIGN §5).
//
// Input: the layouts (cache::RankLayout) of the context ranks and of one generation rank, and
// per request the block ids / slot on each side. Output, per context rank: a list of CopyOps
// (region + offset on both sides) such that
//   * every destination byte of the request that the generation rank owns is written exactly
//     once: the kv records of the blocks [first_block, first_block + num_blocks) and the conv
//     and ssm records of its slot, for every local layer;
//   * each byte comes from a context rank holding the same logical unit (same global layer,
//     role, section and global unit; for kv, the same block position in the request);
//   * nothing else is written.
// Units are matched per section (K|V, x|B|C, Q|K|V, heads, channels), never as one flat range:
// a flat split of the conv state is the bug that silently corrupts output at TP mismatch.
// A unit replicated on the context side (units < ctx tp) has exactly one writer, chosen
// deterministically: the holder with the same TP position when there is one (same TP keeps
// every copy rank-local), otherwise rotated by global layer among the holders that cover this
// generation rank, so that reads spread over the context ranks.
//
// Every address goes through PoolView::offset(index, local_layer), so paged and layer-major
// layouts map onto each other in any direction. Adjacent ops whose source and destination are
// both contiguous are merged: same TP + same layout + consecutive blocks collapses a request to
// one op per pool and block run.
//
// The source -> destination mapping of each (layer, role) is computed once per (context
// layout, generation layout) by Planner::create; planning a request only walks block ids.
// A context rank's plan depends only on its own layout, the generation layout and the two
// sides' ids, so a context rank can plan alone (Planner::createForSource).
//
// Pure: no I/O, no threads. A Planner is immutable after creation; const methods may be called
// from any number of threads at once.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/layout.h"
#include "common/status.h"

namespace hxfer {

// The source region id of ops that read a request's staging area (RankPlan::pack_ops fill it);
// an executor binds it to memory of RankPlan::scratch_bytes before running the ops.
inline constexpr uint32_t kScratchRegion = 0xFFFFFFFFu;

// One contiguous copy. Offsets are relative to the start of the region.
struct CopyOp {
  uint32_t src_region = 0;
  uint64_t src_offset = 0;
  uint32_t dst_region = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
  bool operator==(const CopyOp&) const = default;
};

// One staged section gathered into the staging area: the elements of a box (`dims`, outermost
// first: size, byte stride in the source as `a_stride`, in the staging area as `b_stride`), each
// `element_bytes`, from region `src_region` at `src_offset` on into the staging area at
// `scratch_offset` on, laid out there in the destination's element order (contiguous).
struct PackOp {
  uint32_t src_region = 0;
  uint64_t src_offset = 0;
  uint64_t scratch_offset = 0;
  uint32_t element_bytes = 0;
  std::vector<BoxDim> dims;
  uint64_t elements() const;
  uint64_t bytes() const { return elements() * element_bytes; }
  bool operator==(const PackOp&) const = default;
};

// A request's ids on one rank.
struct RankIds {
  std::vector<uint32_t> blocks;  // the request's block ids in token order (position i = block i)
  uint32_t slot = 0;             // its recurrent state slot (the id of state group 0)
  // The ids of state groups 1.. (RankLayout::state_groups - 1 of them; vLLM's shared per-group
  // tensors: one per group of Mamba layers).
  std::vector<uint32_t> group_slots{};
  // The id indexing state views of `group`. REQUIRES: group <= group_slots.size().
  uint32_t stateId(uint32_t group) const { return group == 0 ? slot : group_slots[group - 1]; }
};

// The ids of an allocation: its blocks, slot (0 when none) and group slots.
inline RankIds idsOf(const Allocation& a) {
  return RankIds{a.blocks, a.slot.value_or(0), a.group_slots};
}

// Ids of `blocks` blocks and of every state group that planning on `l` accepts, for plans whose
// source addresses go unused (the generation rank hashing its destination): the states on ids
// 0.. and, with one id pool, the blocks on the ids after them.
RankIds placeholderIds(const RankLayout& l, uint64_t blocks);

// Whether `ids` name the state ids `l` needs (state_groups of them), each < num_slots and,
// with joint ids, none also one of the request's blocks or another group's state id.
// InvalidArgument names `side` ("gen", "ctx"), the id and its place.
Status checkStateIds(const RankLayout& l, const RankIds& ids, std::string_view side);

// Which kv blocks move: the generation rank's positions [first_block, first_block + num_blocks)
// of the request. Positions before first_block are a prefix the generation side already holds.
// When the two sides' tokens per block are the same, whole blocks move and num_tokens is not
// read. When they differ, kv moves by token ranges: tokens [first_block * T_gen,
// min(end() * T_gen, num_tokens)) (num_tokens 0: the whole of the generation blocks), read from
// the context blocks that hold them (Planner::kvTokens).
struct BlockRange {
  uint32_t first_block = 0;
  uint32_t num_blocks = 0;
  uint64_t num_tokens = 0;  // the request's length in tokens; 0: every token of the blocks
  uint64_t end() const { return uint64_t{first_block} + num_blocks; }
};

// The ops one context rank runs for one request towards the planner's generation rank.
//
// Staging: where the element order inside a unit differs between the two sides (vLLM's SD
// conv state against DS, gdn ssm (head_v, head_k) against (key, value)), a run contiguous on
// both sides would be one element. Those state records go in two phases: `pack_ops` (local
// strided gathers on the context rank, one per staged section, from its pools into a staging
// area of `scratch_bytes`, laid out in the destination's element order) and then ordinary ops
// whose source is kScratchRegion, each a run contiguous in the destination. Transfer ops are
// never element-sized.
struct RankPlan {
  uint32_t ctx_index = 0;  // index into the planner's context layouts
  std::vector<CopyOp> ops;
  uint64_t bytes = 0;            // sum of ops' bytes
  std::vector<PackOp> pack_ops;  // src: the context rank's pools
  uint64_t scratch_bytes = 0;    // 0: no staging
};

struct RequestPlan {
  std::vector<RankPlan> ranks;  // one per context layout, same order (empty when no overlap)
  uint64_t total_bytes = 0;
  uint64_t total_ops = 0;       // transfer ops (pack_ops not counted)
  uint64_t total_pack_ops = 0;  // local staging gathers (one per staged section)
};

// What one context rank sends to the generation rank per request.
struct SourceSummary {
  uint32_t ctx_index = 0;
  uint64_t kv_bytes_per_block = 0;  // per block position sent
  uint64_t state_bytes = 0;         // per request (the slot's conv + ssm records)
};

// Checks that a context rank and a generation rank can exchange state, before any byte moves:
// model fingerprint, kv/conv/ssm dtypes, tokens per block, number of layers, TP divisibility
// of every section on both sides, structural validity of both layouts, and, for every global
// layer both hold, the same roles with the same sections. Refusals are Incompatible (or the
// layout's own InvalidArgument) naming the field and both values, e.g.
// "ctx ssm dtype fp32 != gen ssm dtype bf16".
Status checkCompatible(const RankLayout& ctx, const RankLayout& gen);

// Checks that `ctx` is one whole context instance: non-empty, the same tp/pp/stage split,
// model and dtypes on every rank, and every (tp_rank, pp_rank) exactly once.
Status checkInstance(const std::vector<RankLayout>& ctx);

class Planner {
 public:
  // Planner for every rank of a context instance towards one generation rank. Runs
  // checkInstance(ctx) and checkCompatible(c, gen) for every c.
  static StatusOr<Planner> create(std::vector<RankLayout> ctx, RankLayout gen);
  // Planner for a single context rank (the context side of the engine plans alone). Its
  // ctx_index is 0.
  static StatusOr<Planner> createForSource(RankLayout ctx, RankLayout gen);

  // The ops context rank `ctx_index` runs. `src` are that rank's ids, `dst` the generation
  // rank's. Errors (InvalidArgument): block lists shorter than blocks.end() on a side that
  // moves kv, ids outside the pools, a destination block id repeated in the range.
  // `layers` limits the plan to those global layers, as streaming sends a request's layers when
  // prefill finishes them (ContextSender::markReady with a range). Each layer's records belong
  // to one range of a partition, so a partition's plans together are the whole request's
  // (ops merge only inside one range). RankPlan::bytes is then the range's bytes.
  StatusOr<RankPlan> planRank(uint32_t ctx_index, const RankIds& src, const RankIds& dst,
                              BlockRange blocks, LayerRange layers = kAllLayers) const;
  // planRank for every context rank. ctx_ids has one entry per context layout.
  StatusOr<RequestPlan> plan(const std::vector<RankIds>& ctx_ids, const RankIds& dst,
                             BlockRange blocks) const;
  // The same, reusing the capacity of *out's op vectors (a request's ops can be hundreds of
  // KiB; reusing them avoids fresh pages per request). *out is changed only on success.
  Status planRankInto(uint32_t ctx_index, const RankIds& src, const RankIds& dst, BlockRange blocks,
                      RankPlan* out, LayerRange layers = kAllLayers) const;
  Status planInto(const std::vector<RankIds>& ctx_ids, const RankIds& dst, BlockRange blocks,
                  RequestPlan* out) const;

  // Context ranks that send anything to this generation rank (the peers it must contact).
  const std::vector<SourceSummary>& sources() const { return sources_; }
  // Bytes the generation rank receives per request: num_blocks * gen.kvBytesPerBlock() +
  // gen.stateBytesPerSlot() (same tokens per block), or the kv bytes of kvTokens(blocks) +
  // gen.stateBytesPerSlot() (different).
  uint64_t expectedBytes(BlockRange blocks) const;
  uint64_t expectedBytes(uint32_t num_blocks) const {
    return expectedBytes(BlockRange{0, num_blocks});
  }
  // The request's tokens whose kv moves, [first, end): whole blocks of the range when both sides
  // have the same tokens per block, else clipped to blocks.num_tokens (see BlockRange).
  std::pair<uint64_t, uint64_t> kvTokens(BlockRange blocks) const;
  // True when the context and generation ranks have different tokens per block (kv then moves
  // by token ranges).
  bool byToken() const {
    return !ctx_.empty() && ctx_[0].tokens_per_block != gen_.tokens_per_block;
  }

  const std::vector<RankLayout>& ctxLayouts() const { return ctx_; }
  const RankLayout& genLayout() const { return gen_; }

  // Internal mapping, public only so that the .cc helpers can name them.
  struct Segment {  // bytes at src_off in the source record go to dst_off in the destination
    uint64_t src_off = 0, dst_off = 0, bytes = 0;
  };
  // One section of a kv record pair when the two sides' tokens per block differ: the box of
  // shared logical elements (as in forEachRun, a = context, b = generation) at token 0 of both
  // blocks. A run of n tokens from context offset i to generation offset j is the box with
  // dims[token_dim].size = n, both bases moved by i and j tokens.
  struct TokenBox {
    std::vector<BoxDim> dims;
    uint32_t token_dim = 0;
    uint64_t ctx_base = 0, gen_base = 0;
    uint64_t element_bytes = 0;
  };
  struct RecordMap {     // one (source view, local layer) -> (destination view, local layer)
    uint32_t layer = 0;  // global
    uint32_t src_region = 0, dst_region = 0;
    uint32_t src_group = 0, dst_group = 0;  // state views: the state groups indexing them
    uint64_t src_base = 0, src_stride = 0;  // offset(index, layer) = base + index * stride
    uint64_t dst_base = 0, dst_stride = 0;
    uint32_t seg_begin = 0, seg_end = 0;  // into SourceMap::segments
    uint32_t box_begin = 0, box_end = 0;  // into SourceMap::token_boxes (kv, by token)
    // Staged sections (slot maps only): source record -> staging offset, then staging offset
    // -> destination record.
    uint32_t pack_begin = 0, pack_end = 0;      // into SourceMap::packs (src record-relative)
    uint32_t staged_begin = 0, staged_end = 0;  // into SourceMap::staged
  };
  struct BlockGroup {  // record maps of one (ctx kv view, gen kv view) pair, in layer order
    uint32_t map_begin = 0, map_end = 0;
  };
  struct SourceMap {
    std::vector<RecordMap> block_maps;  // grouped by BlockGroup
    std::vector<BlockGroup> block_groups;
    std::vector<RecordMap> slot_maps;  // in source address order
    std::vector<Segment> segments;
    std::vector<PackOp> packs;    // src_offset in the source record; src_region unused
    std::vector<Segment> staged;  // src_off in the staging area, dst_off in the destination record
    uint64_t kv_bytes_per_block = 0, state_bytes = 0;
    uint64_t scratch_bytes = 0;  // staging area per request
    bool by_token = false;       // the sides' tokens per block differ: kv maps use token_boxes
    std::vector<TokenBox> token_boxes;
    uint64_t kv_bytes_per_token = 0;  // by_token only
  };

 private:
  Planner() = default;
  static StatusOr<Planner> build(std::vector<RankLayout> ctx, RankLayout gen);
  Status checkDst(const RankIds& dst, BlockRange blocks) const;
  Status checkSrc(uint32_t ctx_index, const RankIds& src, BlockRange blocks) const;
  void emit(uint32_t ctx_index, const RankIds& src, const RankIds& dst, BlockRange blocks,
            LayerRange layers, RankPlan* out) const;

  std::vector<RankLayout> ctx_;
  RankLayout gen_;
  std::vector<SourceMap> maps_;  // one per ctx layout
  std::vector<SourceSummary> sources_;
};

// One-shot form: Planner::create(ctx, gen) then plan(). Prefer a cached Planner per peer pair.
StatusOr<RequestPlan> planRequest(const std::vector<RankLayout>& ctx,
                                  const std::vector<RankIds>& ctx_ids, const RankLayout& gen,
                                  const RankIds& gen_ids, BlockRange blocks);

}  // namespace hxfer
