// Model options shared by every subcommand that takes a model (describe, metadata, plan, demo,
// bench, serve): --model PRESET|PATH, dtypes and tokens per block.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "cache/engine_layout.h"
#include "cache/layout.h"
#include "common/status.h"
#include "model/model.h"

namespace hxfer::cli {

struct ModelOptions {
  std::string model;       // preset name or path to a config.json; empty = default preset
  std::string kv_dtype;    // empty = the config's torch_dtype (bf16 if absent)
  std::string conv_dtype;  // empty = the config's torch_dtype (bf16 if absent)
  std::string ssm_dtype;   // empty = fp32
  uint32_t tokens_per_block = 32;
};

void addModelOptions(CLI::App* cmd, ModelOptions* options);

// Loads the preset or file and applies the overrides. Errors name the option and value.
StatusOr<ModelSpec> resolveModel(const ModelOptions& options);

// One side's engine layout options (plan, demo): --<side>-engine, --<side>-kv-layout,
// --<side>-conv-layout, --<side>-tokens-per-block, with `side` "ctx" or "gen".
struct EngineOptions {
  std::string engine = "hxfer";
  std::string kv, conv;           // empty: the engine's default
  std::string shared;             // vllm's shared tensors: on, off or empty (off)
  uint32_t tokens_per_block = 0;  // 0: the model's (--tokens-per-block)
};

// `model` with the side's tokens per block (its own, when the side gives none).
ModelSpec sideModel(const ModelSpec& model, const EngineOptions& options);

void addEngineOptions(CLI::App* cmd, EngineOptions* options, std::string_view side);

// A tensor- or pipeline-parallel size option: 1 to 1024 (CLI11 refuses others, naming it).
CLI::Option* addParallelSize(CLI::App* cmd, const std::string& name, uint32_t* value,
                             const std::string& help, uint32_t default_value);

// The side's layout; `hxfer_state` is the state layout when the engine is hxfer (other engines
// have their own). `state_given`: the user gave the state layout option (--<side>-layout, or
// --layout when `side` is empty), which an engine other than hxfer refuses. Errors name the
// option at fault (--<side>-layout or --<side>-engine) and the value.
StatusOr<EngineLayout> resolveEngineLayout(const EngineOptions& options, std::string_view side,
                                           std::string_view hxfer_state, bool state_given = false);

// A state layout request: "auto" (nullopt), "paged" or "layer-major". Errors name `flag`.
StatusOr<std::optional<StateLayout>> parseStateLayoutOption(std::string_view flag,
                                                            std::string_view value);

// Prints "hxfer: <status>" to stderr and returns exit code 1 (for subcommand callbacks).
int reportError(const Status& status);

}  // namespace hxfer::cli
