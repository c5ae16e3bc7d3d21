// Runs the built `hxfer` binary: `metadata` writes a rank's Hello frame, `inspect` reads it back
// (JSON parsed), and corrupt input makes `inspect` exit 1 with one line naming the problem.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_test_util.h"
#include "wire/codec.h"
#include "wire/messages.h"

namespace {

using Json = nlohmann::json;

using hxfer::cli::testing::CmdResult;
using hxfer::cli::testing::readAll;
using hxfer::cli::testing::runHxfer;
using hxfer::cli::testing::Stderr;

std::string tempFile(const std::string& name) {
  return hxfer::cli::testing::tempFile("hxfer_metadata", name);
}

void writeAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

Json inspectJson(const std::string& path) {
  CmdResult r = runHxfer("inspect --json " + path);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

int lineCount(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

TEST(CliMetadata, WritesAHelloThatInspectDecodesWithTheRanksLayout) {
  const std::string f = tempFile("tp2_r1.bin");
  CmdResult w = runHxfer(
      "metadata --model tiny-hybrid --tp 2 --rank 1 --layout layer-major --role "
      "generation --out " +
          f,
      Stderr::kMerge);
  ASSERT_EQ(w.exit_code, 0) << w.out;
  Json j = inspectJson(f);
  EXPECT_EQ(j["type"], "hello");
  EXPECT_EQ(j["frame_bytes"], readAll(f).size());
  const Json& info = j["rank_info"];
  EXPECT_EQ(info["rank"], 1);
  EXPECT_EQ(info["role"], "generation");
  EXPECT_EQ(info["layout"]["tp"], 2);
  EXPECT_EQ(info["layout"]["tp_rank"], 1);
  EXPECT_EQ(info["layout"]["state_layout"], "layer-major");
  EXPECT_EQ(info["layout"]["num_blocks"], 16);
  EXPECT_EQ(info["layout"]["num_slots"], 4);
  ASSERT_FALSE(info["layout"]["views"].empty());
  // Layer-major: a conv view strides over slots by exactly one record.
  bool saw_conv = false;
  for (const Json& v : info["layout"]["views"]) {
    if (v["role"] != "conv") continue;
    saw_conv = true;
    EXPECT_EQ(v["index_stride"], v["record_bytes"]);
  }
  EXPECT_TRUE(saw_conv);
  // The fingerprint is the model's, as `describe` reports it.
  CmdResult d = runHxfer("describe --json --model tiny-hybrid --tp 2");
  ASSERT_EQ(d.exit_code, 0);
  EXPECT_EQ(info["layout"]["model_fingerprint"], Json::parse(d.out)["fingerprint"]);
  std::remove(f.c_str());
}

TEST(CliMetadata, GlobalRankSplitsIntoTpAndPpRank) {
  const std::string f = tempFile("tp2_pp2_r3.bin");
  ASSERT_EQ(runHxfer("metadata --model tiny-hybrid --tp 2 --pp 2 --rank 3 --out " + f).exit_code,
            0);
  Json j = inspectJson(f);
  const Json& layout = j["rank_info"]["layout"];
  EXPECT_EQ(layout["tp_rank"], 1);
  EXPECT_EQ(layout["pp_rank"], 1);
  EXPECT_EQ(layout["layers_per_stage"], Json::array({4, 4}));
  for (const Json& v : layout["views"]) {
    for (const Json& id : v["layers"]) EXPECT_GE(id.get<int>(), 4);
  }
  std::remove(f.c_str());
}

TEST(CliMetadata, ModelOptionsReachTheLayout) {
  const std::string f = tempFile("fp8.bin");
  ASSERT_EQ(runHxfer("metadata --model tiny-hybrid --kv-dtype fp8 --tokens-per-block 64 --blocks 3 "
                     "--out " +
                     f)
                .exit_code,
            0);
  const Json j = inspectJson(f);
  const Json& layout = j["rank_info"]["layout"];
  EXPECT_EQ(layout["kv_dtype"], "fp8");
  EXPECT_EQ(layout["tokens_per_block"], 64);
  EXPECT_EQ(layout["num_blocks"], 3);
  std::remove(f.c_str());
}

// vLLM's shared tensors: the id groups travel in the rank_info (wire 1.5) and inspect shows
// them, per rank and per state view.
TEST(CliMetadata, SharedTensorsIdGroupsTravelAndInspectShowsThem) {
  const std::string f = tempFile("vllm_shared.bin");
  CmdResult w = runHxfer(
      "metadata --model tiny-hybrid --engine vllm --shared-tensors on --out " + f, Stderr::kMerge);
  ASSERT_EQ(w.exit_code, 0) << w.out;
  Json j = inspectJson(f);
  const Json& layout = j["rank_info"]["layout"];
  EXPECT_EQ(layout["joint_ids"], true);
  EXPECT_EQ(layout["state_groups"], 2);
  std::set<int> groups;
  for (const Json& v : layout["views"]) {
    if (v["role"] != "kv") groups.insert(v["state_group"].get<int>());
  }
  EXPECT_EQ(groups, (std::set<int>{0, 1}));
  CmdResult human = runHxfer("inspect " + f);
  EXPECT_NE(human.out.find("ids: blocks and states from one pool, 2 state ids per request"),
            std::string::npos)
      << human.out;
  std::remove(f.c_str());
}

// A transfer_request's staging slot and group slots (wires 1.4 and 1.5) show in inspect.
TEST(CliMetadata, InspectShowsATransferRequestsStagingAndGroupSlots) {
  const std::string f = tempFile("request.bin");
  hxfer::wire::TransferRequest req;
  req.request_id = 7;
  req.dst_block_ids = {5, 2};
  req.dst_slot = 1;
  req.num_tokens = 50;
  req.staging = hxfer::wire::Staging{9, 4096, 65536};
  req.dst_group_slots = {6, 3};
  const hxfer::Bytes frame = hxfer::wire::encodeMessage(req);
  std::ofstream(f, std::ios::binary)
      .write(reinterpret_cast<const char*>(frame.data()),
             static_cast<std::streamsize>(frame.size()));
  Json j = inspectJson(f);
  EXPECT_EQ(j["dst_group_slots"], (std::vector<uint32_t>{6, 3})) << j.dump();
  EXPECT_EQ(j["staging"]["offset"], 4096) << j.dump();
  std::remove(f.c_str());
}

// An engine layout travels with its described records (wire 1.3 and later) and inspect shows them.
TEST(CliMetadata, EngineLayoutRecordsTravelAndInspectShowsThem) {
  const std::string f = tempFile("vllm_hnd.bin");
  CmdResult w = runHxfer("metadata --model tiny-hybrid --engine vllm --kv-layout hnd --out " + f,
                         Stderr::kMerge);
  ASSERT_EQ(w.exit_code, 0) << w.out;
  EXPECT_NE(w.out.find("version=1." + std::to_string(hxfer::wire::kWireVersionMinor)),
            std::string::npos)
      << w.out;
  Json j = inspectJson(f);
  bool kv_hnd = false, conv_sd = false;
  for (const Json& v : j["rank_info"]["layout"]["views"]) {
    // vllm's kv and conv records are described; its mamba2 ssm is in hxfer's own order.
    if (v["role"] == "ssm") continue;
    ASSERT_TRUE(v.contains("record")) << v.dump();
    const Json& dims = v["record"]["dims"];
    std::vector<std::string> names;
    for (const Json& d : dims) names.push_back(d["name"]);
    if (v["role"] == "kv")
      kv_hnd |= names == std::vector<std::string>{"head", "token", "kv", "dim"};
    if (v["role"] == "conv") conv_sd |= names == std::vector<std::string>{"window", "channel"};
  }
  EXPECT_TRUE(kv_hnd) << j.dump();
  EXPECT_TRUE(conv_sd) << j.dump();
  CmdResult human = runHxfer("inspect " + f);
  ASSERT_EQ(human.exit_code, 0) << human.out;
  EXPECT_NE(human.out.find("record: head 4 @"), std::string::npos) << human.out;

  CmdResult bad = runHxfer("metadata --engine vllm --kv-layout xyz --out " + f, Stderr::kMerge);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.out.find("--engine"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("expected nhd, hnd, cpu or cpu-amx"), std::string::npos) << bad.out;
  std::remove(f.c_str());
}

// --layout is hxfer's: with another engine it is refused naming it (it was silently ignored),
// and a layout metadata does not take names --layout (it named --engine).
TEST(CliMetadata, LayoutWithAnotherEngineIsRefusedAndLayoutErrorsNameLayout) {
  const std::string f = tempFile("layout.bin");
  CmdResult r = runHxfer("metadata --engine vllm --layout layer-major --out " + f, Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --layout layer-major applies to --engine hxfer "
                       "only; --engine vllm keeps its own state layout"),
            std::string::npos)
      << r.out;
  r = runHxfer("metadata --layout auto --out " + f, Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --layout: unknown state layout 'auto'"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(runHxfer("metadata --engine vllm --out " + f).exit_code, 0);
  std::remove(f.c_str());
}

TEST(CliMetadata, HumanInspectListsRegionsAndViews) {
  const std::string f = tempFile("human.bin");
  ASSERT_EQ(runHxfer("metadata --model tiny-hybrid --out " + f).exit_code, 0);
  CmdResult r = runHxfer("inspect " + f);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("hello:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("auth token absent"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("index_stride"), std::string::npos) << r.out;
  std::remove(f.c_str());
}

TEST(CliMetadata, InspectOfACorruptFileExitsOneWithOneLineNamingTheProblem) {
  const std::string good = tempFile("good.bin");
  ASSERT_EQ(runHxfer("metadata --model tiny-hybrid --out " + good).exit_code, 0);
  const std::string bytes = readAll(good);
  ASSERT_GT(bytes.size(), 40u);

  const std::string flipped = tempFile("flipped.bin");
  std::string bad = bytes;
  bad[bad.size() / 2] ^= 0x10;
  writeAll(flipped, bad);
  CmdResult r = runHxfer("inspect " + flipped, Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(lineCount(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("crc32c"), std::string::npos) << r.out;

  const std::string truncated = tempFile("truncated.bin");
  writeAll(truncated, bytes.substr(0, bytes.size() - 1));
  r = runHxfer("inspect --json " + truncated, Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(lineCount(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("truncated"), std::string::npos) << r.out;

  const std::string junk = tempFile("junk.bin");
  writeAll(junk, "not a frame at all");
  r = runHxfer("inspect " + junk, Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("frame.magic"), std::string::npos) << r.out;

  for (const std::string& f : {good, flipped, truncated, junk}) std::remove(f.c_str());
}

TEST(CliMetadata, RankOutsideTheInstanceIsRefused) {
  CmdResult r = runHxfer("metadata --model tiny-hybrid --tp 2 --rank 2 --out " + tempFile("x.bin"),
                         Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--rank 2 >= tp*pp=2"), std::string::npos) << r.out;
}

}  // namespace
