// Test helpers for the planner: small models of every layer kind and random ones.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "model/model.h"

namespace hxfer::testing {

inline LayerSpec attentionLayer(uint32_t kv_heads, uint32_t head_dim) {
  LayerSpec l;
  l.attention = AttentionShape{kv_heads, head_dim};
  return l;
}

inline LayerSpec mamba2Layer(uint32_t heads, uint32_t head_dim, uint32_t groups, uint32_t d_state,
                             uint32_t d_conv) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba2;
  l.mamba2 = {heads, head_dim, groups, d_state, d_conv};
  return l;
}

inline LayerSpec gdnLayer(uint32_t k_heads, uint32_t v_heads, uint32_t dk, uint32_t dv,
                          uint32_t d_conv) {
  LayerSpec l;
  l.recurrent = LayerKind::kGdn;
  l.gdn = {k_heads, v_heads, dk, dv, d_conv};
  return l;
}

inline LayerSpec mamba1Layer(uint32_t d_inner, uint32_t d_state, uint32_t d_conv) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba1;
  l.mamba1 = {d_inner, d_state, d_conv};
  return l;
}

inline ModelSpec makeModel(std::vector<LayerSpec> layers, uint32_t tokens_per_block = 4) {
  ModelSpec m;
  m.name = "test";
  m.layers = std::move(layers);
  m.tokens_per_block = tokens_per_block;
  return m;
}

// The engine-pair model of the staging and device tests: attention, mamba2, a layer with
// both, and gdn, 16 tokens per block.
inline ModelSpec enginePairModel() {
  LayerSpec hybrid = mamba2Layer(8, 2, 2, 4, 4);
  hybrid.attention = AttentionShape{4, 8};
  return makeModel(
      {attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4), hybrid, gdnLayer(2, 4, 2, 3, 3)}, 16);
}

// A random tiny model: 1-8 layers of every kind (attention, mamba2, gdn, mamba1, attention +
// mamba2 in one layer, none), each kind drawn from a palette of two shapes so that layer
// groups span several layers. Unit counts are powers of two up to 16 (so that every tp in
// {1, 2, 4, 8} shards, with replication below), unit sizes are odd-ish small numbers, dtypes
// are random (fp8 gives unit sizes that are not multiples of 8 bytes).
inline ModelSpec randomModel(std::mt19937_64& rng) {
  auto pick = [&](uint32_t lo, uint32_t hi) {
    return static_cast<uint32_t>(std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
  };
  auto pow2 = [&](uint32_t max_log) { return 1u << pick(0, max_log); };
  const DType dtypes[] = {DType::kFp32, DType::kFp16, DType::kBf16, DType::kFp8};
  ModelSpec m;
  m.name = "random";
  m.kv_dtype = dtypes[pick(0, 3)];
  m.conv_dtype = dtypes[pick(0, 3)];
  m.ssm_dtype = pick(0, 1) ? m.conv_dtype : dtypes[pick(0, 3)];
  m.tokens_per_block = std::vector<uint32_t>{1, 2, 3, 4, 8}[pick(0, 4)];
  LayerSpec palette[6][2];
  for (int i = 0; i < 2; ++i) {
    palette[0][i] = attentionLayer(pow2(4), pick(1, 5));
    palette[1][i] = mamba2Layer(pow2(4), pick(1, 4), pow2(3), pick(1, 4), pick(2, 4));
    palette[2][i] = gdnLayer(pow2(3), pow2(4), pick(1, 4), pick(1, 4), pick(2, 4));
    const uint32_t d_conv = pick(2, 4);
    // Half the time conv and ssm records have equal size (coalesced paged pool) when the
    // dtypes agree.
    palette[3][i] = mamba1Layer(pow2(4), pick(0, 1) ? d_conv - 1 : pick(1, 4), d_conv);
    palette[4][i] = palette[1][i];
    palette[4][i].attention = AttentionShape{pow2(4), pick(1, 5)};
    palette[5][i] = LayerSpec{};
  }
  const uint32_t n = pick(1, 8);
  for (uint32_t i = 0; i < n; ++i) m.layers.push_back(palette[pick(0, 5)][pick(0, 1)]);
  if (!m.layers[0].hasCache()) m.layers[0] = palette[0][0];
  return m;
}

// A random split of n layers over pp stages (each >= 1). REQUIRES: n >= pp.
inline std::vector<uint32_t> randomSplit(std::mt19937_64& rng, uint32_t n, uint32_t pp) {
  std::vector<uint32_t> split(pp, 1);
  for (uint32_t i = pp; i < n; ++i) {
    ++split[std::uniform_int_distribution<uint32_t>(0, pp - 1)(rng)];
  }
  return split;
}

}  // namespace hxfer::testing
