// Runs the built `hxfer bench` workloads on the smallest settings (inproc backend, the tiny
// preset, one repetition) and checks what they write: the JSON report (every result verified,
// bytes and ratios present), the CSV (a header and one line per result) and the SVG plot (well
// formed, both panels). It asserts on structure and on byte counts, never on speed: the
// figures themselves belong in docs/performance.md, not in a test.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/cli_test_util.h"

namespace {

using Json = nlohmann::json;

using hxfer::cli::testing::CmdResult;
using hxfer::cli::testing::readAll;
using hxfer::cli::testing::Stderr;

// The workloads report progress and errors on stderr; keep it for the failure messages.
CmdResult runHxfer(const std::string& args) {
  return hxfer::cli::testing::runHxfer(args, Stderr::kMerge);
}

std::string tempFile(const std::string& name) {
  return hxfer::cli::testing::tempFile("hxfer_bench", name);
}

const char kSmall[] = " --backend inproc --model tiny-hybrid --repetitions 1 --warmup 0 --quiet";

TEST(BenchWorkloads, RequestReportIsVerifiedAndCarriesBaselineRatios) {
  const std::string json = tempFile("request.json");
  const std::string csv = tempFile("request.csv");
  CmdResult r = runHxfer(std::string("bench request --tokens 64,256") + kSmall + " --json " + json +
                         " --csv " + csv);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_EQ(j["results"].size(), 2u);
  for (const Json& row : j["results"]) {
    EXPECT_EQ(row["workload"], "request");
    EXPECT_TRUE(row["verified"].get<bool>());
    EXPECT_GT(row["bytes"].get<uint64_t>(), 0u);
    EXPECT_GE(row["contiguous_runs"].get<uint64_t>(), 1u);
    EXPECT_GE(row["ops"].get<uint64_t>(), row["contiguous_runs"].get<uint64_t>());
    EXPECT_TRUE(row.contains("ratio_to_memcpy"));
    EXPECT_TRUE(row.contains("ratio_to_tcp"));
    EXPECT_EQ(row["seconds"].size(), 1u);
  }
  // 256 tokens carry more KV than 64 (the recurrent state is the same).
  EXPECT_GT(j["results"][1]["bytes"].get<uint64_t>(), j["results"][0]["bytes"].get<uint64_t>());
  const std::string text = readAll(csv);
  EXPECT_EQ(text.rfind("workload,backend,", 0), 0u) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3) << text;
}

TEST(BenchWorkloads, ControlRoundTripMovesNothingAndPlotIsWellFormed) {
  const std::string json = tempFile("control.json");
  const std::string svg = tempFile("control.svg");
  CmdResult r = runHxfer(std::string("bench control --rounds 20") + kSmall + " --json " + json +
                         " --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_GE(j["results"].size(), 1u);
  EXPECT_EQ(j["results"][0]["backend"], "inproc");
  EXPECT_EQ(j["results"][0]["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["results"][0]["seconds"].size(), 20u);
  const std::string plot = readAll(svg);
  EXPECT_EQ(plot.rfind("<?xml", 0), 0u);
  EXPECT_NE(plot.find("</svg>"), std::string::npos);
  EXPECT_NE(plot.find("Latency percentiles"), std::string::npos);
  // Request sizes were not measured in this run: the goodput panel says so instead of drawing.
  EXPECT_NE(plot.find("no data"), std::string::npos);
}

TEST(BenchWorkloads, MismatchReportsRatioToMatchedTp) {
  const std::string json = tempFile("mismatch.json");
  CmdResult r = runHxfer(std::string("bench mismatch --tokens 128 --tp-pairs 1:1,2:1,1:2") +
                         kSmall + " --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_EQ(j["results"].size(), 3u);
  for (const Json& row : j["results"]) {
    EXPECT_TRUE(row["verified"].get<bool>());
    EXPECT_EQ(row["ref"], "matched tp");
  }
  // Every pair moves the same request: the generation instance receives the same bytes.
  EXPECT_EQ(j["results"][1]["bytes"], j["results"][0]["bytes"]);
  EXPECT_EQ(j["results"][2]["bytes"], j["results"][0]["bytes"]);
}

// Streamed and whole requests are both verified; streaming writes one piece per layer with a
// cache, so a request above the threshold takes more writes than one below it; the third plot
// panel draws the two bars.
TEST(BenchWorkloads, StreamingReportsExposedTimeAgainstTheWholeRequest) {
  const std::string json = tempFile("streaming.json");
  const std::string csv = tempFile("streaming.csv");
  const std::string svg = tempFile("streaming.svg");
  CmdResult r = runHxfer(std::string("bench streaming --tokens 64,1k --prefill-us-per-token 5") +
                         kSmall + " --json " + json + " --csv " + csv + " --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("writes"), std::string::npos) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_EQ(j["results"].size(), 2u);
  for (const Json& row : j["results"]) {
    EXPECT_EQ(row["workload"], "streaming");
    EXPECT_TRUE(row["verified"].get<bool>());
    EXPECT_EQ(row["ref"], "not streamed");
    EXPECT_GT(row["prefill_ms"].get<double>(), 0.0);
    EXPECT_GT(row["unstreamed_exposed_ms"].get<double>(), 0.0);
    EXPECT_TRUE(row.contains("ratio_to_ref"));
    EXPECT_FALSE(row.contains("goodput_gbps"));  // exposed times are not whole transfers
  }
  EXPECT_GT(j["results"][1]["bytes"].get<uint64_t>(), j["results"][0]["bytes"].get<uint64_t>());
  const std::string text = readAll(csv);
  EXPECT_NE(text.find("prefill_ms,unstreamed_exposed_ms"), std::string::npos) << text;
  const std::string plot = readAll(svg);
  EXPECT_NE(plot.find("Exposed transfer after prefill"), std::string::npos);
  EXPECT_NE(plot.find("streamed per layer"), std::string::npos);
  r = runHxfer(std::string("bench streaming --prefill-us-per-token 0") + kSmall);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--prefill-us-per-token must be > 0, got 0"), std::string::npos) << r.out;
}

// The request row carries its ratio to memcpy on every core; one row per memcpy thread count.
TEST(BenchWorkloads, CopyBandwidthComparesTheRequestWithMemcpyOnEveryCore) {
  const std::string json = tempFile("copy.json");
  const std::string svg = tempFile("copy.svg");
  CmdResult r = runHxfer(std::string("bench copy-bandwidth --tokens 256") + kSmall + " --json " +
                         json + " --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  const Json& rows = j["results"];
  ASSERT_GE(rows.size(), 2u);
  const Json& req = rows.back();
  EXPECT_EQ(req["backend"], "inproc");
  EXPECT_TRUE(req["verified"].get<bool>());
  EXPECT_GT(req["ratio_to_ref"].get<double>(), 0.0);
  EXPECT_EQ(req["ref"].get<std::string>().rfind("memcpy x", 0), 0u);
  EXPECT_EQ(rows[0]["backend"], "memcpy x1");
  for (const Json& row : rows) EXPECT_EQ(row["bytes"], req["bytes"]);
  const std::string plot = readAll(svg);
  EXPECT_NE(plot.find("memcpy x1"), std::string::npos);
  EXPECT_EQ(plot.find("no data: run `hxfer bench copy-bandwidth`"), std::string::npos);
}

// NHD and token-major kv fragment at TP mismatch: more ops than HND for the same request, each
// verified, with the ratio to HND on the same tp pair; every row also runs staged.
TEST(BenchWorkloads, StormCountsTheOpsOfFragmentingLayoutsAgainstHnd) {
  const std::string json = tempFile("storm.json");
  const std::string svg = tempFile("storm.svg");
  CmdResult r = runHxfer(std::string("bench storm --tokens 128 --tp-pairs 1:1,2:1") + kSmall +
                         " --json " + json + " --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Json j = Json::parse(readAll(json), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded());
  ASSERT_EQ(j["results"].size(), 12u);  // hnd, nhd, token-major x 2 tp pairs x staging off, on
  std::map<std::string, uint64_t> ops;
  for (const Json& row : j["results"]) {
    EXPECT_EQ(row["workload"], "storm");
    EXPECT_TRUE(row["verified"].get<bool>());
    ops[row["backend"].get<std::string>() + " " + std::to_string(row["ctx_tp"].get<int>())] =
        row["ops"].get<uint64_t>();
    if (row["backend"] != "inproc hnd") {
      EXPECT_EQ(row["ref"], "hnd");
    }
    if (row["backend"].get<std::string>().ends_with(" staged")) {
      EXPECT_EQ(row["bytes"], j["results"][0]["bytes"]);  // the same request, staged or not
    }
  }
  EXPECT_GT(ops["inproc nhd 2"], ops["inproc hnd 2"]);
  EXPECT_GT(ops["inproc token-major 2"], ops["inproc hnd 2"]);
  EXPECT_GT(ops["inproc nhd 2"], ops["inproc nhd 1"]);
  const std::string plot = readAll(svg);
  EXPECT_NE(plot.find("Descriptor storms: goodput"), std::string::npos);
  EXPECT_EQ(plot.find("no data: run `hxfer bench storm`"), std::string::npos);  // drawn
}

TEST(BenchWorkloads, BadListsAreRefusedNamingTheFlag) {
  CmdResult r = runHxfer(std::string("bench request --tokens 8x") + kSmall);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--tokens"), std::string::npos) << r.out;
  r = runHxfer(std::string("bench mismatch --tp-pairs 2-1") + kSmall);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--tp-pairs"), std::string::npos) << r.out;
}

TEST(BenchWorkloads, TransportBenchStaysRegistered) {
  CmdResult r = runHxfer("bench transport --help");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("--op-size"), std::string::npos) << r.out;
}

}  // namespace
