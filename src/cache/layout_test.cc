#include "cache/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "cache/record_layout.h"
#include "model/presets.h"

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

// ---- Views against an independent packing of the pools -------------------------------------

// Where record (view, index, local layer) must be, found by laying the records of every region
// out one after another in the order DESIGN §3 writes the tensor shapes, without using any
// stride: kv [block][layer][record]; paged [slot][layer][record], or for a shared (coalesced)
// pool [slot][layer][ssm|conv]; layer-major [layer][slot][record].
using RecordKey = std::tuple<size_t, uint32_t, uint32_t>;  // view, index, local layer

std::map<RecordKey, uint64_t> packRecords(const RankLayout& l) {
  std::map<RecordKey, uint64_t> at;
  for (const RegionSpec& region : l.regions) {
    std::vector<size_t> in;  // views of this region, ssm before conv
    for (size_t v = 0; v < l.views.size(); ++v) {
      if (l.views[v].region_id == region.id) in.push_back(v);
    }
    std::sort(in.begin(), in.end(), [&](size_t a, size_t b) {
      return l.views[a].role == Role::kSsm && l.views[b].role != Role::kSsm;
    });
    EXPECT_FALSE(in.empty()) << "region " << region.name << " backs no view";
    if (in.empty()) continue;
    const PoolView& first = l.views[in[0]];
    uint64_t cursor = 0;
    const bool layer_major = first.role != Role::kKv && l.state_layout == StateLayout::kLayerMajor;
    const uint32_t n_layers = static_cast<uint32_t>(first.layers.size());
    if (layer_major) {
      for (uint32_t layer = 0; layer < n_layers; ++layer) {
        for (uint32_t i = 0; i < first.num_indices; ++i) {
          for (size_t v : in) {
            at[{v, i, layer}] = cursor;
            cursor += l.views[v].record_bytes;
          }
        }
      }
    } else {
      for (uint32_t i = 0; i < first.num_indices; ++i) {
        for (uint32_t layer = 0; layer < n_layers; ++layer) {
          for (size_t v : in) {
            at[{v, i, layer}] = cursor;
            cursor += l.views[v].record_bytes;
          }
        }
      }
    }
    EXPECT_EQ(cursor, region.length) << "region " << region.name << " is not densely packed";
  }
  return at;
}

// Checks every view's affine address against packRecords and the pool-sharing rules.
void expectViewsMatchPacking(const RankLayout& l, const std::string& what) {
  SCOPED_TRACE(what);
  const auto at = packRecords(l);
  size_t records = 0;
  for (size_t v = 0; v < l.views.size(); ++v) {
    const PoolView& view = l.views[v];
    for (uint32_t i = 0; i < view.num_indices; ++i) {
      for (uint32_t layer = 0; layer < view.layers.size(); ++layer) {
        auto it = at.find({v, i, layer});
        ASSERT_NE(it, at.end());
        ASSERT_EQ(view.offset(i, layer), it->second)
            << "view " << v << " (" << roleName(view.role) << ") index " << i << " layer " << layer;
        ++records;
      }
    }
  }
  EXPECT_EQ(records, at.size());
  // Sharing: only a paged group's conv and ssm of equal size share a region.
  for (size_t a = 0; a < l.views.size(); ++a) {
    for (size_t b = 0; b < a; ++b) {
      const PoolView& x = l.views[a];
      const PoolView& y = l.views[b];
      const bool coalesce = l.state_layout == StateLayout::kPaged && x.role != Role::kKv &&
                            y.role != Role::kKv && x.role != y.role && x.layers == y.layers &&
                            x.record_bytes == y.record_bytes;
      EXPECT_EQ(x.region_id == y.region_id, coalesce) << "views " << b << " and " << a;
    }
  }
}

// Brute force over every record: no byte belongs to two records, and all lie in their region.
void expectNoRecordOverlaps(const RankLayout& l, const std::string& what) {
  SCOPED_TRACE(what);
  struct Span {
    uint32_t region;
    uint64_t begin, end;
  };
  std::vector<Span> spans;
  for (const PoolView& v : l.views) {
    const RegionSpec* region = l.findRegion(v.region_id);
    ASSERT_NE(region, nullptr);
    for (uint32_t i = 0; i < v.num_indices; ++i) {
      for (uint32_t layer = 0; layer < v.layers.size(); ++layer) {
        const uint64_t off = v.offset(i, layer);
        ASSERT_LE(off + v.record_bytes, region->length) << region->name;
        spans.push_back({v.region_id, off, off + v.record_bytes});
      }
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.region, a.begin) < std::tie(b.region, b.begin);
  });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].region != spans[i - 1].region) continue;
    ASSERT_GE(spans[i].begin, spans[i - 1].end) << "records overlap in region " << spans[i].region;
  }
}

TEST(Layout, ViewsMatchPackingForUnequalConvAndSsmInBothLayouts) {
  for (StateLayout sl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    for (uint32_t tp : {1u, 2u}) {
      for (uint32_t r = 0; r < tp; ++r) {
        auto l = buildRankLayout(tiny(), {tp, 1, {}}, r, 0, sl, 5, 3);
        ASSERT_TRUE(l.isOk()) << l.status().toString();
        ASSERT_NE(l->views[1].record_bytes, l->views[2].record_bytes);
        expectViewsMatchPacking(*l, std::string(stateLayoutName(sl)) + " tp" + std::to_string(tp) +
                                        " rank" + std::to_string(r));
        expectNoRecordOverlaps(*l, "tiny");
      }
    }
  }
}

ModelSpec equalConvSsm() {
  ModelSpec m = tiny();
  for (auto& l : m.layers) {
    if (l.hasRecurrent()) l.mamba2 = {2, 2, 1, 2, 3};  // conv = ssm = 32 bytes at tp 1
  }
  return m;
}

TEST(Layout, CoalescedEqualSizePoolMatchesPackingAndLayerMajorDoesNotCoalesce) {
  auto paged = buildRankLayout(equalConvSsm(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 4, 6);
  ASSERT_TRUE(paged.isOk()) << paged.status().toString();
  EXPECT_EQ(paged->regions.size(), 2u);  // kv0, state0
  EXPECT_EQ(paged->regions[1].name, "state0");
  EXPECT_EQ(paged->regions[1].length, 6u * 2 * 2 * 32);
  expectViewsMatchPacking(*paged, "paged coalesced");
  expectNoRecordOverlaps(*paged, "paged coalesced");

  auto legacy = buildRankLayout(equalConvSsm(), {1, 1, {}}, 0, 0, StateLayout::kLayerMajor, 4, 6);
  ASSERT_TRUE(legacy.isOk());
  EXPECT_EQ(legacy->regions.size(), 3u);  // kv0, conv0, ssm0
  expectViewsMatchPacking(*legacy, "layer-major equal sizes");
  expectNoRecordOverlaps(*legacy, "layer-major equal sizes");
}

TEST(Layout, EveryPresetHasExactNonOverlappingViewsAtTp124Pp12) {
  bool tiny_ran = false;
  for (const std::string& name : presetNames()) {
    auto model = loadPreset(name);
    ASSERT_TRUE(model.isOk()) << model.status().toString();
    for (uint32_t tp : {1u, 2u, 4u}) {
      for (uint32_t pp : {1u, 2u}) {
        for (StateLayout sl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
          for (uint32_t pr = 0; pr < pp; ++pr) {
            for (uint32_t tr = 0; tr < tp; ++tr) {
              auto l = buildRankLayout(*model, {tp, pp, {}}, tr, pr, sl, 3, 2);
              if (!l.isOk()) {
                // Only divisibility may refuse a combination.
                const Status& s = l.status();
                ASSERT_TRUE(s.code() == StatusCode::kIncompatible ||
                            (s.code() == StatusCode::kInvalidArgument &&
                             s.message().find("does not divide") != std::string::npos))
                    << name << ": " << s.toString();
                continue;
              }
              const std::string what = name + " tp" + std::to_string(tp) + " pp" +
                                       std::to_string(pp) + " rank(" + std::to_string(tr) + "," +
                                       std::to_string(pr) + ") " + std::string(stateLayoutName(sl));
              expectViewsMatchPacking(*l, what);
              expectNoRecordOverlaps(*l, what);
              if (name == kDefaultPreset) tiny_ran = true;
            }
          }
        }
      }
    }
  }
  EXPECT_TRUE(tiny_ran);
}

TEST(Layout, ValidateRejectsStridesThatMapTwoRecordsToOneAddress) {
  auto l = buildRankLayout(tiny(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  RankLayout bad = *l;
  // kv: (block 1, layer 0) and (block 0, layer 1) would both sit at one record's offset.
  bad.views[0].index_stride = bad.views[0].record_bytes;
  bad.views[0].layer_stride = bad.views[0].record_bytes;
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s.toString();

  bad = *l;
  bad.views[0].layer_stride = bad.views[0].record_bytes / 2;  // layers half on top of each other
  EXPECT_EQ(bad.validate().code(), StatusCode::kInvalidArgument);
}

TEST(Layout, ValidateRejectsSingleLayerViewWithIndexStrideBelowRecord) {
  ModelSpec m = tiny();
  m.layers = {m.layers[0], m.layers[1]};  // one mamba2, one attention layer
  auto l = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 4, 3);
  ASSERT_TRUE(l.isOk());
  RankLayout bad = *l;
  bad.views[0].index_stride = bad.views[0].record_bytes - 1;
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s.toString();
}

TEST(Layout, ValidateRejectsCoalescedViewsShiftedOntoEachOther) {
  auto l = buildRankLayout(equalConvSsm(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  ASSERT_EQ(l->views[1].region_id, l->views[2].region_id);
  ASSERT_TRUE(l->validate().isOk());
  RankLayout bad = *l;
  bad.views[1].base = bad.views[2].base + 1;  // conv now straddles ssm records
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap in region"), std::string::npos) << s.toString();
}

// A view whose layer stride is no multiple of its slot stride is not one progression; it was
// then compared on the other view's step, so two layer-major pools moved into one region with
// conv (slot 0, layer 1) at [240, 264) inside ssm (slot 0, layer 1) at [240, 288) validated.
// A peer's decoded layout goes through this check.
TEST(Layout, ValidateRejectsViewsSharingARegionWhenOneIsNotOneProgression) {
  ModelSpec m;
  m.name = "two-mamba1";
  LayerSpec mamba1;
  mamba1.recurrent = LayerKind::kMamba1;
  mamba1.mamba1 = {4, 3, 4};
  m.layers = {mamba1, mamba1};
  m.tokens_per_block = 4;
  auto l = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kLayerMajor, 1, 2);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  RankLayout bad = *l;
  ASSERT_EQ(bad.views.size(), 2u);
  PoolView& conv = bad.views[0].role == Role::kConv ? bad.views[0] : bad.views[1];
  PoolView& ssm = bad.views[0].role == Role::kConv ? bad.views[1] : bad.views[0];
  ASSERT_EQ(conv.record_bytes, 24u);
  ASSERT_EQ(ssm.record_bytes, 48u);
  conv.region_id = ssm.region_id = 0;
  conv.base = 0;
  conv.index_stride = 96;
  conv.layer_stride = 240;
  ssm.base = 48;
  ssm.index_stride = 96;
  ssm.layer_stride = 192;
  bad.regions.resize(1);
  bad.regions[0].length = 960;
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap in region 0"), std::string::npos) << s.toString();
}

TEST(Layout, ValidateRejectsTwoViewsForOneLayerAndRole) {
  auto l = buildRankLayout(tiny(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 2, 3);
  ASSERT_TRUE(l.isOk());
  RankLayout bad = *l;
  PoolView dup = bad.views[0];
  dup.region_id = static_cast<uint32_t>(bad.regions.size());
  bad.regions.push_back({dup.region_id, bad.regions[0].length, "kv1"});
  bad.views.push_back(dup);
  Status s = bad.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("already has a kv view"), std::string::npos) << s.toString();
}

TEST(Layout, BuildRefusesPoolsWhoseSizeOverflows64Bits) {
  ModelSpec m = tiny();
  m.tokens_per_block = 1u << 10;
  for (auto& l : m.layers) {
    if (l.hasAttention()) l.attention = AttentionShape{1u << 14, 1u << 10};  // 64 GiB a page
  }
  auto l = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 0xffffffffu, 1);
  EXPECT_EQ(l.status().code(), StatusCode::kResourceExhausted) << l.status().toString();
  // A page of one layer whose byte count itself would pass 2^40 is the model's error.
  for (auto& l : m.layers) {
    if (l.hasAttention()) l.attention = AttentionShape{1u << 20, 1u << 20};
  }
  l = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 1, 1);
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << l.status().toString();
  EXPECT_NE(l.status().message().find("kv record is above"), std::string::npos)
      << l.status().toString();
}

// A split dim (mixed radix, first named most significant) against a whole one: the box is the
// common refinement; two splits with no common refinement are refused, naming both.
TEST(RecordLayout, SplitDimsRefineAgainstAWholeDimAndRefuseSplitsThatCross) {
  RecordLayout whole{{{"token", 32, 64}, {"dim", 32, 2}}, 2};
  RecordLayout amx{{{"token", 2, 1024}, {"dim", 16, 64}, {"token", 16, 4}, {"dim", 2, 2}}, 2};
  EXPECT_EQ(amx.sizeOf("token"), 32u);
  EXPECT_EQ(amx.sizeOf("dim"), 32u);
  auto t = logicalBox(amx, whole, "token");
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].size, 2u);  // token / 16
  EXPECT_EQ((*t)[0].a_stride, 1024u);
  EXPECT_EQ((*t)[0].b_stride, 16u * 64);
  EXPECT_EQ((*t)[1].size, 16u);  // token % 16
  EXPECT_EQ((*t)[1].a_stride, 4u);
  EXPECT_EQ((*t)[1].b_stride, 64u);
  // [4 x 8] and [8 x 4] refine to [4 x 2 x 4]; [3 x 4] and [4 x 3] share no refinement.
  RecordLayout four_eight{{{"token", 4, 512}, {"token", 8, 64}, {"dim", 32, 2}}, 2};
  RecordLayout eight_four{{{"token", 8, 256}, {"token", 4, 64}, {"dim", 32, 2}}, 2};
  auto refined = logicalBox(four_eight, eight_four, "token");
  ASSERT_TRUE(refined.isOk()) << refined.status().toString();
  EXPECT_EQ(refined->size(), 3u);
  RecordLayout three_four{{{"token", 3, 256}, {"token", 4, 64}, {"dim", 32, 2}}, 2};
  RecordLayout four_three{{{"token", 4, 192}, {"token", 3, 64}, {"dim", 32, 2}}, 2};
  auto crossed = logicalBox(three_four, four_three, "token");
  EXPECT_EQ(crossed.status().code(), StatusCode::kIncompatible);
  EXPECT_NE(crossed.status().message().find("split as [3 x 4] on one side and [4 x 3]"),
            std::string::npos)
      << crossed.status().toString();
}

}  // namespace
}  // namespace hxfer
