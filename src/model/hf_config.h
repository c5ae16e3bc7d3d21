// Import of a Hugging Face `config.json` into a ModelSpec.
//
// Supported architectures (the first entry of "architectures", else "model_type"):
//   NemotronHForCausalLM          hybrid_override_pattern (or layers_block_type): M mamba2,
//                                 * attention, - and E no cache
//   Mamba2ForCausalLM             every layer mamba2
//   Qwen3NextForCausalLM          layer_types or full_attention_interval; linear_* -> gdn
//   GraniteMoeHybridForCausalLM   layer_types "mamba" / "attention" (transformers 5:
//                                 "linear_attention" / "full_attention"); mamba_* -> mamba2
//   JambaForCausalLM              attn_layer_period / attn_layer_offset; mamba_* -> mamba1
//   FalconH1ForCausalLM           every layer attention + mamba2 in parallel
//   LlamaForCausalLM              every layer attention (no recurrent state)
// Attention head_dim comes from head_dim, attention_head_dim, or hidden_size /
// num_attention_heads. KV and conv dtypes default to torch_dtype (or dtype; bf16 if absent),
// the SSM dtype to fp32; tokens_per_block is left at its default (a serving choice).
//
// Errors are InvalidArgument naming the architecture and the field:
//   "NemotronHForCausalLM: missing field 'ssm_state_size'".
// Pure: parses text only, no I/O; safe to call from any thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/model.h"

namespace hxfer {

// Parses `json_text` (the contents of a config.json) into a validated ModelSpec named `name`.
StatusOr<ModelSpec> modelFromHfConfig(std::string_view json_text, std::string_view name);

// Architectures modelFromHfConfig understands, in documentation order.
std::vector<std::string> supportedArchitectures();

}  // namespace hxfer
