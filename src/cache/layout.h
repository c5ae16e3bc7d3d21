// Pool views: the affine description of where every record of one rank lives (DESIGN §3).
//
//   addr(index, local_layer) = region.base + view.base + index*index_stride
//                              + local_layer*layer_stride
//
// `index` is a block id for kv views and a slot id for conv/ssm views. A RankLayout is the
// complete, memory-free description of one rank's cache: the wire encodes it, the planner
// reads it, the cache manager allocates regions for it. Layouts:
//   KV (always):       one pool per attention group, [block][local layer][K|V][head][token][dim]
//   paged ("V2"):      one slot holds every local layer of a recurrent group; if the group's
//                      conv and ssm records have equal size they share one pool, interleaved
//                      [ssm_l0|conv_l0|ssm_l1|conv_l1|...]; otherwise one pool per role,
//                      [slot][local layer][record].
//   layer-major:       one pool per (recurrent group, role), [local layer][slot][record].
// Each pool is its own region (ids 0..n-1 in view order of creation).
//
// Pure values: no I/O, no threads; safe to share read-only.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache/record_layout.h"
#include "common/status.h"
#include "model/model.h"

namespace hxfer {

enum class StateLayout : uint8_t { kPaged = 0, kLayerMajor = 1 };
inline constexpr uint8_t kMaxStateLayout = 1;
std::string_view stateLayoutName(StateLayout l);  // "paged", "layer-major"
StatusOr<StateLayout> parseStateLayout(std::string_view name);

struct PoolView {
  Role role = Role::kKv;
  LayerKind kind = LayerKind::kAttention;  // kAttention for kv; the recurrent kind otherwise
  std::vector<uint32_t> layers;            // global layer id of each local layer, ascending
  std::vector<Section> sections;           // global sections of the record
  uint64_t record_bytes = 0;               // bytes of one record on this rank
  uint32_t region_id = 0;
  uint64_t base = 0;  // offset in the region of (index 0, local layer 0)
  uint64_t index_stride = 0;
  uint64_t layer_stride = 0;
  uint32_t num_indices = 0;  // blocks (kv) or slots (conv/ssm)
  // Where each element of a record lies (record_layout.h); absent for hxfer's own contiguous
  // order. record_bytes stays the bytes the record holds; span() its extent in memory.
  std::optional<RecordLayout> record;
  // State views: which of a request's state ids indexes this view (RankIds::stateId): 0 its
  // slot, g > 0 its g-th further id. vLLM's hybrid manager gives each group of Mamba layers a
  // block table of its own, so one request holds one state id per group. 0 for kv views.
  uint32_t state_group = 0;

  uint64_t offset(uint64_t index, uint64_t local_layer) const {
    return base + index * index_stride + local_layer * layer_stride;
  }
  bool indexedByBlock() const { return role == Role::kKv; }
  // Bytes from a record's start to one past its last byte (record_bytes unless described).
  uint64_t span() const { return record ? record->span() : record_bytes; }
  bool operator==(const PoolView&) const = default;
};

struct RegionSpec {
  uint32_t id = 0;
  uint64_t length = 0;
  std::string name;  // "kv0", "state0", "conv0", "ssm0"
  bool operator==(const RegionSpec&) const = default;
};

struct RankLayout {
  uint32_t tp = 1, pp = 1, tp_rank = 0, pp_rank = 0;
  std::vector<uint32_t> layers_per_stage;  // resolved, one entry per pp stage
  StateLayout state_layout = StateLayout::kPaged;
  uint32_t tokens_per_block = 32;
  DType kv_dtype = DType::kBf16, conv_dtype = DType::kBf16, ssm_dtype = DType::kFp32;
  uint64_t model_fingerprint = 0;
  uint32_t num_blocks = 0;
  uint32_t num_slots = 0;
  std::vector<RegionSpec> regions;
  std::vector<PoolView> views;
  // State ids a request has on this rank when it holds recurrent layers: its slot and
  // state_groups - 1 more (PoolView::state_group < state_groups). 1 unless the layout is vLLM's
  // shared per-group tensors.
  uint32_t state_groups = 1;
  // Block ids and state ids are drawn from one pool (vLLM's hybrid manager): num_slots equals
  // num_blocks, and no id is a block and a state of live requests at once. Views of different
  // id groups (the kv views; the state views of each state group) may then share a region and
  // its index space, each record of index i inside [i * index_stride, (i + 1) * index_stride):
  // the record of one group at index i and another's at i are never live together.
  bool joint_ids = false;

  // Structural check, also run on layouts decoded from a peer: ranks < sizes, every view's
  // region exists, record_bytes equals the sharded sections at (tp, tp_rank), every record of
  // every view lies inside its region (overflow-checked), num_indices matches
  // num_blocks/num_slots, layers ascending and inside this rank's pp stage, each (role, layer)
  // in at most one view, no two records overlap (within a view, and between views sharing a
  // region). The overlap test is sufficient, not exact: strides must nest (inner stride >=
  // record, outer stride >= the inner run) and views sharing a region must interleave on one
  // common stride, as every layout buildRankLayout makes does. With joint_ids, views of
  // different id groups may share bytes at the same index as said there, and nothing else.
  // Errors name the view and field: "view 3 (kv)" and "region 2", or what `names` makes of
  // them (a caller that built the views from records of its own names those).
  struct Names {
    std::function<std::string(size_t view)> view;
    std::function<std::string(uint32_t region_id)> region;
  };
  Status validate(const Names& names = {}) const;

  // Global layers of this rank's pp stage, cache or not. REQUIRES: validate() is ok.
  LayerRange stageLayers() const;
  // Bytes of all kv records of one block / all conv+ssm records of one slot on this rank.
  uint64_t kvBytesPerBlock() const;
  // The dtype of the records of `role` (kv, conv or ssm).
  DType dtypeOf(Role role) const {
    return role == Role::kKv ? kv_dtype : role == Role::kConv ? conv_dtype : ssm_dtype;
  }
  uint64_t stateBytesPerSlot() const;
  const RegionSpec* findRegion(uint32_t id) const;
  bool operator==(const RankLayout&) const = default;
};

// The record of kv view `v` of `l` as a RecordLayout: its own, or hxfer's contiguous
// [kv][head][token][dim] (the head dim is a unit's bytes over tokens per block and the element
// size). InvalidArgument when `v` is not a kv view or its unit bytes do not divide.
StatusOr<RecordLayout> kvRecordLayout(const RankLayout& l, const PoolView& v);

// Builds the layout of rank (tp_rank, pp_rank) with the given capacities. Errors: invalid model
// or parallel config, indivisible sections, zero capacities where the rank needs them.
StatusOr<RankLayout> buildRankLayout(const ModelSpec& model, const ParallelConfig& pc,
                                     uint32_t tp_rank, uint32_t pp_rank, StateLayout layout,
                                     uint32_t num_blocks, uint32_t num_slots);

}  // namespace hxfer
