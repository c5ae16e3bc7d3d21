// Where a model comes from: a preset name or the path of a Hugging Face config.json (or its
// folder). Shared by the CLI's --model and the public API's LayoutOptions::model.
#pragma once

#include <string>

#include "common/status.h"
#include "model/model.h"

namespace hxfer::engine {

// A preset by name; anything that looks like a path (has a '/', ends in .json, or exists) is
// read as a config.json, so a missing file names the path. NotFound / the parser's errors.
StatusOr<ModelSpec> loadModel(const std::string& preset_or_path);

}  // namespace hxfer::engine
