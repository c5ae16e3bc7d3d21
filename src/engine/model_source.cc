#include "engine/model_source.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/hf_config.h"
#include "model/presets.h"

namespace hxfer::engine {
namespace {

bool isPresetName(const std::string& name) {
  for (const std::string& n : presetNames()) {
    if (n == name) return true;
  }
  return false;
}

// The model's name for a file: the folder name for ".../<model>/config.json", else the stem.
std::string nameForPath(const std::filesystem::path& path) {
  if (path.filename() == "config.json" && path.has_parent_path() &&
      !path.parent_path().filename().empty()) {
    return path.parent_path().filename().string();
  }
  return path.stem().string();
}

// Reads a config.json (or <dir>/config.json). The model layer stays free of I/O: this reads
// and hands it the text.
StatusOr<ModelSpec> loadConfigFile(const std::string& arg) {
  std::filesystem::path path(arg);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    return NotFound("cannot read model config '" + path.string() +
                    "': " + (err != 0 ? std::strerror(err) : "cannot open"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return NotFound("cannot read model config '" + path.string() + "'");
  auto m = modelFromHfConfig(text.str(), nameForPath(path));
  if (!m.isOk()) return m.status().withContext(path.string());
  return m;
}

}  // namespace

StatusOr<ModelSpec> loadModel(const std::string& arg) {
  if (isPresetName(arg)) return loadPreset(arg);
  // Anything that looks like a path is read as one, so that a missing file names the path
  // instead of listing presets.
  std::error_code ec;
  const bool path_like = arg.find('/') != std::string::npos ||
                         (arg.size() > 5 && arg.compare(arg.size() - 5, 5, ".json") == 0) ||
                         std::filesystem::exists(arg, ec);
  if (path_like) return loadConfigFile(arg);
  return loadPreset(arg);
}

}  // namespace hxfer::engine
