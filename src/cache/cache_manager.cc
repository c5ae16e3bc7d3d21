#include "cache/cache_manager.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "common/logging.h"

namespace hxfer {
namespace {

std::string str(uint64_t v) { return std::to_string(v); }

bool hasRole(const RankLayout& layout, bool kv) {
  for (const PoolView& v : layout.views) {
    if ((v.role == Role::kKv) == kv) return true;
  }
  return false;
}

// Resolves a capacity to (blocks, slots) for a rank whose shape `probe` describes.
Status resolveCapacity(const RankLayout& probe, const Capacity& capacity, uint32_t* blocks,
                       uint32_t* slots) {
  const bool has_kv = hasRole(probe, true);
  const bool has_state = hasRole(probe, false);
  if (capacity.kind == Capacity::Kind::kCounts) {
    *blocks = has_kv ? capacity.blocks : 0;
    *slots = has_state ? capacity.slots : 0;
    return OkStatus();
  }
  *slots = has_state ? capacity.slots : 0;
  if (has_state && *slots == 0) {
    return InvalidArgument("budget capacity has slots=0 but the rank has recurrent layers");
  }
  const uint64_t per_slot = probe.stateBytesPerSlot();
  uint64_t state_bytes = 0;
  if (__builtin_mul_overflow(uint64_t{*slots}, per_slot, &state_bytes) ||
      state_bytes > capacity.budget_bytes) {
    return ResourceExhausted("budget_bytes=" + str(capacity.budget_bytes) + " cannot hold slots=" +
                             str(*slots) + " of " + str(per_slot) + " bytes each");
  }
  *blocks = 0;
  if (has_kv) {
    const uint64_t per_block = probe.kvBytesPerBlock();
    const uint64_t rest = capacity.budget_bytes - state_bytes;
    const uint64_t n = rest / per_block;
    if (n == 0) {
      return ResourceExhausted("budget_bytes=" + str(capacity.budget_bytes) + " leaves " +
                               str(rest) + " bytes after " + str(*slots) +
                               " slots, less than one kv block of " + str(per_block) + " bytes");
    }
    *blocks = static_cast<uint32_t>(std::min<uint64_t>(n, std::numeric_limits<uint32_t>::max()));
  }
  return OkStatus();
}

}  // namespace

// ---- TransferLease ----

TransferLease::TransferLease(TransferLease&& other) noexcept
    : manager_(std::exchange(other.manager_, nullptr)), request_id_(other.request_id_) {}

TransferLease& TransferLease::operator=(TransferLease&& other) noexcept {
  if (this != &other) {
    (void)release();
    manager_ = std::exchange(other.manager_, nullptr);
    request_id_ = other.request_id_;
  }
  return *this;
}

TransferLease::~TransferLease() {
  Status s = release();
  // Only reachable when someone ended this lease's transfer by hand as well.
  if (!s.isOk()) HXFER_LOG_ERROR("transfer lease of request {}: {}", request_id_, s.toString());
}

Status TransferLease::release() {
  if (!manager_) return OkStatus();
  HybridCacheManager* m = std::exchange(manager_, nullptr);
  return m->endTransfer(request_id_);
}

std::vector<uint32_t> Allocation::stateIds() const {
  std::vector<uint32_t> out;
  if (!slot) return out;
  out.push_back(*slot);
  out.insert(out.end(), group_slots.begin(), group_slots.end());
  return out;
}

// ---- HybridCacheManager ----

StatusOr<std::unique_ptr<HybridCacheManager>> HybridCacheManager::create(
    const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
    StateLayout state_layout, Capacity capacity, Region::Backing backing) {
  return create(model, pc, tp_rank, pp_rank, EngineLayout{Engine::kHxfer, state_layout}, capacity,
                backing);
}

StatusOr<std::unique_ptr<HybridCacheManager>> HybridCacheManager::create(
    const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
    const EngineLayout& engine, Capacity capacity, Region::Backing backing) {
  // A one-page probe says which pools the rank has and what a block and a slot cost.
  ASSIGN_OR_RETURN(RankLayout probe, buildEngineLayout(model, pc, tp_rank, pp_rank, engine, 1, 1));
  uint32_t blocks = 0, slots = 0;
  RETURN_IF_ERROR(resolveCapacity(probe, capacity, &blocks, &slots));
  if (probe.joint_ids) {
    // One id pool: the states of `slots` requests are pages of it too.
    uint64_t pages = blocks + uint64_t{slots} * probe.state_groups;
    if (pages > UINT32_MAX) return ResourceExhausted(str(pages) + " pages overflow 32-bit ids");
    blocks = slots = static_cast<uint32_t>(pages);
  }
  ASSIGN_OR_RETURN(RankLayout layout,
                   buildEngineLayout(model, pc, tp_rank, pp_rank, engine, blocks, slots));
  std::vector<std::unique_ptr<Region>> regions;
  regions.reserve(layout.regions.size());
  for (const RegionSpec& spec : layout.regions) {
    StatusOr<std::unique_ptr<Region>> r =
        Region::allocate(spec.id, spec.length, backing, "hxfer-" + spec.name);
    if (!r.isOk()) return r.status().withContext("region " + spec.name);
    regions.push_back(std::move(*r));
  }
  return std::unique_ptr<HybridCacheManager>(
      new HybridCacheManager(std::move(layout), std::move(regions)));
}

StatusOr<std::unique_ptr<HybridCacheManager>> HybridCacheManager::wrap(
    RankLayout layout, std::vector<std::unique_ptr<Region>> regions) {
  RETURN_IF_ERROR(layout.validate());
  if (regions.size() != layout.regions.size()) {
    return InvalidArgument("layout has " + str(layout.regions.size()) + " regions, given " +
                           str(regions.size()));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    const RegionSpec& spec = layout.regions[i];
    const Region* r = regions[i].get();
    if (r == nullptr || r->id() != spec.id) {
      return InvalidArgument("region " + spec.name + " (id " + str(spec.id) + ") is missing");
    }
    if (r->length() < spec.length) {
      return InvalidArgument("region " + spec.name + " is " + str(r->length()) +
                             " bytes, the layout needs " + str(spec.length));
    }
  }
  return std::unique_ptr<HybridCacheManager>(
      new HybridCacheManager(std::move(layout), std::move(regions)));
}

HybridCacheManager::HybridCacheManager(RankLayout layout,
                                       std::vector<std::unique_ptr<Region>> regions)
    : layout_(std::move(layout)),
      regions_(std::move(regions)),
      blocks_(layout_.num_blocks),
      slots_(layout_.joint_ids ? 0 : layout_.num_slots) {}

std::pair<uint32_t, uint32_t> HybridCacheManager::pageCounts(const Allocation& a) const {
  const uint32_t b = static_cast<uint32_t>(a.blocks.size());
  const uint32_t s = a.slot ? 1 + static_cast<uint32_t>(a.group_slots.size()) : 0;
  return layout_.joint_ids ? std::pair{b + s, 0u} : std::pair{b, s};
}

const Region* HybridCacheManager::region(uint32_t region_id) const {
  for (const auto& r : regions_) {
    if (r->id() == region_id) return r.get();
  }
  return nullptr;
}

uint8_t* HybridCacheManager::regionBase(uint32_t region_id) const {
  const Region* r = region(region_id);
  return r ? r->data() : nullptr;
}

uint32_t HybridCacheManager::blocksFor(uint32_t num_tokens) const {
  if (!hasKv()) return 0;
  const uint64_t t = layout_.tokens_per_block;
  return static_cast<uint32_t>((uint64_t{num_tokens} + t - 1) / t);
}

StatusOr<std::span<uint8_t>> HybridCacheManager::record(size_t view, uint32_t index,
                                                        uint32_t local_layer) const {
  if (view >= layout_.views.size()) {
    return InvalidArgument("view " + str(view) + " >= " + str(layout_.views.size()) + " views");
  }
  const PoolView& v = layout_.views[view];
  if (index >= v.num_indices || local_layer >= v.layers.size()) {
    return InvalidArgument("view " + str(view) + " record (index " + str(index) + ", layer " +
                           str(local_layer) + ") outside " + str(v.num_indices) + " x " +
                           str(v.layers.size()));
  }
  // Inside the region: RankLayout::validate() checked the last record of every view.
  return std::span<uint8_t>(regionBase(v.region_id) + v.offset(index, local_layer), v.record_bytes);
}

StatusOr<Allocation> HybridCacheManager::allocate(uint64_t request_id, uint32_t num_tokens) {
  const uint32_t need_blocks = blocksFor(num_tokens);
  const uint32_t need_slots = hasState() ? layout_.state_groups : 0;
  const bool joint = layout_.joint_ids;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = requests_.find(request_id); it != requests_.end()) {
    return InvalidArgument(
        "request " + str(request_id) + " is already allocated" +
        (it->second.freed ? " (freed, quarantined until its transfers end)" : ""));
  }
  if (need_blocks + (joint ? need_slots : 0) > blocks_.freeCount()) {
    ++stats_.exhausted;
    return ResourceExhausted("kv blocks exhausted: request " + str(request_id) + " needs " +
                             str(need_blocks) + " blocks for " + str(num_tokens) + " tokens" +
                             (joint ? " and " + str(need_slots) + " for its states" : "") + ", " +
                             str(blocks_.freeCount()) + " of " + str(blocks_.capacity()) +
                             " free (" + str(stats_.quarantined_blocks) + " quarantined)");
  }
  if (!joint && need_slots > slots_.freeCount()) {
    ++stats_.exhausted;
    return ResourceExhausted("state slots exhausted: request " + str(request_id) + " needs " +
                             str(need_slots) + " slot, " + str(slots_.freeCount()) + " of " +
                             str(slots_.capacity()) + " free (" + str(stats_.quarantined_slots) +
                             " quarantined)");
  }
  Request req;
  req.alloc.request_id = request_id;
  req.alloc.num_tokens = num_tokens;
  ASSIGN_OR_RETURN(req.alloc.blocks, blocks_.take(need_blocks));
  if (need_slots) {
    StatusOr<std::vector<uint32_t>> states = statePool().take(need_slots);
    if (!states.isOk()) {
      // Unreachable after the check above; keep the pools whole regardless.
      (void)blocks_.give(req.alloc.blocks);
      return states.status();
    }
    req.alloc.slot = states->front();
    req.alloc.group_slots.assign(states->begin() + 1, states->end());
  }
  const auto [nb, ns] = pageCounts(req.alloc);
  stats_.used_blocks += nb;
  stats_.used_slots += ns;
  ++stats_.live_requests;
  ++stats_.allocations;
  Allocation out = req.alloc;
  requests_.emplace(request_id, std::move(req));
  return out;
}

Status HybridCacheManager::setFenceMode(FenceMode mode) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode == fence_mode_) return OkStatus();
  if (!requests_.empty()) {
    return InvalidArgument("the pools still hold " + str(requests_.size()) +
                           " requests; the fence mode changes only on empty pools");
  }
  fence_mode_ = mode;
  return OkStatus();
}

StatusOr<Allocation> HybridCacheManager::adopt(uint64_t request_id, uint32_t num_tokens,
                                               std::span<const uint32_t> blocks,
                                               std::optional<uint32_t> slot, uint64_t owner,
                                               uint32_t read_prefix,
                                               std::span<const uint32_t> group_slots) {
  Allocation alloc;
  alloc.request_id = request_id;
  alloc.num_tokens = num_tokens;
  if (hasKv()) {
    if (blocks.size() < blocksFor(num_tokens)) {
      return InvalidArgument("request " + str(request_id) + ": " + str(num_tokens) +
                             " tokens need " + str(blocksFor(num_tokens)) + " blocks of " +
                             str(layout_.tokens_per_block) + " tokens, given " +
                             str(blocks.size()));
    }
    alloc.blocks.assign(blocks.begin(), blocks.end());
  }
  if (hasState()) {
    if (!slot) {
      return InvalidArgument("request " + str(request_id) +
                             ": no slot given, and the rank has recurrent layers");
    }
    if (group_slots.size() + 1 != layout_.state_groups) {
      return InvalidArgument("request " + str(request_id) + ": " + str(group_slots.size()) +
                             " group slots given besides the slot, the rank's layout has " +
                             str(layout_.state_groups) + " state groups");
    }
    alloc.slot = slot;
    alloc.group_slots.assign(group_slots.begin(), group_slots.end());
  }
  const bool joint = layout_.joint_ids;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = requests_.find(request_id); it != requests_.end()) {
    return InvalidArgument("request " + str(request_id) + " is already known" +
                           (it->second.freed ? " (freed, fenced until its transfers end)" : ""));
  }
  // Name the holder of a page that is not free: the engine reused it too early.
  auto holder = [&](bool block, uint32_t page) -> std::string {
    for (const auto& [id, r] : requests_) {
      const std::vector<uint32_t> states = r.alloc.stateIds();
      const bool in_blocks =
          std::find(r.alloc.blocks.begin(), r.alloc.blocks.end(), page) != r.alloc.blocks.end();
      const bool in_states = std::find(states.begin(), states.end(), page) != states.end();
      const bool held = block ? in_blocks || (joint && in_states) : in_states;
      if (held) {
        return " is still held by request " + str(id) +
               (r.freed ? " (freed, fenced: a write into it may still run)" : "");
      }
    }
    return " is not free";
  };
  // Pages hxfer only reads are fenced shared (other readers may hold them too): every page on
  // a kSharedReads manager, and the leading read_prefix blocks on any.
  const bool shared = fence_mode_ == FenceMode::kSharedReads;
  const size_t shared_blocks =
      shared ? alloc.blocks.size() : std::min<size_t>(read_prefix, alloc.blocks.size());
  auto check = [&](const IdPool& pool, bool block, std::span<const uint32_t> ids,
                   size_t shareable) -> Status {
    const char* what = block ? "block " : "slot ";
    const auto& refs = block ? block_refs_ : slot_refs_;
    std::vector<uint32_t> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (sorted[i] >= pool.capacity()) {
        return InvalidArgument("request " + str(request_id) + ": " + what + str(sorted[i]) +
                               " is outside the pool of " + str(pool.capacity()));
      }
      if (i > 0 && sorted[i] == sorted[i - 1]) {
        return InvalidArgument("request " + str(request_id) + ": " + what + str(sorted[i]) +
                               " listed twice");
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      // A page read here may also be held by other readers; one written here must be free.
      const bool read_only = i < shareable;
      if (!pool.isFree(ids[i]) && !(read_only && refs.count(ids[i]))) {
        return InvalidArgument("request " + str(request_id) + ": " + what + str(ids[i]) +
                               holder(block, ids[i]));
      }
    }
    return OkStatus();
  };
  const std::vector<uint32_t> states = alloc.stateIds();
  const std::span<const uint32_t> slot_ids(states);
  const std::span<const uint32_t> all_blocks(alloc.blocks);
  if (joint) {
    // One pool: the states are pages like the blocks, and none may be one of them.
    std::vector<uint32_t> pages = alloc.blocks;
    pages.insert(pages.end(), states.begin(), states.end());
    RETURN_IF_ERROR(check(blocks_, true, pages, shared ? pages.size() : shared_blocks));
  } else {
    RETURN_IF_ERROR(check(blocks_, true, all_blocks, shared_blocks));
    RETURN_IF_ERROR(check(slots_, false, slot_ids, shared ? slot_ids.size() : 0));
  }
  // The first reader of a page takes it from the free pool; later ones only count.
  auto share = [](IdPool& pool, std::unordered_map<uint32_t, uint32_t>& refs,
                  std::span<const uint32_t> ids) -> Status {
    for (uint32_t id : ids) {
      if (refs[id]++ == 0) RETURN_IF_ERROR(pool.takeIds(std::span<const uint32_t>(&id, 1)));
    }
    return OkStatus();
  };
  if (Status s = share(blocks_, block_refs_, all_blocks.first(shared_blocks)); !s.isOk()) {
    return Internal(s.message());
  }
  if (Status s = blocks_.takeIds(all_blocks.subspan(shared_blocks)); !s.isOk()) {
    return Internal(s.message());
  }
  if (Status s = shared ? share(statePool(), stateRefs(), slot_ids) : statePool().takeIds(slot_ids);
      !s.isOk()) {
    return Internal(s.message());
  }
  const auto [nb, ns] = pageCounts(alloc);
  stats_.used_blocks += nb;
  stats_.used_slots += ns;
  ++stats_.live_requests;
  ++stats_.allocations;
  Request req;
  req.alloc = alloc;
  req.owner = owner;
  req.shared_blocks = static_cast<uint32_t>(shared_blocks);
  req.shared_slot = shared && alloc.slot.has_value();
  requests_.emplace(request_id, std::move(req));
  return alloc;
}

Status HybridCacheManager::free(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    return NotFound("request " + str(request_id) + " is not allocated (never, or already freed)");
  }
  Request& req = it->second;
  if (req.freed) {
    return InvalidArgument("request " + str(request_id) +
                           " was already freed; quarantined until its " + str(req.inflight) +
                           " in-flight transfers end");
  }
  const auto [nb, ns] = pageCounts(req.alloc);
  stats_.used_blocks -= nb;
  stats_.used_slots -= ns;
  --stats_.live_requests;
  ++stats_.frees;
  if (req.inflight > 0) {
    req.freed = true;
    stats_.quarantined_blocks += nb;
    stats_.quarantined_slots += ns;
    ++stats_.quarantined_requests;
    return OkStatus();
  }
  return releaseLocked(request_id, req);
}

Status HybridCacheManager::releaseLocked(uint64_t request_id, Request& req) {
  Status blocks = OkStatus(), slot = OkStatus();
  const std::vector<uint32_t> states = req.alloc.stateIds();
  const std::span<const uint32_t> slot_ids(states);
  // The last reader of a shared page gives it back.
  auto unshare = [](IdPool& pool, std::unordered_map<uint32_t, uint32_t>& refs,
                    std::span<const uint32_t> ids) -> Status {
    for (uint32_t id : ids) {
      auto it = refs.find(id);
      if (it == refs.end()) return InvalidArgument("page " + str(id) + " has no reader");
      if (--it->second > 0) continue;
      refs.erase(it);
      RETURN_IF_ERROR(pool.give(std::span<const uint32_t>(&id, 1)));
    }
    return OkStatus();
  };
  const std::span<const uint32_t> all_blocks(req.alloc.blocks);
  blocks = unshare(blocks_, block_refs_, all_blocks.first(req.shared_blocks));
  if (blocks.isOk()) blocks = blocks_.give(all_blocks.subspan(req.shared_blocks));
  slot = req.shared_slot ? unshare(statePool(), stateRefs(), slot_ids) : statePool().give(slot_ids);
  const uint64_t owner = req.owner;
  requests_.erase(request_id);
  if (release_listener_) release_listener_(request_id, owner);
  if (!blocks.isOk()) return Internal("returning blocks: " + blocks.message());
  if (!slot.isOk()) return Internal("returning slot: " + slot.message());
  return OkStatus();
}

StatusOr<Allocation> HybridCacheManager::find(uint64_t request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return NotFound("request " + str(request_id) + " is not allocated");
  return it->second.alloc;
}

Status HybridCacheManager::beginTransfer(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return NotFound("request " + str(request_id) + " is not allocated");
  Request& req = it->second;
  if (req.freed) {
    return Cancelled("request " + str(request_id) + " was freed; no new transfers may start");
  }
  if (req.inflight == std::numeric_limits<uint32_t>::max()) {
    return ResourceExhausted("request " + str(request_id) + " has " + str(req.inflight) +
                             " transfers in flight");
  }
  if (req.inflight++ == 0) ++stats_.inflight_requests;
  ++stats_.inflight_transfers;
  return OkStatus();
}

Status HybridCacheManager::endTransfer(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return NotFound("request " + str(request_id) + " is not allocated");
  Request& req = it->second;
  if (req.inflight == 0) {
    return InvalidArgument("endTransfer on request " + str(request_id) +
                           " with no transfer in flight");
  }
  --stats_.inflight_transfers;
  if (--req.inflight > 0) return OkStatus();
  --stats_.inflight_requests;
  if (!req.freed) return OkStatus();
  const auto [nb, ns] = pageCounts(req.alloc);
  stats_.quarantined_blocks -= nb;
  stats_.quarantined_slots -= ns;
  --stats_.quarantined_requests;
  ++stats_.quarantine_releases;
  return releaseLocked(request_id, req);
}

StatusOr<TransferLease> HybridCacheManager::leaseTransfer(uint64_t request_id) {
  RETURN_IF_ERROR(beginTransfer(request_id));
  return TransferLease(this, request_id);
}

Status HybridCacheManager::selfCheck() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [](std::string what) { return Internal("cache accounting: " + what); };
  std::vector<uint64_t> block_owner(blocks_.capacity(), 0), slot_owner(slots_.capacity(), 0);
  uint64_t used_b = 0, used_s = 0, quar_b = 0, quar_s = 0, live = 0, quar = 0, inflight_req = 0,
           inflight = 0;
  std::unordered_map<uint32_t, uint32_t> block_refs, slot_refs;  // recounted (shared pages)
  const bool joint = layout_.joint_ids;
  // One page of a pool held by request `id`: by one of its readers (shared) or by it alone.
  auto hold = [&](bool block, uint64_t id, uint32_t page, bool shared) -> Status {
    const IdPool& pool = block ? blocks_ : slots_;
    std::vector<uint64_t>& owner = block ? block_owner : slot_owner;
    const std::string what = (block ? "block " : "slot ") + str(page);
    if (page >= owner.size()) return fail("request " + str(id) + " holds " + what);
    if (pool.isFree(page)) return fail(what + " of request " + str(id) + " is free");
    if (shared) {
      ++(block ? block_refs : slot_refs)[page];
      return OkStatus();
    }
    if (owner[page] != 0 || (block ? block_refs_ : slot_refs_).count(page)) {
      return fail(what + " held by requests " + str(owner[page] - 1) + " and " + str(id));
    }
    owner[page] = id + 1;
    return OkStatus();
  };
  for (const auto& [id, r] : requests_) {
    for (size_t i = 0; i < r.alloc.blocks.size(); ++i) {
      RETURN_IF_ERROR(hold(true, id, r.alloc.blocks[i], i < r.shared_blocks));
    }
    for (uint32_t s : r.alloc.stateIds()) RETURN_IF_ERROR(hold(joint, id, s, r.shared_slot));
    const auto [nb, ns] = pageCounts(r.alloc);
    (r.freed ? quar_b : used_b) += nb;
    (r.freed ? quar_s : used_s) += ns;
    ++(r.freed ? quar : live);
    if (r.freed && r.inflight == 0)
      return fail("request " + str(id) + " quarantined, not in flight");
    inflight_req += r.inflight > 0;
    inflight += r.inflight;
  }
  const CacheCounters& c = stats_;
  if (used_b != c.used_blocks || used_s != c.used_slots || quar_b != c.quarantined_blocks ||
      quar_s != c.quarantined_slots) {
    return fail("pages held by requests: used " + str(used_b) + "/" + str(used_s) +
                " quarantined " + str(quar_b) + "/" + str(quar_s) +
                " (blocks/slots), counters say " + str(c.used_blocks) + "/" + str(c.used_slots) +
                " and " + str(c.quarantined_blocks) + "/" + str(c.quarantined_slots));
  }
  if (block_refs != block_refs_ || slot_refs != slot_refs_) {
    return fail("shared page reader counts disagree with the requests holding them");
  }
  // With shared reads a page counts once per reader: count the distinct pages instead.
  uint64_t shared_b = 0, shared_s = 0;
  for (const auto& [page, n] : block_refs) shared_b += n - 1;
  for (const auto& [page, n] : slot_refs) shared_s += n - 1;
  if (used_b + quar_b - shared_b + blocks_.freeCount() != blocks_.capacity() ||
      used_s + quar_s - shared_s + slots_.freeCount() != slots_.capacity()) {
    return fail("free + used + quarantined != total (blocks " + str(blocks_.freeCount()) + "+" +
                str(used_b) + "+" + str(quar_b) + " of " + str(blocks_.capacity()) + ", slots " +
                str(slots_.freeCount()) + "+" + str(used_s) + "+" + str(quar_s) + " of " +
                str(slots_.capacity()) + ")");
  }
  if (live != c.live_requests || quar != c.quarantined_requests ||
      inflight_req != c.inflight_requests || inflight != c.inflight_transfers) {
    return fail("request counts (live " + str(live) + ", quarantined " + str(quar) +
                ", in flight " + str(inflight_req) + "/" + str(inflight) +
                ") disagree with the counters");
  }
  return OkStatus();
}

CacheCounters HybridCacheManager::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  CacheCounters c = stats_;
  c.total_blocks = blocks_.capacity();
  c.free_blocks = blocks_.freeCount();
  c.total_slots = slots_.capacity();
  c.free_slots = slots_.freeCount();
  c.free_block_runs = static_cast<uint32_t>(blocks_.runCount());
  return c;
}

}  // namespace hxfer
