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
  }
  return "unknown";
}

std::string EngineLayout::toString() const {
  const std::string kv_text = kv == KvOrder::kNhd ? "nhd" : "hnd";
  switch (engine) {
    case Engine::kHxfer:
      return "hxfer(" + std::string(stateLayoutName(state)) + ")";
    case Engine::kTrtllmV2:
      return "trtllm-v2(kv=" + kv_text + ")";
    case Engine::kVllm:
      return "vllm(kv=" + kv_text + ",conv=" + (conv == ConvOrder::kSd ? "sd" : "ds") + ")";
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
  return out;
}

StatusOr<EngineLayout> parseEngineLayout(std::string_view engine, std::string_view kv,
                                         std::string_view conv, std::string_view state) {
  EngineLayout out;
  if (engine == "hxfer") {
    out.engine = Engine::kHxfer;
  } else if (engine == "trtllm-v1") {
    out.engine = Engine::kTrtllmV1;
  } else if (engine == "trtllm-v2") {
    out.engine = Engine::kTrtllmV2;
  } else if (engine == "vllm") {
    out.engine = Engine::kVllm;
    out.kv = KvOrder::kNhd;
    out.conv = ConvOrder::kSd;
  } else if (engine == "sglang") {
    out.engine = Engine::kSglang;
  } else {
    return InvalidArgument("unknown engine layout '" + std::string(engine) +
                           "' (expected hxfer, trtllm-v1, trtllm-v2, vllm or sglang)");
  }
  const std::string name(engine);
  if (!kv.empty()) {
    if (out.engine != Engine::kVllm && out.engine != Engine::kTrtllmV2) {
      return InvalidArgument("kv layout '" + std::string(kv) + "': engine " + name +
                             " has one kv order (only vllm and trtllm-v2 take nhd|hnd)");
    }
    if (kv == "nhd") {
      out.kv = KvOrder::kNhd;
    } else if (kv == "hnd") {
      out.kv = KvOrder::kHnd;
    } else {
      return InvalidArgument("unknown kv layout '" + std::string(kv) + "' (expected nhd or hnd)");
    }
  }
  if (!conv.empty()) {
    if (out.engine != Engine::kVllm) {
      return InvalidArgument("conv layout '" + std::string(conv) + "': engine " + name +
                             " has one conv order (only vllm takes sd|ds)");
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

StatusOr<RankLayout> buildVllm(const ModelSpec& model, const ParallelConfig& pc, uint32_t tp_rank,
                               uint32_t pp_rank, const EngineLayout& e, uint32_t num_blocks,
                               uint32_t num_slots) {
  ASSIGN_OR_RETURN(RankLayout base, buildRankLayout(model, pc, tp_rank, pp_rank,
                                                    StateLayout::kPaged, num_blocks, num_slots));
  RankLayout out = base;
  out.regions.clear();
  out.views.clear();
  // One page size for every layer: the attention page, which the Mamba page must fit.
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
    const uint64_t need = (mamba_page + per_token - 1) / per_token;
    return InvalidArgument("vllm layout: the mamba page (" + std::to_string(mamba_page) +
                           " bytes) is larger than the attention page (" +
                           std::to_string(attention_page) +
                           " bytes at tokens_per_block=" + std::to_string(base.tokens_per_block) +
                           "); vLLM raises the block size until it holds it: use at least " +
                           std::to_string(need) + " tokens per block");
  }
  const uint64_t page = attention_page > 0 ? attention_page : mamba_page;
  std::vector<std::string> conv_order = e.conv == ConvOrder::kSd
                                            ? std::vector<std::string>{"window", "channel"}
                                            : std::vector<std::string>{"channel", "window"};
  auto both = [&](uint32_t layer) {
    const LayerSpec& l = model.layers[layer];
    return l.hasAttention() && l.hasRecurrent();
  };
  // Views in layer order: per layer its attention tensor, then its Mamba tensor.
  std::vector<uint32_t> layers;
  for (const PoolView& v : base.views)
    layers.insert(layers.end(), v.layers.begin(), v.layers.end());
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  for (uint32_t layer : layers) {
    for (size_t vi = 0; vi < base.views.size(); ++vi) {
      const PoolView& g = base.views[vi];
      if (!std::binary_search(g.layers.begin(), g.layers.end(), layer)) continue;
      if (g.role == Role::kKv) {
        PoolView v = oneLayer(g, layer, g.sections, out);
        v.index_stride = page;
        ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, kvOrder(e.kv, true)));
        ASSIGN_OR_RETURN(uint64_t length, times(page, num_blocks, "vllm attention tensor"));
        v.region_id =
            addRegion(out, "layer." + std::to_string(layer) + (both(layer) ? ".attn" : ""), length);
        out.views.push_back(std::move(v));
      } else if (g.role == Role::kConv) {
        const PoolView& gs = base.views[vi + 1];  // the group's ssm view follows its conv view
        ASSIGN_OR_RETURN(uint64_t length, times(page, num_slots, "vllm mamba tensor"));
        const uint32_t region = addRegion(
            out, "layer." + std::to_string(layer) + (both(layer) ? ".mamba" : ""), length);
        PoolView conv = oneLayer(g, layer, g.sections, out);
        conv.index_stride = page;
        conv.region_id = region;
        ASSIGN_OR_RETURN(conv.record, recordIn(model, out, conv, conv_order));
        PoolView ssm = oneLayer(gs, layer, gs.sections, out);
        ssm.index_stride = page;
        ssm.region_id = region;
        ssm.base = conv.record_bytes;
        if (ssm.kind == LayerKind::kGdn) {
          ASSIGN_OR_RETURN(ssm.record, recordIn(model, out, ssm, {"head", "value", "key"}));
        }
        out.views.push_back(std::move(conv));
        out.views.push_back(std::move(ssm));
      }
    }
  }
  RETURN_IF_ERROR(out.validate());
  return out;
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
  RETURN_IF_ERROR(out.validate());
  return out;
}

}  // namespace

StatusOr<RankLayout> buildEngineLayout(const ModelSpec& model, const ParallelConfig& pc,
                                       uint32_t tp_rank, uint32_t pp_rank,
                                       const EngineLayout& layout, uint32_t num_blocks,
                                       uint32_t num_slots) {
  switch (layout.engine) {
    case Engine::kHxfer:
      return buildRankLayout(model, pc, tp_rank, pp_rank, layout.state, num_blocks, num_slots);
    case Engine::kTrtllmV1:
      return buildRankLayout(model, pc, tp_rank, pp_rank, StateLayout::kLayerMajor, num_blocks,
                             num_slots);
    case Engine::kTrtllmV2: {
      ASSIGN_OR_RETURN(RankLayout out, buildRankLayout(model, pc, tp_rank, pp_rank,
                                                       StateLayout::kPaged, num_blocks, num_slots));
      if (layout.kv == KvOrder::kNhd) {
        for (PoolView& v : out.views) {
          if (v.role != Role::kKv) continue;
          ASSIGN_OR_RETURN(v.record, recordIn(model, out, v, kvOrder(KvOrder::kNhd, true)));
        }
        RETURN_IF_ERROR(out.validate());
      }
      return out;
    }
    case Engine::kVllm:
      return buildVllm(model, pc, tp_rank, pp_rank, layout, num_blocks, num_slots);
    case Engine::kSglang:
      return buildSglang(model, pc, tp_rank, pp_rank, num_blocks, num_slots);
  }
  return InvalidArgument("unknown engine layout");
}

}  // namespace hxfer
