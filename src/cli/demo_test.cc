// Multi-process tests of the whole job through the built binary. `hxfer demo` forks every
// context and generation rank as its own process, so each case below moves state between
// processes over a real backend (shm, ucx) and checks every byte on arrival; `hxfer serve` runs
// one rank per process, which lets a test kill or mis-configure one side.
//
// Every demo case asserts the demo's own accounting: every request that was not cancelled
// verified, and no rank ended with a page used or quarantined (`leaked_pages` is summed from
// each rank's pool counters after the run).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli_test_util.h"

namespace {

using hxfer::cli::testing::CmdResult;
using hxfer::cli::testing::readAll;
using hxfer::cli::testing::runHxfer;
using hxfer::cli::testing::Stderr;
using hxfer::cli::testing::tempFile;
using Clock = std::chrono::steady_clock;

// Runs `hxfer demo <args> --json` and returns its summary; the exit code must match `pass`.
nlohmann::json runDemo(const std::string& args) {
  CmdResult r = runHxfer("demo --json " + args);
  auto j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "demo " << args << " printed no JSON (exit " << r.exit_code
                                 << "):\n"
                                 << r.out;
  if (j.is_discarded()) return nlohmann::json::object();
  EXPECT_EQ(r.exit_code, j.value("pass", false) ? 0 : 1) << r.out;
  return j;
}

// Nothing failed or leaked on any rank, and every rank reported its metrics.
void expectClean(const nlohmann::json& j, const std::string& what) {
  EXPECT_TRUE(j.value("pass", false)) << what << "\n" << j.dump(2);
  EXPECT_EQ(j.value("failed", -1), 0) << what << "\n" << j["failures"].dump();
  EXPECT_EQ(j.value("leaked_pages", -1), 0) << what;
  EXPECT_EQ(j.value("aux_mismatches", -1), 0) << what;
  EXPECT_TRUE(j["rank_failures"].empty()) << what << "\n" << j["rank_failures"].dump();
  for (const auto& rank : j["ranks"]) {
    EXPECT_EQ(rank.value("leaked_pages", -1), 0) << what << ": " << rank.dump();
    EXPECT_TRUE(rank["metrics"].is_object()) << what << ": " << rank.dump();
    EXPECT_EQ(rank["metrics"].value("accounting_errors", -1), 0) << what << ": " << rank.dump();
  }
}

struct LayoutCase {
  const char* name;
  const char* args;
  int ctx_ranks, gen_ranks;
};

// Layout pairs of the tiny hybrid preset: every rank is a process.
const LayoutCase kLayoutCases[] = {
    {"SameTp", "--ctx-tp 2 --gen-tp 2", 2, 2},
    {"TwoToOne", "--ctx-tp 2 --gen-tp 1", 2, 1},
    {"OneToTwo", "--ctx-tp 1 --gen-tp 2", 1, 2},
    {"FourToTwo", "--ctx-tp 4 --gen-tp 2", 4, 2},
    {"ContextPpTwoToOne", "--ctx-tp 2 --gen-tp 1 --ctx-pp 2 --gen-pp 1", 4, 1},
    {"GenerationPpOneToTwo", "--ctx-tp 1 --gen-tp 2 --ctx-pp 1 --gen-pp 2", 1, 4},
    {"PagedToLayerMajor", "--ctx-tp 2 --gen-tp 1 --ctx-layout paged --gen-layout layer-major", 2,
     1},
    {"LayerMajorToPagedAcrossPp",
     "--ctx-tp 1 --gen-tp 2 --ctx-pp 2 --gen-pp 1 --ctx-layout layer-major --gen-layout paged", 2,
     2},
    {"WithChecksum", "--ctx-tp 2 --gen-tp 1 --checksum", 2, 1},
};

class DemoLayouts : public ::testing::TestWithParam<std::tuple<const char*, LayoutCase>> {};

TEST_P(DemoLayouts, EveryRequestVerifiesAndNoPageLeaks) {
  const auto& [backend, c] = GetParam();
  const std::string args =
      std::string("--requests 6 --tokens 200 --backend ") + backend + " " + c.args;
  nlohmann::json j = runDemo(args);
  expectClean(j, args);
  EXPECT_EQ(j.value("ok", -1), 6) << args;
  EXPECT_EQ(j.value("cancelled", -1), 0) << args;
  EXPECT_GT(j.value("bytes", 0ull), 0ull) << args;
  EXPECT_EQ(j.value("backend", ""), backend);
  EXPECT_EQ(j["ranks"].size(), static_cast<size_t>(c.ctx_ranks + c.gen_ranks)) << args;
}

INSTANTIATE_TEST_SUITE_P(Backends, DemoLayouts,
                         ::testing::Combine(::testing::Values("shm", "ucx"),
                                            ::testing::ValuesIn(kLayoutCases)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// Engine layouts across processes: each pair's ranks keep their pools as that engine does, the
// planner maps one onto the other, and every byte is checked where it lands. The pairs put
// every engine on each side once (and vllm's other kv and conv orders against its defaults),
// at tp 2 -> 1 and 1 -> 2, over both backends.
struct EnginePair {
  const char* name;
  const char* args;
  const char* ctx_layout;  // the summary's ctx.engine
  const char* gen_layout;
};

const EnginePair kEnginePairs[] = {
    {"VllmDsToTrtllmV2", "--ctx-engine vllm --ctx-conv-layout ds --gen-engine trtllm-v2",
     "vllm(kv=nhd,conv=ds)", "trtllm-v2(kv=hnd)"},
    {"TrtllmV2NhdToSglang", "--ctx-engine trtllm-v2 --ctx-kv-layout nhd --gen-engine sglang",
     "trtllm-v2(kv=nhd)", "sglang"},
    {"SglangToHxferPaged", "--ctx-engine sglang --gen-engine hxfer --gen-layout paged", "sglang",
     "hxfer(paged)"},
    {"HxferLayerMajorToTrtllmV1", "--ctx-layout layer-major --gen-engine trtllm-v1",
     "hxfer(layer-major)", "trtllm-v1"},
    {"TrtllmV1ToVllmHndDs",
     "--ctx-engine trtllm-v1 --gen-engine vllm --gen-kv-layout hnd --gen-conv-layout ds",
     "trtllm-v1", "vllm(kv=hnd,conv=ds)"},
    {"VllmHndSdToVllmNhdSd", "--ctx-engine vllm --ctx-kv-layout hnd --gen-engine vllm",
     "vllm(kv=hnd,conv=sd)", "vllm(kv=nhd,conv=sd)"},
    // Conv element order differs (SD against DS): staged on the context ranks, checksummed.
    {"VllmSdToHxferStaged", "--ctx-engine vllm --gen-engine hxfer --gen-layout paged --checksum",
     "vllm(kv=nhd,conv=sd)", "hxfer(paged)"},
    {"SglangToVllmSdStaged", "--ctx-engine sglang --gen-engine vllm --checksum", "sglang",
     "vllm(kv=nhd,conv=sd)"},
    // Tokens per block differ (a large vLLM page against SGLang's page of one token, and the
    // reverse direction with other sizes): kv moves by token ranges, checksummed.
    {"VllmBlock48ToSglangBlock1",
     "--ctx-engine vllm --ctx-conv-layout ds --ctx-tokens-per-block 48 --gen-engine sglang "
     "--gen-tokens-per-block 1 --checksum",
     "vllm(kv=nhd,conv=ds)", "sglang"},
    // vLLM's shared tensors: blocks and a state per Mamba group from one pool; the generation
    // rank's group slots travel in its requests.
    {"VllmSharedToTrtllmV2Staged",
     "--ctx-engine vllm --ctx-shared-tensors on --gen-engine trtllm-v2 --checksum",
     "vllm(kv=nhd,conv=sd,shared)", "trtllm-v2(kv=hnd)"},
    {"SglangToVllmSharedHndDs",
     "--ctx-engine sglang --gen-engine vllm --gen-kv-layout hnd --gen-conv-layout ds "
     "--gen-shared-tensors on --checksum",
     "sglang", "vllm(kv=hnd,conv=ds,shared)"},
    {"VllmSharedToVllmSharedHndDsStaged",
     "--ctx-engine vllm --ctx-shared-tensors on --gen-engine vllm --gen-kv-layout hnd "
     "--gen-conv-layout ds --gen-shared-tensors on --checksum",
     "vllm(kv=nhd,conv=sd,shared)", "vllm(kv=hnd,conv=ds,shared)"},
    {"TrtllmV2Block16ToVllmHndBlock40",
     "--ctx-engine trtllm-v2 --ctx-tokens-per-block 16 --gen-engine vllm --gen-kv-layout hnd "
     "--gen-conv-layout ds --gen-tokens-per-block 40 --checksum",
     "trtllm-v2(kv=hnd)", "vllm(kv=hnd,conv=ds)"},
};

class DemoEngines
    : public ::testing::TestWithParam<std::tuple<const char*, const char*, EnginePair>> {};

TEST_P(DemoEngines, EveryRequestVerifiesAndNoPageLeaks) {
  const auto& [backend, tp, pair] = GetParam();
  const std::string args =
      std::string("--requests 4 --tokens 200 --backend ") + backend + " " + tp + " " + pair.args;
  nlohmann::json j = runDemo(args);
  expectClean(j, args);
  EXPECT_EQ(j.value("ok", -1), 4) << args;
  EXPECT_GT(j.value("bytes", 0ull), 0ull) << args;
  EXPECT_EQ(j["ctx"].value("engine", ""), pair.ctx_layout) << args;
  EXPECT_EQ(j["gen"].value("engine", ""), pair.gen_layout) << args;
  if (std::string(pair.args).find("tokens-per-block") != std::string::npos) {
    EXPECT_NE(j["ctx"].value("tokens_per_block", 0u), j["gen"].value("tokens_per_block", 0u))
        << args;
  }
  uint64_t staged = 0;
  for (const auto& rank : j["ranks"]) staged += rank["metrics"].value("staged_parts", 0ull);
  if (std::string(pair.name).ends_with("Staged")) {
    EXPECT_GT(staged, 0u) << args;
  } else {
    EXPECT_EQ(staged, 0u) << args;
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, DemoEngines,
                         ::testing::Combine(::testing::Values("shm", "ucx"),
                                            ::testing::Values("--ctx-tp 2 --gen-tp 1",
                                                              "--ctx-tp 1 --gen-tp 2"),
                                            ::testing::ValuesIn(kEnginePairs)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  (std::string(std::get<1>(info.param)).find("--ctx-tp 2") == 0
                                       ? "TwoToOne_"
                                       : "OneToTwo_") +
                                  std::get<2>(info.param).name;
                         });

// The same bytes move whichever engines hold them, and a state layout given to an engine that
// has its own is refused naming both options.
TEST(Demo, EngineLayoutsMoveTheSameBytesAndRefuseAForeignStateLayout) {
  const std::string base = "--requests 2 --tokens 150 --ctx-tp 2 --gen-tp 1 --backend shm ";
  nlohmann::json hxfer = runDemo(base + "--ctx-layout paged --gen-layout paged");
  nlohmann::json vllm =
      runDemo(base + "--ctx-engine vllm --ctx-conv-layout ds --gen-engine sglang");
  expectClean(hxfer, "hxfer");
  expectClean(vllm, "vllm -> sglang");
  EXPECT_EQ(vllm.value("bytes", 0ull), hxfer.value("bytes", 1ull));
  CmdResult r =
      runHxfer("demo --requests 1 --ctx-engine sglang --ctx-layout paged", Stderr::kMerge);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--ctx-layout paged applies to --ctx-engine hxfer only"), std::string::npos)
      << r.out;
}

// Bytes that verified are the same whichever layouts the two sides keep: layouts change where
// records live, not what moves.
TEST(Demo, BytesMovedDoNotDependOnTheLayouts) {
  uint64_t first = 0;
  for (const char* layouts :
       {"--ctx-layout paged --gen-layout paged", "--ctx-layout layer-major --gen-layout paged",
        "--ctx-layout layer-major --gen-layout layer-major"}) {
    nlohmann::json j = runDemo(std::string("--requests 3 --tokens 150 --ctx-tp 2 --gen-tp 1 ") +
                               "--backend shm " + layouts);
    expectClean(j, layouts);
    const uint64_t bytes = j.value("bytes", 0ull);
    if (first == 0) first = bytes;
    EXPECT_EQ(bytes, first) << layouts;
  }
  EXPECT_GT(first, 0u);
}

// Cancellation at a fixed point, every request, each side, both backends.
struct CancelCase {
  const char* point;
  int min_cancelled, max_cancelled;  // of 8 requests
};

const CancelCase kCancelCases[] = {
    {"gen-after-start", 8, 8},   // the generation side gives up before the state arrives
    {"gen-after-done", 0, 0},    // a cancel after completion changes nothing
    {"ctx-before-ready", 8, 8},  // the context side drops the request before prefill ends
    {"ctx-after-ready", 0, 8},   // races the transfer: either outcome, never a failure
};

class DemoCancel : public ::testing::TestWithParam<std::tuple<const char*, CancelCase>> {};

TEST_P(DemoCancel, CancelledRequestsFreeEveryPageOnBothSides) {
  const auto& [backend, c] = GetParam();
  const std::string args = std::string("--requests 8 --tokens 300 --ctx-tp 2 --gen-tp 1 ") +
                           "--cancel-fraction 1 --cancel-at " + c.point + " --backend " + backend;
  nlohmann::json j = runDemo(args);
  expectClean(j, args);
  const int cancelled = j.value("cancelled", -1);
  EXPECT_GE(cancelled, c.min_cancelled) << args;
  EXPECT_LE(cancelled, c.max_cancelled) << args;
  EXPECT_EQ(j.value("ok", -1) + cancelled, 8) << args;
}

INSTANTIATE_TEST_SUITE_P(Backends, DemoCancel,
                         ::testing::Combine(::testing::Values("shm", "ucx"),
                                            ::testing::ValuesIn(kCancelCases)),
                         [](const auto& info) {
                           std::string point = std::get<1>(info.param).point;
                           std::erase(point, '-');
                           return std::string(std::get<0>(info.param)) + "_" + point;
                         });

TEST(Demo, RandomCancelsAcrossBothSidesLoseNothingElse) {
  nlohmann::json j = runDemo(
      "--requests 24 --tokens 120 --ctx-tp 2 --gen-tp 2 --ctx-pp 2 --gen-pp 1 --window 6 "
      "--cancel-fraction 0.5 --seed 7 --backend shm");
  expectClean(j, "random cancels");
  EXPECT_GT(j.value("cancelled", 0), 0);
  EXPECT_GT(j.value("ok", 0), 0);
  EXPECT_EQ(j.value("ok", 0) + j.value("cancelled", 0), 24);
}

TEST(Demo, BadOptionsAreRefusedNamingTheOption) {
  CmdResult r = runHxfer("demo --cancel-at sometimes", Stderr::kMerge);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--cancel-at 'sometimes'"), std::string::npos) << r.out;
  r = runHxfer("demo --backend inproc", Stderr::kMerge);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("inproc"), std::string::npos) << r.out;
  r = runHxfer("demo --ctx-tp 3", Stderr::kMerge);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("context"), std::string::npos) << r.out;
  // It said "state_layout: unknown state layout 'foo'", naming no option.
  r = runHxfer("demo --gen-layout foo", Stderr::kMerge);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("hxfer: InvalidArgument: --gen-layout: unknown state layout 'foo'"),
            std::string::npos)
      << r.out;
}

// ---------------------------------------------------------------------------------------------
// `hxfer serve`: one rank per process.

// `hxfer <args>` running in the background, stdout and stderr into a file.
class Background {
 public:
  explicit Background(const std::vector<std::string>& args)
      : log_(tempFile("serve", std::to_string(counter_++) + ".log")) {
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0) ::_exit(126);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(HXFER_BINARY));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(HXFER_BINARY, argv.data());
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::unlink(log_.c_str());
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  std::string output() const { return readAll(log_); }
  // The first match of `re`'s group 1 in the output, or "" after `timeout`.
  std::string waitFor(const std::regex& re, std::chrono::milliseconds timeout) const {
    const auto end = Clock::now() + timeout;
    std::smatch m;
    while (Clock::now() < end) {
      const std::string out = output();
      if (std::regex_search(out, m, re)) return m[1];
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "";
  }
  void signal(int sig) const { ::kill(pid_, sig); }
  // Exit code, or -1 when it was killed by a signal or is still running after `timeout`.
  int wait(std::chrono::milliseconds timeout) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  pid_t pid() const { return pid_; }

 private:
  static inline int counter_ = 0;
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

const std::regex kListening(R"(listening on (\S+))");
constexpr auto kStart = std::chrono::milliseconds(30000);

// A context rank started with `extra` options; its address, or a failed assertion.
std::string startContext(Background& ctx) {
  const std::string address = ctx.waitFor(kListening, kStart);
  EXPECT_FALSE(address.empty()) << "the context rank did not start:\n" << ctx.output();
  return address;
}

std::vector<std::string> contextArgs(const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"serve", "--role", "context", "--blocks", "256", "--slots", "16"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Stops a context rank with SIGTERM; it must exit 0 having printed its metrics with no page
// left used or quarantined. Returns the metrics.
nlohmann::json stopContext(Background& ctx) {
  ctx.signal(SIGTERM);
  EXPECT_EQ(ctx.wait(kStart), 0) << ctx.output();
  const std::string out = ctx.output();
  const size_t brace = out.rfind("\n{");
  auto j = nlohmann::json::parse(brace == std::string::npos ? "" : out.substr(brace + 1), nullptr,
                                 false);
  EXPECT_TRUE(j.is_object()) << out;
  if (!j.is_object()) return nlohmann::json::object();
  EXPECT_EQ(j.value("leaked_pages", -1), 0) << j.dump();
  return j;
}

// A generation rank run to its end against the context rank at `address`; `args` adds options.
CmdResult runGeneration(const std::string& address, const std::string& args) {
  return runHxfer("serve --role generation --blocks 256 --slots 16 --peers " + address + " " + args,
                  Stderr::kMerge);
}

// `hxfer serve --role generation` for the background, with a run of requests long enough to be
// killed in the middle of.
std::vector<std::string> longGenerationArgs(const std::string& address) {
  return {"serve",   "--role",     "generation", "--blocks", "256",
          "--slots", "16",         "--tokens",   "500",      "--timeout",
          "10",      "--requests", "1000000",    "--peers",  address};
}

// GET http://127.0.0.1:port<path>: the whole response, or "" when nothing answered.
std::string httpGet(const std::string& port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(port)));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
    (void)!::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  }
  ::close(fd);
  return out;
}

// `serve --metrics-port`: a Prometheus text endpoint with the counters serve prints, scraped
// while the rank serves, in engine layouts on both sides (--engine).
TEST(Serve, MetricsEndpointIsScrapedWhileServingInEngineLayouts) {
  Background ctx(contextArgs({"--metrics-port", "0", "--engine", "vllm", "--instance", "ctx"}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  const std::string port =
      ctx.waitFor(std::regex(R"(metrics on http://[0-9.]+:(\d+)/metrics)"), kStart);
  ASSERT_FALSE(port.empty()) << ctx.output();
  EXPECT_NE(ctx.output().find("engine layout: vllm(kv=nhd,conv=sd)"), std::string::npos)
      << ctx.output();
  CmdResult gen = runGeneration(address, "--requests 5 --tokens 300 --engine sglang");
  EXPECT_EQ(gen.exit_code, 0) << gen.out;
  EXPECT_NE(gen.out.find("5 of 5 requests verified"), std::string::npos) << gen.out;
  const std::string scrape = httpGet(port, "/metrics");
  EXPECT_NE(scrape.find("HTTP/1.1 200 OK"), std::string::npos) << scrape;
  EXPECT_NE(scrape.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  const std::string labels = R"(role="context",instance="ctx",rank="0")";
  for (const std::string& line : std::vector<std::string>{
           "# TYPE hxfer:requests_total counter",
           "hxfer:requests_total{" + labels + R"(,outcome="ok"} 5)",
           "hxfer:failures_total{" + labels + R"(,cause="timeout"} 0)",
           "# TYPE hxfer:transfer_latency_seconds histogram",
           "hxfer:transfer_latency_seconds_count{" + labels + "} 5",
           "hxfer:transfer_latency_seconds_bucket{" + labels + R"(,le="+Inf"} 5)",
           "hxfer:handshakes_total{" + labels + R"(,result="ok"} 1)"}) {
    EXPECT_NE(scrape.find(line + "\n"), std::string::npos) << line << "\n" << scrape;
  }
  EXPECT_NE(scrape.find("hxfer:bytes_total{" + labels + "} "), std::string::npos);
  EXPECT_NE(httpGet(port, "/other").find("404 Not Found"), std::string::npos);
  stopContext(ctx);
}

// Round 3, finding 8: two generation instances started without --instance each get a name of
// their own, so one context rank serves both side by side (both were "serve-gen" rank 0, and
// each new connection evicted the other's). An instance of several ranks must name itself.
TEST(Serve, TwoUnnamedGenerationInstancesAreServedSideBySide) {
  Background ctx(contextArgs({}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  std::vector<std::string> args = longGenerationArgs(address);
  args[std::find(args.begin(), args.end(), "--requests") - args.begin() + 1] = "40";
  args[std::find(args.begin(), args.end(), "--tokens") - args.begin() + 1] = "300";
  Background a(args), b(args);
  EXPECT_EQ(a.wait(kStart), 0) << a.output();
  EXPECT_EQ(b.wait(kStart), 0) << b.output();
  for (Background* g : {&a, &b}) {
    EXPECT_NE(g->output().find("40 of 40 requests verified"), std::string::npos) << g->output();
    EXPECT_NE(g->output().find("instance: gen-"), std::string::npos) << g->output();
  }
  nlohmann::json m = stopContext(ctx);
  EXPECT_EQ(m.value("connections_superseded", -1), 0) << m.dump();

  CmdResult two = runGeneration(address, "--tp 2 --rank 1 --requests 1");
  EXPECT_NE(two.exit_code, 0);
  EXPECT_NE(two.out.find("--instance is empty, and the instance has 2 ranks"), std::string::npos)
      << two.out;
}

TEST(Serve, GenerationRankVerifiesStateFromAContextRankInAnotherProcess) {
  Background ctx(contextArgs({}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  CmdResult gen = runGeneration(address, "--requests 5 --tokens 300 --checksum");
  EXPECT_EQ(gen.exit_code, 0) << gen.out;
  EXPECT_NE(gen.out.find("5 of 5 requests verified"), std::string::npos) << gen.out;
  EXPECT_NE(gen.out.find("leaked pages 0"), std::string::npos) << gen.out;
  nlohmann::json j = stopContext(ctx);
  EXPECT_EQ(j.value("requests_ok", -1), 5) << j.dump();
}

// Two processes with different tokens per block: the context rank allocates its own blocks
// of 16 for each request it is asked for, the generation rank blocks of 48; kv moves by
// token ranges and every token of every request verifies, checksummed.
TEST(Serve, ContextAndGenerationWithDifferentBlockSizesVerify) {
  Background ctx(contextArgs({"--tokens-per-block", "16"}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  CmdResult gen =
      runGeneration(address, "--requests 3 --tokens 100 --tokens-per-block 48 --checksum");
  EXPECT_EQ(gen.exit_code, 0) << gen.out;
  EXPECT_NE(gen.out.find("3 of 3 requests verified"), std::string::npos) << gen.out;
  nlohmann::json j = stopContext(ctx);
  EXPECT_EQ(j.value("requests_ok", -1), 3) << j.dump();
}

TEST(Serve, WrongTokenIsRefusedAndTheContextRankServesTheRightOne) {
  Background ctx(contextArgs({"--token", "right"}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  CmdResult bad = runGeneration(address, "--requests 1 --timeout 10 --token wrong");
  EXPECT_NE(bad.exit_code, 0) << bad.out;
  EXPECT_NE(bad.out.find("token"), std::string::npos) << bad.out;
  CmdResult good = runGeneration(address, "--requests 2 --tokens 64 --token right");
  EXPECT_EQ(good.exit_code, 0) << good.out;
  EXPECT_NE(good.out.find("2 of 2 requests verified"), std::string::npos) << good.out;
  nlohmann::json j = stopContext(ctx);
  // Refused by the transport's authentication, before the engine saw a Hello.
  EXPECT_EQ(j.value("auth_failures", -1), 1) << j.dump();
  EXPECT_EQ(j.value("ranks_without_token", -1), 0) << j.dump();
}

TEST(Serve, IncompatiblePeerIsRefusedNamingTheField) {
  Background ctx(contextArgs({"--conv-dtype", "bf16"}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  CmdResult gen = runGeneration(address, "--requests 1 --timeout 10 --conv-dtype fp32");
  EXPECT_NE(gen.exit_code, 0) << gen.out;
  EXPECT_NE(gen.out.find("conv dtype"), std::string::npos) << gen.out;
  stopContext(ctx);
}

// Kills one side while requests run; the other side reports it (or keeps serving) and exits
// cleanly.
TEST(Serve, ContextKilledMidRunFailsTheGenerationRankWithAClearError) {
  Background ctx(contextArgs({}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  Background gen(longGenerationArgs(address));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ctx.signal(SIGKILL);
  const int rc = gen.wait(kStart);
  EXPECT_EQ(rc, 1) << gen.output();
  EXPECT_NE(gen.output().find("context rank"), std::string::npos) << gen.output();
}

TEST(Serve, GenerationKilledMidRunLeavesTheContextRankServing) {
  Background ctx(contextArgs({}));
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  {
    Background gen(longGenerationArgs(address));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    gen.signal(SIGKILL);
    EXPECT_EQ(gen.wait(kStart), -1);
  }
  CmdResult next = runGeneration(address, "--requests 4 --tokens 400");
  EXPECT_EQ(next.exit_code, 0) << next.out;
  EXPECT_NE(next.out.find("4 of 4 requests verified"), std::string::npos) << next.out;
  nlohmann::json j = stopContext(ctx);
  EXPECT_GE(j.value("peers_lost", 0), 1) << j.dump();
}

// A signal stopped the generation rank only between requests: while it connected and while it
// waited for a request it ran on to --timeout. Now it stops within a poll (200 ms) in both, the
// request in flight cancelled, and reports as at its end (exit 1: not every request verified).
TEST(Serve, GenerationRankStopsOnASignalWhileConnectingAndWhileWaiting) {
  const std::regex kRouting(R"((routing:))");
  const std::regex kRequests(R"((request ids from))");
  auto expectStopped = [](Background& gen) {
    gen.signal(SIGTERM);
    const auto t0 = Clock::now();
    EXPECT_EQ(gen.wait(std::chrono::milliseconds(10000)), 1) << gen.output();
    EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000)) << gen.output();
    EXPECT_NE(gen.output().find("stopped by a signal\n0 of 16 requests verified"),
              std::string::npos)
        << gen.output();
    EXPECT_NE(gen.output().find("leaked pages 0"), std::string::npos) << gen.output();
  };
  {
    // Nobody listens at this address: the rank keeps trying to connect.
    Background gen({"serve", "--role", "generation", "--timeout", "60", "--peers",
                    "shm:@hxfer-nobody-" + std::to_string(::getpid())});
    ASSERT_FALSE(gen.waitFor(kRouting, kStart).empty()) << gen.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    expectStopped(gen);
  }
  // A context pool smaller than one request: it takes the request and never marks it ready.
  Background ctx({"serve", "--role", "context", "--blocks", "16", "--slots", "16"});
  const std::string address = startContext(ctx);
  ASSERT_FALSE(address.empty());
  {
    Background gen({"serve", "--role", "generation", "--timeout", "60", "--tokens", "1000",
                    "--peers", address});
    ASSERT_FALSE(gen.waitFor(kRequests, kStart).empty()) << gen.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    expectStopped(gen);
    EXPECT_NE(gen.output().find("cancelled by generation"), std::string::npos) << gen.output();
  }
  stopContext(ctx);
}

// Options the rank cannot run with are refused before it resolves its routing, listens,
// connects or registers (some were refused only after listening or registering, --metrics-port
// -5 not at all), each in one line naming the option.
TEST(Serve, BadOptionsAreRefusedBeforeTheRankListensNamingTheOption) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--role", "context", "--metrics-port", "70000"}, "--metrics-port"},
      {{"--role", "context", "--metrics-port", "-5"}, "--metrics-port"},
      {{"--role", "context", "--metrics-host", "foo"}, "--metrics-host"},
      {{"--role", "context", "--lease-ttl", "0", "--instance", "c", "--registry",
        "etcd://127.0.0.1:9"},
       "--lease-ttl"},
      {{"--role", "context", "--tp", "0"}, "--tp"},
      {{"--role", "context", "--advertise", "10.0.0.1"}, "pass --listen 0.0.0.0:PORT"},
      {{"--role", "context", "--listen", "127.0.0.1:0", "--advertise", "10.0.0.1:5000"},
       "--listen 127.0.0.1:0 is a loopback address"},
      {{"--role", "generation"}, "--peers is empty"},
      {{"--role", "generation", "--peers", ","}, "--peers is empty"},
      {{"--role", "generation", "--peers", "shm:@x", "--peer-tp", "0"}, "--peer-tp"},
      {{"--role", "generation", "--peers", "shm:@x", "--peer-pp", "2"},
       "--peers gives 1 address, but --peer-tp 1 x --peer-pp 2 is 2 context ranks"},
  };
  for (const auto& [args, expected] : cases) {
    std::vector<std::string> argv = {"serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    Background rank(argv);
    const int rc = rank.wait(std::chrono::milliseconds(10000));
    const std::string out = rank.output();
    EXPECT_TRUE(rc == 1 || rc == 2) << expected << ": exit " << rc << "\n" << out;
    EXPECT_EQ(out.rfind("hxfer: InvalidArgument: ", 0), 0u) << out;
    EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
    EXPECT_NE(out.find(expected), std::string::npos) << out;
  }
}

}  // namespace
