#include "cli/model_options.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/hf_config.h"
#include "model/presets.h"

namespace hxfer::cli {
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

// Reads a config.json (or <dir>/config.json). The model layer stays free of I/O: the CLI reads
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

}  // namespace

void addModelOptions(CLI::App* cmd, ModelOptions* o) {
  cmd->add_option("--model", o->model,
                  "Preset name (see `hxfer models`) or path to a Hugging Face config.json")
      ->default_str(std::string(kDefaultPreset));
  cmd->add_option("--kv-dtype", o->kv_dtype,
                  "KV cache dtype: fp32, fp16, bf16, fp8 (default: the config's torch_dtype)");
  cmd->add_option("--conv-dtype", o->conv_dtype,
                  "Conv state dtype (default: the config's torch_dtype)");
  cmd->add_option("--ssm-dtype", o->ssm_dtype, "SSM state dtype (default fp32)");
  cmd->add_option("--tokens-per-block", o->tokens_per_block, "Tokens per KV block")
      ->default_val(32)
      ->check(CLI::Range(1u, 1u << 20));
}

StatusOr<ModelSpec> resolveModel(const ModelOptions& o) {
  const std::string name = o.model.empty() ? std::string(kDefaultPreset) : o.model;
  ASSIGN_OR_RETURN(ModelSpec m, loadModel(name));
  auto apply = [](const std::string& flag, const std::string& value, DType* out) -> Status {
    if (value.empty()) return OkStatus();
    auto d = parseDType(value);
    if (!d.isOk()) return d.status().withContext(flag);
    *out = *d;
    return OkStatus();
  };
  RETURN_IF_ERROR(apply("--kv-dtype", o.kv_dtype, &m.kv_dtype));
  RETURN_IF_ERROR(apply("--conv-dtype", o.conv_dtype, &m.conv_dtype));
  RETURN_IF_ERROR(apply("--ssm-dtype", o.ssm_dtype, &m.ssm_dtype));
  m.tokens_per_block = o.tokens_per_block;
  RETURN_IF_ERROR(m.validate());
  return m;
}

int reportError(const Status& status) {
  std::fprintf(stderr, "hxfer: %s\n", status.toString().c_str());
  return 1;
}

void addEngineOptions(CLI::App* cmd, EngineOptions* o, std::string_view side) {
  const std::string prefix = "--" + std::string(side);
  const std::string who = side == "ctx" ? "Context" : "Generation";
  cmd->add_option(prefix + "-engine", o->engine,
                  who +
                      " cache layout as an engine keeps it: hxfer, trtllm-v1, trtllm-v2, "
                      "vllm, sglang (docs/layouts.md)")
      ->default_val("hxfer");
  cmd->add_option(prefix + "-kv-layout", o->kv,
                  who +
                      " kv order inside a block half for vllm and trtllm-v2: nhd or hnd "
                      "(default: vllm nhd, trtllm-v2 hnd)");
  cmd->add_option(prefix + "-conv-layout", o->conv,
                  who + " conv state order for vllm: sd (window, channel; default) or ds");
  cmd->add_option(prefix + "-tokens-per-block", o->tokens_per_block,
                  who +
                      " tokens per KV block (default: --tokens-per-block); when the sides "
                      "differ, kv moves by token ranges")
      ->check(CLI::Range(1u, 1u << 20));
}

ModelSpec sideModel(const ModelSpec& model, const EngineOptions& options) {
  ModelSpec m = model;
  if (options.tokens_per_block != 0) m.tokens_per_block = options.tokens_per_block;
  return m;
}

StatusOr<EngineLayout> resolveEngineLayout(const EngineOptions& o, std::string_view side,
                                           std::string_view hxfer_state) {
  auto layout = parseEngineLayout(o.engine, o.kv, o.conv, o.engine == "hxfer" ? hxfer_state : "");
  if (!layout.isOk()) return layout.status().withContext("--" + std::string(side) + "-engine");
  return layout;
}

}  // namespace hxfer::cli
