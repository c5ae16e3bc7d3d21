#include "model/presets.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace hxfer {
namespace {

TEST(Presets, EveryPresetLoadsAndValidates) {
  const std::vector<std::string> names = presetNames();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const char* n : {"tiny-hybrid", "nemotron-h-8b", "qwen3-next-80b-a3b", "granite-4.0-h-tiny",
                        "jamba-v0.1", "falcon-h1-7b", "mamba-codestral-7b"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  for (const std::string& n : names) {
    auto m = loadPreset(n);
    ASSERT_TRUE(m.isOk()) << n << ": " << m.status().toString();
    EXPECT_EQ(m->name, n);
    EXPECT_TRUE(m->validate().isOk()) << n;
    // Every preset splits evenly over 1, 2 and 4 pipeline stages.
    for (uint32_t pp : {1u, 2u, 4u}) {
      EXPECT_TRUE((ParallelConfig{1, pp, {}}).validate(m->numLayers()).isOk()) << n << " pp=" << pp;
    }
  }
}

TEST(Presets, DefaultPresetExists) {
  auto m = loadPreset(kDefaultPreset);
  ASSERT_TRUE(m.isOk()) << m.status().toString();
  EXPECT_EQ(m->architecture, "NemotronHForCausalLM");
}

TEST(Presets, ConfigJsonIsTheShippedFileVerbatim) {
  auto text = presetConfigJson("jamba-v0.1");
  ASSERT_TRUE(text.isOk());
  EXPECT_NE(text->find("\"architectures\": [\"JambaForCausalLM\"]"), std::string_view::npos);
  EXPECT_NE(text->find("\"attn_layer_period\": 8"), std::string_view::npos);
}

TEST(Presets, UnknownPresetIsNotFoundAndListsTheKnownOnes) {
  auto m = loadPreset("no-such-model");
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("'no-such-model'"), std::string::npos);
  EXPECT_NE(m.status().message().find("tiny-hybrid"), std::string::npos);
  EXPECT_NE(m.status().message().find("nemotron-h-8b"), std::string::npos);
}

// Record bytes per rank at tokens_per_block 32, bf16 KV and conv, fp32 SSM, computed by hand
// from the published shapes (conv as conv_dim*(k-1)*2, the way serving engines size it; KV as
// 2*local_kv_heads*T*head_dim*2; SSM as local_heads*head_dim*d_state*4). 0 = no such record.
struct Expected {
  const char* preset;
  uint32_t tp;
  uint64_t kv, conv, ssm;
};

constexpr uint64_t T = 32;

const Expected kExpected[] = {
    // Nemotron-H-8B: mamba2 H=128 P=64 G=8 N=128 k=4; attention 8 kv heads x 128.
    {"nemotron-h-8b", 1, 2 * 8 * T * 128 * 2, (128 * 64 + 2 * 8 * 128) * 3 * 2, 128 * 64 * 128 * 4},
    {"nemotron-h-8b", 2, 2 * 4 * T * 128 * 2, (64 * 64 + 2 * 4 * 128) * 3 * 2, 64 * 64 * 128 * 4},
    {"nemotron-h-8b", 4, 2 * 2 * T * 128 * 2, (32 * 64 + 2 * 2 * 128) * 3 * 2, 32 * 64 * 128 * 4},
    // Qwen3-Next-80B-A3B: gdn Hk=16 Hv=32 Dk=Dv=128 k=4; attention 2 kv heads x 256.
    {"qwen3-next-80b-a3b", 1, 2 * 2 * T * 256 * 2, (2 * 16 * 128 + 32 * 128) * 3 * 2,
     32 * 128 * 128 * 4},
    {"qwen3-next-80b-a3b", 2, 2 * 1 * T * 256 * 2, (2 * 8 * 128 + 16 * 128) * 3 * 2,
     16 * 128 * 128 * 4},
    // tp=4 > 2 kv heads: each rank holds one replicated head.
    {"qwen3-next-80b-a3b", 4, 2 * 1 * T * 256 * 2, (2 * 4 * 128 + 8 * 128) * 3 * 2,
     8 * 128 * 128 * 4},
    // Granite-4.0-H-Tiny: mamba2 H=48 P=64 G=1 N=128 k=4 (the one group is replicated at
    // tp>1); attention 4 kv heads x 128.
    {"granite-4.0-h-tiny", 1, 2 * 4 * T * 128 * 2, (48 * 64 + 2 * 1 * 128) * 3 * 2,
     48 * 64 * 128 * 4},
    {"granite-4.0-h-tiny", 2, 2 * 2 * T * 128 * 2, (24 * 64 + 2 * 1 * 128) * 3 * 2,
     24 * 64 * 128 * 4},
    {"granite-4.0-h-tiny", 4, 2 * 1 * T * 128 * 2, (12 * 64 + 2 * 1 * 128) * 3 * 2,
     12 * 64 * 128 * 4},
    // Jamba-v0.1: mamba1 d_inner=2*4096 N=16 k=4; attention 8 kv heads x 128.
    {"jamba-v0.1", 1, 2 * 8 * T * 128 * 2, 8192 * 3 * 2, 8192 * 16 * 4},
    {"jamba-v0.1", 2, 2 * 4 * T * 128 * 2, 4096 * 3 * 2, 4096 * 16 * 4},
    {"jamba-v0.1", 4, 2 * 2 * T * 128 * 2, 2048 * 3 * 2, 2048 * 16 * 4},
    // Falcon-H1-7B: every layer attention (2 kv heads x 128) + mamba2 H=24 P=128 G=1 N=256 k=4.
    {"falcon-h1-7b", 1, 2 * 2 * T * 128 * 2, (24 * 128 + 2 * 1 * 256) * 3 * 2, 24 * 128 * 256 * 4},
    {"falcon-h1-7b", 2, 2 * 1 * T * 128 * 2, (12 * 128 + 2 * 1 * 256) * 3 * 2, 12 * 128 * 256 * 4},
    {"falcon-h1-7b", 4, 2 * 1 * T * 128 * 2, (6 * 128 + 2 * 1 * 256) * 3 * 2, 6 * 128 * 256 * 4},
    // Mamba-Codestral-7B: mamba2 H=128 P=64 G=8 N=128 k=4, no attention.
    {"mamba-codestral-7b", 1, 0, (128 * 64 + 2 * 8 * 128) * 3 * 2, 128 * 64 * 128 * 4},
    {"mamba-codestral-7b", 4, 0, (32 * 64 + 2 * 2 * 128) * 3 * 2, 32 * 64 * 128 * 4},
    // tiny-hybrid: mamba2 H=8 P=4 G=2 N=8 k=4 (groups replicated at tp=4); attention 4 x 8.
    {"tiny-hybrid", 1, 2 * 4 * T * 8 * 2, (8 * 4 + 2 * 2 * 8) * 3 * 2, 8 * 4 * 8 * 4},
    {"tiny-hybrid", 2, 2 * 2 * T * 8 * 2, (4 * 4 + 2 * 1 * 8) * 3 * 2, 4 * 4 * 8 * 4},
    {"tiny-hybrid", 4, 2 * 1 * T * 8 * 2, (2 * 4 + 2 * 1 * 8) * 3 * 2, 2 * 4 * 8 * 4},
};

class PresetBytes : public testing::TestWithParam<Expected> {};

TEST_P(PresetBytes, EveryRankHoldsTheHandComputedRecordBytes) {
  const Expected& e = GetParam();
  auto m = loadPreset(e.preset);
  ASSERT_TRUE(m.isOk()) << m.status().toString();
  ASSERT_TRUE(checkShardable(*m, {e.tp, 1, {}}).isOk());
  bool saw_kv = false, saw_state = false;
  for (uint32_t rank = 0; rank < e.tp; ++rank) {
    for (uint32_t id = 0; id < m->numLayers(); ++id) {
      const LayerSpec& l = m->layers[id];
      for (Role role : layerRoles(l)) {
        auto bytes = localRecordBytes(recordSections(*m, l, role), e.tp, rank);
        ASSERT_TRUE(bytes.isOk()) << bytes.status().toString();
        const uint64_t want = role == Role::kKv ? e.kv : role == Role::kConv ? e.conv : e.ssm;
        EXPECT_EQ(*bytes, want) << e.preset << " tp=" << e.tp << " rank=" << rank << " layer=" << id
                                << " " << roleName(role);
        (role == Role::kKv ? saw_kv : saw_state) = true;
      }
    }
  }
  EXPECT_EQ(saw_kv, e.kv != 0);
  EXPECT_EQ(saw_state, e.conv != 0);
}

INSTANTIATE_TEST_SUITE_P(PublishedShapes, PresetBytes, testing::ValuesIn(kExpected),
                         [](const testing::TestParamInfo<Expected>& info) {
                           std::string s = std::string(info.param.preset) + "_tp" +
                                           std::to_string(info.param.tp);
                           for (char& c : s) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return s;
                         });

TEST(Presets, TinyHybridReplicatesItsGroupsAtTp4) {
  auto m = loadPreset("tiny-hybrid");
  ASSERT_TRUE(m.isOk());
  auto conv = recordSections(*m, m->layers[0], Role::kConv);
  ASSERT_EQ(conv.size(), 3u);
  ASSERT_EQ(conv[1].name, "B");
  ASSERT_EQ(conv[1].units, 2u);
  // Ranks 0 and 1 hold group 0, ranks 2 and 3 group 1.
  for (uint32_t rank = 0; rank < 4; ++rank) {
    auto r = shardUnits(conv[1].units, 4, rank, "B");
    ASSERT_TRUE(r.isOk());
    EXPECT_EQ(*r, (UnitRange{rank / 2, 1})) << rank;
  }
}

TEST(Presets, IndivisibleTpIsRefusedNamingTpAndUnits) {
  auto m = loadPreset("tiny-hybrid");
  ASSERT_TRUE(m.isOk());
  Status s = checkShardable(*m, {3, 1, {}});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("tp=3"), std::string::npos);
  EXPECT_NE(s.message().find("units="), std::string::npos);
}

TEST(Presets, TinyHybridStateRecordsStayTiny) {
  auto m = loadPreset(kDefaultPreset);
  ASSERT_TRUE(m.isOk());
  for (const LayerSpec& l : m->layers) {
    for (Role role : layerRoles(l)) {
      auto bytes = localRecordBytes(recordSections(*m, l, role), 1, 0);
      ASSERT_TRUE(bytes.isOk());
      EXPECT_LE(*bytes, 4096u);
    }
  }
}

}  // namespace
}  // namespace hxfer
