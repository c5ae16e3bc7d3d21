// A whole transfer in one process: every rank of a context instance and of a generation
// instance gets real pools, the context side is filled with the oracle, each generation rank's
// plan runs with memcpy, and every destination byte is checked (the oracle) and accounted for
// (the ops' destination ranges are disjoint and their union is exactly the request's
// destination records: each byte written once, nothing else written).
// Used by `hxfer plan --verify`, the planner's property tests and benchmarks.
//
// Not thread-safe; one call owns all the memory it allocates.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/engine_layout.h"
#include "cache/layout.h"
#include "cache/region.h"
#include "common/status.h"
#include "model/model.h"
#include "plan/memory.h"
#include "plan/oracle.h"
#include "plan/planner.h"

namespace hxfer {

// Builds the layout of rank (tp_rank, pp_rank) of an instance with the given capacities (blocks
// for kv, slots for state), as buildEngineLayout does for a named engine layout.
using RankLayoutBuilder = std::function<StatusOr<RankLayout>(
    const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
    uint32_t num_blocks, uint32_t num_slots)>;

struct LocalTransferOptions {
  ParallelConfig ctx, gen;
  StateLayout ctx_layout = StateLayout::kPaged;
  StateLayout gen_layout = StateLayout::kPaged;
  // When set, the side is laid out as that engine keeps it (engine_layout.h) instead of
  // hxfer's own ctx_layout / gen_layout.
  std::optional<EngineLayout> ctx_engine, gen_engine;
  // Tokens per kv block of each side; 0: the model's. When they differ, kv moves by token
  // ranges (BlockRange).
  uint32_t ctx_tokens_per_block = 0, gen_tokens_per_block = 0;
  // When set, the side's layouts come from this builder instead (layouts no named engine
  // makes, e.g. the random record descriptions of the planner's property tests).
  RankLayoutBuilder ctx_builder, gen_builder;
  uint32_t tokens = 1024;      // request length; blocks = ceil(tokens / tokens_per_block)
  uint32_t prefix_tokens = 0;  // already on the generation side: whole blocks are not sent
  uint32_t spare_blocks = 3;   // pool blocks beyond the request's, so ids are not trivial
  uint32_t num_slots = 2;      // slots per rank; ctx and gen use different ones
  bool shuffle_blocks = true;  // random block ids per rank; false: contiguous, offset per rank
  uint64_t seed = 1;           // for shuffled ids
  uint64_t request_id = 7;
  bool execute = true;         // false: plan only (no memory)
  bool check_coverage = true;  // prove each destination byte is written exactly once
  bool use_regions = true;     // Region::allocate (pre-faulted); false: heap buffers (tests)
  // When non-empty (ascending), each context rank's part is planned per global layer range
  // [0, cuts[0]), [cuts[0], cuts[1]), ..., [cuts.back(), every layer) as a streamed request is
  // (LayerRange), and the ranges' ops are run together.
  std::vector<uint32_t> layer_cuts;
};

struct PairStats {
  uint32_t ctx_tp_rank = 0, ctx_pp_rank = 0, gen_tp_rank = 0, gen_pp_rank = 0;
  uint64_t ops = 0, bytes = 0;
};

struct LocalTransferResult {
  BlockRange blocks;             // generation positions sent (num_tokens: the request's)
  std::vector<PairStats> pairs;  // (ctx rank, gen rank) pairs with at least one op
  uint64_t total_bytes = 0, total_ops = 0;
  uint64_t total_pack_ops = 0;  // local staging copies on the context ranks
  uint64_t expected_bytes = 0;  // sum over gen ranks of Planner::expectedBytes
  bool executed = false;
  OracleReport oracle;           // over every gen rank
  uint64_t coverage_errors = 0;  // overlapping writes, or writes != the request's records
  std::string first_coverage_error;
  bool verified() const {
    return executed && oracle.ok() && coverage_errors == 0 && total_bytes == expected_bytes;
  }
};

// One rank with its layout, request ids and memory.
struct LocalRank {
  RankLayout layout;
  RankIds ids;
  RankMemory mem;
  std::vector<std::unique_ptr<Region>> regions;  // when allocated as Regions
  std::vector<std::vector<uint8_t>> buffers;     // when allocated on the heap
};

// Every rank of an instance, ordered pp_rank-major (index = pp_rank * tp + tp_rank), with
// `request_blocks` block ids per rank (+ spare pool blocks) and a slot. `salt` makes the ids
// differ between instances. Memory is allocated when `allocate`.
StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   StateLayout layout, uint32_t request_blocks,
                                                   const LocalTransferOptions& options,
                                                   uint64_t salt, bool allocate);
StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   const EngineLayout& layout,
                                                   uint32_t request_blocks,
                                                   const LocalTransferOptions& options,
                                                   uint64_t salt, bool allocate);
StatusOr<std::vector<LocalRank>> makeLocalInstance(const ModelSpec& model, const ParallelConfig& pc,
                                                   const RankLayoutBuilder& build,
                                                   uint32_t request_blocks,
                                                   const LocalTransferOptions& options,
                                                   uint64_t salt, bool allocate);

// Proves that `plan`'s ops write every byte of the request's records on generation rank `gen`
// (kv records of positions `blocks`, the slot's conv and ssm records) exactly once and nothing
// else (padding, gaps inside described records, other blocks and slots): the ops' destination
// ranges are disjoint and their union is exactly the records' bytes. Works on intervals, not
// bytes. Returns the number of violations; the first is described in *first when it is empty.
// kv token rows at or past `token_end` (Planner::kvTokens) are not part of the records.
uint64_t checkCoverage(const RequestPlan& plan, const RankLayout& gen, const RankIds& ids,
                       BlockRange blocks, std::string* first, uint64_t token_end = UINT64_MAX);

StatusOr<LocalTransferResult> runLocalTransfer(const ModelSpec& model,
                                               const LocalTransferOptions& options);

}  // namespace hxfer
