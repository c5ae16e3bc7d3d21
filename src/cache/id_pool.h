// IdPool: the free list of one kind of page (KV blocks or state slots), ids 0..capacity-1.
//
// Free ids are kept as maximal runs [first, first+length), so that a request gets one
// contiguous run of blocks whenever one is free: contiguous blocks are contiguous bytes in
// the block-major KV pool, and the planner coalesces them into fewer copy ops. Policy of
// take(n): the lowest-starting free run that holds n ids; failing that, the lowest free ids.
//
// Invariant: runs are disjoint, non-adjacent (merged on give) and hold freeCount() ids.
// Not thread-safe: the owner (HybridCacheManager) guards it with its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace hxfer {

class IdPool {
 public:
  explicit IdPool(uint32_t capacity);

  uint32_t capacity() const { return capacity_; }
  uint32_t freeCount() const { return free_; }
  size_t runCount() const { return runs_.size(); }  // fragmentation, for tests and counters
  bool isFree(uint32_t id) const;

  // Takes n free ids (ascending). ResourceExhausted when fewer than n are free; then nothing
  // is taken.
  StatusOr<std::vector<uint32_t>> take(uint32_t n);
  // Takes exactly `ids` (the caller chose them: engine-driven allocation). InvalidArgument,
  // and nothing taken, when an id is out of range, not free or listed twice; the message
  // names the first such id.
  Status takeIds(std::span<const uint32_t> ids);
  // Returns ids to the pool. InvalidArgument, and nothing returned, when an id is out of
  // range, already free or listed twice.
  Status give(std::span<const uint32_t> ids);

 private:
  // `ids` sorted, when each is in range, listed once (else InvalidArgument "... <twice>") and
  // free (`free`) or taken (!`free`).
  StatusOr<std::vector<uint32_t>> sortedIds(std::span<const uint32_t> ids, bool free,
                                            std::string_view twice) const;

  uint32_t capacity_;
  uint32_t free_;
  std::map<uint32_t, uint32_t> runs_;  // first id -> run length
};

}  // namespace hxfer
