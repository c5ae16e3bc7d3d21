// In-process memory of one rank's regions, and a memcpy executor for plans.
//
// RankMemory maps region ids to (pointer, length) so that the oracle, tests, the CLI's
// --verify and benchmarks can address a rank's pools without a transport. It does not own the
// memory (Region or a test buffer does).
//
// Pure functions over caller-owned memory; callers serialize writers to the same bytes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "plan/planner.h"

namespace hxfer {

struct RegionMemory {
  uint8_t* data = nullptr;
  uint64_t length = 0;
};

// Indexed by region id; ids without memory have data == nullptr.
using RankMemory = std::vector<RegionMemory>;

// Bytes [offset, offset + bytes) of region `id`, or InvalidArgument naming the region when it
// is unknown or the range does not fit.
StatusOr<uint8_t*> regionBytes(const RankMemory& mem, uint32_t id, uint64_t offset, uint64_t bytes);

// Runs every op with memcpy from `src` to `dst`, after checking that every range fits
// (nothing is copied when one does not). An op whose source is kScratchRegion reads `scratch`.
Status executeOps(std::span<const CopyOp> ops, const RankMemory& src, const RankMemory& dst,
                  std::span<const uint8_t> scratch = {});

// The source bytes of `op`: region op.src_region of `mem`, or `scratch` for kScratchRegion.
StatusOr<const uint8_t*> sourceBytes(const RankMemory& mem, std::span<const uint8_t> scratch,
                                     const CopyOp& op);

// Whether every op of plan.pack_ops reads inside its region of `src` and writes inside a
// staging area of `scratch_bytes` (at least plan.scratch_bytes); InvalidArgument names the
// range that does not fit. Addresses are computed, never read.
Status checkPackOps(const RankPlan& plan, const RankMemory& src, uint64_t scratch_bytes);

// Runs plan.pack_ops from `src` into `scratch` (at least plan.scratch_bytes long), after
// checking every range (nothing is copied when one does not fit).
Status packScratch(const RankPlan& plan, const RankMemory& src, std::span<uint8_t> scratch);

// A whole context rank's part: packScratch into a buffer of its own, then executeOps.
Status executePlan(const RankPlan& plan, const RankMemory& src, const RankMemory& dst);

}  // namespace hxfer
