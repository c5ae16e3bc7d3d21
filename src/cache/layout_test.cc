#include "cache/layout.h"

#include <gtest/gtest.h>

namespace hxfer {
namespace {

// 4 layers: mamba2, attention, mamba2, attention. conv and ssm records differ in size.
ModelSpec tiny() {
  ModelSpec m;
  m.name = "tiny";
  LayerSpec mamba;
  mamba.recurrent = LayerKind::kMamba2;
  mamba.mamba2 = {8, 4, 2, 8, 4};
  LayerSpec attn;
  attn.attention = AttentionShape{4, 8};
  m.layers = {mamba, attn, mamba, attn};
  m.tokens_per_block = 4;
  return m;
}

TEST(Layout, KvPoolIsBlockMajorOverLocalLayers) {
  auto l = buildRankLayout(tiny(), {2, 1, {}}, 1, 0, StateLayout::kPaged, 10, 3);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const PoolView& kv = l->views[0];
  EXPECT_EQ(kv.role, Role::kKv);
  EXPECT_EQ(kv.layers, (std::vector<uint32_t>{1, 3}));
  const uint64_t rec = 2 /*K,V*/ * 2 /*heads at tp2*/ * 4 * 8 * 2;
  EXPECT_EQ(kv.record_bytes, rec);
  EXPECT_EQ(kv.offset(5, 1), 5 * 2 * rec + rec);
  EXPECT_EQ(l->regions[kv.region_id].length, 10 * 2 * rec);
}

TEST(Layout, PagedUnequalRecordsGetSeparatePools) {
  auto l = buildRankLayout(tiny(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  const PoolView& conv = l->views[1];
  const PoolView& ssm = l->views[2];
  EXPECT_NE(conv.region_id, ssm.region_id);
  EXPECT_EQ(conv.record_bytes, (8u * 4 + 2 * 2 * 8) * 3 * 2);
  EXPECT_EQ(conv.offset(2, 1), 2 * 2 * conv.record_bytes + conv.record_bytes);
  EXPECT_EQ(ssm.offset(1, 0), 2 * ssm.record_bytes);
}

TEST(Layout, PagedEqualRecordsInterleaveSsmThenConv) {
  ModelSpec m = tiny();
  // Make conv == ssm: conv = (H*P + 2*G*N)*(k-1)*2, ssm = H*P*N*4.
  // H=2,P=2,G=1,N=2,k=3: conv = (4+4)*2*2 = 32; ssm = 2*2*2*4 = 32.
  for (auto& l : m.layers) {
    if (l.hasRecurrent()) l.mamba2 = {2, 2, 1, 2, 3};
  }
  auto l = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 5);
  ASSERT_TRUE(l.isOk());
  const PoolView& conv = l->views[1];
  const PoolView& ssm = l->views[2];
  ASSERT_EQ(conv.record_bytes, 32u);
  ASSERT_EQ(ssm.record_bytes, 32u);
  EXPECT_EQ(conv.region_id, ssm.region_id);
  // slot 3, layer 1: [ssm_l0|conv_l0|ssm_l1|conv_l1] per slot of 128 bytes.
  EXPECT_EQ(ssm.offset(3, 1), 3 * 128 + 64);
  EXPECT_EQ(conv.offset(3, 1), 3 * 128 + 96);
}

TEST(Layout, LayerMajorIsLayerThenSlot) {
  auto l = buildRankLayout(tiny(), {1, 1, {}}, 0, 0, StateLayout::kLayerMajor, 2, 3);
  ASSERT_TRUE(l.isOk());
  const PoolView& ssm = l->views[2];
  EXPECT_EQ(ssm.offset(2, 1), 1 * 3 * ssm.record_bytes + 2 * ssm.record_bytes);
}

TEST(Layout, PipelineStageHoldsOnlyItsLayers) {
  auto l = buildRankLayout(tiny(), {1, 2, {}}, 0, 1, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  for (const PoolView& v : l->views) {
    for (uint32_t id : v.layers) EXPECT_GE(id, 2u);
  }
}

TEST(Layout, ValidateRejectsViewPastItsRegion) {
  auto l = buildRankLayout(tiny(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  RankLayout bad = *l;
  bad.views[0].index_stride = ~uint64_t{0} / 2;
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run past region"), std::string::npos);
}

}  // namespace
}  // namespace hxfer
