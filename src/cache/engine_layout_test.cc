// Each engine builder against the engine's own tensors: the byte strides a contiguous
// (row-major) tensor of the engine's declared shape has — what torch.empty(shape).stride()
// gives, times the element size — written out here independently of the builder's formulas.
#include "cache/engine_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/presets.h"

namespace hxfer {
namespace {

// Row-major byte strides of `shape` with `element` bytes per element (torch's contiguous
// strides times the element size).
std::vector<uint64_t> rowMajor(std::vector<uint64_t> shape, uint64_t element) {
  std::vector<uint64_t> out(shape.size());
  uint64_t s = element;
  for (size_t i = shape.size(); i-- > 0;) {
    out[i] = s;
    s *= shape[i];
  }
  return out;
}

// attention (4 kv heads, head_dim 8), mamba2 (8 heads x 4, 2 groups, d_state 16, d_conv 4),
// gdn (2 k heads, 4 v heads, dk 4, dv 6, d_conv 3); 32 tokens per block; bf16 kv and conv,
// fp32 ssm.
ModelSpec model() {
  ModelSpec m;
  m.name = "engines";
  LayerSpec attn;
  attn.attention = AttentionShape{4, 8};
  LayerSpec mamba;
  mamba.recurrent = LayerKind::kMamba2;
  mamba.mamba2 = {8, 4, 2, 16, 4};
  LayerSpec gdn;
  gdn.recurrent = LayerKind::kGdn;
  gdn.gdn = {2, 4, 4, 6, 3};
  m.layers = {attn, mamba, gdn, attn};
  m.tokens_per_block = 32;
  return m;
}

const PoolView* viewOf(const RankLayout& l, uint32_t layer, Role role) {
  for (const PoolView& v : l.views) {
    if (v.role == role && std::find(v.layers.begin(), v.layers.end(), layer) != v.layers.end()) {
      return &v;
    }
  }
  return nullptr;
}

// The strides of `names`, in that order, from the view's record.
std::vector<uint64_t> strides(const PoolView& v, std::vector<std::string> names) {
  std::vector<uint64_t> out;
  for (const std::string& n : names) {
    const RecordDim* d = v.record ? v.record->find(n) : nullptr;
    out.push_back(d ? d->stride : 0);
  }
  return out;
}

std::string regionName(const RankLayout& l, const PoolView& v) {
  return l.findRegion(v.region_id)->name;
}

// vLLM 0.32: one [blocks, heads, tokens, 2 x head_dim] view per layer over a (layer-outer)
// buffer, K and V side by side per (token, head): LBNHC (nhd, the default) or LBHNC (hnd).
// vllm-0.25 (vLLM up to 0.25.1): (num_blocks, 2, block_size, heads, head_dim), HND
// (num_blocks, 2, heads, block_size, head_dim).
TEST(EngineLayout, VllmAttentionBlockIsKvSideBySidePerTokenAndHeadAndVllm025KeepsHalves) {
  for (uint32_t tp : {1u, 2u}) {
    const uint64_t H = 4 / tp, T = 32, D = 8;
    auto nhd = buildEngineLayout(model(), {tp, 1, {}}, 0, 0, *parseEngineLayout("vllm"), 10, 3);
    ASSERT_TRUE(nhd.isOk()) << nhd.status().toString();
    const PoolView* kv = viewOf(*nhd, 3, Role::kKv);
    ASSERT_NE(kv, nullptr);
    const auto s = rowMajor({10, T, H, 2, D}, 2);  // LBNHC, bf16
    EXPECT_EQ(kv->index_stride, s[0]);
    EXPECT_EQ(strides(*kv, {"token", "head", "kv", "dim"}),
              (std::vector<uint64_t>{s[1], s[2], s[3], s[4]}));
    EXPECT_EQ(regionName(*nhd, *kv), "layer.3");
    EXPECT_EQ(nhd->findRegion(kv->region_id)->length, 10 * s[0]);

    auto hnd =
        buildEngineLayout(model(), {tp, 1, {}}, 0, 0, *parseEngineLayout("vllm", "hnd"), 10, 3);
    ASSERT_TRUE(hnd.isOk()) << hnd.status().toString();
    kv = viewOf(*hnd, 0, Role::kKv);
    const auto h = rowMajor({10, H, T, 2, D}, 2);  // LBHNC
    EXPECT_EQ(strides(*kv, {"head", "token", "kv", "dim"}),
              (std::vector<uint64_t>{h[1], h[2], h[3], h[4]}));

    for (std::string order : {"nhd", "hnd"}) {
      auto old = buildEngineLayout(model(), {tp, 1, {}}, 0, 0,
                                   *parseEngineLayout("vllm-0.25", order), 10, 3);
      ASSERT_TRUE(old.isOk()) << old.status().toString();
      kv = viewOf(*old, 3, Role::kKv);
      const auto o = order == "nhd" ? rowMajor({10, 2, T, H, D}, 2) : rowMajor({10, 2, H, T, D}, 2);
      const std::vector<std::string> names =
          order == "nhd" ? std::vector<std::string>{"kv", "token", "head", "dim"}
                         : std::vector<std::string>{"kv", "head", "token", "dim"};
      EXPECT_EQ(strides(*kv, names), (std::vector<uint64_t>{o[1], o[2], o[3], o[4]})) << order;
    }
  }
}

// vLLM's CPU backend: per (block, head) N x D elements of K then of V, both views of one page.
// cpu (its vec kernels): K transposed [dim][token], V [token][dim]. cpu-amx: K token/16, dim/2,
// token%16, dim%2; V dim/16, token/2, dim%16, token%2 (element offsets measured on vLLM 0.32's
// own kernel: cpu_attn_reshape_and_cache).
TEST(EngineLayout, VllmCpuAttentionKeepsKThenVPerHeadInTheKernelsElementOrder) {
  ModelSpec m = model();
  for (LayerSpec& l : m.layers) {
    if (l.attention) l.attention->head_dim = 32;
  }
  const uint64_t H = 4, T = 32, D = 32, e = 2;
  auto cpu = buildEngineLayout(m, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu"), 10, 3);
  ASSERT_TRUE(cpu.isOk()) << cpu.status().toString();
  std::vector<const PoolView*> kv;
  for (const PoolView& v : cpu->views) {
    if (v.role == Role::kKv && v.layers == std::vector<uint32_t>{3}) kv.push_back(&v);
  }
  ASSERT_EQ(kv.size(), 2u);
  EXPECT_EQ(kv[0]->sections.front().name, "K");
  EXPECT_EQ(kv[1]->sections.front().name, "V");
  EXPECT_EQ(kv[0]->region_id, kv[1]->region_id);
  EXPECT_EQ(kv[0]->index_stride, H * 2 * T * D * e);
  EXPECT_EQ(kv[0]->base, 0u);
  EXPECT_EQ(kv[1]->base, T * D * e);
  EXPECT_EQ(kv[0]->record->toString(), "head 4 @4096, dim 32 @64, token 32 @2 (element 2 B)");
  EXPECT_EQ(kv[1]->record->toString(), "head 4 @4096, token 32 @64, dim 32 @2 (element 2 B)");
  auto amx = buildEngineLayout(m, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 10, 3);
  ASSERT_TRUE(amx.isOk()) << amx.status().toString();
  kv.clear();
  for (const PoolView& v : amx->views) {
    if (v.role == Role::kKv && v.layers == std::vector<uint32_t>{3}) kv.push_back(&v);
  }
  ASSERT_EQ(kv.size(), 2u);
  // K element (t, d) at (t/16)*16D + (d/2)*32 + (t%16)*2 + d%2, V at (d/16)*16T + (t/2)*32 +
  // (d%16)*2 + t%2, in elements.
  EXPECT_EQ(kv[0]->record->toString(),
            "head 4 @4096, token 2 @1024, dim 16 @64, token 16 @4, dim 2 @2 (element 2 B)");
  EXPECT_EQ(kv[1]->record->toString(),
            "head 4 @4096, dim 2 @1024, token 16 @64, dim 16 @4, token 2 @2 (element 2 B)");
  // 16-bit elements and multiples of 16 only: vLLM picks its other kernels otherwise.
  ModelSpec fp32 = m;
  fp32.kv_dtype = DType::kFp32;
  auto refused =
      buildEngineLayout(fp32, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 10, 3);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("cpu-amx is vLLM's AMX order"), std::string::npos)
      << refused.status().toString();
  // vLLM 0.32 takes AMX only for bf16, block sizes a multiple of 32 and head sizes a multiple
  // of 32 (_get_attn_isa): fp16, 16-token blocks and head_dim 48 get its vec / vec16 kernels.
  ModelSpec fp16 = m;
  fp16.kv_dtype = DType::kFp16;
  EXPECT_EQ(buildEngineLayout(fp16, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 10, 3)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  ModelSpec t16 = m;
  t16.tokens_per_block = 16;
  auto small =
      buildEngineLayout(t16, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 10, 3);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("tokens_per_block=16"), std::string::npos)
      << small.status().toString();
  ModelSpec d48 = m;
  for (LayerSpec& l : d48.layers) {
    if (l.attention) l.attention->head_dim = 48;
  }
  EXPECT_EQ(buildEngineLayout(d48, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 10, 3)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(EngineLayout, VllmMambaPageIsConvThenSsmPaddedToTheAttentionPage) {
  const uint64_t tp = 2, H = 8 / tp, P = 4, G = 2 / tp, N = 16, k1 = 3;
  const uint64_t C = H * P + 2 * G * N;  // x | B | C channels on this rank
  auto l = buildEngineLayout(model(), {2, 1, {}}, 1, 0, *parseEngineLayout("vllm"), 10, 3);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const uint64_t page = rowMajor({10, 2, 32, 2, 8}, 2)[0];  // the attention page
  const PoolView* conv = viewOf(*l, 1, Role::kConv);
  const PoolView* ssm = viewOf(*l, 1, Role::kSsm);
  ASSERT_TRUE(conv && ssm);
  EXPECT_EQ(conv->region_id, ssm->region_id);
  EXPECT_EQ(regionName(*l, *conv), "layer.1");
  EXPECT_EQ(conv->index_stride, page);
  EXPECT_EQ(ssm->index_stride, page);
  // conv_state (d_conv - 1, conv_dim) "SD", bf16.
  const auto sd = rowMajor({k1, C}, 2);
  EXPECT_EQ(strides(*conv, {"window", "channel"}), (std::vector<uint64_t>{sd[0], sd[1]}));
  // ssm_state (heads, head_dim, d_state), fp32, right after the conv state.
  EXPECT_EQ(ssm->base, k1 * C * 2);
  EXPECT_FALSE(ssm->record.has_value());  // hxfer's own order
  EXPECT_EQ(ssm->record_bytes, H * P * N * 4);
  EXPECT_LE(ssm->base + ssm->record_bytes, page);  // the rest of the page is padding

  auto ds =
      buildEngineLayout(model(), {2, 1, {}}, 1, 0, *parseEngineLayout("vllm", "", "ds"), 10, 3);
  ASSERT_TRUE(ds.isOk());
  const auto d = rowMajor({C, k1}, 2);  // (conv_dim, d_conv - 1) "DS"
  EXPECT_EQ(strides(*viewOf(*ds, 1, Role::kConv), {"channel", "window"}),
            (std::vector<uint64_t>{d[0], d[1]}));

  // gdn ssm (v_heads, head_v, head_k), fp32.
  const auto g = rowMajor({4 / tp, 6, 4}, 4);
  EXPECT_EQ(strides(*viewOf(*l, 2, Role::kSsm), {"head", "value", "key"}),
            (std::vector<uint64_t>{g[0], g[1], g[2]}));
}

TEST(EngineLayout, VllmRefusesAMambaPageLargerThanTheAttentionPageNamingTheBlockSize) {
  ModelSpec m = model();
  m.tokens_per_block = 2;
  auto l = buildEngineLayout(m, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm"), 10, 3);
  ASSERT_FALSE(l.isOk());
  EXPECT_NE(l.status().message().find("it picks 32 tokens per block with FlashAttention, 128 on "
                                      "CPU (32 with --block-size 32): use that tokens_per_block"),
            std::string::npos)
      << l.status().toString();
  // nemotron-h-8b at tp 1: a Mamba page of 4,255,744 bytes against 4096 bytes of KV per token:
  // vLLM 0.32 picks 1040 (16 x 65) with FlashAttention.
  auto nemotron = loadPreset("nemotron-h-8b");
  ASSERT_TRUE(nemotron.isOk());
  auto n = buildEngineLayout(*nemotron, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm"), 4, 2);
  EXPECT_NE(n.status().message().find("picks 1040 tokens per block with FlashAttention, 1152 on "
                                      "CPU (1056 with --block-size 32)"),
            std::string::npos)
      << n.status().toString();
}

// attention (4 kv heads, head_dim 8) at layers 0 and 3, mamba2 (8 heads x 4, 2 groups, d_state
// 16, d_conv 4) at 1, 2 and 4..8; 32 tokens per block.
ModelSpec sharedModel() {
  ModelSpec m = model();
  const LayerSpec attn = m.layers[0], mamba = m.layers[1];
  m.layers = {attn, mamba, mamba, attn, mamba, mamba, mamba, mamba, mamba};
  return m;
}

// vLLM's hybrid manager, written out from kv_cache_utils: specs attention (2 layers) and
// mamba2 (7); group size 2 (the fewest); mamba2 in ceil(7 / 2) = 4 groups, group i its layers
// i, i + 4: {1, 6}, {2, 7}, {4, 8}, {5}; attention {0, 3}. Tensor t (page * num_blocks bytes)
// is shared by the t-th layer of each group: shared.0 by 0, 1, 2, 4, 5 and shared.1 by 3, 6,
// 7, 8. A layer's attention view is (2, num_blocks, T, H, D) restrided so that a block is
// [K | V] (num_blocks stride = the page); a Mamba view is per page [conv | ssm | padding].
TEST(EngineLayout, VllmSharedTensorsHoldOneLayerOfEveryGroupWithOneIdPoolAndAStateIdPerGroup) {
  const uint64_t T = 32, H = 4, D = 8, P = 4, N = 16, k1 = 3, C = 8 * P + 2 * 2 * N;
  const uint64_t page = rowMajor({2, T, H, D}, 2)[0] * 2;
  auto l = buildEngineLayout(sharedModel(), {1, 1, {}}, 0, 0,
                             *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  EXPECT_TRUE(l->joint_ids);
  EXPECT_EQ(l->state_groups, 4u);
  EXPECT_EQ(l->num_slots, 10u);  // states are blocks of the one pool
  auto no_slots = buildEngineLayout(sharedModel(), {1, 1, {}}, 0, 0,
                                    *parseEngineLayout("vllm", "", "", "", "on"), 10, 0);
  ASSERT_TRUE(no_slots.isOk()) << no_slots.status().toString();  // num_slots is not used
  EXPECT_EQ(*no_slots, *l);
  ASSERT_EQ(l->regions.size(), 2u);
  for (const RegionSpec& r : l->regions) EXPECT_EQ(r.length, 10 * page);
  const std::pair<uint32_t, std::string> tensor_of[] = {
      {0, "shared.0"}, {1, "shared.0"}, {2, "shared.0"}, {4, "shared.0"}, {5, "shared.0"},
      {3, "shared.1"}, {6, "shared.1"}, {7, "shared.1"}, {8, "shared.1"}};
  for (const auto& [layer, name] : tensor_of) {
    const bool attention = layer == 0 || layer == 3;
    const PoolView* v = viewOf(*l, layer, attention ? Role::kKv : Role::kConv);
    ASSERT_NE(v, nullptr) << layer;
    EXPECT_EQ(regionName(*l, *v), name) << layer;
    EXPECT_EQ(v->index_stride, page);
    EXPECT_EQ(v->num_indices, 10u);
  }
  const std::pair<uint32_t, uint32_t> group_of[] = {{1, 0}, {6, 0}, {2, 1}, {7, 1},
                                                    {4, 2}, {8, 2}, {5, 3}};
  for (const auto& [layer, group] : group_of) {
    EXPECT_EQ(viewOf(*l, layer, Role::kConv)->state_group, group) << layer;
    EXPECT_EQ(viewOf(*l, layer, Role::kSsm)->state_group, group) << layer;
  }
  const PoolView* kv = viewOf(*l, 3, Role::kKv);
  const auto s = rowMajor({T, H, 2, D}, 2);  // LBNHC: token > head > kv > dim
  EXPECT_EQ(kv->base, 0u);
  EXPECT_EQ(strides(*kv, {"token", "head", "kv", "dim"}),
            (std::vector<uint64_t>{s[0], s[1], s[2], s[3]}));
  const PoolView* conv = viewOf(*l, 6, Role::kConv);
  const PoolView* ssm = viewOf(*l, 6, Role::kSsm);
  const auto sd = rowMajor({k1, C}, 2);
  EXPECT_EQ(conv->base, 0u);
  EXPECT_EQ(strides(*conv, {"window", "channel"}), (std::vector<uint64_t>{sd[0], sd[1]}));
  EXPECT_EQ(ssm->base, k1 * C * 2);
  EXPECT_EQ(ssm->record_bytes, 8 * P * N * 4);
  EXPECT_EQ(ssm->region_id, kv->region_id);  // layer 3's pages and layer 6's states

  // pp 2 (layers 0..4 and 5..8): groups stay the model's; each stage keeps its layers of them.
  auto s0 = buildEngineLayout(sharedModel(), {1, 2, {5, 4}}, 0, 0,
                              *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  auto s1 = buildEngineLayout(sharedModel(), {1, 2, {5, 4}}, 0, 1,
                              *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  ASSERT_TRUE(s0.isOk() && s1.isOk());
  EXPECT_EQ(s0->regions.size(), 2u);  // {0, 1, 2, 4}, {3}
  EXPECT_EQ(s1->regions.size(), 1u);  // {6, 7, 8, 5}
  EXPECT_EQ(regionName(*s0, *viewOf(*s0, 3, Role::kKv)), "shared.1");
  EXPECT_EQ(viewOf(*s1, 5, Role::kConv)->state_group, 3u);
  EXPECT_EQ(s0->state_groups, 4u);
  EXPECT_EQ(s1->state_groups, 4u);
}

// Records of different id groups may share a page only in a layout whose ids are one pool, and
// two records of one group never.
TEST(EngineLayout, VllmSharedTensorsOverlapOnlyAcrossIdGroupsOfOnePool) {
  auto l = buildEngineLayout(sharedModel(), {1, 1, {}}, 0, 0,
                             *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  ASSERT_TRUE(l.isOk());
  RankLayout separate = *l;
  separate.joint_ids = false;
  EXPECT_NE(separate.validate().message().find("overlap in region"), std::string::npos);
  RankLayout same_group = *l;
  for (PoolView& v : same_group.views) {
    if (v.layers[0] == 2) v.state_group = 0;  // layer 1's group, in the same tensor
  }
  EXPECT_NE(same_group.validate().message().find("overlap in region"), std::string::npos);
  RankLayout past = *l;
  past.views.back().state_group = 4;
  EXPECT_NE(past.validate().message().find("state_group=4 >= state_groups=4"), std::string::npos)
      << past.validate().toString();
  RankLayout pools = *l;
  pools.num_slots = 3;
  for (PoolView& v : pools.views) {
    if (v.role != Role::kKv) v.num_indices = 3;
  }
  EXPECT_NE(pools.validate().message().find("joint_ids: num_slots=3 but num_blocks=10"),
            std::string::npos);
}

// vLLM 0.32 allocates every shared tensor in one buffer, tensor t at t * num_blocks * page: a
// layout described from its tensors (hxfer.vllm) has one region whose later tensors start
// whole index windows in. Records of different id groups still meet only at one index there;
// the joint-ids check once assumed every view's records start in the first window and refused
// such a layout ("views 2 and 6 overlap in region 0" for GraniteMoeHybrid).
TEST(EngineLayout, VllmSharedTensorsInOneAllocationOverlapOnlyAcrossIdGroupsAtOneIndex) {
  auto l = buildEngineLayout(sharedModel(), {1, 1, {}}, 0, 0,
                             *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  ASSERT_TRUE(l.isOk());
  ASSERT_EQ(l->regions.size(), 2u);
  RankLayout one = *l;
  const uint64_t tensor0 = one.regions[0].length;
  for (PoolView& v : one.views) {
    if (v.region_id == one.regions[1].id) v.base += tensor0;  // tensor 1 right after tensor 0
    v.region_id = one.regions[0].id;
  }
  one.regions[0].length += one.regions[1].length;
  one.regions.pop_back();
  ASSERT_EQ(tensor0 % one.views[0].index_stride, 0u);
  EXPECT_TRUE(one.validate().isOk()) << one.validate().toString();

  // One group's views a window further in than the other's: state id i and block id i + 1
  // would share bytes, and both may be live.
  RankLayout shifted = one;
  for (PoolView& v : shifted.views) {
    if (v.role != Role::kKv && v.base >= tensor0) v.base += v.index_stride;
  }
  shifted.regions[0].length += shifted.views[0].index_stride;
  EXPECT_NE(shifted.validate().message().find("overlap in region"), std::string::npos)
      << shifted.validate().toString();
}

TEST(EngineLayout, VllmSharedTensorsRefuseSeveralAttentionGroupsAndOptionsElsewhere) {
  ModelSpec m = sharedModel();
  const LayerSpec attn = m.layers[0], mamba = m.layers[1];
  m.layers = {attn, attn, attn, mamba, attn, mamba};  // 4 attention layers in groups of 2
  auto l =
      buildEngineLayout(m, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm", "", "", "", "on"), 10, 3);
  ASSERT_FALSE(l.isOk());
  EXPECT_NE(l.status().message().find("form 2 KV cache groups of 2 layers"), std::string::npos)
      << l.status().toString();
  EXPECT_TRUE(buildEngineLayout(m, {1, 1, {}}, 0, 0, *parseEngineLayout("vllm"), 10, 3).isOk());
  EXPECT_NE(parseEngineLayout("sglang", "", "", "", "on").status().message().find("only vllm"),
            std::string::npos);
  EXPECT_NE(parseEngineLayout("vllm", "", "", "", "yes").status().message().find("on or off"),
            std::string::npos);
  EXPECT_EQ(parseEngineLayout("vllm", "hnd", "", "", "on")->toString(),
            "vllm(kv=hnd,conv=sd,shared)");
}

TEST(EngineLayout, SglangKeepsTokenMajorKAndVBuffersPerLayerAndALayerMajorMambaPool) {
  const uint64_t H = 2, T = 32, D = 8;
  auto l = buildEngineLayout(model(), {2, 1, {}}, 0, 0, *parseEngineLayout("sglang"), 10, 3);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  // k_buffer[layer] (num_pages * page_size, head_num, head_dim), bf16; a page = 32 rows.
  const auto s = rowMajor({10 * T, H, D}, 2);
  int kv_views = 0;
  for (const PoolView& v : l->views) {
    if (v.role != Role::kKv) continue;
    ++kv_views;
    ASSERT_EQ(v.sections.size(), 1u);
    EXPECT_EQ(v.index_stride, T * s[0]);
    EXPECT_EQ(strides(v, {"token", "head", "dim"}), (std::vector<uint64_t>{s[0], s[1], s[2]}));
    EXPECT_EQ(regionName(*l, v),
              (v.sections[0].name == "K" ? "k." : "v.") + std::to_string(v.layers[0]));
  }
  EXPECT_EQ(kv_views, 4);
  // conv (layers, slots, conv_dim, d_conv - 1): hxfer's layer-major pool.
  const PoolView* conv = viewOf(*l, 1, Role::kConv);
  ASSERT_NE(conv, nullptr);
  const uint64_t C = 4 * 4 + 2 * 1 * 16;
  const auto c = rowMajor({1, 3, C, 3}, 2);
  EXPECT_EQ(conv->index_stride, c[1]);
  EXPECT_FALSE(conv->record.has_value());
}

TEST(EngineLayout, TrtllmV2NhdCoalescesPerLayerKAndVInsideTheBlock) {
  const uint64_t H = 4, T = 32, D = 8;
  auto l =
      buildEngineLayout(model(), {1, 1, {}}, 0, 0, *parseEngineLayout("trtllm-v2", "nhd"), 10, 3);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const PoolView* kv = viewOf(*l, 0, Role::kKv);
  // One block: (layers, 2, tokens, heads, dim).
  const auto s = rowMajor({2, 2, T, H, D}, 2);
  EXPECT_EQ(kv->index_stride, 2 * s[0]);
  EXPECT_EQ(kv->layer_stride, s[0]);
  EXPECT_EQ(strides(*kv, {"kv", "token", "head", "dim"}),
            (std::vector<uint64_t>{s[1], s[2], s[3], s[4]}));
}

TEST(EngineLayout, OptionsAnEngineDoesNotHaveAreRefusedNamingThem) {
  EXPECT_NE(parseEngineLayout("sglang", "nhd")
                .status()
                .message()
                .find("only vllm, vllm-0.25 and trtllm-v2"),
            std::string::npos);
  EXPECT_NE(parseEngineLayout("trtllm-v2", "", "sd").status().message().find("only vllm"),
            std::string::npos);
  EXPECT_NE(
      parseEngineLayout("vllm", "xyz").status().message().find("expected nhd, hnd, cpu or cpu-amx"),
      std::string::npos);
  EXPECT_NE(parseEngineLayout("tgi").status().message().find("unknown engine layout 'tgi'"),
            std::string::npos);
  EXPECT_EQ(parseEngineLayout("vllm")->toString(), "vllm(kv=nhd,conv=sd)");
  EXPECT_EQ(parseEngineLayout("hxfer", "", "", "layer-major")->toString(), "hxfer(layer-major)");
}

}  // namespace
}  // namespace hxfer
