// Valid example values of every wire structure, for tests, the fuzzers' seed corpus and docs.
//
// The models cover every layer kind and both pool shapes of the paged layout (coalesced
// equal-size conv/ssm pools and separate pools). Pure functions; thread-safe.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cache/engine_layout.h"
#include "cache/layout.h"
#include "model/model.h"
#include "wire/messages.h"
#include "wire/rank_info.h"

namespace hxfer::wire::examples {

// Small models, each valid at tp 1, 2 and 4 and pp 1 and 2:
//   "mamba2-hybrid"  mamba2 + attention + cacheless layers (Nemotron-H shape)
//   "gdn-hybrid"     gated delta net + attention (Qwen3-Next shape)
//   "mamba1-hybrid"  mamba1 + attention (Jamba shape)
//   "parallel"       attention and mamba2 in the same layer (Falcon-H1 shape)
//   "coalesced"      mamba2 whose conv and ssm records are equal at tp 1 (one shared pool)
std::vector<ModelSpec> models();

// The RankInfo of global rank `rank` (tp_rank = rank % tp, pp_rank = rank / tp) with a few
// blocks and slots, an address, and a transport key on every other region.
StatusOr<RankInfo> rankInfo(const ModelSpec& model, const ParallelConfig& pc, uint32_t rank,
                            StateLayout layout, InstanceRole role);
// The same with the cache laid out as `engine` keeps it (cache/engine_layout.h).
StatusOr<RankInfo> rankInfo(const ModelSpec& model, const ParallelConfig& pc, uint32_t rank,
                            const EngineLayout& engine, InstanceRole role);

// Named examples of every message type (Hello with and without a token, requests with and
// without a slot and aux, Done ok / failed / with checksum, Cancel, Error).
std::vector<std::pair<std::string, Message>> messages();

}  // namespace hxfer::wire::examples
