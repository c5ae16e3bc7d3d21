// Runs the built `hxfer bench transport` end to end on small sizes: every backend moves the
// bytes between two processes, the destination verifies, and the report carries the baselines.
// Sizes are tiny and no speed is asserted: performance belongs to the benchmark itself.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli/cli_test_util.h"

namespace {

using hxfer::cli::testing::CmdResult;
using hxfer::cli::testing::runHxfer;

void expectVerifiedReport(const std::string& args, bool expect_tcp) {
  CmdResult r =
      runHxfer("bench transport --size 1048576 --op-size 65536 --iterations 2 --json " + args);
  ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j["verified"].get<bool>()) << r.out;
  EXPECT_EQ(j["ops"].get<int>(), 16);
  EXPECT_EQ(j["transport"]["runs"].size(), 2u);
  EXPECT_GT(j["transport"]["median_gbps"].get<double>(), 0.0);
  EXPECT_GT(j["memcpy"]["median_gbps"].get<double>(), 0.0);
  EXPECT_GT(j["ratio_to_memcpy"].get<double>(), 0.0);
  EXPECT_EQ(j.contains("ratio_to_tcp"), expect_tcp) << r.out;
}

TEST(BenchTransport, ShmMovesAndVerifiesTheBytesBetweenTwoProcesses) {
  expectVerifiedReport("--backend shm", false);
}

TEST(BenchTransport, InprocMovesAndVerifiesTheBytes) {
  expectVerifiedReport("--backend inproc", false);
}

TEST(BenchTransport, UcxOverTcpReportsTheRawTcpBaselineToo) {
  expectVerifiedReport("--backend ucx --ucx-tls tcp --ucx-mode am", true);
}

TEST(BenchTransport, BadArgumentsExitNonZero) {
  EXPECT_NE(runHxfer("bench transport --backend rdma").exit_code, 0);
  EXPECT_NE(runHxfer("bench transport --backend shm --size 0").exit_code, 0);
  EXPECT_NE(runHxfer("bench transport --backend ucx --ucx-mode fast").exit_code, 0);
}

}  // namespace

namespace hxfer::cli {
namespace {

// `hxfer bench` alone is no longer an error: it runs every workload (said in its help; the
// run itself takes minutes, so the test reads the help and checks that a bad workload name
// is still refused).
TEST(BenchCommand, BenchAloneRunsEveryWorkload) {
  auto help = testing::runHxfer("bench --help", testing::Stderr::kMerge);
  EXPECT_EQ(help.exit_code, 0) << help.out;
  EXPECT_NE(help.out.find("`hxfer bench` alone runs every workload"), std::string::npos)
      << help.out;
  EXPECT_NE(testing::runHxfer("bench nonesuch").exit_code, 0);
}

// A backend name outside shm, ucx, inproc is refused naming --backend and the value, before any
// workload runs (it was "not built in; skipped" and exit 0).
TEST(BenchCommand, UnknownBackendIsRefusedNamingIt) {
  auto r = testing::runHxfer("bench request --backend foo --quiet", testing::Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --backend foo is not one of shm, ucx, inproc"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("hxfer bench: model"), std::string::npos) << r.out;
  r = testing::runHxfer("bench control --backend inproc,rdma --rounds 20 --quiet",
                        testing::Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("--backend rdma"), std::string::npos) << r.out;
}

// The control round trip with CPU-bound threads beside it (a serving engine's busy loops): a
// few rounds, no speed asserted; the report says what ran beside it.
TEST(BenchCommand, ControlRunsBesideBusyThreadsAndSaysSo) {
  auto r = testing::runHxfer("bench control --backend inproc --rounds 20 --busy-threads 2 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("2 CPU-bound threads spinning beside them"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("inproc"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace hxfer::cli
