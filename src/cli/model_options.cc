#include "cli/model_options.h"

#include <cstdio>

#include "model/presets.h"

namespace hxfer::cli {

void addModelOptions(CLI::App* cmd, ModelOptions* o) {
  cmd->add_option("--model", o->model, "Preset name or path to a Hugging Face config.json")
      ->default_str(std::string(kDefaultPreset));
  cmd->add_option("--kv-dtype", o->kv_dtype, "KV cache dtype (fp32, fp16, bf16, fp8)");
  cmd->add_option("--conv-dtype", o->conv_dtype, "Conv state dtype");
  cmd->add_option("--ssm-dtype", o->ssm_dtype, "SSM state dtype (default fp32)");
  cmd->add_option("--tokens-per-block", o->tokens_per_block, "Tokens per KV block")
      ->default_val(32)
      ->check(CLI::Range(1u, 1u << 20));
}

StatusOr<ModelSpec> resolveModel(const ModelOptions& o) {
  const std::string name = o.model.empty() ? std::string(kDefaultPreset) : o.model;
  ASSIGN_OR_RETURN(ModelSpec m, loadPreset(name));
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

}  // namespace hxfer::cli
