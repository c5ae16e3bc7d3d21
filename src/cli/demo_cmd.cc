// `hxfer demo`: the whole job on this host. Every rank of a context instance and of a
// generation instance runs as its own process (forked before any transport object exists);
// context ranks fill each request's state with the planner's oracle, generation ranks ask for
// it, check every byte that arrived, and report to the parent, which prints a summary. Exit 0
// only when every request that was not cancelled arrived intact and no page leaked.
//
// Parent <-> child protocol: one text line per message over a pipe pair per child.
//   context child  -> "addr <address>", "done <leaked pages> <metrics json>", "fail <why>"
//   generation     -> "ready", "req <id> <code> <bytes> <latency ns> <verified> <message>",
//                     "done <leaked pages> <metrics json>", "fail <why>"
//   parent -> ctx  "go", "finish";   parent -> gen  "peer <address>" (one per ctx rank), "go"
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/layout.h"
#include "cli/commands.h"
#include "cli/model_options.h"
#include "common/logging.h"
#include "engine/context_sender.h"
#include "engine/generation_receiver.h"
#include "engine/handshake.h"
#include "engine/routing.h"
#include "plan/oracle.h"
#include "transport/auth.h"
#include "transport/transport.h"

namespace hxfer::cli {
namespace {

using engine::Clock;
using std::chrono::milliseconds;

struct DemoOptions {
  ModelOptions model;
  uint32_t ctx_tp = 2, gen_tp = 1, ctx_pp = 1, gen_pp = 1;
  uint32_t requests = 32;
  uint32_t tokens = 1000;
  std::string backend = "auto";
  std::string ctx_layout = "auto", gen_layout = "auto";
  EngineOptions ctx_engine, gen_engine;
  double cancel_fraction = 0.0;
  std::string cancel_at = "any";  // any, or one CancelPoint name
  uint64_t seed = 1;
  uint32_t window = 8;  // requests in flight per rank
  bool checksum = false;
  bool json = false;
  uint32_t timeout_s = 60;  // per request
};

// Where a request is cancelled (same decision in every process: a function of seed and id).
enum class CancelPoint { kNone, kGenAfterStart, kGenAfterDone, kCtxBeforeReady, kCtxAfterReady };
// Names for --cancel-at, in enum order from kGenAfterStart.
constexpr std::array<std::string_view, 4> kCancelPointNames = {
    "gen-after-start", "gen-after-done", "ctx-before-ready", "ctx-after-ready"};

// 0 for "any" (a point drawn per request), else 1 + the index in kCancelPointNames.
StatusOr<int> parseCancelAt(const std::string& name) {
  if (name == "any") return 0;
  for (size_t i = 0; i < kCancelPointNames.size(); ++i) {
    if (name == kCancelPointNames[i]) return static_cast<int>(i) + 1;
  }
  return InvalidArgument("--cancel-at '" + name +
                         "' is not any, gen-after-start, gen-after-done, ctx-before-ready or "
                         "ctx-after-ready");
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

CancelPoint cancelPointFor(const DemoOptions& o, uint64_t id) {
  const uint64_t h = splitmix(o.seed * 1000003 + id);
  const double u = static_cast<double>(h >> 11) / static_cast<double>(1ull << 53);
  if (u >= o.cancel_fraction) return CancelPoint::kNone;
  const StatusOr<int> fixed = parseCancelAt(o.cancel_at);  // validated in resolveDemo
  const int point = fixed.isOk() ? *fixed : 0;
  return static_cast<CancelPoint>(point != 0 ? point : 1 + splitmix(h) % 4);
}

// Aux payloads, a function of the request id in every process: generation -> context with the
// TransferRequest (request metadata) and context -> generation with the Done (stands in for
// the first token sampled by prefill).
Bytes auxFor(uint64_t id, uint8_t salt) {
  Bytes b(8);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(id >> (8 * i)) ^ salt;
  return b;
}
Bytes requestAuxFor(uint64_t id) { return auxFor(id, 0); }
Bytes firstTokenFor(uint64_t id) { return auxFor(id, 0x5a); }

// One text line per message over a pair of pipe ends.
class Channel {
 public:
  Channel(int in, int out) : in_(in), out_(out) {}
  void send(const std::string& line) const {
    std::string l = line + "\n";
    const char* p = l.data();
    size_t left = l.size();
    while (left > 0) {
      ssize_t n = ::write(out_, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  // The next line, waiting up to `timeout`; nullopt on timeout; "" on end of file.
  std::optional<std::string> receive(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      if (eof_) return std::string();
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      pollfd p{in_, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
      if (r == 0) return std::nullopt;
      if (r < 0) {
        if (errno == EINTR) continue;
        eof_ = true;
        continue;
      }
      char tmp[4096];
      ssize_t n = ::read(in_, tmp, sizeof tmp);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        eof_ = true;
      } else {
        buf_.append(tmp, static_cast<size_t>(n));
      }
    }
  }
  int inFd() const { return in_; }
  bool hasBufferedLine() const { return buf_.find('\n') != std::string::npos; }

 private:
  int in_, out_;
  std::string buf_;
  bool eof_ = false;
};

struct Resolved {
  ModelSpec model;
  ModelSpec ctx_model, gen_model;  // with each side's tokens per block
  ParallelConfig ctx, gen;
  engine::BackendKind backend;
  StateLayout ctx_layout, gen_layout;   // hxfer's state layout, as routed
  EngineLayout ctx_engine, gen_engine;  // what each side's pools look like
  std::vector<std::string> decisions;   // for --json and the header line
  std::string token;  // fresh per run, inherited by the forked ranks, never printed
};

StatusOr<Resolved> resolveDemo(const DemoOptions& o) {
  Resolved r;
  ASSIGN_OR_RETURN(r.model, resolveModel(o.model));
  r.ctx_model = sideModel(r.model, o.ctx_engine);
  r.gen_model = sideModel(r.model, o.gen_engine);
  // Every rank of this run proves the same fresh secret, so no other process can join it.
  ASSIGN_OR_RETURN(r.token, transport::auth::randomToken());
  r.ctx = ParallelConfig{o.ctx_tp, o.ctx_pp, {}};
  r.gen = ParallelConfig{o.gen_tp, o.gen_pp, {}};
  RETURN_IF_ERROR(r.ctx.validate(r.model.numLayers()).withContext("context"));
  RETURN_IF_ERROR(r.gen.validate(r.model.numLayers()).withContext("generation"));
  ASSIGN_OR_RETURN(auto backend, engine::parseBackendRequest(o.backend));
  RETURN_IF_ERROR(parseCancelAt(o.cancel_at).status());
  engine::RoutingEnvironment env = engine::probeRoutingEnvironment();
  env.peers_same_host = true;
  env.single_process = false;  // every rank is its own process
  const auto pref = engine::preferredStateLayout(r.model);
  for (int side = 0; side < 2; ++side) {
    const char* name = side == 0 ? "ctx" : "gen";
    const std::string& layout_request = side == 0 ? o.ctx_layout : o.gen_layout;
    const EngineOptions& engine_options = side == 0 ? o.ctx_engine : o.gen_engine;
    if (engine_options.engine != "hxfer" && layout_request != "auto") {
      return InvalidArgument("--" + std::string(name) + "-layout " + layout_request +
                             " applies to --" + name + "-engine hxfer only; --" + name +
                             "-engine " + engine_options.engine + " keeps its own state layout");
    }
    ASSIGN_OR_RETURN(auto layout,
                     parseStateLayoutOption("--" + std::string(name) + "-layout", layout_request));
    engine::RoutingExplanation e = engine::explainRouting({backend, layout}, env, pref);
    if (!e.status.isOk()) {
      return e.status.withContext(side == 0 ? "context" : "generation");
    }
    r.backend = e.routing->backend;
    (side == 0 ? r.ctx_layout : r.gen_layout) = e.routing->state_layout;
    ASSIGN_OR_RETURN(
        (side == 0 ? r.ctx_engine : r.gen_engine),
        resolveEngineLayout(engine_options, name, stateLayoutName(e.routing->state_layout)));
    for (const auto& d : e.decisions) {
      r.decisions.push_back(std::string(side == 0 ? "ctx " : "gen ") + d.setting + "=" + d.value +
                            ": " + d.reason);
    }
  }
  return r;
}

// "paged" / "layer-major" for hxfer's own layouts (as before engines existed), else the engine
// layout's name with its options ("vllm(kv=nhd,conv=sd)").
std::string layoutLabel(const EngineLayout& l) {
  return l.engine == Engine::kHxfer ? std::string(stateLayoutName(l.state)) : l.toString();
}

// The layout label of side 0 (ctx) or 1 (gen), with its tokens per block when the sides differ.
std::string sideLabel(const Resolved& r, int side) {
  const ModelSpec& m = side == 0 ? r.ctx_model : r.gen_model;
  std::string s = layoutLabel(side == 0 ? r.ctx_engine : r.gen_engine);
  if (r.ctx_model.tokens_per_block != r.gen_model.tokens_per_block) {
    s += ", " + std::to_string(m.tokens_per_block) + " tokens per block";
  }
  return s;
}

Region::Backing backingFor(engine::BackendKind b) {
  return b == engine::BackendKind::kShm ? Region::Backing::kMemfd : Region::Backing::kAnonymous;
}

uint32_t blocksPerRequest(const ModelSpec& m, uint32_t tokens) {
  return (tokens + m.tokens_per_block - 1) / m.tokens_per_block;
}

// One rank's cache: blocks and slots for the requests that can be in flight (--window, or
// fewer when the run has fewer requests), plus two spare. Pools are pre-faulted, so sizing
// them for requests that never come would only cost memory and start-up time.
StatusOr<std::unique_ptr<HybridCacheManager>> makeCache(const DemoOptions& o, const Resolved& r,
                                                        const ModelSpec& model,
                                                        const ParallelConfig& pc,
                                                        const EngineLayout& layout,
                                                        uint32_t tp_rank, uint32_t pp_rank) {
  const uint32_t per = blocksPerRequest(model, o.tokens);
  const uint32_t slots = std::min(o.window, o.requests) + 2;
  return HybridCacheManager::create(model, pc, tp_rank, pp_rank, layout,
                                    Capacity::counts(slots * per, slots), backingFor(r.backend));
}

StatusOr<std::unique_ptr<transport::Agent>> makeAgent(const Resolved& r, const char* label) {
  transport::AgentConfig ac;
  ac.backend = std::string(engine::backendName(r.backend));
  ac.label = label;
  ac.auth_token = r.token;
  return transport::createAgent(ac);
}

uint64_t leakedPages(const HybridCacheManager& cache) { return cache.counters().pagesHeld(); }

// Waits until the cache holds nothing (or the deadline passes).
void waitCacheEmpty(const HybridCacheManager& cache, Clock::time_point deadline) {
  while (leakedPages(cache) > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(2));
  }
}

int contextChild(const DemoOptions& o, const Resolved& r, uint32_t tp_rank, uint32_t pp_rank,
                 Channel& ch) {
  auto cache = makeCache(o, r, r.ctx_model, r.ctx, r.ctx_engine, tp_rank, pp_rank);
  if (!cache.isOk()) return ch.send("fail " + cache.status().toString()), 1;
  auto agent = makeAgent(r, "ctx");
  if (!agent.isOk()) return ch.send("fail " + agent.status().toString()), 1;
  std::atomic<uint64_t> aux_mismatches{0};
  engine::ContextSender::Options so;
  so.instance_id = "demo-ctx";
  so.model = r.ctx_model;
  so.parallel = r.ctx;
  so.tp_rank = tp_rank;
  so.pp_rank = pp_rank;
  so.checksum = o.checksum;
  so.lease_timeout = std::chrono::seconds(2 * o.timeout_s);
  so.on_request = [&aux_mismatches](uint64_t id, uint64_t, const Bytes& aux) {
    if (aux != requestAuxFor(id)) ++aux_mismatches;
  };
  auto sender = engine::ContextSender::create(so, cache->get(), std::move(*agent));
  if (!sender.isOk()) return ch.send("fail " + sender.status().toString()), 1;
  HybridCacheManager& pool = **cache;
  const RankMemory mem = engine::cacheMemory(pool);
  ch.send("addr " + (*sender)->address());

  auto go = ch.receive(milliseconds(600000));
  if (!go || *go != "go") return 1;
  uint64_t next = 1;
  bool finish = false;
  while (!finish) {
    while (next <= o.requests && (*sender)->heldRequests() < o.window) {
      const CancelPoint cp = cancelPointFor(o, next);
      auto a = pool.allocate(next, o.tokens);
      if (!a.isOk()) break;  // pages come back as requests complete
      if (Status s = fillRank(pool.layout(), mem, idsOf(*a), next); !s.isOk()) {
        return ch.send("fail " + s.toString()), 1;
      }
      if (cp == CancelPoint::kCtxBeforeReady) (void)(*sender)->cancel(next);
      Status s = (*sender)->markReady(next, firstTokenFor(next));
      if (!s.isOk() &&
          !(cp == CancelPoint::kCtxBeforeReady && s.code() == StatusCode::kCancelled)) {
        return ch.send("fail mark ready " + std::to_string(next) + ": " + s.toString()), 1;
      }
      if (cp == CancelPoint::kCtxAfterReady) (void)(*sender)->cancel(next);
      ++next;
    }
    auto line = ch.receive(milliseconds(1));
    if (line && (*line == "finish" || line->empty())) finish = true;
  }
  // Every generation rank is done: whatever the sender still holds goes at its lease expiry or
  // now, at shutdown; leaked pages are those left after that.
  waitCacheEmpty(pool, Clock::now() + std::chrono::seconds(5));
  engine::MetricsSnapshot m = (*sender)->metrics();
  (*sender)->shutdown();
  nlohmann::json j = nlohmann::json::parse(m.toJson());
  j["aux_mismatches"] = aux_mismatches.load();
  ch.send("done " + std::to_string(leakedPages(pool)) + " " + j.dump());
  return 0;
}

int generationChild(const DemoOptions& o, const Resolved& r, uint32_t tp_rank, uint32_t pp_rank,
                    Channel& ch) {
  std::vector<std::string> peers;
  while (peers.size() < r.ctx.worldSize()) {
    auto line = ch.receive(milliseconds(600000));
    if (!line || line->rfind("peer ", 0) != 0) return 1;
    peers.push_back(line->substr(5));
  }
  auto cache = makeCache(o, r, r.gen_model, r.gen, r.gen_engine, tp_rank, pp_rank);
  if (!cache.isOk()) return ch.send("fail " + cache.status().toString()), 1;
  auto agent = makeAgent(r, "gen");
  if (!agent.isOk()) return ch.send("fail " + agent.status().toString()), 1;
  engine::GenerationReceiver::Options ro;
  ro.instance_id = "demo-gen";
  ro.model = r.gen_model;
  ro.parallel = r.gen;
  ro.tp_rank = tp_rank;
  ro.pp_rank = pp_rank;
  ro.checksum = o.checksum;
  ro.ctx_parallel = r.ctx;
  ro.ctx_addresses = peers;
  ro.request_timeout = std::chrono::seconds(o.timeout_s);
  auto rx = engine::GenerationReceiver::create(ro, cache->get(), std::move(*agent));
  if (!rx.isOk()) return ch.send("fail " + rx.status().toString()), 1;
  if (Status s = (*rx)->waitForPeers(Clock::now() + std::chrono::seconds(60)); !s.isOk()) {
    return ch.send("fail " + s.toString()), 1;
  }
  HybridCacheManager& pool = **cache;
  const RankMemory mem = engine::cacheMemory(pool);
  ch.send("ready");
  auto go = ch.receive(milliseconds(600000));
  if (!go || *go != "go") return 1;

  struct Active {
    uint64_t id;
    Allocation alloc;
    CancelPoint cp;
  };
  std::deque<Active> active;
  uint64_t next = 1, reported = 0;
  auto report = [&](uint64_t id, const Status& s, uint64_t bytes, int64_t ns, bool verified,
                    const std::string& msg) {
    std::string m = msg;
    std::replace(m.begin(), m.end(), '\n', ' ');
    ch.send("req " + std::to_string(id) + " " + std::to_string(static_cast<int>(s.code())) + " " +
            std::to_string(bytes) + " " + std::to_string(ns) + " " + (verified ? "1" : "0") + " " +
            m);
    ++reported;
  };
  while (reported < o.requests) {
    while (active.size() < o.window && next <= o.requests) {
      auto a = (*rx)->startRequest(next, o.tokens, 0, requestAuxFor(next));
      if (!a.isOk()) {
        if (a.status().code() == StatusCode::kResourceExhausted && !active.empty()) break;
        report(next, a.status(), 0, 0, false, a.status().toString());
        ++next;
        continue;
      }
      const CancelPoint cp = cancelPointFor(o, next);
      if (cp == CancelPoint::kGenAfterStart) (void)(*rx)->cancel(next);
      active.push_back({next, *a, cp});
      ++next;
    }
    if (active.empty()) continue;
    (void)(*rx)->wait(active.front().id, Clock::now() + milliseconds(20));
    for (auto it = active.begin(); it != active.end();) {
      auto res = (*rx)->poll(it->id);
      if (!res.isOk() || !res->terminal()) {
        ++it;
        continue;
      }
      bool verified = false;
      std::string msg = res->status.isOk() ? "" : res->status.toString();
      if (res->status.isOk()) {
        // With different tokens per block, kv moves the request's tokens only.
        const bool by_token = r.ctx_model.tokens_per_block != r.gen_model.tokens_per_block;
        auto check = checkRank(pool.layout(), mem, idsOf(it->alloc), it->id,
                               BlockRange{0, static_cast<uint32_t>(it->alloc.blocks.size())},
                               by_token ? o.tokens : UINT64_MAX);
        verified = check.isOk() && check->ok();
        if (!verified) msg = check.isOk() ? check->toString() : check.status().toString();
        if (verified && res->aux != firstTokenFor(it->id)) {
          verified = false;
          msg = "the context side's aux (" + std::to_string(res->aux.size()) +
                " bytes) is not the one markReady was given";
        }
        if (it->cp == CancelPoint::kGenAfterDone) (void)(*rx)->cancel(it->id);
      }
      report(it->id, res->status, res->bytes, res->latency.count(), verified, msg);
      (void)(*rx)->release(it->id);
      it = active.erase(it);
    }
  }
  // Quarantined pages come back when the last Done (or the peer's loss) arrives.
  waitCacheEmpty(pool, Clock::now() + std::chrono::seconds(30));
  engine::MetricsSnapshot m = (*rx)->metrics();
  const uint64_t leaked = leakedPages(pool);
  (*rx)->shutdown();
  ch.send("done " + std::to_string(leaked) + " " + m.toJson());
  return 0;
}

struct Child {
  pid_t pid = -1;
  bool context = false;
  uint32_t index = 0;
  std::unique_ptr<Channel> ch;
  bool done = false;
  std::string failure;
  uint64_t leaked = 0;
  nlohmann::json metrics;
};

// Forks one rank. The child closes every other child's pipe ends and never returns.
StatusOr<Child> spawn(std::vector<int>& parent_fds, bool context, uint32_t index,
                      const std::function<int(Channel&)>& body) {
  int to_child[2], from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0)
    return Unavailable("pipe: " + std::string(strerror(errno)));
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return Unavailable("pipe: " + std::string(strerror(errno)));
  }
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Unavailable("fork: " + std::string(strerror(errno)));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (int fd : parent_fds) ::close(fd);
    ::close(to_child[1]);
    ::close(from_child[0]);
    Channel ch(to_child[0], from_child[1]);
    const int rc = body(ch);
    std::fflush(nullptr);
    ::_exit(rc);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  parent_fds.push_back(to_child[1]);
  parent_fds.push_back(from_child[0]);
  Child c;
  c.pid = pid;
  c.context = context;
  c.index = index;
  c.ch = std::make_unique<Channel>(from_child[0], to_child[1]);
  return c;
}

struct RequestOutcome {
  int ranks = 0;
  Status status;
  bool verified = true;
  uint64_t bytes = 0;
  int64_t latency_ns = 0;
  std::string message;
};

int runDemo(const DemoOptions& o) {
  auto r = resolveDemo(o);
  if (!r.isOk()) return reportError(r.status());
  if (o.requests == 0 || o.tokens == 0 || o.window == 0) {
    return reportError(InvalidArgument("--requests, --tokens and --window must be > 0"));
  }
  const Resolved& res = *r;
  std::vector<int> fds;
  std::vector<Child> children;
  auto fail = [&](const Status& s) {
    for (auto& c : children) ::kill(c.pid, SIGKILL);
    for (auto& c : children) ::waitpid(c.pid, nullptr, 0);
    return reportError(s);
  };
  // Fork every rank before this process creates any transport object.
  for (uint32_t i = 0; i < res.ctx.worldSize(); ++i) {
    auto c = spawn(fds, true, i, [&, i](Channel& ch) {
      return contextChild(o, res, i % res.ctx.tp, i / res.ctx.tp, ch);
    });
    if (!c.isOk()) return fail(c.status());
    children.push_back(std::move(*c));
  }
  for (uint32_t i = 0; i < res.gen.worldSize(); ++i) {
    auto c = spawn(fds, false, i, [&, i](Channel& ch) {
      return generationChild(o, res, i % res.gen.tp, i / res.gen.tp, ch);
    });
    if (!c.isOk()) return fail(c.status());
    children.push_back(std::move(*c));
  }
  auto expectLine = [&](Child& c, const std::string& prefix) -> StatusOr<std::string> {
    auto line = c.ch->receive(milliseconds(120000));
    const std::string who =
        std::string(c.context ? "context" : "generation") + " rank " + std::to_string(c.index);
    if (!line) return Timeout(who + " did not answer");
    if (line->rfind("fail ", 0) == 0) return Unavailable(who + ": " + line->substr(5));
    if (line->rfind(prefix, 0) != 0) return Internal(who + " said '" + *line + "'");
    return line->substr(prefix.size());
  };
  std::vector<std::string> addresses;
  for (auto& c : children) {
    if (!c.context) continue;
    auto a = expectLine(c, "addr ");
    if (!a.isOk()) return fail(a.status());
    addresses.push_back(*a);
  }
  for (auto& c : children) {
    if (c.context) continue;
    for (const auto& a : addresses) c.ch->send("peer " + a);
  }
  for (auto& c : children) {
    if (c.context) continue;
    auto a = expectLine(c, "ready");
    if (!a.isOk()) return fail(a.status());
  }
  if (!o.json) {
    std::printf(
        "hxfer demo: %s, ctx tp %u pp %u (%s) -> gen tp %u pp %u (%s) over %s, %u requests"
        " x %u tokens, %u processes\n",
        res.model.name.c_str(), res.ctx.tp, res.ctx.pp, sideLabel(res, 0).c_str(), res.gen.tp,
        res.gen.pp, sideLabel(res, 1).c_str(),
        std::string(engine::backendName(res.backend)).c_str(), o.requests, o.tokens,
        static_cast<unsigned>(children.size()));
    std::fflush(stdout);
  }
  const auto start = Clock::now();
  for (auto& c : children) c.ch->send("go");

  std::map<uint64_t, RequestOutcome> outcomes;
  size_t gen_done = 0;
  const size_t gen_count = res.gen.worldSize();
  auto last_progress = start;
  uint64_t bytes_so_far = 0;
  Clock::time_point transfer_end = start;
  std::string protocol_error;
  while (gen_done < gen_count) {
    std::vector<pollfd> pfds;
    for (auto& c : children) pfds.push_back({c.ch->inFd(), POLLIN, 0});
    bool buffered = false;
    for (auto& c : children) buffered |= c.ch->hasBufferedLine();
    if (!buffered) ::poll(pfds.data(), pfds.size(), 200);
    for (size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (c.done || c.context) continue;
      if (!c.ch->hasBufferedLine() && !(pfds[i].revents & (POLLIN | POLLHUP))) continue;
      auto line = c.ch->receive(milliseconds(0));
      if (!line) continue;
      if (line->empty() || line->rfind("fail ", 0) == 0) {
        c.done = true;
        ++gen_done;
        c.failure = line->empty() ? "exited early" : line->substr(5);
        continue;
      }
      std::istringstream in(*line);
      std::string kind;
      in >> kind;
      if (kind == "req") {
        uint64_t id, bytes;
        int code, verified;
        int64_t ns;
        in >> id >> code >> bytes >> ns >> verified;
        std::string msg;
        std::getline(in, msg);
        RequestOutcome& out = outcomes[id];
        ++out.ranks;
        if (code != 0 && out.status.isOk()) {
          out.status = Status(static_cast<StatusCode>(code), msg);
        }
        if (code == 0 && !verified) {
          out.verified = false;
          out.message = msg;
        }
        out.bytes += bytes;
        out.latency_ns = std::max(out.latency_ns, ns);
        bytes_so_far += bytes;
      } else if (kind == "done") {
        in >> c.leaked;
        std::string js;
        std::getline(in, js);
        c.metrics = nlohmann::json::parse(js, nullptr, false);
        c.done = true;
        ++gen_done;
        transfer_end = Clock::now();
      } else {
        protocol_error = "generation rank said '" + *line + "'";
      }
    }
    const auto now = Clock::now();
    if (!o.json && now - last_progress > std::chrono::seconds(2)) {
      last_progress = now;
      size_t complete = 0;
      for (const auto& [id, out] : outcomes) complete += out.ranks == static_cast<int>(gen_count);
      const double secs = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "progress: %zu/%u requests, %.2f GB/s\n", complete, o.requests,
                   bytes_so_far / secs / 1e9);
    }
  }
  for (auto& c : children) {
    if (c.context) c.ch->send("finish");
  }
  for (auto& c : children) {
    if (!c.context) continue;
    auto d = expectLine(c, "done ");
    if (!d.isOk()) {
      c.failure = d.status().toString();
      continue;
    }
    std::istringstream in(*d);
    in >> c.leaked;
    std::string js;
    std::getline(in, js);
    c.metrics = nlohmann::json::parse(js, nullptr, false);
  }
  bool child_failed = false;
  for (auto& c : children) {
    int st = 0;
    ::waitpid(c.pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) child_failed = true;
  }
  for (int fd : fds) ::close(fd);

  // Summary.
  uint64_t ok = 0, failed = 0, cancelled = 0, bytes = 0, leaked = 0, aux_bad = 0;
  std::vector<int64_t> latencies;
  std::vector<std::string> failures;
  for (uint64_t id = 1; id <= o.requests; ++id) {
    auto it = outcomes.find(id);
    if (it == outcomes.end() || it->second.ranks != static_cast<int>(gen_count)) {
      ++failed;
      failures.push_back("request " + std::to_string(id) + ": not reported by every rank");
      continue;
    }
    const RequestOutcome& out = it->second;
    if (out.status.code() == StatusCode::kCancelled) {
      ++cancelled;
    } else if (!out.status.isOk() || !out.verified) {
      ++failed;
      failures.push_back("request " + std::to_string(id) + ": " +
                         (out.status.isOk() ? "mismatch: " + out.message : out.status.toString()));
    } else {
      ++ok;
      bytes += out.bytes;
      latencies.push_back(out.latency_ns);
    }
  }
  std::vector<std::string> rank_failures;
  for (const auto& c : children) {
    leaked += c.leaked;
    if (!c.failure.empty()) {
      rank_failures.push_back(std::string(c.context ? "context" : "generation") + " rank " +
                              std::to_string(c.index) + ": " + c.failure);
    }
    if (c.context && c.metrics.is_object()) aux_bad += c.metrics.value("aux_mismatches", 0ull);
  }
  std::sort(latencies.begin(), latencies.end());
  auto pct = [&](double q) -> double {
    if (latencies.empty()) return 0.0;
    size_t i = static_cast<size_t>(q * (latencies.size() - 1) + 0.5);
    return latencies[std::min(i, latencies.size() - 1)] / 1000.0;
  };
  const double secs = std::max(1e-9, std::chrono::duration<double>(transfer_end - start).count());
  const double gbps = bytes / secs / 1e9;
  const bool pass = failed == 0 && leaked == 0 && aux_bad == 0 && rank_failures.empty() &&
                    !child_failed && protocol_error.empty();
  if (o.json) {
    nlohmann::json j;
    j["model"] = res.model.name;
    j["ctx"] = {{"tp", res.ctx.tp},
                {"pp", res.ctx.pp},
                {"layout", layoutLabel(res.ctx_engine)},
                {"engine", res.ctx_engine.toString()},
                {"tokens_per_block", res.ctx_model.tokens_per_block}};
    j["gen"] = {{"tp", res.gen.tp},
                {"pp", res.gen.pp},
                {"layout", layoutLabel(res.gen_engine)},
                {"engine", res.gen_engine.toString()},
                {"tokens_per_block", res.gen_model.tokens_per_block}};
    j["backend"] = engine::backendName(res.backend);
    j["routing"] = res.decisions;
    j["requests"] = o.requests;
    j["tokens"] = o.tokens;
    j["ok"] = ok;
    j["failed"] = failed;
    j["cancelled"] = cancelled;
    j["bytes"] = bytes;
    j["seconds"] = secs;
    j["gbps"] = gbps;
    j["latency_us"] = {{"p50", pct(0.5)}, {"p99", pct(0.99)}};
    j["leaked_pages"] = leaked;
    j["aux_mismatches"] = aux_bad;
    j["failures"] = failures;
    j["rank_failures"] = rank_failures;
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& c : children) {
      ranks.push_back({{"role", c.context ? "context" : "generation"},
                       {"index", c.index},
                       {"leaked_pages", c.leaked},
                       {"metrics", c.metrics}});
    }
    j["ranks"] = ranks;
    j["pass"] = pass;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("requests: %llu ok, %llu failed, %llu cancelled (of %u)\n",
                static_cast<unsigned long long>(ok), static_cast<unsigned long long>(failed),
                static_cast<unsigned long long>(cancelled), o.requests);
    std::printf("bytes: %llu in %.3f s = %.3f GB/s (fill, transfer and check together)\n",
                static_cast<unsigned long long>(bytes), secs, gbps);
    std::printf("latency: p50 %.1f us, p99 %.1f us\n", pct(0.5), pct(0.99));
    uint64_t expired = 0, quarantined = 0;
    for (const auto& c : children) {
      if (!c.metrics.is_object()) continue;
      expired += c.metrics.value("leases_expired", 0ull);
      quarantined += c.metrics.value("quarantined_requests", 0ull);
    }
    std::printf("leases expired: %llu, requests quarantined: %llu, leaked pages: %llu\n",
                static_cast<unsigned long long>(expired),
                static_cast<unsigned long long>(quarantined),
                static_cast<unsigned long long>(leaked));
    for (size_t i = 0; i < failures.size() && i < 10; ++i) {
      std::printf("  %s\n", failures[i].c_str());
    }
    for (const auto& f : rank_failures) std::printf("  %s\n", f.c_str());
    if (aux_bad)
      std::printf("  aux payload mismatches: %llu\n", static_cast<unsigned long long>(aux_bad));
    if (!protocol_error.empty()) std::printf("  %s\n", protocol_error.c_str());
    std::printf("%s\n", pass ? "PASS" : "FAIL");
  }
  return pass ? 0 : 1;
}

}  // namespace

void addDemoCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "demo", "Run context and generation ranks as processes, move state and verify every byte");
  auto o = std::make_shared<DemoOptions>();
  addModelOptions(cmd, &o->model);
  addParallelSize(cmd, "--ctx-tp", &o->ctx_tp, "Context tensor parallel size", 2);
  addParallelSize(cmd, "--gen-tp", &o->gen_tp, "Generation tensor parallel size", 1);
  addParallelSize(cmd, "--ctx-pp", &o->ctx_pp, "Context pipeline parallel size", 1);
  addParallelSize(cmd, "--gen-pp", &o->gen_pp, "Generation pipeline parallel size", 1);
  cmd->add_option("--requests", o->requests, "Number of requests")->default_val(32);
  cmd->add_option("--tokens", o->tokens, "Prompt tokens per request")->default_val(1000);
  cmd->add_option("--backend", o->backend, "auto, shm or ucx")->default_val("auto");
  cmd->add_option("--ctx-layout", o->ctx_layout, "Context state layout: auto, paged, layer-major")
      ->default_val("auto");
  cmd->add_option("--gen-layout", o->gen_layout,
                  "Generation state layout: auto, paged, layer-major")
      ->default_val("auto");
  addEngineOptions(cmd, &o->ctx_engine, "ctx");
  addEngineOptions(cmd, &o->gen_engine, "gen");
  cmd->add_option("--cancel-fraction", o->cancel_fraction,
                  "Fraction of requests cancelled at a random point on a random side")
      ->default_val(0.0)
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--cancel-at", o->cancel_at,
                  "Where cancelled requests are cancelled: any (drawn per request), "
                  "gen-after-start, gen-after-done, ctx-before-ready, ctx-after-ready")
      ->default_val("any");
  cmd->add_option("--seed", o->seed, "Seed of the cancellation choices")->default_val(1);
  cmd->add_option("--window", o->window, "Requests in flight per rank")->default_val(8);
  cmd->add_option("--timeout", o->timeout_s, "Per-request timeout in seconds")->default_val(60);
  cmd->add_flag("--checksum", o->checksum, "End-to-end xxh3 checksum per request part");
  cmd->add_flag("--json", o->json, "Print the summary as JSON");
  cmd->callback([o] {
    const int rc = runDemo(*o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace hxfer::cli
