// Named engine layouts: one rank's cache laid out the way a serving engine keeps it
// (docs/layouts.md), as a RankLayout the planner maps onto any other (DESIGN §11).
//
//   hxfer       hxfer's own: kv [block][layer][K|V][head][token][dim] per attention group;
//               state paged (slot-major, equal-size conv and ssm coalesced) or layer-major.
//   trtllm-v1   TensorRT-LLM's V1 KV block (hxfer's kv) and layer-major Mamba pools
//               [L][S][C][k-1], [L][S][heads][head_dim][d_state]: hxfer layer-major.
//   trtllm-v2   KVCacheManagerV2: per block, the same-size per-(layer, K|V) buffers coalesced,
//               each HND (head, token, dim; default) or NHD (token, head, dim); Mamba V2
//               slot-major with equal-size conv and ssm interleaved: hxfer paged.
//   vllm        vLLM 0.32: one tensor per layer (shared per KV cache group with `shared`).
//               Attention: a block is [heads, tokens, 2 x head_dim] with K and V side by side
//               per (token, head): token > head > kv > dim (nhd, vLLM's LBNHC, the GPU
//               default) or head > token > kv > dim (hnd, LBHNC); vLLM's CPU backend keeps per
//               head K transposed [dim, token] then V [token, dim] (cpu, its vec / vec16 / neon
//               kernels) or both packed for AMX tiles (cpu-amx: K token/16 > dim/2 > token%16 >
//               dim%2, V dim/16 > token/2 > dim%16 > token%2; 16-bit elements).
//   vllm-0.25   vLLM up to 0.25.1: per block [K | V] halves, each NHD (default) or HND
//               (0.26 put K and V side by side, 0.29 one backing buffer: vllm).
//               vllm and vllm-0.25 otherwise agree:
//               Mamba: per page [conv | ssm | padding], padded to the attention page size
//               (vLLM raises the attention block size until its page holds the Mamba page);
//               conv SD (window, channel; default) or DS (channel, window); ssm (heads,
//               head_dim, d_state) for mamba2, (v_heads, head_v, head_k) for gdn, (d_inner,
//               d_state) for mamba1. With `shared` (vLLM V1's hybrid KV cache manager): the
//               layers form vLLM's KV cache groups (one kind each, equal size), group g of a
//               kind taking that kind's layers g, g + n, g + 2n, ... of the whole model; tensor
//               t is shared by the t-th layer (on this pp stage) of every group, and a block id
//               is an attention page of one layer or a Mamba state of another. Block and state
//               ids come from one pool (RankLayout::joint_ids); each Mamba group has a state
//               id of its own (RankLayout::state_groups).
//   sglang      per attention layer k_buffer / v_buffer, token-major (token, head, dim), a page
//               = tokens_per_block consecutive rows; a layer-major Mamba pool, conv
//               (L, S, C, k-1), ssm (L, S, heads, head_dim, d_state).
// Region (pool) names are stable: hxfer and trtllm-*: kv<g>, state<g> / conv<g>, ssm<g>;
// vllm: layer.<id> (layer.<id>.attn / layer.<id>.mamba for a layer with both), shared.<t> with
// shared tensors; sglang:
// k.<id>, v.<id>, conv<g>, ssm<g> (<id> the global layer id, <g> the layer group).
//
// Pure values and functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cache/layout.h"
#include "common/status.h"
#include "model/model.h"

namespace hxfer {

enum class Engine : uint8_t { kHxfer, kTrtllmV1, kTrtllmV2, kVllm, kSglang, kVllmSplit };
// The element order of an attention block: kHnd / kNhd inside one K or V half (trtllm-v2,
// vllm-0.25) or with K and V side by side per (token, head) (vllm); kCpu / kCpuAmx vLLM's CPU
// backend (vllm only).
enum class KvOrder : uint8_t { kHnd, kNhd, kCpu, kCpuAmx };
std::string_view kvOrderName(KvOrder o);      // "hnd", "nhd", "cpu", "cpu-amx"
enum class ConvOrder : uint8_t { kDs, kSd };  // DS: (channel, window); SD: (window, channel)

// "hxfer", "trtllm-v1", "trtllm-v2", "vllm", "sglang", "vllm-0.25"
std::string_view engineName(Engine e);
bool isVllm(Engine e);  // vllm or vllm-0.25

struct EngineLayout {
  Engine engine = Engine::kHxfer;
  StateLayout state = StateLayout::kPaged;  // hxfer only
  KvOrder kv = KvOrder::kHnd;               // vllm, vllm-0.25, trtllm-v2
  ConvOrder conv = ConvOrder::kDs;          // vllm, vllm-0.25
  bool shared = false;                      // vllm, vllm-0.25: the hybrid manager's tensors
  // "hxfer(paged)", "vllm(kv=nhd,conv=sd)", "vllm(kv=nhd,conv=sd,shared)", "sglang", ...
  std::string toString() const;
  bool operator==(const EngineLayout&) const = default;
};

// `engine` by name with its options; an empty option takes the engine's default (vllm and
// vllm-0.25: nhd, sd, shared off; trtllm-v2: hnd; hxfer: paged). `shared` is "on" or "off".
// InvalidArgument naming the value and what is accepted, also for an option the engine does not
// have.
StatusOr<EngineLayout> parseEngineLayout(std::string_view engine, std::string_view kv = "",
                                         std::string_view conv = "", std::string_view state = "",
                                         std::string_view shared = "");

// Every engine layout with every option value, in a fixed order: hxfer(paged),
// hxfer(layer-major), trtllm-v1, trtllm-v2 hnd and nhd, vllm nhd/hnd x sd/ds, sglang,
// vllm-0.25 nhd/hnd (sd): the layouts any pair of which moves (kv element orders differing
// inside a head's run are refused). vLLM's shared tensors are in sharedEngineLayouts(), its
// CPU orders in cpuEngineLayouts().
std::vector<EngineLayout> allEngineLayouts();
// vllm with shared tensors: (kv=nhd, conv=sd) and (kv=hnd, conv=ds).
std::vector<EngineLayout> sharedEngineLayouts();
// vLLM's CPU attention orders (kv=cpu and cpu-amx, conv=sd, shared off and on). They move
// between layouts of the same kv order (any tp, pp); against another kv order every run is one
// element and the plan is refused (staging is built for state records). cpu-amx needs bf16
// kv and tokens per block and head_dim multiples of 32 (buildEngineLayout refuses others, as
// vLLM 0.32 picks another kernel there).
std::vector<EngineLayout> cpuEngineLayouts();

// The engine's own dtype defaults for what the caller left unset (`conv_set`, `ssm_set` say
// which were set): vllm and vllm-0.25 keep ssm state in the model dtype except for NemotronH
// (fp32; vLLM's CPU platform forces fp32 for every model, set it there); sglang keeps conv in
// bf16 and ssm in fp32; trtllm-v1/v2 ssm in the model dtype (mamba_ssm_cache_dtype "auto");
// hxfer fp32. The model dtype is the config's (kv_dtype).
void applyEngineDtypes(const EngineLayout& layout, bool conv_set, bool ssm_set, ModelSpec* model);

// Ids the engine never hands to a request: vLLM's null block 0 (every group), SGLang's dummy
// page 0 and slot 0. The cache manager of a named layout still may; an engine's own ids never
// name them.
struct ReservedIds {
  std::vector<uint32_t> blocks, slots;
};
ReservedIds reservedIds(const EngineLayout& layout);

// The layout of rank (tp_rank, pp_rank) in `layout` with the given capacities (blocks for kv,
// slots for state). Errors: as buildRankLayout, and for vllm a Mamba page larger than the
// attention page (naming the block size vLLM 0.32 picks), cpu-amx with a model it cannot pack.
StatusOr<RankLayout> buildEngineLayout(const ModelSpec& model, const ParallelConfig& pc,
                                       uint32_t tp_rank, uint32_t pp_rank,
                                       const EngineLayout& layout, uint32_t num_blocks,
                                       uint32_t num_slots);

}  // namespace hxfer
