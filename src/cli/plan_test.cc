// End-to-end tests of `hxfer plan` with engine layouts (docs/cli.md, docs/layouts.md).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli/cli_test_util.h"

namespace hxfer::cli {
namespace {

using testing::CmdResult;
using testing::runHxfer;
using testing::Stderr;

// Every engine pair the default model can be planned between, at 2 -> 1 and 1 -> 2, verified.
TEST(CliPlan, EngineLayoutPairsVerifyAtTpMismatchBothWays) {
  const char* engines[] = {"--%s-engine hxfer",
                           "--%s-engine hxfer --%s-layout layer-major",
                           "--%s-engine trtllm-v1",
                           "--%s-engine trtllm-v2 --%s-kv-layout nhd",
                           "--%s-engine vllm --%s-conv-layout ds",
                           "--%s-engine vllm --%s-kv-layout hnd --%s-conv-layout ds",
                           "--%s-engine sglang"};
  auto side = [](const char* fmt, const char* who) {
    std::string out;
    for (const char* p = fmt; *p; ++p) {
      if (p[0] == '%' && p[1] == 's') {
        out += who;
        ++p;
      } else {
        out += *p;
      }
    }
    return out;
  };
  int runs = 0;
  for (const char* c : engines) {
    for (const char* g : engines) {
      for (const char* tp : {"--ctx-tp 2 --gen-tp 1", "--ctx-tp 1 --gen-tp 2"}) {
        const std::string args = "plan --verify --json --tokens 100 --block-ids shuffled " +
                                 side(c, "ctx") + " " + side(g, "gen") + " " + tp;
        auto r = runHxfer(args, Stderr::kMerge);
        ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.out;
        auto j = nlohmann::json::parse(r.out);
        EXPECT_TRUE(j["verified"].get<bool>()) << args;
        EXPECT_EQ(j["total_bytes"], j["expected_bytes"]) << args;
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 7 * 7 * 2);
}

TEST(CliPlan, ElementOrderMismatchIsStagedAndUnknownEngineIsRefusedNamingTheField) {
  auto r = runHxfer("plan --ctx-engine vllm --gen-engine hxfer --verify", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("staging gathers on the context ranks (element order differs)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("verified: "), std::string::npos) << r.out;
  r = runHxfer("plan --ctx-engine vllm --gen-engine hxfer --json");
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_GT(j.value("total_pack_ops", 0), 0);
  r = runHxfer("plan --ctx-engine vllm --gen-engine vllm --json");
  j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j.value("total_pack_ops", -1), 0);
  r = runHxfer("plan --ctx-engine tgi", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--ctx-engine: unknown engine layout 'tgi'"), std::string::npos) << r.out;
  r = runHxfer("plan --gen-engine sglang --gen-kv-layout nhd", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("only vllm, vllm-0.25 and trtllm-v2"), std::string::npos) << r.out;
}

// A state layout is hxfer's: given with another engine it is refused naming it (it was
// silently ignored), and an unknown one names --ctx-layout (it named --ctx-engine).
TEST(CliPlan, LayoutWithAnotherEngineIsRefusedAndLayoutErrorsNameTheLayoutOption) {
  CmdResult r = runHxfer("plan --ctx-engine sglang --ctx-layout layer-major", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --ctx-layout layer-major applies to --ctx-engine "
                       "hxfer only; --ctx-engine sglang keeps its own state layout"),
            std::string::npos)
      << r.out;
  r = runHxfer("plan --gen-engine vllm --gen-layout paged", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--gen-layout paged applies to --gen-engine hxfer only"), std::string::npos)
      << r.out;
  r = runHxfer("plan --ctx-layout foo", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --ctx-layout: unknown state layout 'foo'"),
            std::string::npos)
      << r.out;
  // The default layout does not count as given.
  EXPECT_EQ(runHxfer("plan --ctx-engine sglang --gen-engine vllm").exit_code, 0);
}

}  // namespace
}  // namespace hxfer::cli
