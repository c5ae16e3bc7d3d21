#include "model/presets.h"

namespace hxfer {
namespace {

ModelSpec tinyHybrid() {
  ModelSpec m;
  m.name = std::string(kDefaultPreset);
  m.architecture = "NemotronHForCausalLM";
  LayerSpec mamba;
  mamba.recurrent = LayerKind::kMamba2;
  mamba.mamba2 = {8, 4, 2, 8, 4};
  LayerSpec attn;
  attn.attention = AttentionShape{4, 8};
  LayerSpec mlp;
  m.layers = {mamba, mlp, mamba, attn, mamba, mlp, mamba, attn};
  return m;
}

}  // namespace

std::vector<std::string> presetNames() { return {std::string(kDefaultPreset)}; }

StatusOr<ModelSpec> loadPreset(std::string_view name) {
  if (name == kDefaultPreset) return tinyHybrid();
  return NotFound("unknown preset '" + std::string(name) + "'");
}

}  // namespace hxfer
