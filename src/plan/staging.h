// Staging a request part as one run (wire::Staging, DESIGN §12): when a context rank's ops
// towards a generation rank are many and small (a descriptor storm: NHD or token-major kv at TP
// mismatch gives one op per token), it gathers them locally into one contiguous area, writes
// that as a single op into a staging slot of the generation rank, which scatters it into the
// pages before it completes the request.
//
// The slot holds the part's bytes in the order of their destination addresses. The destination
// bytes of a part do not depend on the context rank's ids (how its ops merge does), so both
// sides lay the slot out alone: the context rank from the ops it planned, the generation rank
// from a plan of the same request with any source ids.
//
// Pure functions over caller-owned memory.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "plan/memory.h"
#include "plan/planner.h"

namespace hxfer {

// One maximal destination interval of a part and where it sits in the staging slot.
struct StagedRun {
  uint32_t region = 0;
  uint64_t dst_offset = 0;
  uint64_t stage_offset = 0;  // the bytes of every run before this one
  uint64_t bytes = 0;
  bool operator==(const StagedRun&) const = default;
};

// The destination intervals of `ops`, sorted by (region, offset) and joined where they touch,
// each with its offset in the slot. InvalidArgument when two ops write the same byte (a plan
// never does).
StatusOr<std::vector<StagedRun>> stagingRuns(std::span<const CopyOp> ops);

// The slot's size: the bytes of every run.
uint64_t stagingBytes(std::span<const StagedRun> runs);

// A window of a part's staged bytes: `bytes` of them from `offset` (at most to the part's end).
// A part larger than the generation rank's slot moves window by window (wire::Staging::window),
// each window laid out in the slot from its offset 0. The default is the whole part.
struct StagingWindow {
  uint64_t offset = 0;
  uint64_t bytes = UINT64_MAX;
};

// The parts of `runs` inside `window`, their stage offsets counted from the window's start:
// O(log n + the window's runs). InvalidArgument for a window that starts past the part's end.
StatusOr<std::vector<StagedRun>> windowRuns(std::span<const StagedRun> runs, StagingWindow window);

// The ops of gatherStaged, for a copy engine that runs ops (a device): each op of `ops` with its
// destination replaced by its place in a slot laid out by `runs`, in region `area` (the slot
// starting at offset 0 there), in op order. InvalidArgument for an op in no run.
StatusOr<std::vector<CopyOp>> gatherOps(std::span<const CopyOp> ops,
                                        const std::vector<StagedRun>& runs, uint32_t area);

// A part's gather prepared once for all its windows: gatherOps of the part's plan (region 0),
// sorted by place in the slot, so that each window takes only its own ops. A part of n ops in w
// windows costs O(n log n) once, not per window.
struct SlotGather {
  std::vector<CopyOp> ops;  // disjoint destinations, ascending
  uint64_t bytes = 0;       // the part's staged bytes
};
StatusOr<SlotGather> slotGather(std::span<const CopyOp> ops, const std::vector<StagedRun>& runs);

// The ops of `gather` inside `window`, in region `area`, placed from the window's start (an op
// crossing its edge is cut): O(log n + the window's ops). InvalidArgument as windowRuns.
StatusOr<std::vector<CopyOp>> windowOps(const SlotGather& gather, uint32_t area,
                                        StagingWindow window = {});

// Copies the bytes of `gather` inside `window` from their sources (the rank's pools in `src`, or
// `plan_scratch` for an op reading kScratchRegion: packScratch's result) into `slot`, which holds
// the window. Every range is checked before anything is copied.
Status gatherStaged(const SlotGather& gather, const RankMemory& src,
                    std::span<const uint8_t> plan_scratch, std::span<uint8_t> slot,
                    StagingWindow window = {});

// The ops of scatterStaged: each run from its place in a slot at `slot_offset` of region
// `staging` to its destination.
std::vector<CopyOp> scatterOps(std::span<const StagedRun> runs, uint32_t staging,
                               uint64_t slot_offset);

// Each op of `ops` with its destination replaced by the next bytes of region `area`, in op order
// from offset 0 (an area holding a part's source bytes back to back); the area's size is their
// sum.
std::vector<CopyOp> backToBack(std::span<const CopyOp> ops, uint32_t area);

// Copies `slot` into the destination pages `dst`, run by run. Every range is checked before
// anything is copied.
Status scatterStaged(std::span<const StagedRun> runs, std::span<const uint8_t> slot,
                     const RankMemory& dst);

}  // namespace hxfer
