// Device tables (copy_table.h) built from a plan's ops over a rank's memory, every range checked
// first, and their launches emulated on the host for the CPU tests and the CPU fallback.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "device/copy_table.h"
#include "plan/memory.h"
#include "plan/planner.h"

namespace hxfer::device {

// The storm the batched copy is for: run i moves `run_bytes` from src + i * run_bytes to
// dst + order[i] * run_bytes, `order` a permutation shuffled from `seed`.
struct ShuffledRuns {
  std::vector<uint32_t> order;
  std::vector<CopyRun> runs;
  // Where run i's bytes land, as an offset from dst.
  uint64_t destinationOffset(uint32_t i) const { return uint64_t{order[i]} * runs[i].bytes; }
};
ShuffledRuns shuffledRuns(uint64_t src, uint64_t dst, uint32_t count, uint64_t run_bytes,
                          uint64_t seed);

// A batched copy's table in host memory; view() points into it.
struct HostCopyTable {
  std::vector<CopyRun> runs;
  std::vector<uint64_t> first_chunk;  // runs.size() + 1 entries
  CopyTable view() const;
  uint64_t bytes() const;
};

// The runs of `ops` from `src` (kScratchRegion: `scratch`) to `dst`, empty ops dropped.
// InvalidArgument, naming the op and side, where a range does not fit its region (nothing is
// built then). The memory's addresses may be device addresses: they are never read.
StatusOr<HostCopyTable> copyTable(std::span<const CopyOp> ops, const RankMemory& src,
                                  const RankMemory& dst, std::span<const uint8_t> scratch = {});
// A table over `runs` as given (empty runs dropped). InvalidArgument past 2^32 - 1 runs.
StatusOr<HostCopyTable> copyTable(std::span<const CopyRun> runs);

// A pack's table in host memory; view() points into it.
struct HostPackTable {
  std::vector<Pack> packs;
  std::vector<uint64_t> first_element;  // packs.size() + 1 entries
  PackTable view() const;
};

// plan.pack_ops from `src` into the staging area at address `scratch`, `scratch_bytes` long,
// checked as packScratch checks them; each box's dims of size 1 are dropped and dims that
// continue each other on both sides merged. InvalidArgument naming the op where a box keeps
// more than kMaxPackDims dims.
StatusOr<HostPackTable> packTable(const RankPlan& plan, const RankMemory& src, uint64_t scratch,
                                  uint64_t scratch_bytes);

// A launch run on the host: every chunk by each of `threads` threads in turn, or every element.
void runOnHost(const CopyTable& t, uint32_t threads = 256);
void runOnHost(const PackTable& t);

}  // namespace hxfer::device
