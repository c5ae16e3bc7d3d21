#include "cache/engine_layout.h"

#include <algorithm>
#include <utility>

namespace hxfer {

std::string_view engineName(Engine e) {
  switch (e) {
    case Engine::kHxfer:
      return "hxfer";
    case Engine::kTrtllmV1:
      return "trtllm-v1";
    case Engine::kTrtllmV2:
      return "trtllm-v2";
    case Engine::kVllm:
      return "vllm";
    case Engine::kSglang:
      return "sglang";
    case Engine::kVllmSplit:
      return "vllm-0.25";
  }
  return "unknown";
}

bool isVllm(Engine e) { return e == Engine::kVllm || e == Engine::kVllmSplit; }

std::string_view kvOrderName(KvOrder o) {
  switch (o) {
    case KvOrder::kHnd:
      return "hnd";
    case KvOrder::kNhd:
      return "nhd";
    case KvOrder::kCpu:
      return "cpu";
    case KvOrder::kCpuAmx:
      return "cpu-amx";
  }
  return "unknown";
}

std::string EngineLayout::toString() const {
  const std::string kv_text(kvOrderName(kv));
  switch (engine) {
    case Engine::kHxfer:
      return "hxfer(" + std::string(stateLayoutName(state)) + ")";
    case Engine::kTrtllmV2:
      return "trtllm-v2(kv=" + kv_text + ")";
    case Engine::kVllm:
    case Engine::kVllmSplit:
      return std::string(engineName(engine)) + "(kv=" + kv_text +
             ",conv=" + (conv == ConvOrder::kSd ? "sd" : "ds") + (shared ? ",shared)" : ")");
    default:
      return std::string(engineName(engine));
  }
}

std::vector<EngineLayout> allEngineLayouts() {
  std::vector<EngineLayout> out = {{Engine::kHxfer, StateLayout::kPaged},
                                   {Engine::kHxfer, StateLayout::kLayerMajor},
                                   {Engine::kTrtllmV1}};
  for (KvOrder kv : {KvOrder::kHnd, KvOrder::kNhd}) {
    out.push_back({Engine::kTrtllmV2, StateLayout::kPaged, kv});
  }
  for (KvOrder kv : {KvOrder::kNhd, KvOrder::kHnd}) {
    for (ConvOrder conv : {ConvOrder::kSd, ConvOrder::kDs}) {
      out.push_back({Engine::kVllm, StateLayout::kPaged, kv, conv});
    }
  }
  out.push_back({Engine::kSglang});
  for (KvOrder kv : {KvOrder::kNhd, KvOrder::kHnd}) {
    out.push_back({Engine::kVllmSplit, StateLayout::kPaged, kv, ConvOrder::kSd});
  }
  return out;
}

std::vector<EngineLayout> sharedEngineLayouts() {
  return {{Engine::kVllm, StateLayout::kPaged, KvOrder::kNhd, ConvOrder::kSd, true},
          {Engine::kVllm, StateLayout::kPaged, KvOrder::kHnd, ConvOrder::kDs, true}};
}

std::vector<EngineLayout> cpuEngineLayouts() {
  std::vector<EngineLayout> out;
  for (KvOrder kv : {KvOrder::kCpu, KvOrder::kCpuAmx}) {
    for (bool shared : {false, true}) {
      out.push_back({Engine::kVllm, StateLayout::kPaged, kv, ConvOrder::kSd, shared});
    }
  }
  return out;
}

StatusOr<EngineLayout> parseEngineLayout(std::string_view engine, std::string_view kv,
                                         std::string_view conv, std::string_view state,
                                         std::string_view shared) {
  EngineLayout out;
  if (engine == "hxfer") {
    out.engine = Engine::kHxfer;
  } else if (engine == "trtllm-v1") {
    out.engine = Engine::kTrtllmV1;
  } else if (engine == "trtllm-v2") {
    out.engine = Engine::kTrtllmV2;
  } else if (engine == "vllm" || engine == "vllm-0.25") {
    out.engine = engine == "vllm" ? Engine::kVllm : Engine::kVllmSplit;
    out.kv = KvOrder::kNhd;
    out.conv = ConvOrder::kSd;
  } else if (engine == "sglang") {
    out.engine = Engine::kSglang;
  } else {
    return InvalidArgument("unknown engine layout '" + std::string(engine) +
                           "' (expected hxfer, trtllm-v1, trtllm-v2, vllm, vllm-0.25 or sglang)");
  }
  const std::string name(engine);
  if (!kv.empty()) {
    if (!isVllm(out.engine) && out.engine != Engine::kTrtllmV2) {
      return InvalidArgument("kv layout '" + std::string(kv) + "': engine " + name +
                             " has one kv order (only vllm, vllm-0.25 and trtllm-v2 take one)");
    }
    const bool cpu_orders = out.engine == Engine::kVllm;
    if (kv == "nhd") {
      out.kv = KvOrder::kNhd;
    } else if (kv == "hnd") {
      out.kv = KvOrder::kHnd;
    } else if (kv == "cpu" && cpu_orders) {
      out.kv = KvOrder::kCpu;
    } else if (kv == "cpu-amx" && cpu_orders) {
      out.kv = KvOrder::kCpuAmx;
    } else {
      return InvalidArgument(
          "unknown kv layout '" + std::string(kv) + "' for engine " + name +
          (cpu_orders ? " (expected nhd, hnd, cpu or cpu-amx)" : " (expected nhd or hnd)"));
    }
  }
  if (!conv.empty()) {
    if (!isVllm(out.engine)) {
      return InvalidArgument("conv layout '" + std::string(conv) + "': engine " + name +
                             " has one conv order (only vllm and vllm-0.25 take sd|ds)");
    }
    if (conv == "sd") {
      out.conv = ConvOrder::kSd;
    } else if (conv == "ds") {
      out.conv = ConvOrder::kDs;
    } else {
      return InvalidArgument("unknown conv layout '" + std::string(conv) + "' (expected sd or ds)");
    }
  }
  if (!state.empty()) {
    if (out.engine != Engine::kHxfer) {
      return InvalidArgument("state layout '" + std::string(state) + "': engine " + name +
                             " has one state layout (only hxfer takes paged|layer-major)");
    }
    ASSIGN_OR_RETURN(out.state, parseStateLayout(state));
  }
  if (!shared.empty()) {
    if (!isVllm(out.engine)) {
      return InvalidArgument("shared tensors '" + std::string(shared) + "': engine " + name +
                             " has no shared tensors (only vllm and vllm-0.25 take on|off)");
    }
    if (shared == "on") {
      out.shared = true;
    } else if (shared != "off") {
      return InvalidArgument("unknown shared tensors value '" + std::string(shared) +
                             "' (expected on or off)");
    }
  }
  return out;
}

namespace {

// The record of `view` laid out contiguously in `order`.
StatusOr<RecordLayout> recordIn(const ModelSpec& model, const RankLayout& l, const PoolView& view,
                                const std::vector<std::string>& order) {
  const LayerSpec& layer = model.layers[view.layers.front()];
  return contiguousRecordLayout(view.kind, view.role, view.sections,
                                localUnitCounts(view.sections, l.tp, l.tp_rank).value(),
                                static_cast<uint32_t>(dtypeSize(l.dtypeOf(view.role))),
                                innerSizes(model, layer, view.role), order);
}

std::vector<std::string> kvOrder(KvOrder o, bool with_kv_dim) {
  std::vector<std::string> order;
  if (with_kv_dim) order.push_back("kv");
  if (o == KvOrder::kNhd) {
    order.insert(order.end(), {"token", "head", "dim"});
  } else {
    order.insert(order.end(), {"head", "token", "dim"});
  }
  return order;
}

uint32_t addRegion(RankLayout& l, std::string name, uint64_t length) {
  const uint32_t id = static_cast<uint32_t>(l.regions.size());
  l.regions.push_back({id, length, std::move(name)});
  return id;
}

StatusOr<uint64_t> times(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    return ResourceExhausted(std::string(what) + " overflows 64 bits");
  }
  return out;
}

// One PoolView per layer of `group`, each holding `sections` (a subset of the group's).
PoolView oneLayer(const PoolView& group, uint32_t layer, std::vector<Section> sections,
                  const RankLayout& l) {
  PoolView v = group;
  v.layers = {layer};
  v.sections = std::move(sections);
  v.record_bytes = localRecordBytes(v.sections, l.tp, l.tp_rank).value();
  v.base = 0;
  v.layer_stride = 0;
  v.record.reset();
  return v;
}

// The hxfer paged view of `role` holding `layer`. REQUIRES: there is one.
const PoolView& baseView(const RankLayout& base, Role role, uint32_t layer) {
  for (const PoolView& v : base.views) {
    if (v.role == role && std::binary_search(v.layers.begin(), v.layers.end(), layer)) return v;
  }
  return base.views.front();  // unreachable for layers the base layout holds
}

// vLLM's one page size: the attention page, which the Mamba page [conv | ssm] must fit.
StatusOr<uint64_t> vllmPage(const RankLayout& base) {
  uint64_t attention_page = 0, mamba_page = 0, per_token = 0;
  for (const PoolView& v : base.views) {
    if (v.role == Role::kKv) {
      attention_page = std::max(attention_page, v.record_bytes);
      per_token = std::max<uint64_t>(per_token, v.record_bytes / base.tokens_per_block);
    }
  }
  for (size_t i = 0; i + 1 < base.views.size(); ++i) {
    if (base.views[i].role == Role::kConv) {
      mamba_page =
          std::max(mamba_page, base.views[i].record_bytes + base.views[i + 1].record_bytes);
    }
  }
  if (attention_page > 0 && mamba_page > attention_page) {
    // vLLM 0.32 (Platform._align_hybrid_block_size): the smallest multiple of M tokens whose
    // attention page holds the Mamba page, M = max(the backend's smallest kernel block, the
    // configured block size): 16 with FlashAttention, 128 on CPU by default (32 with
    // --block-size 32).
    auto pick = [&](uint64_t m) {
      return m * ((mamba_page + m * per_token - 1) / (m * per_token));
    };
    return InvalidArgument("vllm layout: the mamba page (" + std::to_string(mamba_page) +
                           " bytes) is larger than the attention page (" +
                           std::to_string(attention_page) +
                           " bytes at tokens_per_block=" + std::to_string(base.tokens_per_block) +
                           "); vLLM 0.32 raises the block size until it holds it: it picks " +
                           std::to_string(pick(16)) + " tokens per block with FlashAttention, " +
                           std::to_string(pick(128)) + " on CPU (" + std::to_string(pick(32)) +
                           " with --block-size 32): use that tokens_per_block");
  }
  return attention_page > 0 ? attention_page : mamba_page;
}

// vLLM's CPU attention: per head, K then V, each N x D elements, as two views of the page.
Status addVllmCpuAttention(const ModelSpec& model, const PoolView& g, uint32_t layer, uint64_t page,
                           const EngineLayout& e, uint32_t region, RankLayout& out) {
  const uint64_t el = dtypeSize(out.kv_dtype);
  const uint64_t n = out.tokens_per_block, d = model.layers[layer].attention->head_dim;
  const uint32_t heads = localUnitCounts(g.sections, out.tp, out.tp_rank).value()[0];
  // vLLM 0.32's _get_attn_isa picks its AMX kernels for bf16 with block_size % 32 == 0 and a
  // head size that is not an odd multiple of 16 (vec16 there); the packing needs 16 | head_dim.
  if (e.kv == KvOrder::kCpuAmx && (out.kv_dtype != DType::kBf16 || n % 32 != 0 || d % 32 != 0)) {
    return InvalidArgument(
        "vllm kv layout cpu-amx is vLLM's AMX order, which it picks for bf16 with a block size "
        "and head_dim that are multiples of 32: kv dtype " +
        std::string(dtypeName(out.kv_dtype)) + ", tokens_per_block=" + std::to_string(n) +
        ", head_dim=" + std::to_string(d) + " (vLLM uses the cpu order there)");
  }
  const uint64_t half = n * d * el;
  for (size_t s = 0; s < 2; ++s) {  // K, then V
    PoolView v = oneLayer(g, layer, {g.sections[s]}, out);
    v.index_stride = page;
    v.region_id = region;
    v.base = s * half;
    RecordLayout r;
    r.element_bytes = static_cast<uint32_t>(el);
    r.dims.push_back({"head", heads, 2 * half});
    const auto N = static_cast<uint32_t>(n), D = static_cast<uint32_t>(d);
    if (e.kv == KvOrder::kCpu && s == 0) {  // K transposed: [dim][token]
      r.dims.insert(r.dims.end(), {{"dim", D, n * el}, {"token", N, el}});
    } else if (e.kv == KvOrder::kCpu) {  // V: [token][dim]
      r.dims.insert(r.dims.end(), {{"token", N, d * el}, {"dim", D, el}});
    } else if (s == 0) {  // AMX K: token/16, dim/2, token%16, dim%2
      r.dims.insert(r.dims.end(), {{"token", N / 16, 16 * d * el},
                                   {"dim", D / 2, 32 * el},
                                   {"token", 16, 2 * el},
                                   {"dim", 2, el}});
    } else {  // AMX V: dim/16, token/2, dim%16, token%2
      r.dims.insert(r.dims.end(), {{"dim", D / 16, 16 * n * el},
                                   {"token", N / 2, 32 * el},
                                   {"dim", 16, 2 * el},
                                   {"token", 2, el}});
    }
    v.record = std::move(r);
    out.views.push_back(std::move(v));
  }
  return OkStatus();
}

// Appends `layer`'s attention page in `region`, pages of `page` bytes: vllm-0.25's [K | V]
// halves, vLLM 0.32's K and V side by side per (token, head), or its CPU order.
Status addVllmAttention(const ModelSpec& model, const RankLayout& base, uint32_t layer,
                        uint64_t page, const EngineLayout& e, uint32_t region, RankLayout& out) {
  const PoolView& g = baseView(base, Role::kKv, layer);
  if (e.kv == KvOrder::kCpu || e.kv == KvOrder::kCpuAmx) {
    return addVllmCpuAttention(model, g, layer, page, e, region, out);
  }
  PoolView v = oneLayer(g, layer, g.sections, out);
  v.index_stride = page;
  v.region_id = region;
  std::vector<std::string> order = kvOrder(e.kv, true);
  if (e.engine == Engine::kVllm) {
    order = e.kv == KvOrder::kNhd ? std::vector<std::string>{"token", "head", "kv", "dim"}
                                  : std::vector<std::string>{"head", "token", "kv", "dim"};
  }
  ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, order));
  out.views.push_back(std::move(v));
  return OkStatus();
}

// Appends `layer`'s Mamba page [conv | ssm | padding] in `region`, indexed by state group
// `group`.
Status addVllmMamba(const ModelSpec& model, const RankLayout& base, uint32_t layer, uint64_t page,
                    const EngineLayout& e, uint32_t region, uint32_t group, RankLayout& out) {
  const PoolView& gc = baseView(base, Role::kConv, layer);
  const PoolView& gs = baseView(base, Role::kSsm, layer);
  PoolView conv = oneLayer(gc, layer, gc.sections, out);
  conv.index_stride = page;
  conv.region_id = region;
  conv.state_group = group;
  ASSIGN_OR_RETURN(conv.record, recordIn(model, out, conv,
                                         e.conv == ConvOrder::kSd
                                             ? std::vector<std::string>{"window", "channel"}
                                             : std::vector<std::string>{"channel", "window"}));
  PoolView ssm = oneLayer(gs, layer, gs.sections, out);
  ssm.index_stride = page;
  ssm.region_id = region;
  ssm.state_group = group;
  ssm.base = conv.record_bytes;
  if (ssm.kind == LayerKind::kGdn) {
    ASSIGN_OR_RETURN(ssm.record, recordIn(model, out, ssm, {"head", "value", "key"}));
  }
  out.views.push_back(std::move(conv));
  out.views.push_back(std::move(ssm));
  return OkStatus();
}

// vLLM's KV cache groups over the whole model (kv_cache_utils): the layers of one spec form
// groups of equal size, the fewest layers of a spec (or the most, when under 1.5x the fewest);
// a spec with n groups gives group i its layers i, i + n, i + 2n, ...
struct VllmGroups {
  std::vector<std::vector<uint32_t>> attention, mamba;  // global layer ids of each group
};

VllmGroups vllmGroups(const ModelSpec& model) {
  struct Spec {
    LayerSpec part;  // the attention or the recurrent part of a layer
    std::vector<uint32_t> layers;
  };
  std::vector<Spec> specs;  // in order of first appearance, as vLLM's dict
  auto add = [&specs](LayerSpec part, uint32_t layer) {
    for (Spec& s : specs) {
      if (s.part == part) {
        s.layers.push_back(layer);
        return;
      }
    }
    specs.push_back({std::move(part), {layer}});
  };
  for (uint32_t i = 0; i < model.numLayers(); ++i) {
    const LayerSpec& l = model.layers[i];
    if (l.hasAttention()) {
      LayerSpec part;
      part.attention = l.attention;
      add(part, i);
    }
    if (l.hasRecurrent()) {
      LayerSpec part = l;
      part.attention.reset();
      add(part, i);
    }
  }
  VllmGroups out;
  if (specs.empty()) return out;
  size_t fewest = SIZE_MAX, most = 0;
  for (const Spec& s : specs) {
    fewest = std::min(fewest, s.layers.size());
    most = std::max(most, s.layers.size());
  }
  const size_t size = most * 2 < fewest * 3 ? most : fewest;
  for (const Spec& s : specs) {
    const size_t n = (s.layers.size() + size - 1) / size;
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint32_t> group;
      for (size_t j = i; j < s.layers.size(); j += n) group.push_back(s.layers[j]);
      (s.part.hasAttention() ? out.attention : out.mamba).push_back(std::move(group));
    }
  }
  return out;
}

// vLLM's hybrid manager: tensor t is shared by the t-th layer on this stage of every group.
StatusOr<RankLayout> buildVllmShared(const ModelSpec& model, const RankLayout& base,
                                     const EngineLayout& e, uint64_t page, uint32_t num_blocks,
                                     RankLayout out) {
  const VllmGroups groups = vllmGroups(model);
  if (groups.attention.size() > 1) {
    return InvalidArgument(
        "vllm layout with shared tensors: the attention layers form " +
        std::to_string(groups.attention.size()) + " KV cache groups of " +
        std::to_string(groups.attention.front().size()) +
        " layers, each with a block table of its own; hxfer takes a request's blocks as one "
        "list, so it describes one attention group (use shared tensors off)");
  }
  const LayerRange stage = base.stageLayers();
  auto local = [&stage](const std::vector<uint32_t>& group) {
    std::vector<uint32_t> out;
    for (uint32_t layer : group) {
      if (stage.contains(layer)) out.push_back(layer);
    }
    return out;
  };
  std::vector<uint32_t> attention;
  if (!groups.attention.empty()) attention = local(groups.attention.front());
  std::vector<std::vector<uint32_t>> mamba;
  size_t tensors = attention.size();
  for (const std::vector<uint32_t>& g : groups.mamba) {
    mamba.push_back(local(g));
    tensors = std::max(tensors, mamba.back().size());
  }
  out.num_slots = num_blocks;  // one pool of ids for pages and states
  out.joint_ids = true;
  out.state_groups = std::max<uint32_t>(1, static_cast<uint32_t>(mamba.size()));
  ASSIGN_OR_RETURN(uint64_t length, times(page, num_blocks, "vllm shared tensor"));
  for (size_t t = 0; t < tensors; ++t) {
    const uint32_t region = addRegion(out, "shared." + std::to_string(t), length);
    if (t < attention.size()) {
      RETURN_IF_ERROR(addVllmAttention(model, base, attention[t], page, e, region, out));
    }
    for (size_t g = 0; g < mamba.size(); ++g) {
      if (t >= mamba[g].size()) continue;
      RETURN_IF_ERROR(
          addVllmMamba(model, base, mamba[g][t], page, e, region, static_cast<uint32_t>(g), out));
    }
  }
  for (PoolView& v : out.views) v.num_indices = num_blocks;
  RETURN_IF_ERROR(out.validate());
  return out;
}

StatusOr<RankLayout> buildVllm(const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank,
                               uint32_t pp_rank, const EngineLayout& e, uint32_t num_blocks,
                               uint32_t num_slots) {
  // Shared tensors draw states from the block pool: num_slots is not used there.
  ASSIGN_OR_RETURN(RankLayout base,
                   buildRankLayout(model, pc, tp_rank, pp_rank, StateLayout::kPaged, num_blocks,
                                   e.shared ? num_blocks : num_slots));
  RankLayout out = base;
  out.regions.clear();
  out.views.clear();
  ASSIGN_OR_RETURN(const uint64_t page, vllmPage(base));
  if (e.shared) return buildVllmShared(model, base, e, page, num_blocks, std::move(out));
  auto both = [&](uint32_t layer) {
    const LayerSpec& l = model.layers[layer];
    return l.hasAttention() && l.hasRecurrent();
  };
  // One tensor per layer in layer order: its attention tensor, then its Mamba tensor.
  std::vector<uint32_t> layers;
  for (const PoolView& v : base.views)
    layers.insert(layers.end(), v.layers.begin(), v.layers.end());
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  for (uint32_t layer : layers) {
    const std::string name = "layer." + std::to_string(layer);
    if (model.layers[layer].hasAttention()) {
      ASSIGN_OR_RETURN(uint64_t length, times(page, num_blocks, "vllm attention tensor"));
      const uint32_t region = addRegion(out, name + (both(layer) ? ".attn" : ""), length);
      RETURN_IF_ERROR(addVllmAttention(model, base, layer, page, e, region, out));
    }
    if (model.layers[layer].hasRecurrent()) {
      ASSIGN_OR_RETURN(uint64_t length, times(page, num_slots, "vllm mamba tensor"));
      const uint32_t region = addRegion(out, name + (both(layer) ? ".mamba" : ""), length);
      RETURN_IF_ERROR(addVllmMamba(model, base, layer, page, e, region, 0, out));
    }
  }
  RETURN_IF_ERROR(out.validate());
  return out;
}

// Gated-delta-net ssm state as SGLang and TensorRT-LLM keep it: (v_heads, head_v, head_k).
Status gdnValueMajor(const ModelSpec& model, RankLayout& out) {
  for (PoolView& v : out.views) {
    if (v.role == Role::kSsm && v.kind == LayerKind::kGdn) {
      ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, {"head", "value", "key"}));
    }
  }
  return out.validate();
}

StatusOr<RankLayout> buildSglang(const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank,
                                 uint32_t pp_rank, uint32_t num_blocks, uint32_t num_slots) {
  ASSIGN_OR_RETURN(RankLayout base,
                   buildRankLayout(model, pc, tp_rank, pp_rank, StateLayout::kLayerMajor,
                                   num_blocks, num_slots));
  RankLayout out = base;
  out.regions.clear();
  out.views.clear();
  for (const PoolView& g : base.views) {
    if (g.role != Role::kKv) continue;
    for (uint32_t layer : g.layers) {
      for (const Section& s : g.sections) {  // k_buffer, then v_buffer
        PoolView v = oneLayer(g, layer, {s}, out);
        v.index_stride = v.record_bytes;  // a page is tokens_per_block consecutive token rows
        ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, kvOrder(KvOrder::kNhd, false)));
        ASSIGN_OR_RETURN(uint64_t length, times(v.record_bytes, num_blocks, "sglang kv buffer"));
        const std::string prefix = s.name == "K" ? "k." : "v.";
        v.region_id = addRegion(out, prefix + std::to_string(layer), length);
        out.views.push_back(std::move(v));
      }
    }
  }
  // The Mamba pool is hxfer's layer-major one: keep its views, renumber their regions.
  for (const PoolView& g : base.views) {
    if (g.role == Role::kKv) continue;
    PoolView v = g;
    const RegionSpec* r = base.findRegion(g.region_id);
    v.region_id = addRegion(out, r->name, r->length);
    out.views.push_back(std::move(v));
  }
  RETURN_IF_ERROR(gdnValueMajor(model, out));
  return out;
}

}  // namespace

void applyEngineDtypes(const EngineLayout& layout, bool conv_set, bool ssm_set, ModelSpec* m) {
  switch (layout.engine) {
    case Engine::kVllm:
    case Engine::kVllmSplit:
      if (!ssm_set) {
        m->ssm_dtype = m->architecture.starts_with("NemotronH") ? DType::kFp32 : m->kv_dtype;
      }
      break;
    case Engine::kSglang:
      if (!conv_set) m->conv_dtype = DType::kBf16;
      if (!ssm_set) m->ssm_dtype = DType::kFp32;
      break;
    case Engine::kTrtllmV1:
    case Engine::kTrtllmV2:
      if (!ssm_set) m->ssm_dtype = m->kv_dtype;
      break;
    case Engine::kHxfer:
      break;
  }
}

ReservedIds reservedIds(const EngineLayout& layout) {
  if (isVllm(layout.engine)) return {{0}, {0}};
  if (layout.engine == Engine::kSglang) return {{0}, {0}};
  return {};
}

StatusOr<RankLayout> buildEngineLayout(const ModelSpec& model, const ParallelConfig& pc,
                                       uint32_t tp_rank, uint32_t pp_rank,
                                       const EngineLayout& layout, uint32_t num_blocks,
                                       uint32_t num_slots) {
  switch (layout.engine) {
    case Engine::kHxfer:
      return buildRankLayout(model, pc, tp_rank, pp_rank, layout.state, num_blocks, num_slots);
    case Engine::kTrtllmV1: {
      ASSIGN_OR_RETURN(RankLayout out,
                       buildRankLayout(model, pc, tp_rank, pp_rank, StateLayout::kLayerMajor,
                                       num_blocks, num_slots));
      RETURN_IF_ERROR(gdnValueMajor(model, out));
      return out;
    }
    case Engine::kTrtllmV2: {
      ASSIGN_OR_RETURN(RankLayout out, buildRankLayout(model, pc, tp_rank, pp_rank,
                                                       StateLayout::kPaged, num_blocks, num_slots));
      if (layout.kv == KvOrder::kNhd) {
        for (PoolView& v : out.views) {
          if (v.role != Role::kKv) continue;
          ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, kvOrder(KvOrder::kNhd, true)));
        }
      }
      RETURN_IF_ERROR(gdnValueMajor(model, out));
      return out;
    }
    case Engine::kVllm:
    case Engine::kVllmSplit:
      return buildVllm(model, pc, tp_rank, pp_rank, layout, num_blocks, num_slots);
    case Engine::kSglang:
      return buildSglang(model, pc, tp_rank, pp_rank, num_blocks, num_slots);
  }
  return InvalidArgument("unknown engine layout");
}

}  // namespace hxfer
