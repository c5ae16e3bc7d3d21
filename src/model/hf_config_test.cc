#include "model/hf_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/presets.h"

namespace hxfer {
namespace {

using Json = nlohmann::json;

// The preset's config.json as a mutable JSON object (for variants of a real-format file).
Json presetJson(std::string_view name) {
  auto text = presetConfigJson(name);
  EXPECT_TRUE(text.isOk()) << text.status().toString();
  return Json::parse(*text);
}

StatusOr<ModelSpec> importJson(const Json& j, std::string_view name = "variant") {
  return modelFromHfConfig(j.dump(), name);
}

ModelSpec importOk(const Json& j) {
  auto m = importJson(j);
  EXPECT_TRUE(m.isOk()) << m.status().toString();
  return m.isOk() ? *m : ModelSpec{};
}

struct KindCounts {
  int attention = 0, mamba2 = 0, gdn = 0, mamba1 = 0, none = 0, parallel = 0;
};

KindCounts countKinds(const ModelSpec& m) {
  KindCounts c;
  for (const LayerSpec& l : m.layers) {
    if (l.hasAttention() && l.hasRecurrent()) ++c.parallel;
    if (l.hasAttention()) ++c.attention;
    if (l.recurrent == LayerKind::kMamba2) ++c.mamba2;
    if (l.recurrent == LayerKind::kGdn) ++c.gdn;
    if (l.recurrent == LayerKind::kMamba1) ++c.mamba1;
    if (!l.hasCache()) ++c.none;
  }
  return c;
}

// ---- every importer on a real-format config.json (the shipped presets) ----------------------

TEST(HfConfig, NemotronH8BPatternGivesMamba2AttentionAndCachelessLayers) {
  ModelSpec m = importOk(presetJson("nemotron-h-8b"));
  EXPECT_EQ(m.architecture, "NemotronHForCausalLM");
  ASSERT_EQ(m.numLayers(), 52u);
  KindCounts c = countKinds(m);
  EXPECT_EQ(c.mamba2, 24);
  EXPECT_EQ(c.attention, 4);
  EXPECT_EQ(c.none, 24);
  // "M-M-M-M*...": layer 0 mamba2, layer 1 MLP, layer 7 the first attention layer.
  EXPECT_EQ(m.layers[0].recurrent, LayerKind::kMamba2);
  EXPECT_EQ(m.layers[0].mamba2, (Mamba2Shape{128, 64, 8, 128, 4}));
  EXPECT_FALSE(m.layers[1].hasCache());
  ASSERT_TRUE(m.layers[7].hasAttention());
  // The published file gives attention_head_dim (no head_dim).
  EXPECT_EQ(*m.layers[7].attention, (AttentionShape{8, 128}));
  EXPECT_EQ(m.kv_dtype, DType::kBf16);
  EXPECT_EQ(m.conv_dtype, DType::kBf16);
  EXPECT_EQ(m.ssm_dtype, DType::kFp32);
}

TEST(HfConfig, Mamba2EveryLayerIsMamba2) {
  ModelSpec m = importOk(presetJson("mamba-codestral-7b"));
  EXPECT_EQ(m.architecture, "Mamba2ForCausalLM");
  ASSERT_EQ(m.numLayers(), 64u);
  EXPECT_EQ(countKinds(m).mamba2, 64);
  EXPECT_EQ(countKinds(m).attention, 0);
  EXPECT_EQ(m.layers[63].mamba2, (Mamba2Shape{128, 64, 8, 128, 4}));
}

TEST(HfConfig, Qwen3NextFullAttentionIntervalPlacesAttentionEveryFourthLayer) {
  ModelSpec m = importOk(presetJson("qwen3-next-80b-a3b"));
  EXPECT_EQ(m.architecture, "Qwen3NextForCausalLM");
  ASSERT_EQ(m.numLayers(), 48u);
  for (uint32_t i = 0; i < 48; ++i) {
    if ((i + 1) % 4 == 0) {
      ASSERT_TRUE(m.layers[i].hasAttention()) << i;
      EXPECT_FALSE(m.layers[i].hasRecurrent()) << i;
      EXPECT_EQ(*m.layers[i].attention, (AttentionShape{2, 256})) << i;
    } else {
      ASSERT_EQ(m.layers[i].recurrent, LayerKind::kGdn) << i;
      EXPECT_EQ(m.layers[i].gdn, (GdnShape{16, 32, 128, 128, 4})) << i;
    }
  }
}

TEST(HfConfig, Qwen3NextLayerTypesListMatchesTheIntervalForm) {
  Json j = presetJson("qwen3-next-80b-a3b");
  const ModelSpec by_interval = importOk(j);
  Json types = Json::array();
  for (int i = 0; i < 48; ++i)
    types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  j["layer_types"] = types;
  j["full_attention_interval"] = 7;  // layer_types wins, as in Hugging Face
  EXPECT_EQ(importOk(j).layers, by_interval.layers);
}

TEST(HfConfig, GraniteMoeHybridLayerTypesGiveMamba2AndAttention) {
  ModelSpec m = importOk(presetJson("granite-4.0-h-tiny"));
  EXPECT_EQ(m.architecture, "GraniteMoeHybridForCausalLM");
  ASSERT_EQ(m.numLayers(), 40u);
  KindCounts c = countKinds(m);
  EXPECT_EQ(c.attention, 4);
  EXPECT_EQ(c.mamba2, 36);
  for (uint32_t i : {5u, 15u, 25u, 35u}) {
    ASSERT_TRUE(m.layers[i].hasAttention()) << i;
    // No head_dim field: hidden_size 1536 / 12 heads.
    EXPECT_EQ(*m.layers[i].attention, (AttentionShape{4, 128})) << i;
  }
  EXPECT_EQ(m.layers[0].mamba2, (Mamba2Shape{48, 64, 1, 128, 4}));
}

TEST(HfConfig, GraniteAutoHeadDimIsExpandTimesHiddenOverHeads) {
  Json j = presetJson("granite-4.0-h-tiny");
  j["mamba_d_head"] = "auto";
  EXPECT_EQ(importOk(j).layers[0].mamba2.head_dim, 2u * 1536 / 48);
  j.erase("mamba_d_head");
  EXPECT_EQ(importOk(j).layers[0].mamba2.head_dim, 64u);
}

TEST(HfConfig, GraniteWithoutLayerTypesIsAllMamba) {
  Json j = presetJson("granite-4.0-h-tiny");
  j.erase("layer_types");
  ModelSpec m = importOk(j);
  EXPECT_EQ(countKinds(m).mamba2, 40);
  EXPECT_EQ(countKinds(m).attention, 0);
}

TEST(HfConfig, JambaAttentionPeriodAndOffsetWithMamba1Elsewhere) {
  ModelSpec m = importOk(presetJson("jamba-v0.1"));
  EXPECT_EQ(m.architecture, "JambaForCausalLM");
  ASSERT_EQ(m.numLayers(), 32u);
  for (uint32_t i = 0; i < 32; ++i) {
    if (i % 8 == 4) {
      ASSERT_TRUE(m.layers[i].hasAttention()) << i;
      EXPECT_EQ(*m.layers[i].attention, (AttentionShape{8, 4096 / 32})) << i;
    } else {
      ASSERT_EQ(m.layers[i].recurrent, LayerKind::kMamba1) << i;
      // d_inner = mamba_expand * hidden_size.
      EXPECT_EQ(m.layers[i].mamba1, (Mamba1Shape{2 * 4096, 16, 4})) << i;
    }
  }
}

TEST(HfConfig, JambaOffsetNotBelowPeriodIsRefused) {
  Json j = presetJson("jamba-v0.1");
  j["attn_layer_offset"] = 8;
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("attn_layer_offset"), std::string::npos);
  EXPECT_NE(m.status().message().find("attn_layer_period=8"), std::string::npos);
}

TEST(HfConfig, FalconH1EveryLayerHoldsAttentionAndMamba2InParallel) {
  ModelSpec m = importOk(presetJson("falcon-h1-7b"));
  EXPECT_EQ(m.architecture, "FalconH1ForCausalLM");
  ASSERT_EQ(m.numLayers(), 44u);
  EXPECT_EQ(countKinds(m).parallel, 44);
  EXPECT_EQ(m.layers[0].kindName(), "attention+mamba2");
  EXPECT_EQ(*m.layers[10].attention, (AttentionShape{2, 128}));
  EXPECT_EQ(m.layers[10].mamba2, (Mamba2Shape{24, 128, 1, 256, 4}));
}

TEST(HfConfig, FalconH1AutoHeadDimUsesDSsmThenExpandTimesHidden) {
  Json j = presetJson("falcon-h1-7b");
  j["mamba_d_head"] = "auto";
  j["mamba_d_ssm"] = 1536;
  EXPECT_EQ(importOk(j).layers[0].mamba2.head_dim, 1536u / 24);
  j["mamba_d_ssm"] = nullptr;  // Hugging Face: null means mamba_expand * hidden_size
  EXPECT_EQ(importOk(j).layers[0].mamba2.head_dim, 2u * 3072 / 24);
  j["hidden_size"] = 1000;  // 2000 is not a multiple of 24: the error names where 2000 came from
  auto bad = importJson(j);
  ASSERT_FALSE(bad.isOk());
  EXPECT_NE(bad.status().message().find("does not divide mamba_expand*hidden_size=2000"),
            std::string::npos)
      << bad.status().toString();
  // Not written at all: FalconH1Config's default, 1024 (not mamba_expand * hidden_size).
  j.erase("mamba_d_ssm");
  j["mamba_n_heads"] = 16;
  EXPECT_EQ(importOk(j).layers[0].mamba2.head_dim, 1024u / 16);
}

// Shape fields far above any model's would make byte counts wrap 64 bits, and a huge layer
// count a vector of that many layers: both refused, naming the field.
TEST(HfConfig, HugeShapesAndLayerCountsAreRefusedNamingTheField) {
  Json j = presetJson("mamba-codestral-7b");
  j["head_dim"] = 2147483648u;
  auto big = importJson(j);
  ASSERT_FALSE(big.isOk());
  EXPECT_NE(
      big.status().message().find("field 'head_dim' must be a positive integer up to 1048576"),
      std::string::npos)
      << big.status().toString();
  j = presetJson("mamba-codestral-7b");
  j["num_hidden_layers"] = 4000000000u;
  EXPECT_NE(importJson(j).status().message().find("'num_hidden_layers'"), std::string::npos);
  j["num_hidden_layers"] = 70000;
  auto layers = importJson(j);
  ASSERT_FALSE(layers.isOk());
  EXPECT_NE(layers.status().message().find("must be at most 65536, got 70000"), std::string::npos)
      << layers.status().toString();
  // Fields each within bounds whose product is not: the record is refused, not wrapped.
  j = presetJson("mamba-codestral-7b");
  j["head_dim"] = 1048576;
  j["state_size"] = 1048576;
  auto wide = importJson(j);
  ASSERT_FALSE(wide.isOk());
  EXPECT_NE(wide.status().message().find("ssm record is above 1099511627776 bytes"),
            std::string::npos)
      << wide.status().toString();
}

TEST(HfConfig, TinyHybridHasEveryKindOfLayer) {
  ModelSpec m = importOk(presetJson("tiny-hybrid"));
  ASSERT_EQ(m.numLayers(), 8u);
  KindCounts c = countKinds(m);
  EXPECT_EQ(c.mamba2, 4);
  EXPECT_EQ(c.attention, 2);
  EXPECT_EQ(c.none, 2);
}

// ---- field spellings and defaults --------------------------------------------------------------

TEST(HfConfig, NemotronHLayersBlockTypeListEqualsThePattern) {
  Json j = presetJson("tiny-hybrid");
  const ModelSpec from_pattern = importOk(j);
  j.erase("hybrid_override_pattern");
  j["layers_block_type"] = {"mamba", "mlp", "mamba", "attention",
                            "mamba", "moe", "mamba", "attention"};
  EXPECT_EQ(importOk(j).layers, from_pattern.layers);
}

TEST(HfConfig, NemotronHLegacyMambaFieldNamesAreAccepted) {
  Json j = presetJson("tiny-hybrid");
  j["mamba_n_groups"] = j["n_groups"];
  j["mamba_d_conv"] = j["conv_kernel"];
  j.erase("n_groups");
  j.erase("conv_kernel");
  EXPECT_EQ(importOk(j).layers[0].mamba2, (Mamba2Shape{8, 4, 2, 8, 4}));
}

TEST(HfConfig, AttentionHeadDimFromHeadDimThenAttentionHeadDimThenHiddenOverHeads) {
  Json j = presetJson("tiny-hybrid");  // attention at layer 3
  j["head_dim"] = 16;
  j["attention_head_dim"] = 12;
  EXPECT_EQ(importOk(j).layers[3].attention->head_dim, 16u);
  j.erase("head_dim");
  EXPECT_EQ(importOk(j).layers[3].attention->head_dim, 12u);
  j.erase("attention_head_dim");
  EXPECT_EQ(importOk(j).layers[3].attention->head_dim, 32u / 4);  // hidden_size / heads
}

TEST(HfConfig, HiddenSizeNotDivisibleByHeadsNamesBothFields) {
  Json j = presetJson("tiny-hybrid");
  j.erase("head_dim");
  j["num_attention_heads"] = 5;
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().message(),
            "NemotronHForCausalLM: num_attention_heads=5 does not divide hidden_size=32");
}

TEST(HfConfig, MissingKvHeadsMeansMultiHeadAttention) {
  Json j = presetJson("tiny-hybrid");
  j.erase("num_key_value_heads");
  j["num_attention_heads"] = 2;
  EXPECT_EQ(importOk(j).layers[3].attention->n_kv_heads, 2u);
}

TEST(HfConfig, KvAndConvDtypesFollowTorchDtypeAndSsmStaysFp32) {
  Json j = presetJson("tiny-hybrid");
  j["torch_dtype"] = "float16";
  ModelSpec m = importOk(j);
  EXPECT_EQ(m.kv_dtype, DType::kFp16);
  EXPECT_EQ(m.conv_dtype, DType::kFp16);
  EXPECT_EQ(m.ssm_dtype, DType::kFp32);
  j.erase("torch_dtype");
  EXPECT_EQ(importOk(j).kv_dtype, DType::kBf16);
  j["dtype"] = "float32";  // the newer spelling
  EXPECT_EQ(importOk(j).conv_dtype, DType::kFp32);
}

TEST(HfConfig, UnknownTorchDtypeNamesTheField) {
  Json j = presetJson("tiny-hybrid");
  j["torch_dtype"] = "int4";
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("NemotronHForCausalLM: field 'torch_dtype'"),
            std::string::npos);
  EXPECT_NE(m.status().message().find("int4"), std::string::npos);
}

TEST(HfConfig, ModelTypeIdentifiesTheArchitectureWhenArchitecturesIsAbsent) {
  Json j = presetJson("jamba-v0.1");
  j.erase("architectures");
  EXPECT_EQ(importOk(j).architecture, "JambaForCausalLM");
}

TEST(HfConfig, NameAndDefaultsAreSet) {
  auto m = modelFromHfConfig(*presetConfigJson("tiny-hybrid"), "my-model");
  ASSERT_TRUE(m.isOk());
  EXPECT_EQ(m->name, "my-model");
  EXPECT_EQ(m->tokens_per_block, 32u);
}

// ---- errors name the architecture and the field -----------------------------------------------

struct MissingCase {
  const char* preset;
  const char* field;
  const char* message;
};

class HfConfigMissingField : public testing::TestWithParam<MissingCase> {};

TEST_P(HfConfigMissingField, NamesArchitectureAndField) {
  Json j = presetJson(GetParam().preset);
  ASSERT_TRUE(j.contains(GetParam().field));
  j.erase(GetParam().field);
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.status().message(), GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    EveryImporter, HfConfigMissingField,
    testing::Values(
        MissingCase{"nemotron-h-8b", "ssm_state_size",
                    "NemotronHForCausalLM: missing field 'ssm_state_size'"},
        MissingCase{"nemotron-h-8b", "hybrid_override_pattern",
                    "NemotronHForCausalLM: missing field 'hybrid_override_pattern'"},
        MissingCase{"nemotron-h-8b", "n_groups", "NemotronHForCausalLM: missing field 'n_groups'"},
        MissingCase{"mamba-codestral-7b", "state_size",
                    "Mamba2ForCausalLM: missing field 'state_size'"},
        MissingCase{"qwen3-next-80b-a3b", "linear_num_value_heads",
                    "Qwen3NextForCausalLM: missing field 'linear_num_value_heads'"},
        MissingCase{"qwen3-next-80b-a3b", "full_attention_interval",
                    "Qwen3NextForCausalLM: missing field 'full_attention_interval'"},
        MissingCase{"granite-4.0-h-tiny", "mamba_d_state",
                    "GraniteMoeHybridForCausalLM: missing field 'mamba_d_state'"},
        MissingCase{"jamba-v0.1", "mamba_d_conv", "JambaForCausalLM: missing field 'mamba_d_conv'"},
        MissingCase{"jamba-v0.1", "attn_layer_offset",
                    "JambaForCausalLM: missing field 'attn_layer_offset'"},
        MissingCase{"falcon-h1-7b", "mamba_n_heads",
                    "FalconH1ForCausalLM: missing field 'mamba_n_heads'"}),
    [](const testing::TestParamInfo<MissingCase>& info) {
      std::string s = std::string(info.param.preset) + "_" + info.param.field;
      for (char& c : s) {
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return s;
    });

TEST(HfConfig, WrongTypedFieldNamesFieldAndValue) {
  Json j = presetJson("nemotron-h-8b");
  j["ssm_state_size"] = "128";
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().message(),
            "NemotronHForCausalLM: field 'ssm_state_size' must be a positive integer, got \"128\"");
}

TEST(HfConfig, ZeroAndNegativeSizesAreRefused) {
  for (int v : {0, -4}) {
    Json j = presetJson("qwen3-next-80b-a3b");
    j["linear_key_head_dim"] = v;
    auto m = importJson(j);
    ASSERT_FALSE(m.isOk()) << v;
    EXPECT_NE(m.status().message().find("field 'linear_key_head_dim'"), std::string::npos);
  }
}

TEST(HfConfig, ConvKernelOfOneIsRefusedByValidation) {
  Json j = presetJson("tiny-hybrid");
  j["conv_kernel"] = 1;
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("d_conv=1"), std::string::npos);
  EXPECT_EQ(m.status().message().rfind("NemotronHForCausalLM", 0), 0u);
}

TEST(HfConfig, PatternLengthMustMatchNumHiddenLayers) {
  Json j = presetJson("tiny-hybrid");
  j["num_hidden_layers"] = 10;
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().message(),
            "NemotronHForCausalLM: hybrid_override_pattern has 8 layers but "
            "num_hidden_layers=10");
}

TEST(HfConfig, UnknownPatternCharacterIsNamedWithItsPosition) {
  Json j = presetJson("tiny-hybrid");
  j["hybrid_override_pattern"] = "M-M*X-M*";
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("hybrid_override_pattern[4]='X'"), std::string::npos);
}

TEST(HfConfig, UnknownArchitectureIsNamed) {
  Json j = presetJson("tiny-hybrid");
  j["architectures"] = {"GPT2LMHeadModel"};
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.status().message().rfind("GPT2LMHeadModel: unsupported architecture", 0), 0u);
  EXPECT_NE(m.status().message().find("NemotronHForCausalLM"), std::string::npos);
}

TEST(HfConfig, MissingArchitectureAndModelTypeIsNamed) {
  auto m = modelFromHfConfig(R"({"num_hidden_layers": 4})", "x");
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("missing field 'architectures'"), std::string::npos);
}

TEST(HfConfig, MalformedJsonIsInvalidArgumentNotACrash) {
  for (std::string_view text : {"", "{", "[1, 2]", "{\"architectures\": 3}", "null"}) {
    auto m = modelFromHfConfig(text, "bad");
    ASSERT_FALSE(m.isOk()) << text;
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << text;
  }
}

TEST(HfConfig, SupportedArchitecturesListsAllSeven) {
  EXPECT_EQ(
      supportedArchitectures(),
      (std::vector<std::string>{"NemotronHForCausalLM", "Mamba2ForCausalLM", "Qwen3NextForCausalLM",
                                "GraniteMoeHybridForCausalLM", "JambaForCausalLM",
                                "FalconH1ForCausalLM", "LlamaForCausalLM"}));
}

// transformers 5 writes GraniteMoeHybrid's layer_types as Qwen3-Next does (the vLLM test
// fixtures are saved that way): the same layers as the older mamba / attention names.
TEST(HfConfig, GraniteLayerTypesInTransformers5NamesAreTheOlderNames) {
  Json j = presetJson("granite-4.0-h-tiny");
  ModelSpec old_names = importOk(j);
  std::vector<std::string> types;
  for (const auto& t : j["layer_types"]) {
    types.push_back(t == "attention" ? "full_attention" : "linear_attention");
  }
  j["layer_types"] = types;
  EXPECT_EQ(importOk(j).layers, old_names.layers);
  j["layer_types"][0] = "sliding_attention";
  auto m = importJson(j);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("layer_types[0]='sliding_attention'"), std::string::npos);
}

TEST(HfConfig, LlamaIsEveryLayerAttentionWithoutState) {
  Json j = {{"architectures", {"LlamaForCausalLM"}},
            {"num_hidden_layers", 2},
            {"hidden_size", 128},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", 32},
            {"torch_dtype", "float32"}};
  ModelSpec m = importOk(j);
  ASSERT_EQ(m.numLayers(), 2u);
  for (const LayerSpec& l : m.layers) {
    ASSERT_TRUE(l.hasAttention());
    EXPECT_EQ(*l.attention, (AttentionShape{2, 32}));
    EXPECT_EQ(l.recurrent, LayerKind::kNone);
  }
  j.erase("head_dim");  // hidden_size / num_attention_heads
  EXPECT_EQ(*importOk(j).layers[0].attention, (AttentionShape{2, 32}));
}

}  // namespace
}  // namespace hxfer
