// Model presets: Hugging Face config.json files under presets/<name>/ compiled into the library,
// so the CLI and the demo need no files at run time. A preset is parsed by the same importer as
// a user's config.json (model/hf_config.h), so every preset is also an importer test.
//
// Pure: no I/O (the CLI reads user files). The embedded data is immutable; every function is
// safe to call from any thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/model.h"

namespace hxfer {

// The name of the model used when none is given (the demo, tests).
inline constexpr std::string_view kDefaultPreset = "tiny-hybrid";

// Every preset name, sorted.
std::vector<std::string> presetNames();
// ModelSpec of a built-in preset; NotFound naming the preset and listing the known ones.
StatusOr<ModelSpec> loadPreset(std::string_view name);
// The verbatim config.json text of a preset (NotFound as loadPreset).
StatusOr<std::string_view> presetConfigJson(std::string_view name);

}  // namespace hxfer
