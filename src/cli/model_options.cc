#include "cli/model_options.h"

#include <cstdio>

#include "engine/model_source.h"
#include "model/presets.h"

namespace hxfer::cli {

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
  ASSIGN_OR_RETURN(ModelSpec m, engine::loadModel(name));
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

CLI::Option* addParallelSize(CLI::App* cmd, const std::string& name, uint32_t* value,
                             const std::string& help, uint32_t default_value) {
  return cmd->add_option(name, *value, help)
      ->default_val(default_value)
      ->check(CLI::Range(1u, 1024u));
}

void addEngineOptions(CLI::App* cmd, EngineOptions* o, std::string_view side) {
  const std::string prefix = "--" + std::string(side);
  const std::string who = side == "ctx" ? "Context" : "Generation";
  cmd->add_option(prefix + "-engine", o->engine,
                  who +
                      " cache layout as an engine keeps it: hxfer, trtllm-v1, trtllm-v2, "
                      "vllm, vllm-0.25, sglang (docs/layouts.md)")
      ->default_val("hxfer");
  cmd->add_option(prefix + "-kv-layout", o->kv,
                  who +
                      " kv order: nhd or hnd (trtllm-v2, vllm-0.25: inside a K or V half; "
                      "vllm: K and V side by side per token and head), cpu or cpu-amx (vllm: "
                      "its CPU kernels); default: vllm nhd, trtllm-v2 hnd");
  cmd->add_option(prefix + "-conv-layout", o->conv,
                  who + " conv state order for vllm: sd (window, channel; default) or ds");
  cmd->add_option(prefix + "-shared-tensors", o->shared,
                  who +
                      " vllm: on lays the cache out as vLLM's hybrid manager shares it (one "
                      "tensor per layer of every KV cache group, one id pool), off (default) "
                      "one tensor per layer");
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
                                           std::string_view hxfer_state, bool state_given) {
  const std::string prefix = side.empty() ? "--" : "--" + std::string(side) + "-";
  const bool hxfer = o.engine == "hxfer";
  if (hxfer) {
    if (auto s = parseStateLayout(hxfer_state); !s.isOk()) {
      return s.status().withContext(prefix + "layout");
    }
  }
  auto layout = parseEngineLayout(o.engine, o.kv, o.conv, hxfer ? hxfer_state : "", o.shared);
  if (!layout.isOk()) return layout.status().withContext(prefix + "engine");
  if (state_given && !hxfer) {
    return InvalidArgument(prefix + "layout " + std::string(hxfer_state) + " applies to " + prefix +
                           "engine hxfer only; " + prefix + "engine " + o.engine +
                           " keeps its own state layout");
  }
  return layout;
}

StatusOr<std::optional<StateLayout>> parseStateLayoutOption(std::string_view flag,
                                                            std::string_view value) {
  if (value == "auto") return std::optional<StateLayout>();
  if (auto l = parseStateLayout(value); l.isOk()) return std::optional<StateLayout>(*l);
  return InvalidArgument(std::string(flag) + ": unknown state layout '" + std::string(value) +
                         "' (expected auto, paged or layer-major)");
}

}  // namespace hxfer::cli
