#include "model/hf_config.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

namespace hxfer {
namespace {

using Json = nlohmann::json;

// Typed, error-naming access to the fields of one config object. Every error starts with the
// architecture so that a message read on its own says which importer refused what.
class Fields {
 public:
  Fields(const Json& j, std::string arch) : j_(j), arch_(std::move(arch)) {}

  const std::string& arch() const { return arch_; }

  // Present and not null (Hugging Face writes unset optionals as null).
  bool has(std::string_view key) const {
    auto it = j_.find(key);
    return it != j_.end() && !it->is_null();
  }
  // Written out, null or not.
  bool written(std::string_view key) const { return j_.find(key) != j_.end(); }
  const Json& at(std::string_view key) const { return *j_.find(key); }

  Status error(const std::string& message) const { return InvalidArgument(arch_ + ": " + message); }
  Status missing(std::string_view key) const {
    return error("missing field '" + std::string(key) + "'");
  }
  Status wrongType(std::string_view key, std::string_view expected) const {
    std::string value = at(key).dump();
    if (value.size() > 40) value = value.substr(0, 37) + "...";
    return error("field '" + std::string(key) + "' must be " + std::string(expected) + ", got " +
                 value);
  }

  // A required integer in [1, 2^32).
  StatusOr<uint32_t> positive(std::string_view key) const {
    if (!has(key)) return missing(key);
    return positiveValue(key);
  }

  // num_hidden_layers, at most kMaxModelLayers (the importers size a vector by it).
  StatusOr<uint32_t> layerCount() const {
    ASSIGN_OR_RETURN(uint32_t n, positive("num_hidden_layers"));
    if (n > kMaxModelLayers) {
      return wrongType("num_hidden_layers", "at most " + std::to_string(kMaxModelLayers));
    }
    return n;
  }

  // The first of `keys` that is present (aliases: the current name first, then legacy ones).
  StatusOr<uint32_t> positiveAny(std::initializer_list<std::string_view> keys) const {
    for (std::string_view k : keys) {
      if (has(k)) return positiveValue(k);
    }
    return missing(*keys.begin());
  }

  // Absent, null or "auto" (a value Hugging Face derives) gives nullopt.
  StatusOr<std::optional<uint32_t>> positiveOrAuto(std::string_view key) const {
    if (!has(key)) return std::optional<uint32_t>();
    if (at(key).is_string() && at(key).get_ref<const std::string&>() == "auto") {
      return std::optional<uint32_t>();
    }
    ASSIGN_OR_RETURN(uint32_t v, positiveValue(key));
    return std::optional<uint32_t>(v);
  }

  StatusOr<std::string> string(std::string_view key) const {
    if (!has(key)) return missing(key);
    if (!at(key).is_string()) return wrongType(key, "a string");
    return at(key).get<std::string>();
  }

  // A list of strings (layer_types, layers_block_type).
  StatusOr<std::vector<std::string>> stringList(std::string_view key) const {
    if (!has(key)) return missing(key);
    const Json& v = at(key);
    if (!v.is_array()) return wrongType(key, "a list of strings");
    std::vector<std::string> out;
    for (const Json& e : v) {
      if (!e.is_string()) return wrongType(key, "a list of strings");
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  StatusOr<uint32_t> positiveValue(std::string_view key) const {
    const Json& v = at(key);
    if (!v.is_number_integer()) return wrongType(key, "a positive integer");
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      // Far above any real model's; every byte count derived from it then fits 64 bits.
      if (u == 0 || u > kMaxShapeField) {
        return wrongType(key, "a positive integer up to " + std::to_string(kMaxShapeField));
      }
      return static_cast<uint32_t>(u);
    }
    // A signed integer that is not unsigned is negative.
    return wrongType(key, "a positive integer");
  }

  const Json& j_;
  std::string arch_;
};

// a*b as uint32, or an error naming both fields.
StatusOr<uint32_t> product(const Fields& f, uint32_t a, std::string_view a_name, uint32_t b,
                           std::string_view b_name) {
  const uint64_t p = uint64_t{a} * b;
  if (p > std::numeric_limits<uint32_t>::max()) {
    return f.error(std::string(a_name) + "=" + std::to_string(a) + " * " + std::string(b_name) +
                   "=" + std::to_string(b) + " overflows");
  }
  return static_cast<uint32_t>(p);
}

// a/b, requiring an exact division; the error names both fields and values.
StatusOr<uint32_t> exactQuotient(const Fields& f, uint32_t a, std::string_view a_name, uint32_t b,
                                 std::string_view b_name) {
  if (a % b != 0) {
    return f.error(std::string(b_name) + "=" + std::to_string(b) + " does not divide " +
                   std::string(a_name) + "=" + std::to_string(a));
  }
  return a / b;
}

StatusOr<AttentionShape> attentionShape(const Fields& f) {
  AttentionShape a;
  if (f.has("num_key_value_heads")) {
    ASSIGN_OR_RETURN(a.n_kv_heads, f.positive("num_key_value_heads"));
  } else {
    // Hugging Face's rule: no num_key_value_heads means multi-head attention.
    ASSIGN_OR_RETURN(a.n_kv_heads, f.positive("num_attention_heads"));
  }
  if (f.has("head_dim")) {
    ASSIGN_OR_RETURN(a.head_dim, f.positive("head_dim"));
  } else if (f.has("attention_head_dim")) {
    ASSIGN_OR_RETURN(a.head_dim, f.positive("attention_head_dim"));
  } else {
    ASSIGN_OR_RETURN(uint32_t hidden, f.positive("hidden_size"));
    ASSIGN_OR_RETURN(uint32_t heads, f.positive("num_attention_heads"));
    ASSIGN_OR_RETURN(a.head_dim,
                     exactQuotient(f, hidden, "hidden_size", heads, "num_attention_heads"));
  }
  return a;
}

LayerSpec attentionLayer(const AttentionShape& a) {
  LayerSpec l;
  l.attention = a;
  return l;
}

LayerSpec mamba2Layer(const Mamba2Shape& m) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba2;
  l.mamba2 = m;
  return l;
}

LayerSpec mamba1Layer(const Mamba1Shape& m) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba1;
  l.mamba1 = m;
  return l;
}

LayerSpec gdnLayer(const GdnShape& g) {
  LayerSpec l;
  l.recurrent = LayerKind::kGdn;
  l.gdn = g;
  return l;
}

// The Mamba2 shape spelled with mamba_ prefixes (GraniteMoeHybrid, FalconH1). mamba_d_head may be
// "auto": the inner size split over the heads. The inner size is mamba_expand * hidden_size, or
// FalconH1's mamba_d_ssm when `d_ssm_field` and it is set; errors name the field the model uses.
StatusOr<Mamba2Shape> prefixedMamba2Shape(const Fields& f, bool d_ssm_field) {
  Mamba2Shape m;
  ASSIGN_OR_RETURN(m.n_heads, f.positive("mamba_n_heads"));
  ASSIGN_OR_RETURN(m.n_groups, f.positive("mamba_n_groups"));
  ASSIGN_OR_RETURN(m.d_state, f.positive("mamba_d_state"));
  ASSIGN_OR_RETURN(m.d_conv, f.positive("mamba_d_conv"));
  ASSIGN_OR_RETURN(std::optional<uint32_t> d_head, f.positiveOrAuto("mamba_d_head"));
  if (d_head) {
    m.head_dim = *d_head;
    return m;
  }
  // Hugging Face: FalconH1's d_ssm = mamba_d_ssm (FalconH1Config's default 1024 when the field
  // is not written), or mamba_expand * hidden_size when it is null.
  uint32_t d_inner = 0;
  std::string d_inner_name = "mamba_expand*hidden_size";
  if (d_ssm_field && f.has("mamba_d_ssm")) {
    ASSIGN_OR_RETURN(d_inner, f.positive("mamba_d_ssm"));
    d_inner_name = "mamba_d_ssm";
  } else if (d_ssm_field && !f.written("mamba_d_ssm")) {
    d_inner = 1024;
    d_inner_name = "mamba_d_ssm (not written: FalconH1Config's default)";
  } else {
    ASSIGN_OR_RETURN(uint32_t expand, f.positive("mamba_expand"));
    ASSIGN_OR_RETURN(uint32_t hidden, f.positive("hidden_size"));
    ASSIGN_OR_RETURN(d_inner, product(f, expand, "mamba_expand", hidden, "hidden_size"));
  }
  ASSIGN_OR_RETURN(m.head_dim, exactQuotient(f, d_inner, d_inner_name, m.n_heads, "mamba_n_heads"));
  return m;
}

Status checkLayerCount(const Fields& f, size_t count, std::string_view source) {
  if (!f.has("num_hidden_layers")) return OkStatus();
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  if (n != count) {
    return f.error(std::string(source) + " has " + std::to_string(count) +
                   " layers but num_hidden_layers=" + std::to_string(n));
  }
  return OkStatus();
}

// Reads layer_types into `is_attention` (sized num_hidden_layers): a name in `attention` marks an
// attention layer, a name in `recurrent` a recurrent one, and any other name is an error that
// lists `expected`.
Status readLayerTypes(const Fields& f, std::initializer_list<std::string_view> attention,
                      std::initializer_list<std::string_view> recurrent, std::string_view expected,
                      std::vector<bool>* is_attention) {
  ASSIGN_OR_RETURN(std::vector<std::string> types, f.stringList("layer_types"));
  RETURN_IF_ERROR(checkLayerCount(f, types.size(), "layer_types"));
  for (size_t i = 0; i < types.size(); ++i) {
    if (std::find(attention.begin(), attention.end(), types[i]) != attention.end()) {
      (*is_attention)[i] = true;
    } else if (std::find(recurrent.begin(), recurrent.end(), types[i]) == recurrent.end()) {
      return f.error("layer_types[" + std::to_string(i) + "]='" + types[i] + "' (expected " +
                     std::string(expected) + ")");
    }
  }
  return OkStatus();
}

// ---- NemotronH -------------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importNemotronH(const Fields& f) {
  std::string pattern;
  std::string source = "hybrid_override_pattern";
  if (f.has("hybrid_override_pattern")) {
    ASSIGN_OR_RETURN(pattern, f.string("hybrid_override_pattern"));
  } else if (f.has("layers_block_type") || f.has("layer_types")) {
    // Newer checkpoints spell the pattern as a list of names.
    source = f.has("layers_block_type") ? "layers_block_type" : "layer_types";
    ASSIGN_OR_RETURN(std::vector<std::string> types, f.stringList(source));
    for (size_t i = 0; i < types.size(); ++i) {
      const std::string& t = types[i];
      if (t == "mamba" || t == "linear_attention") {
        pattern += 'M';
      } else if (t == "attention" || t == "full_attention") {
        pattern += '*';
      } else if (t == "mlp" || t == "moe") {
        pattern += '-';
      } else {
        return f.error(source + "[" + std::to_string(i) + "]='" + t +
                       "' (expected mamba, attention, mlp or moe)");
      }
    }
  } else {
    return f.missing("hybrid_override_pattern");
  }
  if (pattern.empty()) return f.error(source + " is empty");
  RETURN_IF_ERROR(checkLayerCount(f, pattern.size(), source));

  bool any_mamba = false, any_attention = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == 'M') {
      any_mamba = true;
    } else if (c == '*') {
      any_attention = true;
    } else if (c != '-' && c != 'E') {
      return f.error(source + "[" + std::to_string(i) + "]='" + std::string(1, c) +
                     "' (expected M, *, - or E)");
    }
  }
  Mamba2Shape m;
  if (any_mamba) {
    ASSIGN_OR_RETURN(m.n_heads, f.positive("mamba_num_heads"));
    ASSIGN_OR_RETURN(m.head_dim, f.positive("mamba_head_dim"));
    ASSIGN_OR_RETURN(m.n_groups, f.positiveAny({"n_groups", "mamba_n_groups"}));
    ASSIGN_OR_RETURN(m.d_state, f.positive("ssm_state_size"));
    ASSIGN_OR_RETURN(m.d_conv, f.positiveAny({"conv_kernel", "mamba_d_conv"}));
  }
  AttentionShape a;
  if (any_attention) {
    ASSIGN_OR_RETURN(a, attentionShape(f));
  }
  std::vector<LayerSpec> layers;
  for (char c : pattern) {
    if (c == 'M') {
      layers.push_back(mamba2Layer(m));
    } else if (c == '*') {
      layers.push_back(attentionLayer(a));
    } else {
      layers.emplace_back();  // MLP or MoE: counts for pipeline stages, holds no cache
    }
  }
  return layers;
}

// ---- Mamba2 ----------------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importMamba2(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  Mamba2Shape m;
  ASSIGN_OR_RETURN(m.n_heads, f.positive("num_heads"));
  ASSIGN_OR_RETURN(m.head_dim, f.positive("head_dim"));
  ASSIGN_OR_RETURN(m.n_groups, f.positive("n_groups"));
  ASSIGN_OR_RETURN(m.d_state, f.positive("state_size"));
  ASSIGN_OR_RETURN(m.d_conv, f.positive("conv_kernel"));
  return std::vector<LayerSpec>(n, mamba2Layer(m));
}

// ---- Qwen3-Next ------------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importQwen3Next(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  std::vector<bool> is_attention(n);
  if (f.has("layer_types")) {
    RETURN_IF_ERROR(readLayerTypes(f, {"full_attention", "attention"}, {"linear_attention"},
                                   "linear_attention or full_attention", &is_attention));
  } else {
    // Hugging Face's rule: layer i is full attention when (i + 1) % interval == 0.
    ASSIGN_OR_RETURN(uint32_t interval, f.positive("full_attention_interval"));
    for (uint32_t i = 0; i < n; ++i) is_attention[i] = (i + 1) % interval == 0;
  }
  bool any_gdn = false, any_attention = false;
  for (bool a : is_attention) (a ? any_attention : any_gdn) = true;
  GdnShape g;
  if (any_gdn) {
    ASSIGN_OR_RETURN(g.n_k_heads, f.positive("linear_num_key_heads"));
    ASSIGN_OR_RETURN(g.n_v_heads, f.positive("linear_num_value_heads"));
    ASSIGN_OR_RETURN(g.k_head_dim, f.positive("linear_key_head_dim"));
    ASSIGN_OR_RETURN(g.v_head_dim, f.positive("linear_value_head_dim"));
    ASSIGN_OR_RETURN(g.d_conv, f.positive("linear_conv_kernel_dim"));
  }
  AttentionShape a;
  if (any_attention) {
    ASSIGN_OR_RETURN(a, attentionShape(f));
  }
  std::vector<LayerSpec> layers;
  for (bool attn : is_attention) layers.push_back(attn ? attentionLayer(a) : gdnLayer(g));
  return layers;
}

// ---- GraniteMoeHybrid ------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importGraniteMoeHybrid(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  std::vector<bool> is_attention(n, false);  // Hugging Face: no layer_types means all mamba
  if (f.has("layer_types")) {
    // transformers 5 spells them linear_attention / full_attention (the Qwen3-Next names).
    RETURN_IF_ERROR(
        readLayerTypes(f, {"attention", "full_attention"}, {"mamba", "linear_attention"},
                       "mamba, linear_attention, attention or full_attention", &is_attention));
  }
  bool any_mamba = false, any_attention = false;
  for (bool a : is_attention) (a ? any_attention : any_mamba) = true;
  Mamba2Shape m;
  if (any_mamba) {
    ASSIGN_OR_RETURN(m, prefixedMamba2Shape(f, /*d_ssm_field=*/false));
  }
  AttentionShape a;
  if (any_attention) {
    ASSIGN_OR_RETURN(a, attentionShape(f));
  }
  std::vector<LayerSpec> layers;
  for (bool attn : is_attention) layers.push_back(attn ? attentionLayer(a) : mamba2Layer(m));
  return layers;
}

// ---- Jamba -----------------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importJamba(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  ASSIGN_OR_RETURN(uint32_t period, f.positive("attn_layer_period"));
  uint32_t offset = 0;  // 0 is a valid offset, so it is read without positive()
  if (!f.has("attn_layer_offset")) return f.missing("attn_layer_offset");
  const Json& off = f.at("attn_layer_offset");
  if (!off.is_number_unsigned() || off.get<uint64_t>() >= period) {
    return f.wrongType("attn_layer_offset",
                       "an integer in [0, attn_layer_period=" + std::to_string(period) + ")");
  }
  offset = static_cast<uint32_t>(off.get<uint64_t>());
  Mamba1Shape m;
  ASSIGN_OR_RETURN(uint32_t expand, f.positive("mamba_expand"));
  ASSIGN_OR_RETURN(uint32_t hidden, f.positive("hidden_size"));
  ASSIGN_OR_RETURN(m.d_inner, product(f, expand, "mamba_expand", hidden, "hidden_size"));
  ASSIGN_OR_RETURN(m.d_state, f.positive("mamba_d_state"));
  ASSIGN_OR_RETURN(m.d_conv, f.positive("mamba_d_conv"));
  AttentionShape a;
  if (offset < n) {
    ASSIGN_OR_RETURN(a, attentionShape(f));
  }
  std::vector<LayerSpec> layers;
  for (uint32_t i = 0; i < n; ++i) {
    layers.push_back(i % period == offset ? attentionLayer(a) : mamba1Layer(m));
  }
  return layers;
}

// ---- FalconH1 --------------------------------------------------------------------------------

StatusOr<std::vector<LayerSpec>> importFalconH1(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  ASSIGN_OR_RETURN(AttentionShape a, attentionShape(f));
  ASSIGN_OR_RETURN(Mamba2Shape m, prefixedMamba2Shape(f, /*d_ssm_field=*/true));
  LayerSpec l = mamba2Layer(m);  // parallel hybrid: both parts in every layer
  l.attention = a;
  return std::vector<LayerSpec>(n, l);
}

// ---- Llama (attention only) ------------------------------------------------------------------

// Every one of num_hidden_layers is full attention: no recurrent state, only kv. A control for
// engines whose connector serves hybrid and plain models alike.
StatusOr<std::vector<LayerSpec>> importLlama(const Fields& f) {
  ASSIGN_OR_RETURN(uint32_t n, f.layerCount());
  ASSIGN_OR_RETURN(AttentionShape a, attentionShape(f));
  return std::vector<LayerSpec>(n, attentionLayer(a));
}

// ---- dispatch --------------------------------------------------------------------------------

struct Importer {
  std::string_view architecture;
  std::string_view model_type;
  StatusOr<std::vector<LayerSpec>> (*fn)(const Fields&);
};

constexpr Importer kImporters[] = {
    {"NemotronHForCausalLM", "nemotron_h", importNemotronH},
    {"Mamba2ForCausalLM", "mamba2", importMamba2},
    {"Qwen3NextForCausalLM", "qwen3_next", importQwen3Next},
    {"GraniteMoeHybridForCausalLM", "granitemoehybrid", importGraniteMoeHybrid},
    {"JambaForCausalLM", "jamba", importJamba},
    {"FalconH1ForCausalLM", "falcon_h1", importFalconH1},
    {"LlamaForCausalLM", "llama", importLlama},
};

std::string supportedList() {
  std::string s;
  for (const Importer& i : kImporters) {
    if (!s.empty()) s += ", ";
    s += i.architecture;
  }
  return s;
}

StatusOr<DType> modelDType(const Fields& f) {
  // Newer transformers write "dtype", older ones "torch_dtype".
  for (std::string_view key : {"torch_dtype", "dtype"}) {
    if (!f.has(key)) continue;
    ASSIGN_OR_RETURN(std::string s, f.string(key));
    auto d = parseDType(s);
    if (!d.isOk()) return f.error("field '" + std::string(key) + "': " + d.status().message());
    return *d;
  }
  return DType::kBf16;
}

}  // namespace

std::vector<std::string> supportedArchitectures() {
  std::vector<std::string> out;
  for (const Importer& i : kImporters) out.emplace_back(i.architecture);
  return out;
}

StatusOr<ModelSpec> modelFromHfConfig(std::string_view json_text, std::string_view name) {
  const std::string where = "config.json of model '" + std::string(name) + "'";
  Json j;
  try {
    j = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::parse_error& e) {
    return InvalidArgument(where + " is not valid JSON: " + e.what());
  }
  if (!j.is_object()) return InvalidArgument(where + " is not a JSON object");

  const Importer* importer = nullptr;
  std::string arch;
  auto archs = j.find("architectures");
  if (archs != j.end() && !archs->is_null()) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      return InvalidArgument(where + ": field 'architectures' must be a non-empty list of strings");
    }
    arch = (*archs)[0].get<std::string>();
    for (const Importer& i : kImporters) {
      if (i.architecture == arch) importer = &i;
    }
  } else {
    auto mt = j.find("model_type");
    if (mt == j.end() || !mt->is_string()) {
      return InvalidArgument(where + ": missing field 'architectures' (and no 'model_type')");
    }
    arch = mt->get<std::string>();
    for (const Importer& i : kImporters) {
      if (i.model_type == arch) importer = &i;
    }
  }
  if (importer == nullptr) {
    return InvalidArgument(arch + ": unsupported architecture (supported: " + supportedList() +
                           ")");
  }

  const Fields f(j, std::string(importer->architecture));
  ModelSpec m;
  m.name = std::string(name);
  m.architecture = std::string(importer->architecture);
  ASSIGN_OR_RETURN(m.layers, importer->fn(f));
  ASSIGN_OR_RETURN(DType d, modelDType(f));
  m.kv_dtype = d;
  m.conv_dtype = d;
  m.ssm_dtype = DType::kFp32;
  Status valid = m.validate();
  if (!valid.isOk()) return valid.withContext(m.architecture);
  return m;
}

}  // namespace hxfer
