#include "model/presets.h"

#include "model/hf_config.h"
#include "model/preset_data.h"

namespace hxfer {

std::vector<std::string> presetNames() {
  std::vector<std::string> names;
  for (size_t i = 0; i < internal::kNumEmbeddedPresets; ++i) {
    names.emplace_back(internal::kEmbeddedPresets[i].name);
  }
  return names;
}

StatusOr<std::string_view> presetConfigJson(std::string_view name) {
  for (size_t i = 0; i < internal::kNumEmbeddedPresets; ++i) {
    if (internal::kEmbeddedPresets[i].name == name) return internal::kEmbeddedPresets[i].json;
  }
  std::string known;
  for (const std::string& n : presetNames()) known += (known.empty() ? "" : ", ") + n;
  return NotFound("unknown preset '" + std::string(name) + "' (presets: " + known + ")");
}

StatusOr<ModelSpec> loadPreset(std::string_view name) {
  ASSIGN_OR_RETURN(std::string_view json, presetConfigJson(name));
  return modelFromHfConfig(json, name);
}

}  // namespace hxfer
