// Model presets and Hugging Face config.json import.
//
// Presets are config.json files under presets/ compiled into the library, so the CLI and the
// demo need no files at run time. Pure: parsing only, no I/O (the CLI reads files).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/model.h"

namespace hxfer {

// The name of the model used when none is given (the demo, tests).
inline constexpr std::string_view kDefaultPreset = "tiny-hybrid";

std::vector<std::string> presetNames();
// ModelSpec of a built-in preset; NotFound naming the preset and listing the known ones.
StatusOr<ModelSpec> loadPreset(std::string_view name);

}  // namespace hxfer
