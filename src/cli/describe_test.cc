// Runs the built `hxfer` binary: `describe` and `models` end to end, output parsed as JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_test_util.h"
#include "wire/codec.h"

namespace {

using Json = nlohmann::json;

using hxfer::cli::testing::CmdResult;
using hxfer::cli::testing::runHxfer;
using hxfer::cli::testing::Stderr;

Json describeJson(const std::string& args) {
  CmdResult r = runHxfer("describe --json " + args);
  EXPECT_EQ(r.exit_code, 0) << args;
  Json j = Json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

// One version everywhere: the CMake project's, which hxfer.__version__ and libhxfer.so's SONAME
// carry too (python/tests/test_package.py, api_exports).
TEST(CliVersion, VersionIsTheProjectsAndNamesTheWire) {
  CmdResult r = runHxfer("--version");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, std::string("hxfer ") + HXFER_VERSION + " (wire 1." +
                       std::to_string(hxfer::wire::kWireVersionMinor) + ")\n");
}

// A command line CLI11 refuses while parsing reads as every other bad input: one line,
// `hxfer: InvalidArgument: ...`, exit 2 (it printed CLI11's own text and exited 104-109).
TEST(CliParse, ParseErrorsAreOneHxferLineWithExitCodeTwo) {
  for (const char* args : {"models --nope", "serve", "describe --tp 0", "describe --tp x",
                           "--log-level loud models", "nosuchcommand"}) {
    CmdResult r = runHxfer(args, Stderr::kMerge);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.out;
    EXPECT_EQ(r.out.rfind("hxfer: InvalidArgument: ", 0), 0u) << args << ": " << r.out;
    EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << args << ": " << r.out;
  }
  EXPECT_NE(runHxfer("serve", Stderr::kMerge).out.find("--role is required"), std::string::npos);
  EXPECT_EQ(runHxfer("models --help").exit_code, 0);
}

TEST(CliDescribe, TinyHybridAtTp2JsonHasHandComputedBytesPerRank) {
  Json j = describeJson("--model tiny-hybrid --tp 2");
  ASSERT_TRUE(j.contains("ranks"));
  ASSERT_EQ(j["ranks"].size(), 2u);
  EXPECT_EQ(j["kv_dtype"], "bf16");
  EXPECT_EQ(j["ssm_dtype"], "fp32");
  for (uint32_t r = 0; r < 2; ++r) {
    const Json& rank = j["ranks"][r];
    EXPECT_EQ(rank["tp_rank"], r);
    EXPECT_EQ(rank["pp_rank"], 0);
    // 2 attention layers x K,V x 2 of 4 kv heads x head_dim 8 x 2 bytes.
    EXPECT_EQ(rank["kv_bytes_per_token"], 2 * 2 * 2 * 8 * 2);
    // 4 mamba2 layers x (conv (4 of 8 heads x 4 + 2 x 1 of 2 groups x 8) x 3 x 2 bytes
    //                    + ssm 4 heads x 4 x 8 x 4 bytes).
    EXPECT_EQ(rank["state_bytes_per_request"], 4 * ((4 * 4 + 2 * 1 * 8) * 3 * 2 + 4 * 4 * 8 * 4));
    ASSERT_EQ(rank["layers"].size(), 8u);

    const Json& l0 = rank["layers"][0];
    EXPECT_EQ(l0["id"], 0);
    EXPECT_EQ(l0["kind"], "mamba2");
    ASSERT_EQ(l0["records"].size(), 2u);
    const Json& conv = l0["records"][0];
    EXPECT_EQ(conv["role"], "conv");
    EXPECT_EQ(conv["bytes"], (4 * 4 + 2 * 8) * 3 * 2);
    ASSERT_EQ(conv["sections"].size(), 3u);
    EXPECT_EQ(conv["sections"][0]["name"], "x");
    EXPECT_EQ(conv["sections"][0]["units"], 8);
    EXPECT_EQ(conv["sections"][0]["unit_bytes"], 4 * 3 * 2);
    EXPECT_EQ(conv["sections"][0]["first_unit"], 4 * r);
    EXPECT_EQ(conv["sections"][1]["name"], "B");
    EXPECT_EQ(conv["sections"][1]["units"], 2);
    EXPECT_EQ(conv["sections"][1]["unit_bytes"], 8 * 3 * 2);
    EXPECT_EQ(conv["sections"][2]["name"], "C");
    EXPECT_EQ(l0["records"][1]["role"], "ssm");
    EXPECT_EQ(l0["records"][1]["bytes"], 4 * 4 * 8 * 4);

    EXPECT_EQ(rank["layers"][1]["kind"], "none");
    EXPECT_TRUE(rank["layers"][1]["records"].empty());

    const Json& l3 = rank["layers"][3];
    EXPECT_EQ(l3["kind"], "attention");
    ASSERT_EQ(l3["records"].size(), 1u);
    EXPECT_EQ(l3["records"][0]["role"], "kv");
    EXPECT_EQ(l3["records"][0]["bytes"], 2 * 2 * 32 * 8 * 2);
    EXPECT_EQ(l3["records"][0]["sections"][1]["name"], "V");
    EXPECT_FALSE(rank.contains("pools"));
  }
}

TEST(CliDescribe, PipelineStagesSplitTheLayers) {
  Json j = describeJson("--model tiny-hybrid --tp 2 --pp 4");
  ASSERT_EQ(j["ranks"].size(), 8u);
  const Json& last = j["ranks"][7];
  EXPECT_EQ(last["pp_rank"], 3);
  EXPECT_EQ(last["tp_rank"], 1);
  ASSERT_EQ(last["layers"].size(), 2u);
  EXPECT_EQ(last["layers"][0]["id"], 6);
  EXPECT_EQ(last["layers"][1]["id"], 7);
  // Stage 0 holds layers 0 (mamba2) and 1 (no cache): no kv at all.
  EXPECT_EQ(j["ranks"][0]["kv_bytes_per_token"], 0);
}

TEST(CliDescribe, LayoutAddsPoolsMatchingTheRecords) {
  Json j = describeJson("--model tiny-hybrid --tp 2 --layout paged --blocks 10 --slots 3");
  EXPECT_EQ(j["state_layout"], "paged");
  for (const Json& rank : j["ranks"]) {
    ASSERT_TRUE(rank.contains("pools"));
    const Json& pools = rank["pools"];
    ASSERT_EQ(pools.size(), 3u);  // kv, conv, ssm (conv and ssm records differ in size)
    EXPECT_EQ(pools[0]["role"], "kv");
    EXPECT_EQ(pools[0]["layers"], Json::array({3, 7}));
    EXPECT_EQ(pools[0]["record_bytes"], 2 * 2 * 32 * 8 * 2);
    EXPECT_EQ(pools[0]["index_stride"], 2 * (2 * 2 * 32 * 8 * 2));
    EXPECT_EQ(pools[0]["region_bytes"], 10 * 2 * (2 * 2 * 32 * 8 * 2));
    EXPECT_EQ(pools[1]["role"], "conv");
    EXPECT_EQ(pools[1]["record_bytes"], (4 * 4 + 2 * 8) * 3 * 2);
    EXPECT_EQ(pools[1]["layers"], Json::array({0, 2, 4, 6}));
    EXPECT_EQ(pools[2]["role"], "ssm");
    EXPECT_EQ(pools[2]["num_indices"], 3);
  }
  Json lm = describeJson("--model tiny-hybrid --layout layer-major --slots 3");
  const Json& conv = lm["ranks"][0]["pools"][1];
  EXPECT_EQ(conv["index_stride"], conv["record_bytes"]);
  EXPECT_EQ(conv["layer_stride"], 3 * conv["record_bytes"].get<uint64_t>());
}

// kv bytes per token and state bytes per request of one rank, by hand from the published
// shapes (bf16 KV and conv, fp32 SSM).
struct RankBytes {
  const char* preset;
  uint32_t tp;
  uint64_t kv_per_token, state_per_request;
};

const RankBytes kRankBytes[] = {
    // 4 attention layers (8 kv heads x 128) and 24 mamba2 layers (H=128 P=64 G=8 N=128 k=4).
    {"nemotron-h-8b", 1, 4 * 2 * 8 * 128 * 2,
     24 * ((128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)},
    {"nemotron-h-8b", 2, 4 * 2 * 4 * 128 * 2,
     24 * ((64 * 64 + 2 * 4 * 128) * 3 * 2 + 64 * 64 * 128 * 4)},
    {"nemotron-h-8b", 4, 4 * 2 * 2 * 128 * 2,
     24 * ((32 * 64 + 2 * 2 * 128) * 3 * 2 + 32 * 64 * 128 * 4)},
    // 12 attention layers (2 kv heads x 256), 36 gdn (Hk=16 Hv=32 Dk=Dv=128 k=4).
    {"qwen3-next-80b-a3b", 1, 12 * 2 * 2 * 256 * 2,
     36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)},
    {"qwen3-next-80b-a3b", 2, 12 * 2 * 1 * 256 * 2,
     36 * ((2 * 8 * 128 + 16 * 128) * 3 * 2 + 16 * 128 * 128 * 4)},
    {"qwen3-next-80b-a3b", 4, 12 * 2 * 1 * 256 * 2,
     36 * ((2 * 4 * 128 + 8 * 128) * 3 * 2 + 8 * 128 * 128 * 4)},
    // 4 attention layers (4 kv heads x 128), 36 mamba2 (H=48 P=64 G=1 N=128 k=4).
    {"granite-4.0-h-tiny", 1, 4 * 2 * 4 * 128 * 2,
     36 * ((48 * 64 + 2 * 128) * 3 * 2 + 48 * 64 * 128 * 4)},
    {"granite-4.0-h-tiny", 2, 4 * 2 * 2 * 128 * 2,
     36 * ((24 * 64 + 2 * 128) * 3 * 2 + 24 * 64 * 128 * 4)},
    {"granite-4.0-h-tiny", 4, 4 * 2 * 1 * 128 * 2,
     36 * ((12 * 64 + 2 * 128) * 3 * 2 + 12 * 64 * 128 * 4)},
    // 4 attention layers (8 kv heads x 128), 28 mamba1 (d_inner=8192 N=16 k=4).
    {"jamba-v0.1", 1, 4 * 2 * 8 * 128 * 2, 28 * (8192 * 3 * 2 + 8192 * 16 * 4)},
    {"jamba-v0.1", 2, 4 * 2 * 4 * 128 * 2, 28 * (4096 * 3 * 2 + 4096 * 16 * 4)},
    {"jamba-v0.1", 4, 4 * 2 * 2 * 128 * 2, 28 * (2048 * 3 * 2 + 2048 * 16 * 4)},
    // 44 layers, each attention (2 kv heads x 128) + mamba2 (H=24 P=128 G=1 N=256 k=4).
    {"falcon-h1-7b", 1, 44 * 2 * 2 * 128 * 2,
     44ull * ((24 * 128 + 2 * 256) * 3 * 2 + 24 * 128 * 256 * 4)},
    {"falcon-h1-7b", 2, 44 * 2 * 1 * 128 * 2,
     44ull * ((12 * 128 + 2 * 256) * 3 * 2 + 12 * 128 * 256 * 4)},
    {"falcon-h1-7b", 4, 44 * 2 * 1 * 128 * 2,
     44ull * ((6 * 128 + 2 * 256) * 3 * 2 + 6 * 128 * 256 * 4)},
    // 64 mamba2 layers (H=128 P=64 G=8 N=128 k=4).
    {"mamba-codestral-7b", 1, 0, 64ull * ((128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4)},
    {"mamba-codestral-7b", 2, 0, 64ull * ((64 * 64 + 2 * 4 * 128) * 3 * 2 + 64 * 64 * 128 * 4)},
    {"mamba-codestral-7b", 4, 0, 64ull * ((32 * 64 + 2 * 2 * 128) * 3 * 2 + 32 * 64 * 128 * 4)},
    // 2 attention layers (4 kv heads x 8), 4 mamba2 (H=8 P=4 G=2 N=8 k=4).
    {"tiny-hybrid", 1, 2 * 2 * 4 * 8 * 2, 4 * ((8 * 4 + 2 * 2 * 8) * 3 * 2 + 8 * 4 * 8 * 4)},
    {"tiny-hybrid", 4, 2 * 2 * 1 * 8 * 2, 4 * ((2 * 4 + 2 * 1 * 8) * 3 * 2 + 2 * 4 * 8 * 4)},
};

// --engine sglang: per attention layer a k.<id> and a v.<id> pool, token-major rows; a page is
// tokens_per_block rows. tiny-hybrid at tp 2: 2 local kv heads of dim 8, 32 tokens per block,
// fp16. The strides are those of a contiguous (token, head, dim) tensor, written out here.
TEST(CliDescribe, EngineListsEveryPoolWithItsRecordShapeAndStrides) {
  Json j = describeJson("--model tiny-hybrid --tp 2 --engine sglang --blocks 10 --slots 3");
  EXPECT_EQ(j["engine_layout"], "sglang");
  for (const Json& rank : j["ranks"]) {
    std::vector<std::string> names;
    for (const Json& pool : rank["pools"]) {
      names.push_back(pool["region"]);
      if (pool["role"] != "kv") continue;
      const Json& r = pool["record"];
      EXPECT_TRUE(r["described"].get<bool>());
      EXPECT_EQ(r["element_bytes"], 2);
      EXPECT_EQ(r["dims"], Json::parse(R"([{"name":"token","size":32,"stride":32},
                                           {"name":"head","size":2,"stride":16},
                                           {"name":"dim","size":8,"stride":2}])"))
          << r.dump();
      EXPECT_EQ(r["span"], 32 * 2 * 8 * 2);
      EXPECT_EQ(pool["index_stride"], 32 * 2 * 8 * 2);  // the next block: the next 32 rows
      EXPECT_EQ(pool["record_bytes"], 32 * 2 * 8 * 2);
    }
    for (const char* want : {"k.3", "v.3", "k.7", "v.7"}) {
      EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
    }
  }
  // hxfer's own pools: undescribed, in hxfer's order [kv][head][token][dim].
  Json h = describeJson("--model tiny-hybrid --tp 2 --engine hxfer --blocks 10 --slots 3");
  const Json& kv = h["ranks"][0]["pools"][0];
  EXPECT_FALSE(kv["record"]["described"].get<bool>());
  EXPECT_EQ(kv["record"]["dims"][0]["name"], "kv");
  EXPECT_EQ(kv["record"]["dims"][3], Json::parse(R"({"name":"dim","size":8,"stride":2})"));
  CmdResult human = runHxfer("describe --model tiny-hybrid --engine vllm --kv-layout hnd");
  ASSERT_EQ(human.exit_code, 0) << human.out;
  EXPECT_NE(human.out.find("pools (vllm(kv=hnd,conv=sd)"), std::string::npos) << human.out;
  // vLLM 0.32's HND: head > token > kv > dim.
  EXPECT_NE(human.out.find("kv record: head 4 @"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find(", kv 2 @16, dim 8 @2"), std::string::npos) << human.out;
  for (const char* args :
       {"--engine sglang --layout layer-major", "--engine tgi", "--engine vllm --kv-layout xyz"}) {
    CmdResult r = runHxfer(std::string("describe ") + args, Stderr::kMerge);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << args << ": " << r.out;
  }
}

// vLLM's shared tensors: pools shared.<t>, each holding one layer of every KV cache group;
// state pools say which state id indexes them, and the rank how many ids a request has.
TEST(CliDescribe, VllmSharedTensorsListSharedPoolsWithTheirStateGroups) {
  Json j = describeJson("--model tiny-hybrid --engine vllm --shared-tensors on");
  ASSERT_EQ(j["ranks"].size(), 1u);
  const Json& rank = j["ranks"][0];
  EXPECT_EQ(j["engine_layout"], "vllm(kv=nhd,conv=sd,shared)");
  EXPECT_EQ(rank["state_groups"], 2);
  EXPECT_EQ(rank["joint_ids"], true);
  std::set<std::string> regions;
  std::set<int> groups;
  for (const Json& p : rank["pools"]) {
    regions.insert(p["region"].get<std::string>());
    if (p["role"] != "kv") groups.insert(p["state_group"].get<int>());
    EXPECT_EQ(p["num_indices"], 16) << p.dump();  // one pool of block ids
  }
  EXPECT_EQ(regions, (std::set<std::string>{"shared.0", "shared.1"}));
  EXPECT_EQ(groups, (std::set<int>{0, 1}));
  CmdResult human = runHxfer("describe --model tiny-hybrid --engine vllm --shared-tensors on");
  EXPECT_NE(human.out.find("states drawn from the blocks, state ids per request: 2"),
            std::string::npos)
      << human.out;
  CmdResult bad =
      runHxfer("describe --model tiny-hybrid --engine sglang --shared-tensors on", Stderr::kMerge);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("only vllm and vllm-0.25 take on|off"), std::string::npos) << bad.out;
}

TEST(CliDescribe, EveryPresetAtTp124PrintsHandComputedBytes) {
  for (const RankBytes& e : kRankBytes) {
    SCOPED_TRACE(std::string(e.preset) + " tp=" + std::to_string(e.tp));
    Json j = describeJson("--model " + std::string(e.preset) + " --tp " + std::to_string(e.tp));
    ASSERT_EQ(j["ranks"].size(), e.tp);
    for (const Json& rank : j["ranks"]) {
      EXPECT_EQ(rank["kv_bytes_per_token"].get<uint64_t>(), e.kv_per_token);
      EXPECT_EQ(rank["state_bytes_per_request"].get<uint64_t>(), e.state_per_request);
    }
  }
}

TEST(CliDescribe, DtypeOverridesChangeTheBytes) {
  Json j =
      describeJson("--model tiny-hybrid --kv-dtype fp8 --ssm-dtype bf16 --tokens-per-block 16");
  EXPECT_EQ(j["kv_dtype"], "fp8");
  EXPECT_EQ(j["tokens_per_block"], 16);
  const Json& rank = j["ranks"][0];
  EXPECT_EQ(rank["kv_bytes_per_token"], 2 * 2 * 4 * 8 * 1);
  EXPECT_EQ(rank["kv_bytes_per_block"], 16 * (2 * 2 * 4 * 8 * 1));
  EXPECT_EQ(rank["state_bytes_per_request"], 4 * ((8 * 4 + 2 * 2 * 8) * 3 * 2 + 8 * 4 * 8 * 2));
}

TEST(CliDescribe, IndivisibleTpExitsNonZeroWithOneLineNamingTpAndUnits) {
  CmdResult r = runHxfer("describe --model tiny-hybrid --tp 3", Stderr::kMerge);
  EXPECT_NE(r.exit_code, 0);
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;  // exactly one line
  EXPECT_NE(r.out.find("tp=3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("units=8"), std::string::npos) << r.out;
}

TEST(CliDescribe, BadInputExitsNonZeroWithOneLine) {
  for (const char* args : {"--pp 3", "--tp 0", "--kv-dtype int3", "--layout diagonal",
                           "--model no-such-preset", "--model /no/such/dir/config.json"}) {
    CmdResult r = runHxfer(std::string("describe ") + args, Stderr::kMerge);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(r.out.rfind("hxfer: ", 0), 0u) << args << ": " << r.out;
    EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << args << ": " << r.out;
  }
  CmdResult missing = runHxfer("describe --model /no/such/dir/config.json", Stderr::kMerge);
  EXPECT_NE(missing.out.find("'/no/such/dir/config.json'"), std::string::npos) << missing.out;
}

TEST(CliDescribe, ModelPathReadsAConfigJsonAndNamesTheModelAfterItsFolder) {
  const std::string dir = testing::TempDir() + "hxfer_describe_test_model";
  std::string mkdir = "mkdir -p '" + dir + "'";
  ASSERT_EQ(std::system(mkdir.c_str()), 0);
  {
    std::ofstream f(dir + "/config.json");
    f << R"({"architectures": ["Mamba2ForCausalLM"], "num_hidden_layers": 2, "num_heads": 4,
             "head_dim": 8, "n_groups": 1, "state_size": 16, "conv_kernel": 4,
             "torch_dtype": "float16"})";
  }
  Json j = describeJson("--model '" + dir + "/config.json' --tp 2");
  EXPECT_EQ(j["model"], "hxfer_describe_test_model");
  EXPECT_EQ(j["architecture"], "Mamba2ForCausalLM");
  EXPECT_EQ(j["conv_dtype"], "fp16");
  // 2 layers x (conv (2 of 4 heads x 8 + 2 x 1 replicated group x 16) x 3 x 2
  //             + ssm 2 heads x 8 x 16 x 4).
  EXPECT_EQ(j["ranks"][1]["state_bytes_per_request"],
            2 * ((2 * 8 + 2 * 16) * 3 * 2 + 2 * 8 * 16 * 4));
  // A folder holding a config.json works too.
  EXPECT_EQ(describeJson("--model '" + dir + "'")["model"], "hxfer_describe_test_model");
}

TEST(CliModels, ListsEveryPresetWithLayerCounts) {
  CmdResult r = runHxfer("models --json");
  ASSERT_EQ(r.exit_code, 0);
  Json j = Json::parse(r.out);
  EXPECT_EQ(j["default"], "tiny-hybrid");
  bool saw_nemotron = false;
  for (const Json& m : j["models"]) {
    if (m["name"] != "nemotron-h-8b") continue;
    saw_nemotron = true;
    EXPECT_EQ(m["architecture"], "NemotronHForCausalLM");
    EXPECT_EQ(m["layers"], 52);
    EXPECT_EQ(m["attention"], 4);
    EXPECT_EQ(m["mamba2"], 24);
    EXPECT_EQ(m["no_cache"], 24);
  }
  EXPECT_TRUE(saw_nemotron);
  EXPECT_GE(j["models"].size(), 7u);

  CmdResult human = runHxfer("models");
  ASSERT_EQ(human.exit_code, 0);
  EXPECT_NE(human.out.find("tiny-hybrid *"), std::string::npos);
  EXPECT_NE(human.out.find("JambaForCausalLM"), std::string::npos);
}

}  // namespace
