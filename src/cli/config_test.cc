// `hxfer config`: the backend and state layout a deployment resolves to, and why, as every
// rank resolves them at start-up; device memory goes to cuda on one host and to no backend
// across hosts.
#include <gtest/gtest.h>

#include <string>

#include "cli/cli_test_util.h"

namespace hxfer::cli {
namespace {

using testing::CmdResult;
using testing::runHxfer;
using testing::Stderr;

TEST(CliConfig, MemoryKindsPickTheirBackendAndSayWhy) {
  CmdResult shared = runHxfer("config --model tiny-hybrid");
  EXPECT_EQ(shared.exit_code, 0) << shared.out;
  EXPECT_EQ(shared.out, "backend=shm state_layout=paged\n");
  CmdResult device = runHxfer("config --model tiny-hybrid --memory device --explain");
  EXPECT_EQ(device.exit_code, 0) << device.out;
  EXPECT_NE(device.out.find("backend=cuda"), std::string::npos) << device.out;
  EXPECT_NE(device.out.find("CUDA device memory"), std::string::npos) << device.out;
}

TEST(CliConfig, DeviceMemoryAcrossHostsGoesByUcxAndAnotherHostBackendExitsNonZeroNamingWhy) {
  CmdResult far =
      runHxfer("config --model tiny-hybrid --memory device --other-host --explain", Stderr::kMerge);
  EXPECT_EQ(far.exit_code, 0) << far.out;
  EXPECT_NE(far.out.find("backend=ucx"), std::string::npos) << far.out;
  EXPECT_NE(far.out.find("staged through pinned host memory"), std::string::npos) << far.out;
  CmdResult shm =
      runHxfer("config --model tiny-hybrid --memory device --backend shm", Stderr::kMerge);
  EXPECT_NE(shm.exit_code, 0);
  EXPECT_NE(shm.out.find("memory=device"), std::string::npos) << shm.out;
  CmdResult bad = runHxfer("config --model tiny-hybrid --memory gpu", Stderr::kMerge);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--memory=gpu is not one of: shareable, private, device"),
            std::string::npos)
      << bad.out;
}

}  // namespace
}  // namespace hxfer::cli
