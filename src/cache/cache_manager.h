// HybridCacheManager: the cache of one rank of a hybrid model (DESIGN §3, §7).
//
// It owns one Region per pool of the rank's RankLayout (allocated up front, pre-faulted,
// optionally memfd-backed so the shm transport can share them) and hands out, per request,
// KV blocks and one recurrent-state slot. Pages that have transfers in flight are gated:
//
//   allocate(id, tokens)  -> blocks + slot are "used"
//   beginTransfer(id)     -> the request's in-flight count +1 (or leaseTransfer(): RAII)
//   endTransfer(id)       -> -1
//   free(id)              -> not in flight: pages return to the free pools at once;
//                            in flight: pages are "quarantined" and the id stays known until
//                            the last endTransfer, which returns them to the free pools.
//
// Invariant (counters()): for blocks and for slots, free + used + quarantined == total, and
// a page is in at most one request. A page in use or quarantined is never handed out.
// Free lists hand out the lowest-starting contiguous run first (see id_pool.h).
//
// Errors, never undefined behaviour: pools too small -> ResourceExhausted naming the pool and
// the counts; an id never allocated (or already fully freed) -> NotFound; allocating a known
// id, freeing twice while quarantined, endTransfer without beginTransfer -> InvalidArgument;
// beginTransfer on a freed (quarantined) request -> Cancelled.
//
// Thread-safety: every method may be called from any thread at once (one mutex guards the
// allocation state; the serving thread and transfer threads share a manager). layout(),
// regions() and the region pointers are fixed at create() and need no lock. The manager must
// outlive every TransferLease it hands out.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/engine_layout.h"
#include "cache/id_pool.h"
#include "cache/layout.h"
#include "cache/region.h"
#include "common/status.h"
#include "model/model.h"

namespace hxfer {

class HybridCacheManager;

// How many pages to make. Either explicit counts, or a byte budget for the rank's records:
// the requested `slots` are reserved first (one per concurrent request), then as many KV
// blocks as the rest holds. Counts are ignored (set to 0) for a pool the rank does not have:
// blocks on a rank without attention layers, slots on a rank without recurrent layers.
// The budget counts record bytes; each region rounds up to whole pages on top of it.
struct Capacity {
  enum class Kind : uint8_t { kCounts, kBudget };
  Kind kind = Kind::kCounts;
  uint32_t blocks = 0;        // kCounts
  uint32_t slots = 0;         // kCounts, and the slots reserved first under kBudget
  uint64_t budget_bytes = 0;  // kBudget

  static Capacity counts(uint32_t blocks, uint32_t slots) {
    return {Kind::kCounts, blocks, slots, 0};
  }
  static Capacity budget(uint64_t bytes, uint32_t slots) {
    return {Kind::kBudget, 0, slots, bytes};
  }
};

// What one request holds on this rank. `blocks` ascending; empty on a rank without attention
// layers. `slot` is set iff the rank has recurrent layers.
struct Allocation {
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;
  std::vector<uint32_t> blocks;
  std::optional<uint32_t> slot;
  // The state ids of state groups 1.. (RankLayout::state_groups - 1 of them; vLLM's shared
  // tensors), set with `slot`.
  std::vector<uint32_t> group_slots;
  // slot, then group_slots: the request's state ids (none without recurrent layers).
  std::vector<uint32_t> stateIds() const;
  bool operator==(const Allocation&) const = default;
};

// A snapshot of the pools; taken under the lock, so it is self-consistent.
struct CacheCounters {
  uint32_t total_blocks = 0, free_blocks = 0, used_blocks = 0, quarantined_blocks = 0;
  uint32_t total_slots = 0, free_slots = 0, used_slots = 0, quarantined_slots = 0;
  uint32_t free_block_runs = 0;       // fragmentation of the block free list
  uint32_t live_requests = 0;         // allocated, not freed
  uint32_t quarantined_requests = 0;  // freed while in flight
  uint32_t inflight_requests = 0;     // requests with at least one transfer in flight
  uint64_t inflight_transfers = 0;    // sum of the in-flight counts
  // Lifetime totals.
  uint64_t allocations = 0, frees = 0, exhausted = 0, quarantine_releases = 0;

  // Pages used or quarantined: zero on a rank whose requests have all ended (a leak otherwise).
  uint64_t pagesHeld() const {
    return uint64_t{used_blocks} + used_slots + quarantined_blocks + quarantined_slots;
  }
  bool operator==(const CacheCounters&) const = default;
};

// RAII form of beginTransfer/endTransfer: ends the transfer when destroyed or released.
// Move-only. Not thread-safe itself (one owner), but the manager calls it makes are.
class TransferLease {
 public:
  TransferLease() = default;
  TransferLease(TransferLease&& other) noexcept;
  TransferLease& operator=(TransferLease&& other) noexcept;
  TransferLease(const TransferLease&) = delete;
  TransferLease& operator=(const TransferLease&) = delete;
  ~TransferLease();

  bool held() const { return manager_ != nullptr; }
  uint64_t requestId() const { return request_id_; }
  // Ends the transfer now (endTransfer's status); a no-op returning ok when not held.
  Status release();

 private:
  friend class HybridCacheManager;
  TransferLease(HybridCacheManager* manager, uint64_t request_id)
      : manager_(manager), request_id_(request_id) {}

  HybridCacheManager* manager_ = nullptr;
  uint64_t request_id_ = 0;
};

class HybridCacheManager {
 public:
  // Builds the layout of rank (tp_rank, pp_rank) with the capacity and allocates its regions.
  // Errors: those of buildRankLayout; InvalidArgument for a budget without slots on a rank
  // that needs them; ResourceExhausted for a budget too small for the slots plus one block,
  // or regions the machine cannot map.
  static StatusOr<std::unique_ptr<HybridCacheManager>> create(
      const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
      StateLayout state_layout, Capacity capacity,
      Region::Backing backing = Region::Backing::kAnonymous);
  // The same with the pools laid out as `engine` keeps them (engine_layout.h); errors also
  // those of buildEngineLayout.
  static StatusOr<std::unique_ptr<HybridCacheManager>> create(
      const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
      const EngineLayout& engine, Capacity capacity,
      Region::Backing backing = Region::Backing::kAnonymous);

  // A manager over memory the engine owns (engine-driven allocation, DESIGN §11): `regions`
  // (usually Region::borrow) back `layout`'s regions, same ids in the same order, each at
  // least as long. hxfer never allocates or frees the engine's pages: the engine names them
  // per request with adopt(). InvalidArgument naming the region when one is missing, unknown
  // or short; the layout's own validate() errors.
  static StatusOr<std::unique_ptr<HybridCacheManager>> wrap(
      RankLayout layout, std::vector<std::unique_ptr<Region>> regions);

  HybridCacheManager(const HybridCacheManager&) = delete;
  HybridCacheManager& operator=(const HybridCacheManager&) = delete;

  // Fixed at create(); no lock needed.
  const RankLayout& layout() const { return layout_; }
  // regions()[i] backs layout().regions[i] (same id, same length).
  const std::vector<std::unique_ptr<Region>>& regions() const { return regions_; }
  // nullptr for an unknown region id.
  const Region* region(uint32_t region_id) const;
  uint8_t* regionBase(uint32_t region_id) const;
  bool hasKv() const { return layout_.num_blocks > 0; }
  bool hasState() const { return layout_.num_slots > 0; }
  uint32_t blocksFor(uint32_t num_tokens) const;  // 0 on a rank without attention layers
  // The bytes of record (index, local_layer) of layout().views[view]; InvalidArgument when
  // any of the three is out of range.
  StatusOr<std::span<uint8_t>> record(size_t view, uint32_t index, uint32_t local_layer) const;

  // Allocates blocksFor(num_tokens) blocks and, on a rank with recurrent layers, one slot per
  // state group (with one id pool, RankLayout::joint_ids, those are pages of the block pool
  // and count as blocks; the pool then holds blocks + slots x state_groups pages).
  // All or nothing: ResourceExhausted (naming the pool, needed and free counts) leaves the
  // pools unchanged. InvalidArgument when request_id is already known (live or quarantined).
  StatusOr<Allocation> allocate(uint64_t request_id, uint32_t num_tokens);
  // How adopt() fences pages. kExclusive: a page is in at most one request. kSharedReads (a
  // context rank over engine memory, where hxfer only reads the pages): requests may name the
  // same page, e.g. a cached prompt prefix, and it stays fenced until the last of them is
  // released. Counters then count page references (used + quarantined may exceed the total).
  enum class FenceMode : uint8_t { kExclusive, kSharedReads };
  // InvalidArgument while any request is known (naming how many).
  Status setFenceMode(FenceMode mode);

  // Takes the pages the engine chose for `request_id`: `blocks` (each at most once, ignored on
  // a rank without attention layers) and `slot` (required on a rank with recurrent layers,
  // ignored otherwise) and `group_slots` (the further state groups' ids: state_groups - 1 of
  // them), for `num_tokens` tokens; the request is then live as after allocate().
  // All or nothing. InvalidArgument naming the page when one is outside its pool, listed
  // twice, or still held by a request (live, or freed while a write into it may still run:
  // the engine reused a page before hxfer released it), when blocks are fewer than
  // blocksFor(num_tokens), or when request_id is known.
  // `owner` tags the request for the release listener (which transceiver took the pages).
  // The first `read_prefix` blocks are only read (a prefix the generation side already holds):
  // they are fenced shared, so other requests may name them too, as on a kSharedReads manager.
  StatusOr<Allocation> adopt(uint64_t request_id, uint32_t num_tokens,
                             std::span<const uint32_t> blocks, std::optional<uint32_t> slot,
                             uint64_t owner = 0, uint32_t read_prefix = 0,
                             std::span<const uint32_t> group_slots = {});
  // Frees a live request. NotFound for an unknown id; InvalidArgument when it was already
  // freed and waits in quarantine. Returns ok in both the immediate and the quarantined case.
  Status free(uint64_t request_id);
  // The allocation of a live or quarantined request; NotFound otherwise.
  StatusOr<Allocation> find(uint64_t request_id) const;

  // Marks one transfer in flight on a live request: its pages stay gated until endTransfer.
  // NotFound for an unknown id, Cancelled when the request was freed (quarantined).
  Status beginTransfer(uint64_t request_id);
  // Ends one transfer. When it was the last one of a freed request, its pages return to the
  // free pools and the id is forgotten. NotFound for an unknown id, InvalidArgument when the
  // request has no transfer in flight.
  Status endTransfer(uint64_t request_id);
  // beginTransfer, with the matching endTransfer run by the returned lease.
  StatusOr<TransferLease> leaseTransfer(uint64_t request_id);

  CacheCounters counters() const;

  // Called with the id (and adopt()'s owner tag; 0 for allocate()) of every request whose
  // pages return to the free pools (at free() when
  // nothing is in flight, else at the last endTransfer()): from then on no write into or out
  // of them can run, and the engine may reuse them. Runs on the thread that released them,
  // with the manager's lock held: it must not call the manager and must not block.
  // Replaces the previous listener (under the lock, so a release never sees half of one).
  void setReleaseListener(std::function<void(uint64_t request_id, uint64_t owner)> listener) {
    std::lock_guard<std::mutex> lock(mu_);
    release_listener_ = std::move(listener);
  }

  // The accounting self-check: recounts every page from the requests the manager knows and
  // checks it against the pools and counters. Every page is exactly one of free, held by one
  // live request, or held by one quarantined request; free + used + quarantined = total; the
  // in-flight counts match. Internal naming the first disagreement otherwise (a bug).
  Status selfCheck() const;

 private:
  struct Request {
    Allocation alloc;
    uint32_t inflight = 0;
    bool freed = false;          // quarantined: freed while in flight
    uint64_t owner = 0;          // adopt()'s tag
    uint32_t shared_blocks = 0;  // the leading blocks fenced shared (read only)
    bool shared_slot = false;    // the state ids fenced shared
  };
  // Where state ids come from: the block pool when the layout draws both from one pool.
  IdPool& statePool() { return layout_.joint_ids ? blocks_ : slots_; }
  std::unordered_map<uint32_t, uint32_t>& stateRefs() {
    return layout_.joint_ids ? block_refs_ : slot_refs_;
  }
  // The pages `a` holds as (blocks, slots) counts: states count as blocks with one id pool.
  std::pair<uint32_t, uint32_t> pageCounts(const Allocation& a) const;

  HybridCacheManager(RankLayout layout, std::vector<std::unique_ptr<Region>> regions);
  // Returns the request's pages to the pools and forgets it. REQUIRES: mu_ held.
  Status releaseLocked(uint64_t request_id, Request& request);

  const RankLayout layout_;
  const std::vector<std::unique_ptr<Region>> regions_;

  mutable std::mutex mu_;
  IdPool blocks_;                                   // guarded by mu_
  IdPool slots_;                                    // guarded by mu_
  std::unordered_map<uint64_t, Request> requests_;  // guarded by mu_
  CacheCounters stats_;  // guarded by mu_; the lifetime totals and used/quarantined counts
  std::function<void(uint64_t, uint64_t)> release_listener_;  // guarded by mu_
  FenceMode fence_mode_ = FenceMode::kExclusive;              // guarded by mu_
  // The requests holding each page fenced shared (read-only pages of adopt()).
  std::unordered_map<uint32_t, uint32_t> block_refs_, slot_refs_;  // guarded by mu_
};

}  // namespace hxfer
