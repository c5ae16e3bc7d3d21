#include "model/model.h"

#include <gtest/gtest.h>

namespace hxfer {
namespace {

LayerSpec mamba2Layer(uint32_t h, uint32_t p, uint32_t g, uint32_t n, uint32_t k) {
  LayerSpec l;
  l.recurrent = LayerKind::kMamba2;
  l.mamba2 = {h, p, g, n, k};
  return l;
}

LayerSpec attentionLayer(uint32_t heads, uint32_t dim) {
  LayerSpec l;
  l.attention = AttentionShape{heads, dim};
  return l;
}

ModelSpec modelOf(std::vector<LayerSpec> layers) {
  ModelSpec m;
  m.name = "t";
  m.layers = std::move(layers);
  return m;
}

TEST(Sections, AttentionKvIsKThenVPerHead) {
  ModelSpec m = modelOf({attentionLayer(8, 128)});
  m.kv_dtype = DType::kFp16;
  m.tokens_per_block = 16;
  auto s = recordSections(m, m.layers[0], Role::kKv);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], (Section{"K", 8, 16 * 128 * 2}));
  EXPECT_EQ(s[1], (Section{"V", 8, 16 * 128 * 2}));
  EXPECT_TRUE(recordSections(m, m.layers[0], Role::kConv).empty());
}

TEST(Sections, Mamba2ConvIsXThenBThenCChannelMajor) {
  // Nemotron-H-8B: H=128, P=64, G=8, N=128, k=4.
  ModelSpec m = modelOf({mamba2Layer(128, 64, 8, 128, 4)});
  auto conv = recordSections(m, m.layers[0], Role::kConv);
  ASSERT_EQ(conv.size(), 3u);
  EXPECT_EQ(conv[0], (Section{"x", 128, 64 * 3 * 2}));
  EXPECT_EQ(conv[1], (Section{"B", 8, 128 * 3 * 2}));
  EXPECT_EQ(conv[2], (Section{"C", 8, 128 * 3 * 2}));
  auto ssm = recordSections(m, m.layers[0], Role::kSsm);
  ASSERT_EQ(ssm.size(), 1u);
  EXPECT_EQ(ssm[0], (Section{"heads", 128, 64 * 128 * 4}));
}

TEST(Sections, GdnConvIsQKVAndSsmIsPerValueHead) {
  ModelSpec m;
  LayerSpec l;
  l.recurrent = LayerKind::kGdn;
  l.gdn = {16, 32, 128, 128, 4};  // Qwen3-Next-80B
  m.layers = {l};
  auto conv = recordSections(m, l, Role::kConv);
  ASSERT_EQ(conv.size(), 3u);
  EXPECT_EQ(conv[0], (Section{"Q", 16, 128 * 3 * 2}));
  EXPECT_EQ(conv[1], (Section{"K", 16, 128 * 3 * 2}));
  EXPECT_EQ(conv[2], (Section{"V", 32, 128 * 3 * 2}));
  auto ssm = recordSections(m, l, Role::kSsm);
  EXPECT_EQ(ssm[0], (Section{"heads", 32, 128 * 128 * 4}));
}

TEST(Sections, Mamba1IsPerChannel) {
  ModelSpec m;
  m.conv_dtype = DType::kFp32;
  m.ssm_dtype = DType::kBf16;
  LayerSpec l;
  l.recurrent = LayerKind::kMamba1;
  l.mamba1 = {8192, 16, 4};  // Jamba
  auto conv = recordSections(m, l, Role::kConv);
  EXPECT_EQ(conv, (std::vector<Section>{{"channels", 8192, 3 * 4}}));
  auto ssm = recordSections(m, l, Role::kSsm);
  EXPECT_EQ(ssm, (std::vector<Section>{{"channels", 8192, 16 * 2}}));
}

TEST(Shard, SplitsEvenlyWhenUnitsAtLeastTp) {
  for (uint32_t tp : {1u, 2u, 4u, 8u}) {
    for (uint32_t r = 0; r < tp; ++r) {
      auto u = shardUnits(128, tp, r, "x");
      ASSERT_TRUE(u.isOk());
      EXPECT_EQ(u->first, r * 128 / tp);
      EXPECT_EQ(u->count, 128 / tp);
    }
  }
}

TEST(Shard, ReplicatesWhenUnitsBelowTp) {
  // n_groups=1 at tp=2: both ranks hold group 0.
  EXPECT_EQ(*shardUnits(1, 2, 0, "B"), (UnitRange{0, 1}));
  EXPECT_EQ(*shardUnits(1, 2, 1, "B"), (UnitRange{0, 1}));
  // 2 kv heads at tp=8: ranks 0-3 hold head 0, ranks 4-7 head 1.
  for (uint32_t r = 0; r < 8; ++r) EXPECT_EQ(shardUnits(2, 8, r, "K")->first, r / 4);
}

TEST(Shard, IndivisibleIsIncompatibleAndNamesBoth) {
  auto a = shardUnits(8, 3, 0, "mamba2 conv B");
  EXPECT_EQ(a.status().code(), StatusCode::kIncompatible);
  EXPECT_EQ(a.status().message(), "tp=3 does not divide mamba2 conv B units=8");
  auto b = shardUnits(3, 4, 0, "K");
  EXPECT_EQ(b.status().code(), StatusCode::kIncompatible);
}

TEST(Shard, LocalRecordBytesSumsEachSectionSeparately) {
  // Conv at tp=2 with G=1: x splits (64 heads each) while B and C replicate whole.
  ModelSpec m = modelOf({mamba2Layer(128, 64, 1, 128, 4)});
  auto conv = recordSections(m, m.layers[0], Role::kConv);
  auto bytes = localRecordBytes(conv, 2, 1);
  ASSERT_TRUE(bytes.isOk());
  EXPECT_EQ(*bytes, 64u * 64 * 3 * 2 + 2u * 128 * 3 * 2);
}

TEST(Parallel, EvenSplitAndExplicitSplit) {
  ParallelConfig pc{1, 2, {}};
  EXPECT_TRUE(pc.validate(52).isOk());
  EXPECT_EQ(stageLayers(pc, 52, 1)->first, 26u);
  ParallelConfig odd{1, 3, {}};
  Status s = odd.validate(52);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "pp=3 does not divide num_layers=52 (give layers_per_stage)");
  ParallelConfig given{1, 3, {18, 17, 17}};
  EXPECT_TRUE(given.validate(52).isOk());
  EXPECT_EQ(stageLayers(given, 52, 2)->first, 35u);
  ParallelConfig wrong{1, 2, {10, 10}};
  EXPECT_FALSE(wrong.validate(52).isOk());
}

TEST(Model, ValidateNamesTheBadField) {
  ModelSpec m = modelOf({mamba2Layer(8, 4, 1, 4, 1)});
  Status s = m.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("d_conv=1"), std::string::npos);
}

TEST(Model, FingerprintChangesWithAnyShape) {
  ModelSpec a = modelOf({attentionLayer(8, 128), mamba2Layer(64, 64, 8, 128, 4)});
  ModelSpec b = a;
  EXPECT_EQ(modelFingerprint(a), modelFingerprint(b));
  b.layers[1].mamba2.n_groups = 4;
  EXPECT_NE(modelFingerprint(a), modelFingerprint(b));
  ModelSpec c = a;
  std::swap(c.layers[0], c.layers[1]);
  EXPECT_NE(modelFingerprint(a), modelFingerprint(c));
}

// fp8 is E4M3: its spellings parse to kFp8; E5M2's are refused, naming the value (the two
// formats' bytes mean other numbers, and both would travel as the one fp8 dtype).
TEST(DTypes, Fp8IsE4m3AndE5m2IsRefusedNamingIt) {
  for (std::string_view n : {"fp8", "float8_e4m3fn", "torch.float8_e4m3fn", "e4m3"}) {
    auto d = parseDType(n);
    ASSERT_TRUE(d.isOk()) << n << ": " << d.status().toString();
    EXPECT_EQ(*d, DType::kFp8) << n;
  }
  for (std::string_view n : {"float8_e5m2", "torch.float8_e5m2", "e5m2", "fp8_e5m2"}) {
    auto d = parseDType(n);
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << n;
    EXPECT_NE(d.status().message().find("'" + std::string(n) + "'"), std::string::npos)
        << d.status().toString();
    EXPECT_NE(d.status().message().find("E5M2 is not supported"), std::string::npos)
        << d.status().toString();
  }
}

}  // namespace
}  // namespace hxfer
