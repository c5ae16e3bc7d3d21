// The model layer: what a hybrid model's cache looks like, independent of any memory.
//
// A ModelSpec is an ordered list of global layers. Each layer may hold an attention part
// (paged KV), a recurrent part (mamba2, gdn or mamba1: conv + ssm state), both (parallel
// hybrids such as Falcon-H1) or neither (MLP / MoE layers: they count for pipeline stages but
// have no cache). recordSections() turns a (layer, role) into the sectioned record of
// DESIGN §2; shardUnits() says which units of a section a TP rank holds.
//
// Pure: no I/O, no threads. Values are safe to share read-only between threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace hxfer {

enum class DType : uint8_t { kFp32 = 0, kFp16 = 1, kBf16 = 2, kFp8 = 3 };
inline constexpr uint8_t kMaxDType = 3;

size_t dtypeSize(DType d);
std::string_view dtypeName(DType d);  // "fp32", "fp16", "bf16", "fp8"
// Accepts our names and Hugging Face / torch spellings ("float32", "bfloat16", "float8_e4m3fn").
StatusOr<DType> parseDType(std::string_view name);

// The kind of a layer's cache-holding part. kAttention is only ever the attention part; the
// recurrent part of a layer is one of kMamba2, kGdn, kMamba1 or kNone.
enum class LayerKind : uint8_t { kNone = 0, kAttention = 1, kMamba2 = 2, kGdn = 3, kMamba1 = 4 };
inline constexpr uint8_t kMaxLayerKind = 4;
std::string_view layerKindName(LayerKind k);

// The role of a record: kv for attention, conv and ssm for recurrent layers.
enum class Role : uint8_t { kKv = 0, kConv = 1, kSsm = 2 };
inline constexpr uint8_t kMaxRole = 2;
std::string_view roleName(Role r);

struct AttentionShape {
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  bool operator==(const AttentionShape&) const = default;
};

struct Mamba2Shape {
  uint32_t n_heads = 0;   // H
  uint32_t head_dim = 0;  // P
  uint32_t n_groups = 0;  // G
  uint32_t d_state = 0;   // N
  uint32_t d_conv = 0;    // k (conv kernel); the conv state keeps k-1 columns
  bool operator==(const Mamba2Shape&) const = default;
};

struct GdnShape {
  uint32_t n_k_heads = 0;   // Hk
  uint32_t n_v_heads = 0;   // Hv
  uint32_t k_head_dim = 0;  // Dk
  uint32_t v_head_dim = 0;  // Dv
  uint32_t d_conv = 0;      // k
  bool operator==(const GdnShape&) const = default;
};

struct Mamba1Shape {
  uint32_t d_inner = 0;
  uint32_t d_state = 0;
  uint32_t d_conv = 0;
  bool operator==(const Mamba1Shape&) const = default;
};

struct LayerSpec {
  std::optional<AttentionShape> attention;
  LayerKind recurrent = LayerKind::kNone;  // kNone, kMamba2, kGdn or kMamba1
  Mamba2Shape mamba2;                      // meaningful when recurrent == kMamba2
  GdnShape gdn;                            // ... kGdn
  Mamba1Shape mamba1;                      // ... kMamba1

  bool hasAttention() const { return attention.has_value(); }
  bool hasRecurrent() const { return recurrent != LayerKind::kNone; }
  bool hasCache() const { return hasAttention() || hasRecurrent(); }
  // "attention", "mamba2", "attention+mamba2", "none", ...
  std::string kindName() const;
  bool operator==(const LayerSpec&) const = default;
};

// Bounds on a model's numbers, far above any real model's, so that every byte count derived
// from them fits 64 bits: a shape field (heads, dims, d_state, d_conv, tokens per block), the
// layer count (the wire's limit), one record's bytes.
inline constexpr uint32_t kMaxShapeField = 1u << 20;
inline constexpr uint32_t kMaxModelLayers = 1u << 16;
inline constexpr uint64_t kMaxRecordBytes = uint64_t{1} << 40;

struct ModelSpec {
  std::string name;               // preset name or file stem
  std::string architecture;       // Hugging Face architecture, e.g. "NemotronHForCausalLM"
  std::vector<LayerSpec> layers;  // index = global layer id
  DType kv_dtype = DType::kBf16;
  DType conv_dtype = DType::kBf16;
  DType ssm_dtype = DType::kFp32;
  uint32_t tokens_per_block = 32;

  uint32_t numLayers() const { return static_cast<uint32_t>(layers.size()); }
  // Every shape non-zero and at most kMaxShapeField, d_conv >= 2, at most kMaxModelLayers
  // layers, every record (one page of one layer and role) at most kMaxRecordBytes, at least
  // one layer with a cache.
  Status validate() const;
};

// One section of a record: `units` global units of `unit_bytes` bytes each.
struct Section {
  std::string name;  // "K", "V", "x", "B", "C", "Q", "heads", "channels"
  uint32_t units = 0;
  uint64_t unit_bytes = 0;
  bool operator==(const Section&) const = default;
};

// The sections of the record of `layer` for `role` (DESIGN §2). Empty when the layer has no
// record of that role (kv without attention, conv/ssm without a recurrent part).
std::vector<Section> recordSections(const ModelSpec& model, const LayerSpec& layer, Role role);

// Units [first, first + count) of a section held by one TP rank.
struct UnitRange {
  uint32_t first = 0;
  uint32_t count = 0;
  bool operator==(const UnitRange&) const = default;
};

// Ownership rule of DESIGN §2:
//   units >= tp: requires units % tp == 0; rank holds [rank*units/tp, (rank+1)*units/tp).
//   units <  tp: requires tp % units == 0; rank holds the single unit rank*units/tp.
// `what` names the section in the error: "tp=3 does not divide mamba2 conv B units=8".
StatusOr<UnitRange> shardUnits(uint32_t units, uint32_t tp, uint32_t rank, std::string_view what);

// Bytes of one record on TP rank `rank` of `tp` (sum over sections of local units × bytes).
StatusOr<uint64_t> localRecordBytes(const std::vector<Section>& sections, uint32_t tp,
                                    uint32_t rank);

// Roles that a layer holds records for, in record order: kv, then conv, ssm.
std::vector<Role> layerRoles(const LayerSpec& layer);

// Tensor/pipeline parallel layout of one instance.
struct ParallelConfig {
  uint32_t tp = 1;
  uint32_t pp = 1;
  // Optional explicit split of global layers over pp stages; empty = even split.
  std::vector<uint32_t> layers_per_stage;

  // Checks tp/pp >= 1, that the split covers exactly num_layers, and (even split) that pp
  // divides num_layers. Errors name the field and values.
  Status validate(uint32_t num_layers) const;
  uint32_t worldSize() const { return tp * pp; }
};

struct LayerRange {
  uint32_t first = 0;
  uint32_t count = 0;
  uint32_t end() const { return first + count; }
  bool contains(uint32_t layer) const { return layer >= first && layer < end(); }
  bool operator==(const LayerRange&) const = default;
};
// Every layer (a plan not limited to some layers).
inline constexpr LayerRange kAllLayers{0, UINT32_MAX};

// Global layers of pipeline stage `pp_rank`. REQUIRES: pc.validate(num_layers) is ok.
StatusOr<LayerRange> stageLayers(const ParallelConfig& pc, uint32_t num_layers, uint32_t pp_rank);
// The per-stage layer counts (explicit or the even split).
StatusOr<std::vector<uint32_t>> resolvedLayersPerStage(const ParallelConfig& pc,
                                                       uint32_t num_layers);

// Checks that every section of every layer can be sharded at pc.tp (names the first failure).
Status checkShardable(const ModelSpec& model, const ParallelConfig& pc);

// A 64-bit hash (xxh3) over every layer's kinds and shapes, in order. Peers whose fingerprints
// differ do not run the same model. Dtypes and tokens per block are compared separately so
// that a refusal can name them.
uint64_t modelFingerprint(const ModelSpec& model);

}  // namespace hxfer
