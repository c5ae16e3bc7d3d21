#include "wire/examples.h"

namespace hxfer::wire::examples {
namespace {

LayerSpec attention(uint32_t kv_heads, uint32_t head_dim) {
  LayerSpec l;
  l.attention = AttentionShape{kv_heads, head_dim};
  return l;
}

LayerSpec mamba2(Mamba2Shape shape) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba2;
  l.mamba2 = shape;
  return l;
}

ModelSpec named(std::string name, std::string arch, std::vector<LayerSpec> layers) {
  ModelSpec m;
  m.name = std::move(name);
  m.architecture = std::move(arch);
  m.layers = std::move(layers);
  m.tokens_per_block = 16;
  return m;
}

}  // namespace

std::vector<ModelSpec> models() {
  std::vector<ModelSpec> out;
  const LayerSpec none;
  {
    const LayerSpec m = mamba2({8, 4, 2, 8, 4});
    const LayerSpec a = attention(4, 8);
    out.push_back(named("mamba2-hybrid", "NemotronHForCausalLM", {m, none, m, a, m, none, m, a}));
  }
  {
    LayerSpec g;
    g.recurrent = LayerKind::kGdn;
    g.gdn = {4, 8, 8, 8, 4};
    out.push_back(named("gdn-hybrid", "Qwen3NextForCausalLM", {g, g, g, attention(4, 16)}));
  }
  {
    LayerSpec m;
    m.recurrent = LayerKind::kMamba1;
    m.mamba1 = {16, 4, 4};
    const LayerSpec a = attention(2, 8);  // 2 kv heads: replicated at tp 4
    ModelSpec spec = named("mamba1-hybrid", "JambaForCausalLM", {m, m, a, m, m, a});
    spec.kv_dtype = DType::kFp16;
    out.push_back(std::move(spec));
  }
  {
    LayerSpec p = mamba2({8, 4, 2, 8, 4});
    p.attention = AttentionShape{4, 8};
    out.push_back(named("parallel", "FalconH1ForCausalLM", {p, p, p, p}));
  }
  {
    // conv = (H*P + 2*G*N) * (k-1) * 4 = 32 bytes = ssm = H*P*N*4 at tp 1.
    const LayerSpec m = mamba2({2, 2, 1, 2, 2});
    ModelSpec spec = named("coalesced", "Mamba2ForCausalLM", {m, m, attention(2, 4), m});
    spec.conv_dtype = DType::kFp32;
    spec.ssm_dtype = DType::kFp32;
    spec.kv_dtype = DType::kFp8;
    spec.tokens_per_block = 8;
    out.push_back(std::move(spec));
  }
  return out;
}

StatusOr<RankInfo> rankInfo(const ModelSpec& model, const ParallelConfig& pc, uint32_t rank,
                            StateLayout layout, InstanceRole role) {
  return rankInfo(model, pc, rank, EngineLayout{Engine::kHxfer, layout}, role);
}

StatusOr<RankInfo> rankInfo(const ModelSpec& model, const ParallelConfig& pc, uint32_t rank,
                            const EngineLayout& engine, InstanceRole role) {
  if (pc.tp == 0) return InvalidArgument("tp=0");
  RankInfo info;
  ASSIGN_OR_RETURN(info.layout,
                   buildEngineLayout(model, pc, rank % pc.tp, rank / pc.tp, engine, 6, 3));
  info.role = role;
  info.instance_id = std::string(role == InstanceRole::kContext ? "ctx-" : "gen-") + model.name;
  const std::string address = "unix:@hxfer-" + info.instance_id + "-r" + std::to_string(rank);
  info.address.assign(address.begin(), address.end());
  for (const RegionSpec& r : info.layout.regions) {
    if (r.id % 2 == 1) continue;
    RegionKey k{r.id, {}};
    for (uint32_t i = 0; i < 16; ++i) k.key.push_back(static_cast<uint8_t>(r.id * 31 + i * 7));
    info.region_keys.push_back(std::move(k));
  }
  return info;
}

std::vector<std::pair<std::string, Message>> messages() {
  std::vector<std::pair<std::string, Message>> out;
  const std::vector<ModelSpec> ms = models();
  auto gen = rankInfo(ms[0], {2, 1, {}}, 1, StateLayout::kPaged, InstanceRole::kGeneration);
  auto ctx = rankInfo(ms[2], {1, 2, {}}, 1, StateLayout::kLayerMajor, InstanceRole::kContext);
  if (gen.isOk()) out.emplace_back("hello_token", Hello{*gen, "shared-secret"});
  if (ctx.isOk()) out.emplace_back("hello", Hello{*ctx, "", 0x9e3779b97f4a7c15ull});

  TransferRequest req;
  req.request_id = 7;
  req.gen_tp_rank = 1;
  req.dst_block_ids = {5, 2, 3, 0};
  req.dst_slot = 2;
  req.first_block = 1;
  req.num_tokens = 50;
  req.aux = {0x2a, 0, 0, 0};
  req.epoch = 3;
  out.emplace_back("transfer_request", req);
  TransferRequest plain;
  plain.request_id = 0xfedcba9876543210ull;
  plain.gen_pp_rank = 1;
  plain.dst_block_ids = {300, 301};
  plain.num_tokens = 17;
  out.emplace_back("transfer_request_no_slot", plain);
  req.staging = Staging{0x7FFF0000u, 4096, 1u << 20};
  out.emplace_back("transfer_request_staged", req);
  req.staging = Staging{0x7FFF0000u, 4096, 1u << 19, 3u << 19, 7u << 18};
  out.emplace_back("transfer_request_window", req);
  req.staging.reset();
  req.dst_group_slots = {6, 7, 1};
  out.emplace_back("transfer_request_group_slots", req);

  out.emplace_back("transfer_done", TransferDone{7, OkStatus(), 123456, 0x0123456789abcdefull,
                                                 Bytes{0x2a, 0, 0, 0}, 3});
  out.emplace_back("transfer_done_failed",
                   TransferDone{8, Unavailable("context rank 1 is gone"), 0, std::nullopt, {}, 0});
  out.emplace_back(
      "transfer_done_expired",
      TransferDone{10, Expired("lease of request 10 expired"), 0, std::nullopt, {}, 1});
  out.emplace_back("cancel", Cancel{9, "client disconnected", 200});
  out.emplace_back("error", Error{Incompatible("ctx ssm dtype fp32 != gen ssm dtype bf16")});
  return out;
}

}  // namespace hxfer::wire::examples
