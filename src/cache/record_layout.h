// The shape of one record in memory, for layouts other than hxfer's own (DESIGN §11).
//
// hxfer's own records are the concatenation of their sections, each a run of whole units
// (layout.h). A serving engine lays the same bytes out its own way: vLLM keeps a KV block NHD
// (token, head, dim) per K and V half, SGLang token rows, vLLM's conv state (window, channel).
// A RecordLayout says where every element of a record is: an N-d strided tensor of elements
// of `element_bytes`, with named dims (size on this rank, byte stride), inside the record
// that PoolView::offset(index, layer) locates.
//
// The logical coordinates of an element are the same on every layout of a (kind, role):
//   kv            section dim "kv" (K = 0, V = 1); unit dim "head"; "token", "dim"
//   conv          unit dim "channel" (sections x|B|C, Q|K|V or channels, consecutive along it;
//                 a unit is unit_len channels); "window" (the d_conv - 1 kept columns)
//   mamba2 ssm    unit dim "head"; "head_dim", "state"
//   gdn ssm       unit dim "head"; "key", "value"
//   mamba1 ssm    unit dim "channel"; "state"
// hxfer's own order is the one listed ([kv][head][token][dim], [channel][window], ...); a view
// without a RecordLayout is in that order and contiguous. An inner dim may be split: named more
// than once, its index is mixed-radix over those dims, the first named the most significant
// (vLLM's CPU attention on AMX keeps K as token/16, dim/2, token%16, dim%2); the section and
// unit dims are named once. Sections split the unit dim into
// ranges (or, with a section dim, sit at its indices; a view holding a single section, e.g. K
// alone, may leave the section dim out); TP shards each section by whole units
// (DESIGN §2), so a rank's unit dim holds its local units of every section, in section order.
//
// Pure values and functions; safe to share read-only.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "hxfer/record_dim.h"
#include "model/model.h"

namespace hxfer {

struct RecordLayout {
  std::vector<RecordDim> dims;  // as the engine declares the tensor, outermost first
  uint32_t element_bytes = 0;   // the dtype's size; elements are contiguous bytes
  bool operator==(const RecordLayout&) const = default;

  // The first dim of that name (the only one for the section and unit dims), or nullptr.
  const RecordDim* find(std::string_view name) const;
  // The logical size of a dim: the product of the sizes of every dim of that name (0: none).
  uint64_t sizeOf(std::string_view name) const;
  // One past the last byte any element occupies (the record's extent in memory).
  uint64_t span() const;
  // "token 16 @512, head 2 @256, dim 64 @2" (outermost first), for messages and the CLI.
  std::string toString() const;
};

// The logical dims of a (kind, role): hxfer's order, outermost first.
struct LogicalDims {
  std::string section_dim;  // "kv" for kv records; empty when sections run along the unit dim
  std::string unit_dim;     // "head" or "channel"
  std::vector<std::string> inner;
};
LogicalDims logicalDims(LayerKind kind, Role role);

// The sizes of the inner logical dims of `layer`'s `role` record in `model` (by name, in the
// order of logicalDims().inner).
std::vector<uint32_t> innerSizes(const ModelSpec& model, const LayerSpec& layer, Role role);

// Units each section holds on TP rank `tp_rank` of `tp` (shardUnits(...).count per section).
StatusOr<std::vector<uint32_t>> localUnitCounts(const std::vector<Section>& sections, uint32_t tp,
                                                uint32_t tp_rank);

// The sizes of `r`'s inner dims, in the order of dims.inner. REQUIRES: r has every one.
std::vector<uint32_t> innerSizesOf(const RecordLayout& r, const LogicalDims& dims);

// Elements of a section's unit along the unit dim: unit_bytes / (element_bytes x the product
// of the inner sizes). InvalidArgument when it does not divide.
StatusOr<uint32_t> unitLength(const Section& s, uint32_t element_bytes,
                              const std::vector<uint32_t>& inner_sizes);

// Everything a RecordLayout of a view must satisfy, given the view's kind, role, sections and
// the rank's tp: the dim names are exactly the logical ones of (kind, role); the section dim
// has one index per section; the unit dim holds the rank's local units of every section; the
// element size is the role's dtype; strides nest (sorted by stride, each at least the extent
// of the dims below it), so no two elements share a byte. `tokens_per_block` checks "token".
// Errors name the dim and the values.
Status checkRecordLayout(const RecordLayout& r, LayerKind kind, Role role,
                         const std::vector<Section>& sections, uint32_t tp, uint32_t tp_rank,
                         uint32_t element_bytes, uint32_t tokens_per_block);

// A contiguous record of (kind, role) whose dims are in `order` (outermost first; the logical
// dim names, the section dim left out when empty or when `sections` has one entry), for a rank
// holding `local_units` of each section, with the given inner sizes.
StatusOr<RecordLayout> contiguousRecordLayout(LayerKind kind, Role role,
                                              const std::vector<Section>& sections,
                                              const std::vector<uint32_t>& local_units,
                                              uint32_t element_bytes,
                                              const std::vector<uint32_t>& inner_sizes,
                                              const std::vector<std::string>& order);

// hxfer's own record of (kind, role) as a RecordLayout: contiguousRecordLayout in the order of
// logicalDims (section dim, unit dim, inner dims).
StatusOr<RecordLayout> canonicalRecordLayout(LayerKind kind, Role role,
                                             const std::vector<Section>& sections,
                                             const std::vector<uint32_t>& local_units,
                                             uint32_t element_bytes,
                                             const std::vector<uint32_t>& inner_sizes);

// Where one section's units lie in a record. For a rank holding units [first, first + count)
// of the section: unit u (local index) starts at base + u * unit_stride; inside a unit the
// element at within-unit index c along the unit dim is at + c * within_stride; the inner dims
// follow by name.
struct SectionPlacement {
  uint64_t base = 0;
  uint64_t unit_stride = 0;
  uint64_t within_stride = 0;
  uint32_t unit_len = 0;
};
// REQUIRES: checkRecordLayout(r, ...) is ok. `section` indexes `sections`.
SectionPlacement placeSection(const RecordLayout& r, const LogicalDims& dims,
                              const std::vector<Section>& sections,
                              const std::vector<uint32_t>& local_units, size_t section,
                              uint32_t unit_len);

// A box of logical elements walked on two layouts at once: per dim its size and its byte
// stride on side a and on side b.
struct BoxDim {
  uint64_t size = 0;
  uint64_t a_stride = 0;
  uint64_t b_stride = 0;
};
// Calls fn(a_offset, b_offset, bytes) for the box's elements in b's memory order, one call per
// maximal run contiguous on both sides (dims whose strides continue the run on both sides
// merge into it). Returns the run length in bytes (the same for every call).
uint64_t forEachRun(std::vector<BoxDim> dims, uint64_t element_bytes, uint64_t a_base,
                    uint64_t b_base, const std::function<void(uint64_t, uint64_t, uint64_t)>& fn);
// The run length forEachRun would report, without walking the box.
uint64_t runBytes(std::vector<BoxDim> dims, uint64_t element_bytes);
// The box's dims in b's memory order (outermost first), dims of size 1 dropped. Its elements in
// that order are b's in ascending address when b's strides nest.
std::vector<BoxDim> inBOrder(std::vector<BoxDim> dims);

// The logical dim `name` of records a and b as box dims (outermost first): one dim when neither
// splits it, else the common refinement of both mixed-radix splits (a split [2, 16] against a
// whole 32 gives [2, 16] with b's strides 16*s and s). Incompatible when no refinement exists
// (splits [4, 8] and [8, 4]). REQUIRES: both have the dim, with the same logical size.
StatusOr<std::vector<BoxDim>> logicalBox(const RecordLayout& a, const RecordLayout& b,
                                         std::string_view name);

}  // namespace hxfer
