#include "model/model.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <numeric>

#include "common/coding.h"

namespace hxfer {

size_t dtypeSize(DType d) {
  switch (d) {
    case DType::kFp32:
      return 4;
    case DType::kFp16:
      return 2;
    case DType::kBf16:
      return 2;
    case DType::kFp8:
      return 1;
  }
  return 0;
}

std::string_view dtypeName(DType d) {
  switch (d) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
    case DType::kFp8:
      return "fp8";
  }
  return "unknown";
}

StatusOr<DType> parseDType(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n.rfind("torch.", 0) == 0) n = n.substr(6);
  if (n == "fp32" || n == "float32" || n == "float") return DType::kFp32;
  if (n == "fp16" || n == "float16" || n == "half") return DType::kFp16;
  if (n == "bf16" || n == "bfloat16") return DType::kBf16;
  if (n == "fp8" || n == "float8" || n == "float8_e4m3fn" || n == "float8_e4m3" || n == "e4m3") {
    return DType::kFp8;
  }
  // fp8 is E4M3 here: E5M2 bytes taken for it (a peer of the other format plans as equal
  // dtypes) would mean other numbers.
  if (n == "float8_e5m2" || n == "e5m2" || n == "fp8_e5m2") {
    return InvalidArgument("dtype '" + std::string(name) +
                           "': hxfer's fp8 is E4M3 (float8_e4m3fn); E5M2 is not supported");
  }
  return InvalidArgument("unknown dtype '" + std::string(name) +
                         "' (expected fp32, fp16, bf16 or fp8)");
}

std::string_view layerKindName(LayerKind k) {
  switch (k) {
    case LayerKind::kNone:
      return "none";
    case LayerKind::kAttention:
      return "attention";
    case LayerKind::kMamba2:
      return "mamba2";
    case LayerKind::kGdn:
      return "gdn";
    case LayerKind::kMamba1:
      return "mamba1";
  }
  return "unknown";
}

std::string_view roleName(Role r) {
  switch (r) {
    case Role::kKv:
      return "kv";
    case Role::kConv:
      return "conv";
    case Role::kSsm:
      return "ssm";
  }
  return "unknown";
}

std::string LayerSpec::kindName() const {
  if (hasAttention() && hasRecurrent()) return "attention+" + std::string(layerKindName(recurrent));
  if (hasAttention()) return "attention";
  return std::string(layerKindName(recurrent));
}

namespace {

Status requirePositive(uint32_t v, std::string_view layer, std::string_view field) {
  if (v == 0) return InvalidArgument(std::string(layer) + " " + std::string(field) + "=0");
  if (v > kMaxShapeField) {
    return InvalidArgument(std::string(layer) + " " + std::string(field) + "=" + std::to_string(v) +
                           " is above " + std::to_string(kMaxShapeField));
  }
  return OkStatus();
}

Status requireConv(uint32_t d_conv, std::string_view layer) {
  if (d_conv < 2) {
    return InvalidArgument(std::string(layer) + " d_conv=" + std::to_string(d_conv) +
                           " must be >= 2 (the conv state keeps d_conv-1 columns)");
  }
  return requirePositive(d_conv, layer, "d_conv");
}

// With every field at most kMaxShapeField a section's unit bytes fit 64 bits (two fields and
// an element size); units x unit bytes and their sum are taken in 128.
Status requireRecordBytes(const ModelSpec& model, const LayerSpec& layer, std::string_view where) {
  for (Role role : layerRoles(layer)) {
    unsigned __int128 bytes = 0;
    for (const Section& s : recordSections(model, layer, role)) {
      bytes += static_cast<unsigned __int128>(s.units) * s.unit_bytes;
    }
    if (bytes > kMaxRecordBytes) {
      return InvalidArgument(std::string(where) + " " + std::string(roleName(role)) +
                             " record is above " + std::to_string(kMaxRecordBytes) +
                             " bytes a page (its shape fields multiply past it)");
    }
  }
  return OkStatus();
}

}  // namespace

Status ModelSpec::validate() const {
  if (layers.empty()) return InvalidArgument("model '" + name + "' has no layers");
  if (layers.size() > kMaxModelLayers) {
    return InvalidArgument("model '" + name + "' has " + std::to_string(layers.size()) +
                           " layers, above " + std::to_string(kMaxModelLayers));
  }
  RETURN_IF_ERROR(requirePositive(tokens_per_block, "model '" + name + "'", "tokens_per_block"));
  bool any_cache = false;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& l = layers[i];
    const std::string where = "layer " + std::to_string(i);
    any_cache |= l.hasCache();
    if (l.attention) {
      RETURN_IF_ERROR(requirePositive(l.attention->n_kv_heads, where, "n_kv_heads"));
      RETURN_IF_ERROR(requirePositive(l.attention->head_dim, where, "head_dim"));
    }
    switch (l.recurrent) {
      case LayerKind::kNone:
        break;
      case LayerKind::kAttention:
        return InvalidArgument(where + " has recurrent kind 'attention'");
      case LayerKind::kMamba2:
        RETURN_IF_ERROR(requirePositive(l.mamba2.n_heads, where, "mamba2 n_heads"));
        RETURN_IF_ERROR(requirePositive(l.mamba2.head_dim, where, "mamba2 head_dim"));
        RETURN_IF_ERROR(requirePositive(l.mamba2.n_groups, where, "mamba2 n_groups"));
        RETURN_IF_ERROR(requirePositive(l.mamba2.d_state, where, "mamba2 d_state"));
        RETURN_IF_ERROR(requireConv(l.mamba2.d_conv, where));
        break;
      case LayerKind::kGdn:
        RETURN_IF_ERROR(requirePositive(l.gdn.n_k_heads, where, "gdn n_k_heads"));
        RETURN_IF_ERROR(requirePositive(l.gdn.n_v_heads, where, "gdn n_v_heads"));
        RETURN_IF_ERROR(requirePositive(l.gdn.k_head_dim, where, "gdn k_head_dim"));
        RETURN_IF_ERROR(requirePositive(l.gdn.v_head_dim, where, "gdn v_head_dim"));
        RETURN_IF_ERROR(requireConv(l.gdn.d_conv, where));
        break;
      case LayerKind::kMamba1:
        RETURN_IF_ERROR(requirePositive(l.mamba1.d_inner, where, "mamba1 d_inner"));
        RETURN_IF_ERROR(requirePositive(l.mamba1.d_state, where, "mamba1 d_state"));
        RETURN_IF_ERROR(requireConv(l.mamba1.d_conv, where));
        break;
    }
    RETURN_IF_ERROR(requireRecordBytes(*this, l, where));
  }
  if (!any_cache) return InvalidArgument("model '" + name + "' has no layer with a cache");
  return OkStatus();
}

std::vector<Section> recordSections(const ModelSpec& model, const LayerSpec& layer, Role role) {
  const uint64_t e_kv = dtypeSize(model.kv_dtype);
  const uint64_t e = dtypeSize(model.conv_dtype);
  const uint64_t e_ssm = dtypeSize(model.ssm_dtype);
  switch (role) {
    case Role::kKv: {
      if (!layer.attention) return {};
      const uint64_t per_head = uint64_t{model.tokens_per_block} * layer.attention->head_dim * e_kv;
      return {{"K", layer.attention->n_kv_heads, per_head},
              {"V", layer.attention->n_kv_heads, per_head}};
    }
    case Role::kConv:
      switch (layer.recurrent) {
        case LayerKind::kMamba2: {
          const auto& m = layer.mamba2;
          const uint64_t cols = m.d_conv - 1;
          return {{"x", m.n_heads, uint64_t{m.head_dim} * cols * e},
                  {"B", m.n_groups, uint64_t{m.d_state} * cols * e},
                  {"C", m.n_groups, uint64_t{m.d_state} * cols * e}};
        }
        case LayerKind::kGdn: {
          const auto& g = layer.gdn;
          const uint64_t cols = g.d_conv - 1;
          return {{"Q", g.n_k_heads, uint64_t{g.k_head_dim} * cols * e},
                  {"K", g.n_k_heads, uint64_t{g.k_head_dim} * cols * e},
                  {"V", g.n_v_heads, uint64_t{g.v_head_dim} * cols * e}};
        }
        case LayerKind::kMamba1:
          return {{"channels", layer.mamba1.d_inner, uint64_t{layer.mamba1.d_conv - 1} * e}};
        default:
          return {};
      }
    case Role::kSsm:
      switch (layer.recurrent) {
        case LayerKind::kMamba2: {
          const auto& m = layer.mamba2;
          return {{"heads", m.n_heads, uint64_t{m.head_dim} * m.d_state * e_ssm}};
        }
        case LayerKind::kGdn: {
          const auto& g = layer.gdn;
          return {{"heads", g.n_v_heads, uint64_t{g.k_head_dim} * g.v_head_dim * e_ssm}};
        }
        case LayerKind::kMamba1:
          return {{"channels", layer.mamba1.d_inner, uint64_t{layer.mamba1.d_state} * e_ssm}};
        default:
          return {};
      }
  }
  return {};
}

StatusOr<UnitRange> shardUnits(uint32_t units, uint32_t tp, uint32_t rank, std::string_view what) {
  if (tp == 0) return InvalidArgument("tp=0 for " + std::string(what));
  if (rank >= tp) {
    return InvalidArgument("tp rank " + std::to_string(rank) + " >= tp=" + std::to_string(tp) +
                           " for " + std::string(what));
  }
  if (units == 0) return InvalidArgument(std::string(what) + " has units=0");
  if (units >= tp) {
    if (units % tp != 0) {
      return Incompatible("tp=" + std::to_string(tp) + " does not divide " + std::string(what) +
                          " units=" + std::to_string(units));
    }
    const uint32_t per = units / tp;
    return UnitRange{rank * per, per};
  }
  if (tp % units != 0) {
    return Incompatible(std::string(what) + " units=" + std::to_string(units) +
                        " does not divide tp=" + std::to_string(tp) + " (replication needs it)");
  }
  return UnitRange{static_cast<uint32_t>(uint64_t{rank} * units / tp), 1};
}

StatusOr<uint64_t> localRecordBytes(const std::vector<Section>& sections, uint32_t tp,
                                    uint32_t rank) {
  uint64_t total = 0;
  for (const Section& s : sections) {
    ASSIGN_OR_RETURN(UnitRange r, shardUnits(s.units, tp, rank, "section " + s.name));
    total += uint64_t{r.count} * s.unit_bytes;
  }
  return total;
}

std::vector<Role> layerRoles(const LayerSpec& layer) {
  std::vector<Role> roles;
  if (layer.hasAttention()) roles.push_back(Role::kKv);
  if (layer.hasRecurrent()) {
    roles.push_back(Role::kConv);
    roles.push_back(Role::kSsm);
  }
  return roles;
}

Status ParallelConfig::validate(uint32_t num_layers) const {
  if (tp == 0) return InvalidArgument("tp=0 (must be >= 1)");
  if (pp == 0) return InvalidArgument("pp=0 (must be >= 1)");
  if (!layers_per_stage.empty()) {
    if (layers_per_stage.size() != pp) {
      return InvalidArgument("layers_per_stage has " + std::to_string(layers_per_stage.size()) +
                             " entries but pp=" + std::to_string(pp));
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < layers_per_stage.size(); ++i) {
      if (layers_per_stage[i] == 0) {
        return InvalidArgument("layers_per_stage[" + std::to_string(i) + "]=0");
      }
      sum += layers_per_stage[i];
    }
    if (sum != num_layers) {
      return InvalidArgument("layers_per_stage sums to " + std::to_string(sum) +
                             " but the model has " + std::to_string(num_layers) + " layers");
    }
    return OkStatus();
  }
  if (num_layers % pp != 0) {
    return InvalidArgument("pp=" + std::to_string(pp) + " does not divide num_layers=" +
                           std::to_string(num_layers) + " (give layers_per_stage)");
  }
  return OkStatus();
}

StatusOr<std::vector<uint32_t>> resolvedLayersPerStage(const ParallelConfig& pc,
                                                       uint32_t num_layers) {
  RETURN_IF_ERROR(pc.validate(num_layers));
  if (!pc.layers_per_stage.empty()) return pc.layers_per_stage;
  return std::vector<uint32_t>(pc.pp, num_layers / pc.pp);
}

StatusOr<LayerRange> stageLayers(const ParallelConfig& pc, uint32_t num_layers, uint32_t pp_rank) {
  ASSIGN_OR_RETURN(std::vector<uint32_t> per, resolvedLayersPerStage(pc, num_layers));
  if (pp_rank >= pc.pp) {
    return InvalidArgument("pp rank " + std::to_string(pp_rank) +
                           " >= pp=" + std::to_string(pc.pp));
  }
  uint32_t first = 0;
  for (uint32_t s = 0; s < pp_rank; ++s) first += per[s];
  return LayerRange{first, per[pp_rank]};
}

Status checkShardable(const ModelSpec& model, const ParallelConfig& pc) {
  for (uint32_t i = 0; i < model.numLayers(); ++i) {
    const LayerSpec& layer = model.layers[i];
    for (Role role : layerRoles(layer)) {
      for (const Section& s : recordSections(model, layer, role)) {
        const std::string what =
            "layer " + std::to_string(i) + " " +
            std::string(role == Role::kKv ? "attention" : layerKindName(layer.recurrent)) + " " +
            std::string(roleName(role)) + " " + s.name;
        auto r = shardUnits(s.units, pc.tp, 0, what);
        if (!r.isOk()) return r.status();
      }
    }
  }
  return OkStatus();
}

uint64_t modelFingerprint(const ModelSpec& model) {
  Bytes b;
  putVarint64(b, model.layers.size());
  for (const LayerSpec& l : model.layers) {
    putFixed8(b, l.attention ? 1 : 0);
    if (l.attention) {
      putVarint64(b, l.attention->n_kv_heads);
      putVarint64(b, l.attention->head_dim);
    }
    putFixed8(b, static_cast<uint8_t>(l.recurrent));
    switch (l.recurrent) {
      case LayerKind::kMamba2:
        for (uint32_t v : {l.mamba2.n_heads, l.mamba2.head_dim, l.mamba2.n_groups, l.mamba2.d_state,
                           l.mamba2.d_conv}) {
          putVarint64(b, v);
        }
        break;
      case LayerKind::kGdn:
        for (uint32_t v :
             {l.gdn.n_k_heads, l.gdn.n_v_heads, l.gdn.k_head_dim, l.gdn.v_head_dim, l.gdn.d_conv}) {
          putVarint64(b, v);
        }
        break;
      case LayerKind::kMamba1:
        for (uint32_t v : {l.mamba1.d_inner, l.mamba1.d_state, l.mamba1.d_conv}) putVarint64(b, v);
        break;
      default:
        break;
    }
  }
  return XXH3_64bits(b.data(), b.size());
}

}  // namespace hxfer
