// Test helpers for end-to-end tests of the built `hxfer` binary: run it with arguments and
// capture its exit code and output, and name scratch files private to the test process.
// Header-only so that test targets outside src/cli (bench/) can use it without linking the CLI.
// Every includer must define HXFER_BINARY (the path of the built binary) at compile time.
// Thread-safety: the functions keep no state; concurrent calls are fine.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

namespace hxfer::cli::testing {

// What happens to the child's stderr: dropped, or merged into `CmdResult::out`.
enum class Stderr { kDrop, kMerge };

struct CmdResult {
  int exit_code = -1;  // -1 when the binary could not be started or did not exit normally.
  std::string out;
};

// Runs `hxfer <args>` through the shell (so `args` may hold several words) and waits for it.
inline CmdResult runHxfer(const std::string& args, Stderr err = Stderr::kDrop) {
  const std::string cmd =
      std::string(HXFER_BINARY) + " " + args + (err == Stderr::kMerge ? " 2>&1" : " 2>/dev/null");
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A file name private to this test process; `prefix` keeps test files apart from each other.
inline std::string tempFile(const std::string& prefix, const std::string& name) {
  return ::testing::TempDir() + prefix + "_" + std::to_string(getpid()) + "_" + name;
}

// The whole content of `path`, or "" when it cannot be read.
inline std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace hxfer::cli::testing
