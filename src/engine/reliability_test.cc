// Reliability tests of the transceiver end to end (docs/reliability.md): real process kills on
// either side, a lost control message, a peer delayed past the timeout, a peer restarted with
// an incompatible layout, cancellation races on both sides, hostile peers speaking well-formed
// wire messages, and a load run over 2 context and 2 generation ranks.
//
// Every test proves the same four things about a fault: the affected requests fail with a
// clear status, the unaffected ones complete and every byte verifies against the oracle, pool
// accounting returns to its start on every surviving rank, and the engine keeps serving.
// Generation pools start filled with a sentinel; records never handed to a request must still
// hold it at the end ("no byte outside a request's own pages is written").
//
// Ranks are threads with their own agents over shm, or forked processes where a real kill is
// the point (forked before any thread or transport object exists in the test). Deadlines are
// generous and nothing asserts on time: the box may be loaded.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/coding.h"
#include "common/crc32c.h"
#include "common/logging.h"
#include "engine/context_sender.h"
#include "engine/generation_receiver.h"
#include "engine/handshake.h"
#include "model/presets.h"
#include "plan/oracle.h"
#include "transport/fault.h"
#include "transport/transfer_core.h"
#include "transport/transport.h"
#include "wire/messages.h"
#include "wire/rank_info.h"

namespace hxfer::engine {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using transport::Agent;

constexpr uint8_t kSentinel = 0xA5;

Clock::time_point deadline(seconds s = seconds(60)) { return Clock::now() + s; }

ModelSpec tinyModel() {
  auto m = loadPreset(kDefaultPreset);
  EXPECT_TRUE(m.isOk()) << m.status().toString();
  return m.isOk() ? *m : ModelSpec{};
}

// A listen name unique to this process (abstract Unix socket names are host-wide).
std::string uniqueName(const std::string& what) {
  static std::atomic<int> counter{0};
  return "hxrel-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + "-" + what;
}
std::string shmAddress(const std::string& name) { return "shm:@" + name; }

// Captures the lines of the hxfer logger while alive. Create it before any engine object and
// destroy it after all of them (the logger's sink list is not meant to change while logging).
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<Sink>()) {
    logger().sinks().push_back(sink_);
    old_level_ = logger().level();
    if (old_level_ > spdlog::level::warn) logger().set_level(spdlog::level::warn);
  }
  ~LogCapture() {
    auto& sinks = logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    logger().set_level(old_level_);
  }
  // True when one logged line contains every needle.
  bool has(std::initializer_list<std::string_view> needles) const {
    for (const std::string& line : sink_->lines()) {
      if (std::all_of(needles.begin(), needles.end(),
                      [&](std::string_view n) { return line.find(n) != std::string::npos; })) {
        return true;
      }
    }
    return false;
  }
  std::string all() const {
    std::string out;
    for (const std::string& l : sink_->lines()) out += l + "\n";
    return out;
  }

 private:
  class Sink : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::vector<std::string> lines() {
      std::lock_guard lock(mutex_);
      return lines_;
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& msg) override {
      lines_.emplace_back(msg.payload.data(), msg.payload.size());
    }
    void flush_() override {}

   private:
    std::vector<std::string> lines_;  // guarded by mutex_
  };
  std::shared_ptr<Sink> sink_;
  spdlog::level::level_enum old_level_;
};

// Forwards to an inner agent; while held, outgoing control messages queue (in order) and go
// out on release(): a peer that is slow to answer, delayed past the other side's timeout.
class HoldAgent final : public Agent {
 public:
  explicit HoldAgent(std::unique_ptr<Agent> inner) : inner_(std::move(inner)) {}
  void hold() {
    std::lock_guard lock(mu_);
    held_ = true;
  }
  void release() {
    std::lock_guard lock(mu_);
    held_ = false;
    for (auto& [peer, bytes] : queue_) (void)inner_->sendMessage(peer, bytes);
    queue_.clear();
  }
  // Sends the oldest held message and keeps holding the rest.
  bool releaseOne() {
    std::lock_guard lock(mu_);
    if (queue_.empty()) return false;
    (void)inner_->sendMessage(queue_.front().first, queue_.front().second);
    queue_.pop_front();
    return true;
  }
  size_t heldMessages() const {
    std::lock_guard lock(mu_);
    return queue_.size();
  }

  const transport::Capabilities& capabilities() const override { return inner_->capabilities(); }
  std::string localAddress() const override { return inner_->localAddress(); }
  StatusOr<std::vector<uint8_t>> registerRegion(const Region& r,
                                                transport::RegionAccess access) override {
    return inner_->registerRegion(r, access);
  }
  Status deregisterRegion(uint32_t id) override { return inner_->deregisterRegion(id); }
  StatusOr<transport::PeerId> connect(const std::string& a) override { return inner_->connect(a); }
  Status disconnect(transport::PeerId p) override { return inner_->disconnect(p); }
  Status addRemoteRegion(transport::PeerId p, uint32_t id, uint64_t len,
                         std::span<const uint8_t> key) override {
    return inner_->addRemoteRegion(p, id, len, key);
  }
  StatusOr<transport::Transfer> postWrite(transport::PeerId p,
                                          std::vector<transport::WriteOp> ops) override {
    return inner_->postWrite(p, std::move(ops));
  }
  Status sendMessage(transport::PeerId p, std::span<const uint8_t> payload) override {
    std::lock_guard lock(mu_);
    if (held_) {
      queue_.emplace_back(p, std::vector<uint8_t>(payload.begin(), payload.end()));
      return OkStatus();
    }
    return inner_->sendMessage(p, payload);
  }
  std::optional<transport::Event> pollEvent(milliseconds timeout) override {
    return inner_->pollEvent(timeout);
  }
  transport::AgentStats agentStats() const override { return inner_->agentStats(); }
  void requireWriteGrants() override { inner_->requireWriteGrants(); }
  Status grantWrites(transport::PeerId p) override { return inner_->grantWrites(p); }

 private:
  std::unique_ptr<Agent> inner_;
  mutable std::mutex mu_;
  bool held_ = false;                                                     // guarded by mu_
  std::deque<std::pair<transport::PeerId, std::vector<uint8_t>>> queue_;  // guarded by mu_
};

StatusOr<std::unique_ptr<Agent>> shmAgent(const std::string& listen, const std::string& label,
                                          const std::string& token = "") {
  transport::AgentConfig ac;
  ac.auth_token = token;
  ac.backend = "shm";
  ac.listen = listen;
  ac.label = label;
  return transport::createAgent(ac);
}

// The serving code of a context rank: when a request is first asked for, allocate its pages,
// fill them with the oracle and mark them ready. Runs on the sender's progress thread.
struct AutoServe {
  HybridCacheManager* cache = nullptr;
  std::atomic<ContextSender*> sender{nullptr};
  std::atomic<uint64_t> served{0}, exhausted{0};
  void operator()(uint64_t id, uint64_t tokens) {
    ContextSender* s = sender.load();
    if (s == nullptr) return;
    auto a = cache->allocate(id, static_cast<uint32_t>(tokens));
    if (!a.isOk()) {
      ++exhausted;
      (void)s->cancel(id);  // answers the ask instead of letting it wait for the lease
      return;
    }
    Status f =
        fillRank(cache->layout(), cacheMemory(*cache), RankIds{a->blocks, a->slot.value_or(0)}, id);
    if (!f.isOk()) {
      (void)cache->free(id);
      (void)s->cancel(id);
      return;
    }
    Status st = s->markReady(id);
    // Cancelled: the sender freed the pages itself (the request was cancelled before ready).
    if (!st.isOk() && st.code() != StatusCode::kCancelled) (void)cache->free(id);
    if (st.isOk()) ++served;
  }
};

struct CtxRank {
  std::unique_ptr<HybridCacheManager> cache;
  std::shared_ptr<AutoServe> serve;
  Agent* agent = nullptr;  // owned by the sender; valid while it lives
  std::unique_ptr<ContextSender> sender;
};

// Starts context rank `rank` of `pc` listening on `listen`. `wrap` may decorate its agent.
// hxfer's own layouts by StateLayout, or any engine layout.
struct LayoutChoice {
  EngineLayout engine;
  LayoutChoice(StateLayout s) : engine{Engine::kHxfer, s} {}  // NOLINT: implicit on purpose
  LayoutChoice(EngineLayout e) : engine(e) {}                 // NOLINT
};

StatusOr<CtxRank> startContext(
    const ModelSpec& model, const ParallelConfig& pc, uint32_t rank, const std::string& listen,
    LayoutChoice layout, Capacity capacity,
    std::function<std::unique_ptr<Agent>(std::unique_ptr<Agent>)> wrap = nullptr,
    const std::string& token = "", std::function<void(ContextSender::Options&)> tune = nullptr) {
  CtxRank c;
  ASSIGN_OR_RETURN(c.cache,
                   HybridCacheManager::create(model, pc, rank % pc.tp, rank / pc.tp, layout.engine,
                                              capacity, Region::Backing::kMemfd));
  ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent,
                   shmAgent(listen, "ctx" + std::to_string(rank), token));
  if (wrap) agent = wrap(std::move(agent));
  c.agent = agent.get();
  c.serve = std::make_shared<AutoServe>();
  c.serve->cache = c.cache.get();
  ContextSender::Options so;
  so.instance_id = "ctx";
  so.model = model;
  so.parallel = pc;
  so.tp_rank = rank % pc.tp;
  so.pp_rank = rank / pc.tp;
  so.on_request = [serve = c.serve](uint64_t id, uint64_t tokens, const Bytes&) {
    (*serve)(id, tokens);
  };
  if (tune) tune(so);
  ASSIGN_OR_RETURN(c.sender, ContextSender::create(so, c.cache.get(), std::move(agent)));
  c.serve->sender = c.sender.get();
  return c;
}

struct GenRank {
  std::unique_ptr<HybridCacheManager> cache;
  Agent* agent = nullptr;  // owned by the receiver
  std::unique_ptr<GenerationReceiver> rx;
  std::mutex mu;
  std::set<uint32_t> used_blocks, used_slots;  // guarded by mu: every page ever handed out

  StatusOr<Allocation> start(uint64_t id, uint32_t tokens) {
    auto a = rx->startRequest(id, tokens);
    if (a.isOk()) {
      std::lock_guard lock(mu);
      used_blocks.insert(a->blocks.begin(), a->blocks.end());
      if (a->slot) used_slots.insert(*a->slot);
    }
    return a;
  }
  // Oracle check of a completed request's pages.
  StatusOr<OracleReport> verify(uint64_t id) const {
    ASSIGN_OR_RETURN(Allocation a, cache->find(id));
    return checkRank(cache->layout(), cacheMemory(*cache), RankIds{a.blocks, a.slot.value_or(0)},
                     id, BlockRange{0, static_cast<uint32_t>(a.blocks.size())});
  }
  // Bytes of the pools outside every page ever handed out that no longer hold the sentinel.
  uint64_t strayBytes(std::string* where) {
    std::lock_guard lock(mu);
    const RankLayout& layout = cache->layout();
    uint64_t stray = 0;
    for (const auto& region : cache->regions()) {
      std::vector<uint8_t> mine(region->length(), 0);
      for (const PoolView& v : layout.views) {
        if (v.region_id != region->id()) continue;
        const auto& used = v.role == Role::kKv ? used_blocks : used_slots;
        for (uint32_t index : used) {
          for (uint32_t l = 0; l < v.layers.size(); ++l) {
            const uint64_t off = v.offset(index, l);
            std::fill(mine.begin() + off, mine.begin() + off + v.record_bytes, 1);
          }
        }
      }
      for (uint64_t i = 0; i < region->length(); ++i) {
        if (!mine[i] && region->data()[i] != kSentinel) {
          if (stray == 0 && where) {
            *where = "region " + std::to_string(region->id()) + " offset " + std::to_string(i);
          }
          ++stray;
        }
      }
    }
    return stray;
  }
};

StatusOr<std::unique_ptr<GenRank>> startGeneration(
    const ModelSpec& model, const ParallelConfig& pc, uint32_t rank, StateLayout layout,
    Capacity capacity, const ParallelConfig& ctx_pc, std::vector<std::string> ctx_addresses,
    milliseconds request_timeout = milliseconds(60000),
    std::function<std::unique_ptr<Agent>(std::unique_ptr<Agent>)> wrap = nullptr,
    const std::string& token = "") {
  auto g = std::make_unique<GenRank>();
  ASSIGN_OR_RETURN(g->cache, HybridCacheManager::create(model, pc, rank % pc.tp, rank / pc.tp,
                                                        layout, capacity, Region::Backing::kMemfd));
  for (const auto& r : g->cache->regions()) std::memset(r->data(), kSentinel, r->length());
  ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent, shmAgent("", "gen" + std::to_string(rank), token));
  if (wrap) agent = wrap(std::move(agent));
  g->agent = agent.get();
  GenerationReceiver::Options ro;
  ro.instance_id = "gen";
  ro.model = model;
  ro.parallel = pc;
  ro.tp_rank = rank % pc.tp;
  ro.pp_rank = rank / pc.tp;
  ro.ctx_parallel = ctx_pc;
  ro.ctx_addresses = std::move(ctx_addresses);
  ro.request_timeout = request_timeout;
  ro.reconnect_interval = milliseconds(100);
  ASSIGN_OR_RETURN(g->rx, GenerationReceiver::create(ro, g->cache.get(), std::move(agent)));
  return g;
}

// Polls `cond` until it holds or the test deadline passes; returns its last value (`cond` is
// not called again once it held: it may have side effects).
template <class Cond>
bool waitUntil(Cond cond) {
  const auto end = deadline();
  bool met = cond();
  while (!met && Clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(2));
    met = cond();
  }
  return met;
}

// No used, quarantined or in-flight page: the rank's pool accounting is back at its start.
bool pagesFree(const HybridCacheManager& cache, std::string* why) {
  const CacheCounters c = cache.counters();
  const bool ok = c.used_blocks == 0 && c.used_slots == 0 && c.quarantined_blocks == 0 &&
                  c.quarantined_slots == 0 && c.inflight_transfers == 0 &&
                  c.free_blocks == c.total_blocks && c.free_slots == c.total_slots;
  if (!ok && why) {
    *why = "used blocks " + std::to_string(c.used_blocks) + " slots " +
           std::to_string(c.used_slots) + ", quarantined blocks " +
           std::to_string(c.quarantined_blocks) + " slots " + std::to_string(c.quarantined_slots) +
           ", in flight " + std::to_string(c.inflight_transfers);
  }
  return ok;
}
void expectPagesFree(const HybridCacheManager& cache, const std::string& who) {
  std::string why;
  EXPECT_TRUE(waitUntil([&] { return pagesFree(cache, &why); })) << who << ": " << why;
  Status check = cache.selfCheck();
  EXPECT_TRUE(check.isOk()) << who << ": " << check.toString();
}

// Runs one request on `gens` (same id on each), waits, verifies every byte and releases it.
void runAndVerify(const std::vector<GenRank*>& gens, uint64_t id, uint32_t tokens) {
  for (GenRank* g : gens) {
    auto a = g->start(id, tokens);
    ASSERT_TRUE(a.isOk()) << "request " << id << ": " << a.status().toString();
  }
  for (GenRank* g : gens) {
    auto r = g->rx->wait(id, deadline());
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    ASSERT_EQ(r->state, RequestResult::State::kDone)
        << "request " << id << ": " << r->status.toString();
    auto report = g->verify(id);
    ASSERT_TRUE(report.isOk()) << report.status().toString();
    EXPECT_TRUE(report->ok()) << report->toString();
    EXPECT_GT(report->bytes_checked, 0u);
    ASSERT_TRUE(g->rx->release(id).isOk());
  }
}

void expectNoStrayBytes(GenRank& g, const std::string& who) {
  std::string where;
  EXPECT_EQ(g.strayBytes(&where), 0u) << who << ": first stray byte at " << where;
}

// ---------------------------------------------------------------------------------------------
// Child processes. Forked before the test creates any thread; a child waits for kGo on its
// command pipe, runs its body and _exits with the body's code (never returns into gtest).

constexpr char kGo = 'G';
constexpr char kQuit = 'Q';
constexpr char kReady = 'R';
constexpr char kPosted = 'P';
constexpr char kStarted = 'S';

class Child {
 public:
  using Body = std::function<int(int cmd_fd, int report_fd)>;
  static std::unique_ptr<Child> spawn(Body body) {
    int cmd[2], rep[2];
    if (pipe(cmd) != 0 || pipe(rep) != 0) return nullptr;
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      close(cmd[1]);
      close(rep[0]);
      char c = 0;
      if (read(cmd[0], &c, 1) != 1 || c != kGo) _exit(0);  // never started: nothing to do
      _exit(body(cmd[0], rep[1]));
    }
    close(cmd[0]);
    close(rep[1]);
    auto child = std::unique_ptr<Child>(new Child);
    child->pid_ = pid;
    child->cmd_ = cmd[1];
    child->rep_ = rep[0];
    return child;
  }
  ~Child() {
    if (pid_ > 0) kill();
    close(cmd_);
    close(rep_);
  }
  bool send(char c) { return write(cmd_, &c, 1) == 1; }
  // Reads report bytes until `c` arrives (true) or the deadline / EOF (false).
  bool expect(char c, seconds timeout = seconds(60)) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end) {
      pollfd p{rep_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char got = 0;
      if (read(rep_, &got, 1) != 1) return false;
      if (got == c) return true;
    }
    return false;
  }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
  }
  // Waits for a normal exit; its code, or -1 when it did not exit by itself in time.
  int join(seconds timeout = seconds(60)) {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end) {
      int st = 0;
      const pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return -1;
  }

 private:
  Child() = default;
  pid_t pid_ = -1;
  int cmd_ = -1, rep_ = -1;
};

void report(int fd, char c) { (void)!write(fd, &c, 1); }

// Context rank `rank` of `pc` serving until kQuit (exit 0) or killed. With `write_delay` every
// write completes only that long after it was posted (it stays in flight); kPosted is reported
// once `report_after` writes have been posted.
int contextChild(int cmd, int rep, const ModelSpec& model, ParallelConfig pc, uint32_t rank,
                 std::string listen, milliseconds write_delay, uint64_t report_after) {
  std::function<std::unique_ptr<Agent>(std::unique_ptr<Agent>)> wrap;
  if (write_delay.count() > 0) {
    wrap = [&](std::unique_ptr<Agent> a) {
      transport::FaultPolicy p;
      p.write_delay = write_delay;
      return transport::wrapWithFaults(std::move(a), p);
    };
  }
  auto c =
      startContext(model, pc, rank, listen, StateLayout::kPaged, Capacity::counts(128, 32), wrap);
  if (!c.isOk()) return 10;
  report(rep, kReady);
  bool posted = false;
  while (true) {
    pollfd p{cmd, POLLIN, 0};
    if (::poll(&p, 1, 10) > 0) {
      char got = 0;
      if (read(cmd, &got, 1) != 1 || got == kQuit) break;
    }
    if (!posted && report_after > 0 &&
        transport::faultStats(*c->agent).writes_delayed >= report_after) {
      report(rep, kPosted);
      posted = true;
    }
  }
  c->sender->shutdown();
  std::string why;
  return pagesFree(*c->cache, &why) ? 0 : 11;
}

// Generation rank `rank` of `pc`: starts `n` requests (ids from `first_id`). `verify`: waits
// for them, checks every byte and exits 0 when all verified; otherwise reports kStarted and
// idles until killed.
int generationChild(int cmd, int rep, const ModelSpec& model, ParallelConfig pc, uint32_t rank,
                    ParallelConfig ctx_pc, std::vector<std::string> ctx_addresses,
                    uint64_t first_id, int n, bool verify) {
  auto g = startGeneration(model, pc, rank, StateLayout::kPaged, Capacity::counts(128, 32), ctx_pc,
                           ctx_addresses);
  if (!g.isOk()) return 20;
  if (!(*g)->rx->waitForPeers(deadline()).isOk()) return 21;
  for (int i = 0; i < n; ++i) {
    if (!(*g)->start(first_id + i, 50 + 7 * i).isOk()) return 22;
  }
  if (!verify) {
    report(rep, kStarted);
    while (true) pause();
  }
  for (int i = 0; i < n; ++i) {
    auto r = (*g)->rx->wait(first_id + i, deadline());
    if (!r.isOk() || r->state != RequestResult::State::kDone) return 23;
    auto report = (*g)->verify(first_id + i);
    if (!report.isOk() || !report->ok()) return 24;
    if (!(*g)->rx->release(first_id + i).isOk()) return 25;
  }
  (*g)->rx->shutdown();
  std::string why;
  return pagesFree(*(*g)->cache, &why) ? 0 : 26;
}

// Same TP on both sides: generation rank r reads only from context rank r, so a fault on one
// pair leaves the other pair's requests unaffected.
const ParallelConfig kTp1{1, 1, {}};
const ParallelConfig kTp2{2, 1, {}};

// ---------------------------------------------------------------------------------------------
// Faults

TEST(Faults, ContextProcessKilledMidTransferFailsOnlyItsRequestsAndRestartServesAgain) {
  const ModelSpec model = tinyModel();
  const std::string ctx0 = uniqueName("ctx0"), ctx1 = uniqueName("ctx1");
  constexpr int kInFlight = 6;
  // Incarnation 1 of context rank 1: every write stays in flight for a minute (it is killed
  // long before). Incarnation 2: restarted at the same address, healthy.
  auto first = Child::spawn([&](int cmd, int rep) {
    return contextChild(cmd, rep, model, kTp2, 1, ctx1, milliseconds(60000), kInFlight);
  });
  auto second = Child::spawn([&](int cmd, int rep) {
    return contextChild(cmd, rep, model, kTp2, 1, ctx1, milliseconds(0), 0);
  });
  ASSERT_TRUE(first && second);
  ASSERT_TRUE(first->send(kGo));
  ASSERT_TRUE(first->expect(kReady));

  auto c0 = startContext(model, kTp2, 0, ctx0, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c0.isOk()) << c0.status().toString();
  const std::vector<std::string> addrs = {shmAddress(ctx0), shmAddress(ctx1)};
  auto g0 =
      startGeneration(model, kTp2, 0, StateLayout::kPaged, Capacity::counts(128, 32), kTp2, addrs);
  auto g1 =
      startGeneration(model, kTp2, 1, StateLayout::kPaged, Capacity::counts(128, 32), kTp2, addrs);
  ASSERT_TRUE(g0.isOk() && g1.isOk());
  ASSERT_EQ((*g0)->rx->contextRanks(), std::vector<uint32_t>{0});
  ASSERT_EQ((*g1)->rx->contextRanks(), std::vector<uint32_t>{1});
  ASSERT_TRUE((*g0)->rx->waitForPeers(deadline()).isOk());
  ASSERT_TRUE((*g1)->rx->waitForPeers(deadline()).isOk());

  // Requests towards the doomed rank: posted, in flight when it dies.
  for (int i = 0; i < kInFlight; ++i) ASSERT_TRUE((*g1)->start(100 + i, 40 + 9 * i).isOk());
  ASSERT_TRUE(first->expect(kPosted)) << "the context child never posted its writes";
  // Requests of the other pair run before, across and after the kill.
  for (int i = 0; i < 4; ++i) runAndVerify({g0->get()}, 1 + i, 30 + 11 * i);
  first->kill();
  for (int i = 0; i < kInFlight; ++i) {
    auto r = (*g1)->rx->wait(100 + i, deadline());
    ASSERT_TRUE(r.isOk());
    EXPECT_EQ(r->state, RequestResult::State::kFailed);
    EXPECT_EQ(r->status.code(), StatusCode::kUnavailable) << r->status.toString();
    EXPECT_NE(r->status.message().find("context rank 1"), std::string::npos)
        << r->status.toString();
    ASSERT_TRUE((*g1)->rx->release(100 + i).isOk());
  }
  for (int i = 0; i < 4; ++i) runAndVerify({g0->get()}, 10 + i, 64);
  // The pages of the failed requests are free again: no context rank can write into them.
  expectPagesFree(*(*g1)->cache, "gen 1 after the kill");
  // While the rank is down its requests fail at once rather than hang.
  EXPECT_EQ((*g1)->rx->startRequest(200, 10).status().code(), StatusCode::kUnavailable);

  // Restarted at the same address: the generation rank reconnects and is served again.
  ASSERT_TRUE(second->send(kGo));
  ASSERT_TRUE(second->expect(kReady));
  ASSERT_TRUE((*g1)->rx->waitForPeers(deadline()).isOk());
  for (int i = 0; i < 3; ++i) runAndVerify({g1->get()}, 300 + i, 50 + 20 * i);
  runAndVerify({g0->get()}, 400, 70);
  EXPECT_GE((*g1)->rx->metrics().failuresBy(FailureCause::kPeerLost), uint64_t{kInFlight});
  EXPECT_GE((*g1)->rx->metrics().reconnects, 1u);
  ASSERT_TRUE(second->send(kQuit));
  EXPECT_EQ(second->join(), 0) << "the restarted context rank did not end with free pages";

  expectPagesFree(*(*g0)->cache, "gen 0");
  expectPagesFree(*(*g1)->cache, "gen 1");
  expectPagesFree(*c0->cache, "ctx 0");
  EXPECT_EQ(c0->sender->heldRequests(), 0u);
  expectNoStrayBytes(**g0, "gen 0");
  expectNoStrayBytes(**g1, "gen 1");
}

TEST(Faults, GenerationProcessKilledMidTransferFreesTheContextSideAndServesTheNextOne) {
  const ModelSpec model = tinyModel();
  const std::string ctx0 = uniqueName("ctx0"), ctx1 = uniqueName("ctx1");
  const std::vector<std::string> addrs = {shmAddress(ctx0), shmAddress(ctx1)};
  constexpr int kInFlight = 6;
  auto doomed = Child::spawn([&](int cmd, int rep) {
    return generationChild(cmd, rep, model, kTp2, 1, kTp2, addrs, 100, kInFlight, false);
  });
  auto next = Child::spawn([&](int cmd, int rep) {
    return generationChild(cmd, rep, model, kTp2, 1, kTp2, addrs, 500, 3, true);
  });
  ASSERT_TRUE(doomed && next);

  auto c0 = startContext(model, kTp2, 0, ctx0, StateLayout::kPaged, Capacity::counts(128, 32));
  // Context rank 1's writes complete 1.5 s after posting: in flight when the reader dies.
  auto c1 = startContext(model, kTp2, 1, ctx1, StateLayout::kPaged, Capacity::counts(128, 32),
                         [](std::unique_ptr<Agent> a) {
                           transport::FaultPolicy p;
                           p.write_delay = milliseconds(1500);
                           return transport::wrapWithFaults(std::move(a), p);
                         });
  ASSERT_TRUE(c0.isOk() && c1.isOk());
  auto g0 =
      startGeneration(model, kTp2, 0, StateLayout::kPaged, Capacity::counts(128, 32), kTp2, addrs);
  ASSERT_TRUE(g0.isOk());
  ASSERT_TRUE((*g0)->rx->waitForPeers(deadline()).isOk());

  ASSERT_TRUE(doomed->send(kGo));
  ASSERT_TRUE(doomed->expect(kStarted));
  waitUntil([&] { return transport::faultStats(*c1->agent).writes_delayed >= kInFlight; });
  ASSERT_GE(transport::faultStats(*c1->agent).writes_delayed, uint64_t{kInFlight});
  runAndVerify({g0->get()}, 1, 60);
  doomed->kill();
  runAndVerify({g0->get()}, 2, 60);

  // The context rank frees the dead reader's source pages once the writes reach a terminal
  // state; nothing waits for an answer nobody can receive.
  expectPagesFree(*c1->cache, "ctx 1 after the generation rank died");
  waitUntil([&] { return c1->sender->connectedPeers() == 0; });
  EXPECT_EQ(c1->sender->heldRequests(), 0u);
  EXPECT_GE(c1->sender->metrics().peers_lost, 1u);

  // A new generation process is served by the same context rank; it verifies every byte.
  ASSERT_TRUE(next->send(kGo));
  EXPECT_EQ(next->join(), 0) << "the next generation rank did not verify its requests";
  runAndVerify({g0->get()}, 3, 90);

  expectPagesFree(*c0->cache, "ctx 0");
  expectPagesFree(*c1->cache, "ctx 1");
  expectPagesFree(*(*g0)->cache, "gen 0");
  expectNoStrayBytes(**g0, "gen 0");
}

// Two rank-local pairs in this process, built by the fault tests below.
struct Pairs {
  std::string ctx_names[2];
  CtxRank ctx[2];
  std::unique_ptr<GenRank> gen[2];
  ~Pairs() {
    for (auto& g : gen) {
      if (g) g->rx->shutdown();
    }
    for (auto& c : ctx) {
      if (c.sender) c.sender->shutdown();
    }
  }
};

using Wrap = std::function<std::unique_ptr<Agent>(std::unique_ptr<Agent>)>;

// Every rank of the pairs has its pool accounting back at the start; no stray byte anywhere.
void expectPairsClean(Pairs& p) {
  for (int i = 0; i < 2; ++i) {
    expectPagesFree(*p.ctx[i].cache, "ctx " + std::to_string(i));
    expectPagesFree(*p.gen[i]->cache, "gen " + std::to_string(i));
    Status ctx = p.ctx[i].sender->selfCheck(), gen = p.gen[i]->rx->selfCheck();
    EXPECT_TRUE(ctx.isOk()) << "ctx " << i << ": " << ctx.toString();
    EXPECT_TRUE(gen.isOk()) << "gen " << i << ": " << gen.toString();
    expectNoStrayBytes(*p.gen[i], "gen " + std::to_string(i));
  }
}

void startPairs(Pairs& p, const ModelSpec& model, Wrap ctx1_wrap, Wrap gen1_wrap,
                milliseconds gen1_timeout) {
  for (int i = 0; i < 2; ++i) {
    p.ctx_names[i] = uniqueName("ctx" + std::to_string(i));
    auto c = startContext(model, kTp2, i, p.ctx_names[i], StateLayout::kPaged,
                          Capacity::counts(128, 32), i == 1 ? ctx1_wrap : nullptr);
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    p.ctx[i] = std::move(*c);
  }
  const std::vector<std::string> addrs = {shmAddress(p.ctx_names[0]), shmAddress(p.ctx_names[1])};
  for (int i = 0; i < 2; ++i) {
    auto g =
        startGeneration(model, kTp2, i, StateLayout::kPaged, Capacity::counts(128, 32), kTp2, addrs,
                        i == 1 ? gen1_timeout : milliseconds(60000), i == 1 ? gen1_wrap : nullptr);
    ASSERT_TRUE(g.isOk()) << g.status().toString();
    p.gen[i] = std::move(*g);
  }
  for (auto& g : p.gen) ASSERT_TRUE(g->rx->waitForPeers(deadline()).isOk());
}

TEST(Faults, LostTransferRequestTimesOutAloneAndItsPagesComeBack) {
  const ModelSpec model = tinyModel();
  Pairs p;
  // Generation rank 1's messages: #1 Hello, #2 the first request, #3 the second: lost.
  transport::FaultPolicy policy;
  policy.drop_nth_message = 3;
  startPairs(
      p, model, nullptr,
      [&](std::unique_ptr<Agent> a) { return transport::wrapWithFaults(std::move(a), policy); },
      milliseconds(3000));
  if (HasFatalFailure()) return;
  runAndVerify({p.gen[1].get()}, 1, 40);
  ASSERT_TRUE(p.gen[1]->start(2, 40).isOk());  // its TransferRequest is dropped
  EXPECT_EQ(transport::faultStats(*p.gen[1]->agent).messages_dropped, 1u);
  for (int i = 0; i < 5; ++i) runAndVerify({p.gen[0].get()}, 10 + i, 50);
  auto r = p.gen[1]->rx->wait(2, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  EXPECT_NE(r->status.message().find("request 2"), std::string::npos) << r->status.toString();
  ASSERT_TRUE(p.gen[1]->rx->release(2).isOk());
  // The context rank never saw the request; it answers the generation rank's Cancel so that
  // the quarantined pages come back without tearing the connection down.
  expectPagesFree(*p.gen[1]->cache, "gen 1 after the lost request");
  for (int i = 0; i < 3; ++i) runAndVerify({p.gen[1].get()}, 20 + i, 60);
  EXPECT_EQ(p.gen[1]->rx->metrics().failuresBy(FailureCause::kTimeout), 1u);
  expectPairsClean(p);
}

// The context rank closed just before the request went out, and its loss is not seen yet: the
// send fails inside startRequest. The caller gets the error and no pages (they are back in the
// pool, not handed out twice), the id is free again, and the rank serves on.
TEST(Faults, RequestWhoseSendFailsReturnsTheErrorAndHoldsNoPages) {
  const ModelSpec model = tinyModel();
  Pairs p;
  // Generation rank 1's messages: #1 Hello, #2 the first request, #3 the second: fails.
  transport::FaultPolicy policy;
  policy.fail_nth_message = 3;
  startPairs(
      p, model, nullptr,
      [&](std::unique_ptr<Agent> a) { return transport::wrapWithFaults(std::move(a), policy); },
      milliseconds(3000));
  if (HasFatalFailure()) return;
  runAndVerify({p.gen[1].get()}, 1, 40);
  auto a = p.gen[1]->rx->startRequest(2, 40);
  ASSERT_FALSE(a.isOk()) << "startRequest handed out pages it had already freed";
  EXPECT_EQ(a.status().code(), StatusCode::kUnavailable) << a.status().toString();
  EXPECT_NE(a.status().message().find("context rank 1"), std::string::npos)
      << a.status().toString();
  EXPECT_EQ(transport::faultStats(*p.gen[1]->agent).messages_failed, 1u);
  EXPECT_EQ(p.gen[1]->rx->poll(2).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.gen[1]->rx->activeRequests(), 0u);
  expectPagesFree(*p.gen[1]->cache, "gen 1 after the failed start");
  runAndVerify({p.gen[1].get()}, 2, 40);
  expectPairsClean(p);
}

// The generation rank cancels a request whose Done is already on its way, releases it once the
// Done arrived and reuses the id. The Cancel reaches the context rank after it forgot the
// request; it must not answer it a second time, or that answer would end the in-flight hold
// (and fail) the new request with the same id while its bytes are still being written.
TEST(Faults, CancelCrossingTheDoneLeavesALaterRequestWithTheSameIdAlone) {
  const ModelSpec model = tinyModel();
  Pairs p;
  HoldAgent* hold = nullptr;
  startPairs(
      p, model,
      [&](std::unique_ptr<Agent> a) {
        auto h = std::make_unique<HoldAgent>(std::move(a));
        hold = h.get();
        return h;
      },
      nullptr, milliseconds(60000));
  if (HasFatalFailure()) return;
  ASSERT_NE(hold, nullptr);
  runAndVerify({p.gen[1].get()}, 1, 40);
  hold->hold();
  ASSERT_TRUE(p.gen[1]->start(2, 40).isOk());
  ASSERT_TRUE(waitUntil([&] { return hold->heldMessages() == 1; }))
      << "the Done of request 2 was never sent";
  ASSERT_TRUE(p.gen[1]->rx->cancel(2).isOk());  // crosses the held Done
  ASSERT_TRUE(p.gen[1]->rx->release(2).isOk());
  // Request 3 goes out after the Cancel; once its Done is queued the Cancel was handled.
  ASSERT_TRUE(p.gen[1]->start(3, 40).isOk());
  ASSERT_TRUE(waitUntil([&] { return p.ctx[1].sender->metrics().requests_ok >= 3; }))
      << "request 3 was never served";
  EXPECT_EQ(hold->heldMessages(), 2u) << "the Cancel was answered a second time";
  ASSERT_TRUE(hold->releaseOne());  // the Done of the first request 2: its hold ends, and
                                    // the id can be used again
  StatusOr<Allocation> again = InvalidArgument("not started");
  ASSERT_TRUE(waitUntil([&] {
    again = p.gen[1]->start(2, 50);
    return again.isOk();
  })) << "the id 2 never became free again: "
      << again.status().toString();
  hold->release();
  for (uint64_t id : {2u, 3u}) {
    auto r = p.gen[1]->rx->wait(id, deadline());
    ASSERT_TRUE(r.isOk());
    ASSERT_EQ(r->state, RequestResult::State::kDone)
        << "request " << id << ": " << r->status.toString();
    auto report = p.gen[1]->verify(id);
    ASSERT_TRUE(report.isOk()) << report.status().toString();
    EXPECT_TRUE(report->ok()) << report->toString();
    ASSERT_TRUE(p.gen[1]->rx->release(id).isOk());
  }
  expectPairsClean(p);
}

TEST(Faults, PeerDelayedPastTheTimeoutFailsItsRequestWhileOthersComplete) {
  const ModelSpec model = tinyModel();
  Pairs p;
  HoldAgent* hold = nullptr;
  startPairs(
      p, model,
      [&](std::unique_ptr<Agent> a) {
        auto h = std::make_unique<HoldAgent>(std::move(a));
        hold = h.get();
        return h;
      },
      nullptr, milliseconds(1500));
  if (HasFatalFailure()) return;
  ASSERT_NE(hold, nullptr);
  runAndVerify({p.gen[1].get()}, 1, 40);
  hold->hold();  // context rank 1 writes, but its TransferDone is late
  ASSERT_TRUE(p.gen[1]->start(2, 70).isOk());
  for (int i = 0; i < 5; ++i) runAndVerify({p.gen[0].get()}, 10 + i, 50);
  auto r = p.gen[1]->rx->wait(2, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  ASSERT_TRUE(p.gen[1]->rx->release(2).isOk());
  // In-flight gating: until the late Done arrives the pages stay quarantined, never reused.
  const CacheCounters during = p.gen[1]->cache->counters();
  EXPECT_GT(during.quarantined_blocks + during.quarantined_slots, 0u);
  EXPECT_GE(hold->heldMessages(), 1u);
  hold->release();
  expectPagesFree(*p.gen[1]->cache, "gen 1 after the late Done");
  for (int i = 0; i < 3; ++i) runAndVerify({p.gen[1].get()}, 20 + i, 60);
  EXPECT_GE(p.gen[1]->rx->metrics().quarantined_requests, 1u);
  expectPairsClean(p);
}

// A context rank whose socket accepts but which never answers the hello (hung, stopped): the
// generation rank's connect to it waits out the agent's whole connect timeout (10 s here). That
// wait runs on its own thread, so the other context rank's handshake and this rank's request
// timers go on; once the address serves again the rank connects and requests verify.
TEST(Faults, ContextRankThatNeverAnswersTheHelloStallsNothingElse) {
  const ModelSpec model = tinyModel();
  const std::string ctx0 = uniqueName("ctx0"), ctx1 = uniqueName("ctx1");
  int hole = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(hole, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, ctx1.data(), ctx1.size());  // abstract name, as the shm agent
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + ctx1.size());
  ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&sa), len), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(hole, 16), 0);  // never accepted: the connect waits for an answer

  auto c0 = startContext(model, kTp2, 0, ctx0, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c0.isOk()) << c0.status().toString();
  auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(128, 32), kTp2,
                           {shmAddress(ctx0), shmAddress(ctx1)}, milliseconds(300));
  ASSERT_TRUE(g.isOk()) << g.status().toString();
  // Context rank 0 finishes its handshake while the connect to rank 1 hangs.
  Status peers = (*g)->rx->waitForPeers(Clock::now() + milliseconds(1500));
  EXPECT_EQ(peers.code(), StatusCode::kTimeout) << peers.toString();
  EXPECT_EQ(peers.message(), "context ranks not connected: 1") << peers.toString();
  // A request waiting for rank 1 times out on time, not when the connect gives up.
  const auto t0 = Clock::now();
  ASSERT_TRUE((*g)->start(1, 50).isOk());
  auto r = (*g)->rx->wait(1, Clock::now() + seconds(5));
  const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, RequestResult::State::kFailed);
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  EXPECT_LT(waited.count(), 4000) << "the request timer waited for the hanging connect";
  ASSERT_TRUE((*g)->rx->release(1).isOk());

  // The address serves again: the hanging connect fails, the next attempt succeeds.
  ::close(hole);
  auto c1 = startContext(model, kTp2, 1, ctx1, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c1.isOk()) << c1.status().toString();
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  for (int i = 0; i < 3; ++i) runAndVerify({g->get()}, 10 + i, 40 + 30 * i);
  expectPagesFree(*(*g)->cache, "gen");
  expectPagesFree(*c0->cache, "ctx 0");
  expectPagesFree(*c1->cache, "ctx 1");
  expectNoStrayBytes(**g, "gen");
}

// A context rank that accepts the connection and is gone at once (crashing while it starts):
// the loss can reach the progress thread before the connect's result does. The rank must treat
// that connect as failed and retry after reconnect_interval, not wait out the whole handshake
// timeout (10 s) on a dead connection.
TEST(Faults, ContextRankGoneRightAfterAcceptingIsRetriedAtOnce) {
  const ModelSpec model = tinyModel();
  const std::string ctx0 = uniqueName("ctx0"), ctx1 = uniqueName("ctx1");
  auto c0 = startContext(model, kTp2, 0, ctx0, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c0.isOk()) << c0.status().toString();
  auto c1 = startContext(model, kTp2, 1, ctx1, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c1.isOk()) << c1.status().toString();
  transport::FaultPolicy policy;
  policy.close_nth_connect = 1;  // generation rank 1 talks to context rank 1 only
  auto g = startGeneration(
      model, kTp2, 1, StateLayout::kPaged, Capacity::counts(128, 32), kTp2,
      {shmAddress(ctx0), shmAddress(ctx1)}, milliseconds(60000),
      [&](std::unique_ptr<Agent> a) { return transport::wrapWithFaults(std::move(a), policy); });
  ASSERT_TRUE(g.isOk()) << g.status().toString();
  Status s = (*g)->rx->waitForPeers(Clock::now() + seconds(5));
  EXPECT_TRUE(s.isOk()) << s.toString() << " (the dead connection waited for its handshake)";
  EXPECT_EQ(transport::faultStats(*(*g)->agent).peers_closed, 1u);
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  for (int i = 0; i < 3; ++i) runAndVerify({g->get()}, 1 + i, 40 + 20 * i);
  expectPagesFree(*(*g)->cache, "gen");
  expectPagesFree(*c1->cache, "ctx 1");
  expectNoStrayBytes(**g, "gen");
}

// A context rank whose connection goes between its Hello and the grant of our pools (the
// transport no longer knows the peer): a loss, retried, not a refusal. It was refused for good
// until its kPeerLost came, and every request started in between failed with NotFound.
TEST(Faults, ContextRankLostBetweenHelloAndGrantIsRetriedNotRefused) {
  const ModelSpec model = tinyModel();
  const std::string ctx0 = uniqueName("ctx0");
  auto c0 = startContext(model, kTp1, 0, ctx0, StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c0.isOk()) << c0.status().toString();
  transport::FaultPolicy policy;
  policy.close_nth_grant = 1;
  auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(128, 32), kTp1,
                           {shmAddress(ctx0)}, milliseconds(60000), [&](std::unique_ptr<Agent> a) {
                             return transport::wrapWithFaults(std::move(a), policy);
                           });
  ASSERT_TRUE(g.isOk()) << g.status().toString();
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  EXPECT_EQ(transport::faultStats(*(*g)->agent).peers_closed, 1u);
  EXPECT_EQ((*g)->rx->metrics().handshakes_refused, 0u) << "a lost connection counted as refused";
  EXPECT_EQ((*g)->rx->metrics().handshakes_ok, 1u);
  for (int i = 0; i < 3; ++i) runAndVerify({g->get()}, 1 + i, 40 + 20 * i);
  expectPagesFree(*(*g)->cache, "gen");
  expectNoStrayBytes(**g, "gen");
}

// A request whose context rank never became reachable (the prefill instance died before its
// decode asked) times out saying so: the rank, its address and the last connection error, not
// only "not complete" (an engine logs this line per failed load).
TEST(Faults, RequestWaitingForAnUnreachableContextRankTimesOutNamingIt) {
  const ModelSpec model = tinyModel();
  const std::string gone = uniqueName("ctx-gone");  // nothing ever listens there
  auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(64, 16), kTp1,
                           {shmAddress(gone)}, milliseconds(300));
  ASSERT_TRUE(g.isOk()) << g.status().toString();
  auto a = (*g)->start(5, 40);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  auto r = (*g)->rx->wait(5, deadline());
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  ASSERT_EQ(r->state, RequestResult::State::kFailed);
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  const std::string m = r->status.message();
  EXPECT_NE(m.find("not complete after 300 ms; waiting for context rank 0 at " + shmAddress(gone) +
                   ", not connected ("),
            std::string::npos)
      << m;
  ASSERT_TRUE((*g)->rx->release(5).isOk());
  expectPagesFree(*(*g)->cache, "gen");
}

TEST(Faults, PeerRestartedWithAnotherLayoutIsRefusedNamingTheField) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  Pairs p;
  startPairs(p, model, nullptr, nullptr, milliseconds(60000));
  if (HasFatalFailure()) return;
  runAndVerify({p.gen[1].get()}, 1, 40);
  // Context rank 1 goes away and comes back at the same address with fp32 conv state.
  p.ctx[1].sender->shutdown();
  p.ctx[1].sender.reset();
  // The loss is seen asynchronously; a restart that beats it would find the old session alive.
  ASSERT_TRUE(waitUntil([&] { return p.gen[1]->rx->metrics().peers_lost == 1; }))
      << "the generation rank never saw it leave";
  expectPagesFree(*p.gen[1]->cache, "gen 1 after the context rank left");
  ModelSpec other = model;
  other.conv_dtype = DType::kFp32;
  auto c =
      startContext(other, kTp2, 1, p.ctx_names[1], StateLayout::kPaged, Capacity::counts(128, 32));
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  p.ctx[1] = std::move(*c);
  Status s = p.gen[1]->rx->waitForPeers(deadline());
  EXPECT_EQ(s.code(), StatusCode::kIncompatible) << s.toString();
  EXPECT_NE(s.message().find("conv dtype"), std::string::npos) << s.toString();
  // Refused for good: requests needing it fail at once, naming the field, allocating nothing.
  auto a = p.gen[1]->rx->startRequest(2, 40);
  EXPECT_EQ(a.status().code(), StatusCode::kIncompatible) << a.status().toString();
  EXPECT_NE(a.status().message().find("conv dtype"), std::string::npos);
  EXPECT_TRUE(logs.has({"refusing", "conv dtype"})) << logs.all();
  for (int i = 0; i < 3; ++i) runAndVerify({p.gen[0].get()}, 10 + i, 50);
  expectPairsClean(p);
}

// ---------------------------------------------------------------------------------------------
// A full mesh: context tp=2, generation pp=2 (every generation rank reads from both context
// ranks, every context rank serves both generation ranks), context paged, generation
// layer-major.

struct Mesh {
  const ParallelConfig ctx_pc{2, 1, {}};
  const ParallelConfig gen_pc{1, 2, {}};
  CtxRank ctx[2];
  std::unique_ptr<GenRank> gen[2];
  ~Mesh() {
    for (auto& g : gen) {
      if (g) g->rx->shutdown();
    }
    for (auto& c : ctx) {
      if (c.sender) c.sender->shutdown();
    }
  }
  void start(const ModelSpec& model, uint32_t gen_blocks, uint32_t gen_slots) {
    std::vector<std::string> addrs;
    for (int i = 0; i < 2; ++i) {
      const std::string name = uniqueName("mesh-ctx" + std::to_string(i));
      auto c = startContext(model, ctx_pc, i, name, StateLayout::kPaged,
                            Capacity::counts(4 * gen_blocks, 4 * gen_slots));
      ASSERT_TRUE(c.isOk()) << c.status().toString();
      ctx[i] = std::move(*c);
      addrs.push_back(shmAddress(name));
    }
    for (int i = 0; i < 2; ++i) {
      auto g = startGeneration(model, gen_pc, i, StateLayout::kLayerMajor,
                               Capacity::counts(gen_blocks, gen_slots), ctx_pc, addrs);
      ASSERT_TRUE(g.isOk()) << g.status().toString();
      gen[i] = std::move(*g);
      ASSERT_EQ(gen[i]->rx->contextRanks().size(), 2u);
    }
    for (auto& g : gen) ASSERT_TRUE(g->rx->waitForPeers(deadline()).isOk());
  }
  void expectQuiet() {
    for (int i = 0; i < 2; ++i) {
      expectPagesFree(*ctx[i].cache, "ctx " + std::to_string(i));
      expectPagesFree(*gen[i]->cache, "gen " + std::to_string(i));
      expectNoStrayBytes(*gen[i], "gen " + std::to_string(i));
      EXPECT_EQ(gen[i]->rx->activeRequests(), 0u);
      EXPECT_EQ(ctx[i].serve->exhausted.load(), 0u) << "context rank " << i << " ran out of pages";
    }
    const auto end = deadline();
    for (int i = 0; i < 2; ++i) {
      while (ctx[i].sender->heldRequests() != 0 && Clock::now() < end) {
        std::this_thread::sleep_for(milliseconds(2));
      }
      EXPECT_EQ(ctx[i].sender->heldRequests(), 0u);
    }
  }
};

// Starts `id` on both generation ranks, retrying while pages are short (quarantined pages come
// back when their late Dones arrive).
bool startOnBoth(Mesh& m, uint64_t id, uint32_t tokens) {
  const auto end = deadline();
  for (auto& g : m.gen) {
    while (true) {
      auto a = g->start(id, tokens);
      if (a.isOk()) break;
      if (a.status().code() != StatusCode::kResourceExhausted || Clock::now() > end) {
        ADD_FAILURE() << "start " << id << ": " << a.status().toString();
        return false;
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
  }
  return true;
}

TEST(CancellationRaces, RandomCancelsOnBothSidesNeverTouchAnotherRequestsPages) {
  const ModelSpec model = tinyModel();
  Mesh m;
  m.start(model, 256, 64);
  if (HasFatalFailure()) return;
  constexpr int kRequests = 1200;
  constexpr size_t kWindow = 24;
  std::mt19937_64 rng(20240607);
  std::deque<uint64_t> live;
  std::set<uint64_t> cancelled;
  uint64_t ok = 0, failed = 0, verified_twice = 0;
  std::atomic<uint64_t> cancels{0};
  // Cancels from a second thread hit requests at random points of their life on both sides.
  std::mutex live_mu;
  std::vector<uint64_t> targets;  // guarded by live_mu
  std::atomic<bool> stop{false};
  std::thread canceller([&] {
    std::mt19937_64 r(7);
    while (!stop.load()) {
      uint64_t id = 0;
      {
        std::lock_guard lock(live_mu);
        if (!targets.empty()) id = targets[r() % targets.size()];
      }
      if (id != 0) {
        switch (r() % 4) {
          case 0:
            (void)m.ctx[r() % 2].sender->cancel(id);
            break;
          case 1:
            (void)m.gen[r() % 2]->rx->cancel(id);
            break;
          default:
            break;  // leave it alone this time
        }
        ++cancels;
      }
      if (r() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(r() % 500));
    }
  });

  // Completed requests are checked when they finish and again just before release, after
  // later requests (and late writes of cancelled ones) had their chance to touch them.
  std::deque<uint64_t> done;
  auto settle = [&](uint64_t id) {
    bool all_ok = true;
    for (auto& g : m.gen) {
      auto r = g->rx->wait(id, deadline());
      ASSERT_TRUE(r.isOk()) << r.status().toString();
      ASSERT_TRUE(r->terminal()) << "request " << id << " hung";
      if (r->state == RequestResult::State::kDone) {
        auto report = g->verify(id);
        ASSERT_TRUE(report.isOk()) << report.status().toString();
        ASSERT_TRUE(report->ok()) << "request " << id << ": " << report->toString();
      } else {
        all_ok = false;
        // The only way to fail here is a cancel (from either side).
        EXPECT_EQ(r->status.code(), StatusCode::kCancelled)
            << "request " << id << ": " << r->status.toString();
        ASSERT_TRUE(g->rx->release(id).isOk());
      }
    }
    if (all_ok) {
      ++ok;
      done.push_back(id);
    } else {
      ++failed;
      for (auto& g : m.gen) {
        if (g->rx->poll(id).isOk()) {
          ASSERT_TRUE(g->rx->release(id).isOk());
        }
      }
    }
    while (done.size() > 8) {
      const uint64_t old = done.front();
      done.pop_front();
      for (auto& g : m.gen) {
        auto report = g->verify(old);
        ASSERT_TRUE(report.isOk()) << report.status().toString();
        ASSERT_TRUE(report->ok()) << "request " << old
                                  << " changed after completion: " << report->toString();
        ASSERT_TRUE(g->rx->release(old).isOk());
      }
      ++verified_twice;
    }
  };

  for (uint64_t id = 1; id <= kRequests; ++id) {
    const uint32_t tokens = 1 + static_cast<uint32_t>(rng() % 160);
    ASSERT_TRUE(startOnBoth(m, id, tokens));
    {
      std::lock_guard lock(live_mu);
      targets.push_back(id);
      if (targets.size() > kWindow) targets.erase(targets.begin());
    }
    // Some cancels land right at the start, before the context rank even heard of the request.
    if (rng() % 16 == 0) (void)m.gen[rng() % 2]->rx->cancel(id);
    if (rng() % 16 == 0) (void)m.ctx[rng() % 2].sender->cancel(id);
    live.push_back(id);
    while (live.size() > kWindow) {
      const uint64_t oldest = live.front();
      live.pop_front();
      settle(oldest);
      if (HasFatalFailure()) break;
    }
    if (HasFatalFailure()) break;
  }
  stop = true;
  canceller.join();
  if (HasFatalFailure()) return;
  while (!live.empty()) {
    settle(live.front());
    live.pop_front();
    if (HasFatalFailure()) return;
  }
  while (!done.empty()) {
    for (auto& g : m.gen) {
      auto report = g->verify(done.front());
      ASSERT_TRUE(report.isOk() && report->ok());
      ASSERT_TRUE(g->rx->release(done.front()).isOk());
    }
    done.pop_front();
  }
  EXPECT_EQ(ok + failed, uint64_t{kRequests});
  EXPECT_GT(failed, 0u) << "no cancel hit a live request";
  EXPECT_GT(ok, 0u);
  EXPECT_GT(cancels.load(), 100u);
  RecordProperty("requests", kRequests);
  RecordProperty("ok", std::to_string(ok));
  RecordProperty("cancelled", std::to_string(failed));
  RecordProperty("cancel_calls", std::to_string(cancels.load()));
  std::printf(
      "cancellation races: %d requests, %llu completed and verified (%llu twice), "
      "%llu cancelled, %llu cancel calls\n",
      kRequests, static_cast<unsigned long long>(ok),
      static_cast<unsigned long long>(verified_twice), static_cast<unsigned long long>(failed),
      static_cast<unsigned long long>(cancels.load()));
  m.expectQuiet();
}

// ---------------------------------------------------------------------------------------------
// Load

TEST(Load, ThousandsOfConcurrentRequestsAcrossTwoByTwoRanksLoseNothing) {
  const ModelSpec model = tinyModel();
  Mesh m;
  m.start(model, 1024, 96);
  if (HasFatalFailure()) return;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 500;  // 2000 requests, each on both generation ranks
  constexpr size_t kWindow = 16;   // per thread: 64 in flight
  std::atomic<uint64_t> verified{0}, bytes{0}, lost{0};
  std::vector<std::string> errors(kThreads);
  const auto start = Clock::now();
  std::vector<std::thread> drivers;
  for (int t = 0; t < kThreads; ++t) {
    drivers.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::deque<uint64_t> live;
      auto finish = [&](uint64_t id) {
        for (auto& g : m.gen) {
          auto r = g->rx->wait(id, deadline(seconds(120)));
          if (!r.isOk() || r->state != RequestResult::State::kDone) {
            ++lost;
            if (errors[t].empty()) {
              errors[t] = "request " + std::to_string(id) + ": " +
                          (r.isOk() ? r->status.toString() : r.status().toString());
            }
            if (r.isOk() && !r->terminal()) (void)g->rx->cancel(id);
            (void)g->rx->release(id);
            continue;
          }
          auto report = g->verify(id);
          if (!report.isOk() || !report->ok()) {
            ++lost;
            if (errors[t].empty()) {
              errors[t] = "request " + std::to_string(id) + ": " +
                          (report.isOk() ? report->toString() : report.status().toString());
            }
          } else {
            bytes += report->bytes_checked;
          }
          (void)g->rx->release(id);
        }
        ++verified;
      };
      for (int i = 0; i < kPerThread; ++i) {
        const uint64_t id = 1 + t * kPerThread + i;
        const uint32_t tokens = 1 + static_cast<uint32_t>(rng() % 200);
        if (!startOnBoth(m, id, tokens)) {
          ++lost;
          continue;
        }
        live.push_back(id);
        while (live.size() > kWindow) {
          finish(live.front());
          live.pop_front();
        }
      }
      while (!live.empty()) {
        finish(live.front());
        live.pop_front();
      }
    });
  }
  for (auto& d : drivers) d.join();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  for (const auto& e : errors) EXPECT_TRUE(e.empty()) << e;
  EXPECT_EQ(lost.load(), 0u);
  EXPECT_EQ(verified.load(), uint64_t{kThreads * kPerThread});
  for (auto& g : m.gen) {
    EXPECT_EQ(g->rx->metrics().requests_ok, uint64_t{kThreads * kPerThread});
    EXPECT_EQ(g->rx->metrics().requests_failed, 0u);
  }
  std::printf(
      "load: %d requests x 2 generation ranks, %d in flight, %llu bytes verified, "
      "0 lost, %.1f s\n",
      kThreads * kPerThread, static_cast<int>(kThreads * kWindow),
      static_cast<unsigned long long>(bytes.load()), secs);
  m.expectQuiet();
}

// ---------------------------------------------------------------------------------------------
// Hostile peers: raw agents that speak well-formed wire messages with bad content.

// Sends `m` and returns the next message from `peer` (skipping connection events), decoded.
StatusOr<wire::Message> exchange(Agent& agent, transport::PeerId peer,
                                 std::optional<wire::Message> m) {
  if (m) RETURN_IF_ERROR(agent.sendMessage(peer, wire::encodeMessage(*m)));
  const auto end = deadline();
  while (Clock::now() < end) {
    auto ev = agent.pollEvent(milliseconds(100));
    if (!ev) continue;
    if (ev->peer != peer) continue;
    if (ev->kind == transport::Event::Kind::kPeerLost) {
      return Unavailable("peer lost: " + ev->status.toString());
    }
    if (ev->kind != transport::Event::Kind::kMessage) continue;
    return wire::decodeMessage(ev->payload);
  }
  return Timeout("no answer");
}

// A generation rank's RankInfo for `cache`, as the receiver would publish it.
wire::RankInfo rankInfoOf(const HybridCacheManager& cache, const Agent& agent,
                          wire::InstanceRole role) {
  wire::RankInfo info;
  info.instance_id = "hostile";
  info.role = role;
  const std::string addr = agent.localAddress();
  info.address.assign(addr.begin(), addr.end());
  info.layout = cache.layout();
  return info;
}

TEST(HostilePeer, GenerationPeerWithBadRequestsIsRefusedAndNothingIsWritten) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const ParallelConfig one{1, 1, {}};
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, one, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto honest = startGeneration(model, one, 0, StateLayout::kPaged, Capacity::counts(64, 8), one,
                                {shmAddress(name)}, milliseconds(60000), nullptr, "secret");
  ASSERT_TRUE(honest.isOk());
  ASSERT_TRUE((*honest)->rx->waitForPeers(deadline()).isOk());
  runAndVerify({honest->get()}, 1, 50);

  // The hostile peer has real pools (filled with the sentinel) registered with its agent.
  auto cache = HybridCacheManager::create(model, one, 0, 0, StateLayout::kPaged,
                                          Capacity::counts(64, 8), Region::Backing::kMemfd);
  ASSERT_TRUE(cache.isOk());
  for (const auto& r : (*cache)->regions()) std::memset(r->data(), kSentinel, r->length());
  auto agent = shmAgent("", "hostile", "secret");
  ASSERT_TRUE(agent.isOk());
  for (const auto& r : (*cache)->regions()) {
    ASSERT_TRUE((*agent)->registerRegion(*r, transport::RegionAccess::kRemoteWritable).isOk());
  }
  const wire::RankInfo good = rankInfoOf(**cache, **agent, wire::InstanceRole::kGeneration);

  auto refusedWith = [&](wire::Hello hello, std::string_view needle) {
    auto peer = (*agent)->connect(shmAddress(name));
    ASSERT_TRUE(peer.isOk());
    auto answer = exchange(**agent, *peer, wire::Message{std::move(hello)});
    ASSERT_TRUE(answer.isOk()) << answer.status().toString();
    auto* err = std::get_if<wire::Error>(&*answer);
    ASSERT_NE(err, nullptr) << wire::summarize(*answer);
    EXPECT_NE(err->status.message().find(needle), std::string::npos) << err->status.toString();
    EXPECT_TRUE(logs.has({"refusing generation peer", needle})) << logs.all();
    (void)(*agent)->disconnect(*peer);
  };
  {
    // Another token is refused by the transport, before any Hello or region crosses.
    auto guesser = shmAgent("", "guesser", "guess");
    ASSERT_TRUE(guesser.isOk());
    auto peer = (*guesser)->connect(shmAddress(name));
    ASSERT_EQ(peer.status().code(), StatusCode::kPermissionDenied) << peer.status().toString();
    EXPECT_TRUE(waitUntil([&] { return c->sender->metrics().auth_failures >= 1; }));
  }
  wire::RankInfo wrong_model = good;
  wrong_model.layout.model_fingerprint ^= 1;
  refusedWith(wire::Hello{wrong_model, "secret"}, "fingerprint");

  // Accepted handshake, then requests that must each be refused before any byte moves.
  auto peer = (*agent)->connect(shmAddress(name));
  ASSERT_TRUE(peer.isOk());
  auto hello = exchange(**agent, *peer, wire::Message{wire::Hello{good, "secret"}});
  ASSERT_TRUE(hello.isOk() && std::holds_alternative<wire::Hello>(*hello));
  const RankLayout& gl = (*cache)->layout();
  auto request = [&](uint64_t id) {
    wire::TransferRequest r;
    r.request_id = id;
    r.dst_block_ids = {0, 1, 2};
    r.dst_slot = 0;
    r.num_tokens = 3 * gl.tokens_per_block;
    return r;
  };
  struct Bad {
    std::string what;
    wire::TransferRequest req;
    std::string needle;
  };
  std::vector<Bad> bad;
  {
    auto r = request(9001);
    r.dst_block_ids = {0, gl.num_blocks + 5};
    bad.push_back({"a block it does not own", r, "dst_block_ids"});
  }
  {
    auto r = request(9002);
    r.gen_tp_rank = 3;
    bad.push_back({"another rank's pages", r, "reached rank"});
  }
  {
    auto r = request(9003);
    r.dst_slot = gl.num_slots;
    bad.push_back({"a slot it does not own", r, "dst_slot"});
  }
  {
    auto r = request(9004);
    r.dst_block_ids.clear();
    for (uint32_t b = 0; b < 40; ++b) r.dst_block_ids.push_back(b);
    r.num_tokens = 1;  // the context side holds one block; 40 are asked for
    bad.push_back({"more blocks than the request has", r, "block"});
  }
  {
    auto r = request(9006);
    r.dst_block_ids = {4, 4};
    r.num_tokens = 2;
    bad.push_back({"a block twice", r, "twice"});
  }
  for (const Bad& b : bad) {
    auto answer = exchange(**agent, *peer, wire::Message{b.req});
    ASSERT_TRUE(answer.isOk()) << b.what << ": " << answer.status().toString();
    auto* done = std::get_if<wire::TransferDone>(&*answer);
    ASSERT_NE(done, nullptr) << b.what << ": " << wire::summarize(*answer);
    EXPECT_EQ(done->request_id, b.req.request_id);
    EXPECT_FALSE(done->status.isOk()) << b.what;
    EXPECT_EQ(done->bytes, 0u) << b.what;
    EXPECT_NE(done->status.message().find(b.needle), std::string::npos)
        << b.what << ": " << done->status.toString();
    EXPECT_TRUE(logs.has({"refusing request " + std::to_string(b.req.request_id)})) << logs.all();
  }
  (void)(*agent)->disconnect(*peer);
  // Requests the decoder itself refuses (a count over its limit, an index past its list): the
  // peer is refused and dropped, naming the field.
  std::vector<Bad> undecodable;
  {
    auto r = request(9100);
    r.dst_block_ids.assign(wire::kMaxBlockIds + 1, 0);
    undecodable.push_back({"an oversize block count", r, "dst_block_ids.count"});
  }
  {
    auto r = request(9101);
    r.first_block = 7;
    undecodable.push_back({"first_block past its blocks", r, "first_block"});
  }
  for (const Bad& b : undecodable) {
    auto p2 = (*agent)->connect(shmAddress(name));
    ASSERT_TRUE(p2.isOk());
    auto h2 = exchange(**agent, *p2, wire::Message{wire::Hello{good, "secret"}});
    ASSERT_TRUE(h2.isOk() && std::holds_alternative<wire::Hello>(*h2)) << b.what;
    auto answer = exchange(**agent, *p2, wire::Message{b.req});
    ASSERT_TRUE(answer.isOk()) << b.what << ": " << answer.status().toString();
    auto* err = std::get_if<wire::Error>(&*answer);
    ASSERT_NE(err, nullptr) << b.what << ": " << wire::summarize(*answer);
    EXPECT_NE(err->status.message().find(b.needle), std::string::npos)
        << b.what << ": " << err->status.toString();
    EXPECT_TRUE(logs.has({"refusing generation peer", b.needle})) << logs.all();
    (void)(*agent)->disconnect(*p2);
  }

  // Nothing was written into the hostile peer's pools, and the honest rank is still served.
  uint64_t written = 0;
  for (const auto& r : (*cache)->regions()) {
    written +=
        std::count_if(r->data(), r->data() + r->length(), [](uint8_t b) { return b != kSentinel; });
  }
  EXPECT_EQ(written, 0u);
  runAndVerify({honest->get()}, 2, 80);
  EXPECT_GE(c->sender->metrics().handshakes_refused, 3u);
  expectPagesFree(*c->cache, "ctx");
  expectPagesFree(*(*honest)->cache, "gen");
  expectNoStrayBytes(**honest, "gen");
  (*honest)->rx->shutdown();
  c->sender->shutdown();
}

// A context peer that answers the handshake with `reply` (built from the Hello it receives).
struct HostileContext {
  std::unique_ptr<HybridCacheManager> cache;
  std::unique_ptr<Agent> agent;
  transport::PeerId peer = 0;
  wire::RankInfo gen_info;  // from the generation rank's Hello
  // How many of the generation rank's regions this peer could declare as write targets (on shm:
  // whose fds it holds).
  size_t writableRegions() {
    size_t n = 0;
    for (const RegionSpec& r : gen_info.layout.regions) {
      n += agent->addRemoteRegion(peer, r.id, r.length, {}).isOk();
    }
    return n;
  }
  static std::unique_ptr<HostileContext> make(const ModelSpec& model) {
    auto h = std::make_unique<HostileContext>();
    auto cache = HybridCacheManager::create(model, {1, 1, {}}, 0, 0, StateLayout::kPaged,
                                            Capacity::counts(64, 8), Region::Backing::kMemfd);
    auto agent = shmAgent(uniqueName("hostile-ctx"), "hostile", "secret");
    if (!cache.isOk() || !agent.isOk()) return nullptr;
    h->cache = std::move(*cache);
    h->agent = std::move(*agent);
    for (const auto& r : h->cache->regions()) {
      if (!h->agent->registerRegion(*r, transport::RegionAccess::kLocalSource).isOk())
        return nullptr;
    }
    return h;
  }
  // Waits for the generation rank's Hello.
  bool acceptHello() {
    const auto end = deadline();
    while (Clock::now() < end) {
      auto ev = agent->pollEvent(milliseconds(100));
      if (!ev || ev->kind != transport::Event::Kind::kMessage) continue;
      auto m = wire::decodeMessage(ev->payload);
      if (m.isOk() && std::holds_alternative<wire::Hello>(*m)) {
        peer = ev->peer;
        gen_info = std::get<wire::Hello>(*m).rank_info;
        return true;
      }
    }
    return false;
  }
  void send(const wire::Message& m) {
    ASSERT_TRUE(agent->sendMessage(peer, wire::encodeMessage(m)).isOk());
  }
  // Next message from the generation rank, decoded.
  std::optional<wire::Message> next() {
    const auto end = deadline();
    while (Clock::now() < end) {
      auto ev = agent->pollEvent(milliseconds(100));
      if (!ev || ev->kind != transport::Event::Kind::kMessage) continue;
      auto m = wire::decodeMessage(ev->payload);
      if (m.isOk()) return *m;
    }
    return std::nullopt;
  }
};

TEST(HostilePeer, ContextPeerWithWrongModelOrTokenOrAnswersIsRefused) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const ParallelConfig one{1, 1, {}};
  struct Case {
    std::string what;
    std::function<void(wire::Hello&)> spoil;
    StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"wrong model fingerprint", [](wire::Hello& h) { h.rank_info.layout.model_fingerprint ^= 1; },
       StatusCode::kIncompatible, "fingerprint"},
      {"claims the generation role",
       [](wire::Hello& h) { h.rank_info.role = wire::InstanceRole::kGeneration; },
       StatusCode::kIncompatible, "role"},
  };
  for (const Case& k : cases) {
    auto h = HostileContext::make(model);
    ASSERT_NE(h, nullptr);
    auto g = startGeneration(model, one, 0, StateLayout::kPaged, Capacity::counts(64, 8), one,
                             {h->agent->localAddress()}, milliseconds(60000), nullptr, "secret");
    ASSERT_TRUE(g.isOk());
    ASSERT_TRUE(h->acceptHello()) << k.what;
    // Round 3, finding 1: past the token alone a peer holds no region of the generation rank;
    // its fds go only to a context rank whose Hello matched (they once came with the welcome).
    EXPECT_EQ(h->writableRegions(), 0u) << k.what;
    wire::Hello hello{rankInfoOf(*h->cache, *h->agent, wire::InstanceRole::kContext), "secret"};
    k.spoil(hello);
    if (!wire::checkRankInfo(hello.rank_info).isOk()) {
      // A layout the decoder itself would refuse never reaches the receiver's own checks.
      hello.rank_info.layout = h->cache->layout();
      hello.rank_info.layout.model_fingerprint ^= 1;
    }
    h->send(hello);
    Status s = (*g)->rx->waitForPeers(deadline());
    EXPECT_EQ(s.code(), k.code) << k.what << ": " << s.toString();
    EXPECT_NE(s.message().find(k.needle), std::string::npos) << k.what << ": " << s.toString();
    EXPECT_TRUE(logs.has({"refusing context rank", k.needle})) << k.what << "\n" << logs.all();
    EXPECT_FALSE((*g)->rx->startRequest(1, 10).isOk());
    (*g)->rx->shutdown();
    expectPagesFree(*(*g)->cache, k.what);
    expectNoStrayBytes(**g, k.what);
  }

  // A context peer that handshakes correctly, then lies in its answers.
  auto h = HostileContext::make(model);
  ASSERT_NE(h, nullptr);
  auto g = startGeneration(model, one, 0, StateLayout::kPaged, Capacity::counts(64, 8), one,
                           {h->agent->localAddress()}, milliseconds(60000), nullptr, "secret");
  ASSERT_TRUE(g.isOk());
  ASSERT_TRUE(h->acceptHello());
  h->send(wire::Hello{rankInfoOf(*h->cache, *h->agent, wire::InstanceRole::kContext), ""});
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  // Its Hello matched: the regions follow.
  EXPECT_TRUE(waitUntil([&] { return h->writableRegions() == h->gen_info.layout.regions.size(); }));
  // A Done for a request nobody asked for is ignored.
  h->send(wire::TransferDone{777, OkStatus(), 1 << 20, std::nullopt, {}});
  // A Done claiming success with the wrong byte count fails the request instead of lying.
  ASSERT_TRUE((*g)->start(5, 40).isOk());
  auto ask = h->next();
  ASSERT_TRUE(ask && std::holds_alternative<wire::TransferRequest>(*ask));
  h->send(wire::TransferDone{5, OkStatus(), 12345, std::nullopt, {}});
  auto r = (*g)->rx->wait(5, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, RequestResult::State::kFailed);
  EXPECT_NE(r->status.message().find("expected"), std::string::npos) << r->status.toString();
  ASSERT_TRUE((*g)->rx->release(5).isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kInternal);
  EXPECT_FALSE((*g)->rx->poll(777).isOk());
  (*g)->rx->shutdown();
  expectPagesFree(*(*g)->cache, "gen");
  expectNoStrayBytes(**g, "gen");
}

// ---------------------------------------------------------------------------------------------
// Incarnations, epochs, bounds and stalls (docs/reliability.md, promises 10-12)

// A raw generation peer: real pools (sentinel-filled) registered with its own agent, one
// authenticated connection to a context rank, and a Hello naming `instance` and `incarnation`.
struct RawGeneration {
  std::unique_ptr<HybridCacheManager> cache;
  std::unique_ptr<Agent> agent;
  transport::PeerId peer = 0;
  wire::RankInfo info;

  static std::unique_ptr<RawGeneration> make(const ModelSpec& model, const ParallelConfig& pc,
                                             uint32_t rank, const std::string& instance,
                                             Capacity capacity = Capacity::counts(64, 8)) {
    auto g = std::make_unique<RawGeneration>();
    auto cache = HybridCacheManager::create(model, pc, rank % pc.tp, rank / pc.tp,
                                            StateLayout::kPaged, capacity, Region::Backing::kMemfd);
    auto agent = shmAgent("", "raw-" + instance, "secret");
    if (!cache.isOk() || !agent.isOk()) return nullptr;
    g->cache = std::move(*cache);
    g->agent = std::move(*agent);
    for (const auto& r : g->cache->regions()) {
      std::memset(r->data(), kSentinel, r->length());
      if (!g->agent->registerRegion(*r, transport::RegionAccess::kRemoteWritable).isOk()) {
        return nullptr;
      }
    }
    g->info = rankInfoOf(*g->cache, *g->agent, wire::InstanceRole::kGeneration);
    g->info.instance_id = instance;
    return g;
  }
  // Connects and completes the handshake; the context rank's Hello, or why not.
  StatusOr<wire::Hello> connect(const std::string& address, uint64_t incarnation) {
    ASSIGN_OR_RETURN(peer, agent->connect(address));
    ASSIGN_OR_RETURN(wire::Message answer,
                     exchange(*agent, peer, wire::Message{wire::Hello{info, "", incarnation}}));
    if (auto* hello = std::get_if<wire::Hello>(&answer)) return *hello;
    return Internal("answered " + wire::summarize(answer));
  }
  wire::TransferRequest request(uint64_t id, uint64_t epoch, std::vector<uint32_t> blocks) const {
    wire::TransferRequest r;
    r.request_id = id;
    r.epoch = epoch;
    r.gen_tp_rank = info.layout.tp_rank;
    r.gen_pp_rank = info.layout.pp_rank;
    r.num_tokens = blocks.size() * info.layout.tokens_per_block;
    r.dst_block_ids = std::move(blocks);
    r.dst_slot = 0;
    return r;
  }
  // Sends `m` and returns the TransferDone that answers it.
  StatusOr<wire::TransferDone> ask(const wire::Message& m) {
    ASSIGN_OR_RETURN(wire::Message answer, exchange(*agent, peer, m));
    if (auto* done = std::get_if<wire::TransferDone>(&answer)) return *done;
    return Internal("answered " + wire::summarize(answer));
  }
  // Waits for this connection's loss.
  bool lost() {
    const auto end = deadline();
    while (Clock::now() < end) {
      auto ev = agent->pollEvent(milliseconds(100));
      if (ev && ev->peer == peer && ev->kind == transport::Event::Kind::kPeerLost) return true;
    }
    return false;
  }
};

// A context rank in an engine layout (described records, wire 1.3) refuses a generation peer
// older than 1.3, which would read its records in hxfer's own order; a 1.3 peer is served.
TEST(EngineLayouts, PeerOlderThanTheRecordsMinorIsRefusedAndACurrentOneIsServed) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  // conv DS: the raw peer holds hxfer's order, and SD against it would need staging.
  auto c = startContext(model, kTp1, 0, name, *parseEngineLayout("vllm", "nhd", "ds"),
                        Capacity::counts(128, 32), nullptr, "secret");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto old_peer = RawGeneration::make(model, kTp1, 0, "gen-old");
  ASSERT_TRUE(old_peer);
  old_peer->info.version_minor = wire::kRecordsMinor - 1;
  auto refused = old_peer->connect(shmAddress(name), 1);
  ASSERT_FALSE(refused.isOk());
  EXPECT_NE(refused.status().message().find("engine layouts need 1.3 or later"), std::string::npos)
      << refused.status().toString();
  EXPECT_TRUE(logs.has({"refusing generation peer", "peer speaks 1.2"})) << logs.all();

  auto current = RawGeneration::make(model, kTp1, 0, "gen-new");
  ASSERT_TRUE(current);
  ASSERT_TRUE(current->connect(shmAddress(name), 2).isOk());
  auto done = current->ask(wire::Message{current->request(5, 1, {0, 1})});
  ASSERT_TRUE(done.isOk()) << done.status().toString();
  EXPECT_TRUE(done->status.isOk()) << done->status.toString();
  EXPECT_GT(done->bytes, 0u);
}

// Finding 8: a request id used again while the context rank still holds the first request, or
// asked for by another generation instance, is refused; the old request's state is never
// handed out a second time.
TEST(Epochs, ReusedOrForeignRequestIdIsRefusedNotServedFromTheOldRequest) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret",
                        [](ContextSender::Options& o) { o.lease_timeout = milliseconds(2000); });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  // Generation at tp 2: request 77 stays held here until both of its ranks asked (or, as
  // rank 1 never will, until the lease ends).
  auto a = RawGeneration::make(model, kTp2, 0, "gen-a");
  auto b = RawGeneration::make(model, kTp2, 1, "gen-b");
  ASSERT_TRUE(a && b);
  auto ha = a->connect(shmAddress(name), 1);
  ASSERT_TRUE(ha.isOk()) << ha.status().toString();
  EXPECT_NE(ha->incarnation, 0u);
  ASSERT_TRUE(b->connect(shmAddress(name), 2).isOk());

  auto first = a->ask(wire::Message{a->request(77, 1, {0, 1, 2})});
  ASSERT_TRUE(first.isOk()) << first.status().toString();
  ASSERT_TRUE(first->status.isOk()) << first->status.toString();
  EXPECT_EQ(first->epoch, 1u);
  EXPECT_GT(first->bytes, 0u);
  ASSERT_EQ(c->sender->heldRequests(), 1u);

  auto again = a->ask(wire::Message{a->request(77, 2, {3, 4, 5})});
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_EQ(again->status.code(), StatusCode::kInvalidArgument) << again->status.toString();
  EXPECT_NE(again->status.message().find("request id 77 reused"), std::string::npos)
      << again->status.toString();
  EXPECT_EQ(again->epoch, 2u);
  EXPECT_EQ(again->bytes, 0u);

  auto foreign = b->ask(wire::Message{b->request(77, 1, {0, 1, 2})});
  ASSERT_TRUE(foreign.isOk()) << foreign.status().toString();
  EXPECT_EQ(foreign->status.code(), StatusCode::kInvalidArgument) << foreign->status.toString();
  EXPECT_NE(foreign->status.message().find("belongs to generation 'gen-a'"), std::string::npos)
      << foreign->status.toString();
  EXPECT_TRUE(logs.has({"refusing request 77"})) << logs.all();

  // Nothing landed in the blocks of the refused asks.
  auto untouched = [](RawGeneration& g, std::vector<uint32_t> blocks) {
    const RankLayout& layout = g.cache->layout();
    uint64_t changed = 0;
    for (const PoolView& v : layout.views) {
      if (v.role != Role::kKv) continue;
      const uint8_t* base = nullptr;
      for (const auto& r : g.cache->regions()) {
        if (r->id() == v.region_id) base = r->data();
      }
      for (uint32_t blk : blocks) {
        for (uint32_t l = 0; l < v.layers.size(); ++l) {
          const uint8_t* rec = base + v.offset(blk, l);
          changed +=
              std::count_if(rec, rec + v.record_bytes, [](uint8_t x) { return x != kSentinel; });
        }
      }
    }
    return changed;
  };
  EXPECT_EQ(untouched(*a, {3, 4, 5}), 0u);
  EXPECT_EQ(untouched(*b, {0, 1, 2}), 0u);

  (void)a->agent->disconnect(a->peer);
  (void)b->agent->disconnect(b->peer);
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// Staging windows (wire 1.7), context side: each window of a part is checked against the part,
// the pages stay held between windows until the last is answered, an ask for another window
// than the next ends the part (and no later window of it is served), a Cancel between windows
// (no Done awaited) lets the pages go, and the lease runs from the last window answered.
TEST(StagingWindows, TheContextRankServesEachWindowOnceAndInOrder) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret",
                        [](ContextSender::Options& o) { o.lease_timeout = milliseconds(1000); });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto g = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(g);
  const uint32_t staging_id = 0x7FFF0000u;
  auto region = Region::allocate(staging_id, 1 << 20, Region::Backing::kMemfd, "staging");
  ASSERT_TRUE(region.isOk()) << region.status().toString();
  ASSERT_TRUE(g->agent->registerRegion(**region, transport::RegionAccess::kRemoteWritable).isOk());
  g->info.layout.regions.push_back({staging_id, (*region)->length(), "staging"});
  ASSERT_TRUE(g->connect(shmAddress(name), 1).isOk());
  // The part's bytes: one ask of it unstaged.
  auto whole = g->ask(wire::Message{g->request(1, 1, {0, 1, 2})});
  ASSERT_TRUE(whole.isOk() && whole->status.isOk()) << whole.status().toString();
  const uint64_t part = whole->bytes;
  ASSERT_GT(part, 300u);
  auto windowOf = [&](uint64_t id, uint64_t window, uint64_t bytes, uint64_t total = 0) {
    wire::TransferRequest r = g->request(id, 1, {0, 1, 2});
    r.staging = wire::Staging{staging_id, 4096, bytes, window, total == 0 ? part : total};
    return g->ask(wire::Message{r});
  };
  auto held = [&](size_t n) {
    for (int i = 0; i < 300 && c->sender->heldRequests() != n; ++i) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    return c->sender->heldRequests() == n;
  };
  auto refused = [](const StatusOr<wire::TransferDone>& done, const std::string& why) {
    if (!done.isOk()) return ::testing::AssertionFailure() << done.status().toString();
    if (done->status.code() == StatusCode::kInvalidArgument &&
        done->status.message().find(why) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << done->status.toString();
  };
  ASSERT_TRUE(held(0));

  // A window reaching past the part, and one of a part counted otherwise: refused.
  EXPECT_TRUE(refused(windowOf(2, 0, part + 1), "staging slot of " + std::to_string(part + 1) +
                                                    " bytes at window 0 of a part of " +
                                                    std::to_string(part) + " for a part of " +
                                                    std::to_string(part)));
  EXPECT_TRUE(refused(windowOf(3, 0, 64, part + 1), "of a part of " + std::to_string(part + 1) +
                                                        " for a part of " + std::to_string(part)));
  EXPECT_TRUE(held(0));

  // Three windows in order: the pages stay held until the last.
  const uint64_t w = part / 3 + 1;
  for (const uint64_t at : {uint64_t{0}, w, 2 * w}) {
    auto done = windowOf(4, at, std::min(w, part - at));
    ASSERT_TRUE(done.isOk() && done->status.isOk()) << at << ": " << done.status().toString();
    EXPECT_EQ(done->bytes, std::min(w, part - at));
    EXPECT_TRUE(held(at + w < part ? 1 : 0)) << at;
  }
  const auto m = c->sender->metrics();
  EXPECT_EQ(m.requests_ok, 2u);  // 1 and 4, once each
  EXPECT_EQ(m.bytes, 2 * part);

  // Out of order: refused naming the next window, and the part ends; its next window is then
  // refused, never served from a request started over.
  ASSERT_TRUE(windowOf(5, 0, w)->status.isOk());
  EXPECT_TRUE(held(1));
  EXPECT_TRUE(refused(windowOf(5, 2 * w, w), "asked for staging window " + std::to_string(2 * w) +
                                                 " of epoch 1; the next is " + std::to_string(w)));
  EXPECT_TRUE(held(0)) << "a refused window left the part's pages held";
  EXPECT_TRUE(refused(windowOf(5, w, w), "holds no earlier window of that part"));

  // A Cancel between two windows: nothing answers it, and the pages go.
  ASSERT_TRUE(windowOf(6, 0, w)->status.isOk());
  EXPECT_TRUE(held(1));
  ASSERT_TRUE(
      g->agent->sendMessage(g->peer, wire::encodeMessage(wire::Cancel{6, "stop", 1})).isOk());
  EXPECT_TRUE(held(0)) << "a Cancel between windows left the pages held";

  // The lease runs from the last window: a 0.6 s gap passes, a 1.5 s gap expires it.
  ASSERT_TRUE(windowOf(7, 0, w)->status.isOk());
  std::this_thread::sleep_for(milliseconds(600));
  ASSERT_TRUE(windowOf(7, w, w)->status.isOk());
  std::this_thread::sleep_for(milliseconds(1500));
  auto slow = windowOf(7, 2 * w, part - 2 * w);
  ASSERT_TRUE(slow.isOk()) << slow.status().toString();
  EXPECT_EQ(slow->status.code(), StatusCode::kExpired) << slow->status.toString();
  EXPECT_NE(slow->status.message().find("while a staged part waited for its next window"),
            std::string::npos)
      << slow->status.toString();
  EXPECT_TRUE(held(0));
  const auto end = c->sender->metrics();
  EXPECT_EQ(end.requests_started, 7u) << end.toJson();  // every request once
  EXPECT_EQ(end.requests_ok, 2u) << end.toJson();
  EXPECT_EQ(end.requests_failed, 5u) << end.toJson();  // 2, 3, 5, 6 (cancelled) and 7
  EXPECT_EQ(end.requests_cancelled, 1u) << end.toJson();

  (void)g->agent->disconnect(g->peer);
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// Finding 8, generation side: a TransferDone or Cancel of an earlier use of the id (another
// epoch) neither completes nor fails the request now using it.
TEST(Epochs, DoneOrCancelOfAnEarlierUseOfAnIdEndsNothing) {
  const ModelSpec model = tinyModel();
  auto h = HostileContext::make(model);
  ASSERT_NE(h, nullptr);
  auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(64, 8), kTp1,
                           {h->agent->localAddress()}, milliseconds(60000), nullptr, "secret");
  ASSERT_TRUE(g.isOk());
  ASSERT_TRUE(h->acceptHello());
  h->send(wire::Hello{rankInfoOf(*h->cache, *h->agent, wire::InstanceRole::kContext), "", 5});
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  auto alloc = (*g)->start(5, 40);
  ASSERT_TRUE(alloc.isOk());
  auto ask = h->next();
  ASSERT_TRUE(ask && std::holds_alternative<wire::TransferRequest>(*ask));
  const uint64_t epoch = std::get<wire::TransferRequest>(*ask).epoch;
  ASSERT_NE(epoch, 0u);

  h->send(wire::TransferDone{5, Cancelled("an older request 5"), 0, std::nullopt, {}, epoch + 7});
  h->send(wire::Cancel{5, "an older request 5", epoch + 7});
  ASSERT_TRUE(waitUntil([&] { return (*g)->rx->metrics().stale_messages >= 2; }));
  auto r = (*g)->rx->poll(5);
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, RequestResult::State::kInProgress) << r->status.toString();

  const RankLayout& layout = (*g)->cache->layout();
  const uint64_t bytes =
      alloc->blocks.size() * layout.kvBytesPerBlock() + layout.stateBytesPerSlot();
  h->send(wire::TransferDone{5, OkStatus(), bytes, std::nullopt, {}, epoch});
  r = (*g)->rx->wait(5, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, RequestResult::State::kDone) << r->status.toString();
  ASSERT_TRUE((*g)->rx->release(5).isOk());
  (*g)->rx->shutdown();
  expectPagesFree(*(*g)->cache, "gen");
}

// Finding 6/8: one connection per generation rank. A second one claiming the same instance and
// rank (a restart, another incarnation) replaces the first, which is dropped with its asks.
TEST(Epochs, NewConnectionClaimingAGenerationRankDropsTheOlderOne) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto old = RawGeneration::make(model, kTp1, 0, "gen");
  auto fresh = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(old && fresh);
  ASSERT_TRUE(old->connect(shmAddress(name), 11).isOk());
  ASSERT_TRUE(fresh->connect(shmAddress(name), 12).isOk());
  EXPECT_TRUE(old->lost()) << "the older connection was kept";
  EXPECT_EQ(c->sender->metrics().connections_superseded, 1u);
  EXPECT_TRUE(logs.has({"connected again (incarnation 11 -> 12)"})) << logs.all();
  EXPECT_TRUE(waitUntil([&] { return c->sender->connectedPeers() == 1; }));
  auto done = fresh->ask(wire::Message{fresh->request(5, 1, {0, 1})});
  ASSERT_TRUE(done.isOk()) << done.status().toString();
  EXPECT_TRUE(done->status.isOk()) << done->status.toString();
  (void)fresh->agent->disconnect(fresh->peer);
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// Round 3, finding 11: a tombstone answers the generation process whose request ended, not a
// restarted one (same instance, another incarnation) that numbers its requests from 1 again.
TEST(Epochs, ATombstoneAnswersItsOwnGenerationProcessNotARestartedOne) {
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c =
      startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32), nullptr,
                   "secret", [](ContextSender::Options& o) { o.on_request = nullptr; });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto a = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(a);
  ASSERT_TRUE(a->connect(shmAddress(name), 1).isOk());
  ASSERT_TRUE(a->agent->sendMessage(a->peer, wire::encodeMessage(a->request(9, 1, {0, 1}))).isOk());
  ASSERT_TRUE(waitUntil([&] { return c->sender->metrics().requests_started >= 1; }));
  ASSERT_TRUE(c->sender->cancel(9).isOk());
  // The process that asked hears the cancel, and hears it again when it asks again.
  auto again = a->ask(wire::Message{a->request(9, 2, {0, 1})});
  ASSERT_TRUE(again.isOk()) << again.status().toString();
  EXPECT_EQ(again->status.code(), StatusCode::kCancelled) << again->status.toString();

  // A restarted process (incarnation 2) asks for id 9 anew: a request of its own, served once
  // the context engine marks it ready.
  auto b = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->connect(shmAddress(name), 2).isOk());
  std::thread prefill([&] {
    ASSERT_TRUE(waitUntil([&] { return c->sender->metrics().requests_started >= 3; }));
    (*c->serve)(9, 2 * b->info.layout.tokens_per_block);
  });
  auto fresh = b->ask(wire::Message{b->request(9, 1, {2, 3})});
  prefill.join();
  ASSERT_TRUE(fresh.isOk()) << fresh.status().toString();
  EXPECT_TRUE(fresh->status.isOk()) << fresh->status.toString();
  EXPECT_GT(fresh->bytes, 0u);
  (void)b->agent->disconnect(b->peer);
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// `m` encoded as a frame of `minor`, its last `drop` body bytes (fields that minor predates) cut.
Bytes frameOfMinor(const wire::Message& m, uint16_t minor, size_t drop) {
  Bytes frame = wire::encodeMessage(m);
  frame.resize(frame.size() - 4 - drop);   // the crc, then the fields
  frame[6] = static_cast<uint8_t>(minor);  // little-endian
  frame[7] = static_cast<uint8_t>(minor >> 8);
  storeFixed32(frame.data() + 9, static_cast<uint32_t>(frame.size() - 13));
  putFixed32(frame, crc32c(frame.data(), frame.size()));
  return frame;
}

// Round 3, finding 11: one connection speaks the minor its Hello came in. A peer that said 1.5
// and then sends a minor-1 frame (an epoch-less Cancel, which would cancel every use of the id)
// is refused, not served.
TEST(Epochs, AFrameOfAnotherMinorThanTheHelloIsRefused) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto g = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->connect(shmAddress(name), 1).isOk());
  // A minor-1 Cancel: the current encoding without its epoch (one varint byte, 0).
  const Bytes frame = frameOfMinor(wire::Message{wire::Cancel{42, "old", 0}}, 1, 1);
  ASSERT_TRUE(wire::decodeMessage(frame).isOk());  // a well-formed frame of minor 1
  ASSERT_TRUE(g->agent->sendMessage(g->peer, frame).isOk());
  auto answer = exchange(*g->agent, g->peer, std::nullopt);
  ASSERT_TRUE(answer.isOk()) << answer.status().toString();
  auto* error = std::get_if<wire::Error>(&*answer);
  ASSERT_NE(error, nullptr) << wire::summarize(*answer);
  EXPECT_NE(error->status.message().find("frame of minor 1 on a connection whose hello came in "
                                         "minor " +
                                         std::to_string(wire::kWireVersionMinor)),
            std::string::npos)
      << error->status.toString();
  EXPECT_TRUE(g->lost());
  EXPECT_TRUE(logs.has({"one connection speaks one minor"})) << logs.all();
}

// Finding 3: what one authenticated peer can make the context rank hold is bounded: requests
// waiting for markReady, and the destination blocks they name.
TEST(Bounds, WaitingRequestsOfOnePeerAreBoundedAndRefusedLoudly) {
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret", [](ContextSender::Options& o) {
                          o.on_request = nullptr;  // nobody marks anything ready
                          o.max_waiting_requests = 4;
                          o.max_waiting_blocks_factor = 1;
                        });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto g = RawGeneration::make(model, kTp1, 0, "gen");
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->connect(shmAddress(name), 1).isOk());
  const uint32_t n = g->info.layout.num_blocks;
  // Three one-block requests and one naming n - 3 blocks wait: n blocks in all, the budget.
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(
        g->agent->sendMessage(g->peer, wire::encodeMessage(g->request(id, id, {0}))).isOk());
  }
  std::vector<uint32_t> most;
  for (uint32_t b = 0; b + 3 < n; ++b) most.push_back(b);
  ASSERT_TRUE(g->agent->sendMessage(g->peer, wire::encodeMessage(g->request(4, 4, most))).isOk());
  // Past the count, then (one cancelled: 3 waiting, n - 1 blocks) past the blocks: refused at
  // once, each naming the bound.
  auto over = g->ask(wire::Message{g->request(5, 5, {1})});
  ASSERT_TRUE(over.isOk()) << over.status().toString();
  EXPECT_EQ(over->request_id, 5u);
  EXPECT_EQ(over->status.code(), StatusCode::kResourceExhausted) << over->status.toString();
  EXPECT_NE(over->status.message().find("limits 4 requests"), std::string::npos)
      << over->status.toString();
  auto cancelled = g->ask(wire::Message{wire::Cancel{1, "done waiting", 1}});
  ASSERT_TRUE(cancelled.isOk() && cancelled->status.code() == StatusCode::kCancelled);
  auto blocks = g->ask(wire::Message{g->request(6, 6, {2, 3, 4})});
  ASSERT_TRUE(blocks.isOk()) << blocks.status().toString();
  EXPECT_EQ(blocks->status.code(), StatusCode::kResourceExhausted) << blocks->status.toString();
  EXPECT_NE(blocks->status.message().find(std::to_string(n) + " blocks"), std::string::npos)
      << blocks->status.toString();
  EXPECT_EQ(c->sender->metrics().requests_over_limit, 2u);
  (void)g->agent->disconnect(g->peer);
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(waitUntil([&] { return c->sender->connectedPeers() == 0; }));
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// Round 3, finding 11, generation side: a context rank whose Hello came in the current minor and
// then answers with an epoch-less minor-1 Done (which would end any use of the id) is dropped,
// and the request fails instead of completing on it.
TEST(Epochs, AContextFrameOfAnotherMinorThanItsHelloDropsTheConnection) {
  LogCapture logs;
  const ModelSpec model = tinyModel();
  auto h = HostileContext::make(model);
  ASSERT_NE(h, nullptr);
  auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(64, 8), kTp1,
                           {h->agent->localAddress()}, milliseconds(60000), nullptr, "secret");
  ASSERT_TRUE(g.isOk());
  ASSERT_TRUE(h->acceptHello());
  h->send(wire::Hello{rankInfoOf(*h->cache, *h->agent, wire::InstanceRole::kContext), "", 5});
  ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
  auto alloc = (*g)->start(5, 40);
  ASSERT_TRUE(alloc.isOk());
  auto ask = h->next();
  ASSERT_TRUE(ask && std::holds_alternative<wire::TransferRequest>(*ask));
  const RankLayout& layout = (*g)->cache->layout();
  const uint64_t bytes =
      alloc->blocks.size() * layout.kvBytesPerBlock() + layout.stateBytesPerSlot();
  const wire::TransferDone done{5, OkStatus(), bytes, std::nullopt, {}, 0};
  ASSERT_TRUE(h->agent->sendMessage(h->peer, frameOfMinor(wire::Message{done}, 1, 1)).isOk());
  auto r = (*g)->rx->wait(5, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_NE(r->state, RequestResult::State::kDone) << r->status.toString();
  EXPECT_TRUE(logs.has({"one connection speaks one minor"})) << logs.all();
  ASSERT_TRUE((*g)->rx->release(5).isOk());
  // The fence of the part ends once the dropped peer's end is closed too (no write after release).
  (void)h->agent->disconnect(h->peer);
  expectPagesFree(*(*g)->cache, "gen");
  (*g)->rx->shutdown();
}

// Round 3, finding 6: the blocks a peer's waiting asks may name are bounded by this rank's own
// pool, not by the peer's claimed num_blocks (a claim of 2^32 - 1 let 250 parked requests take
// 1.15 GB); and the generation ranks connected at once are bounded.
TEST(Bounds, WaitingBlocksAreBoundedByThisRanksPoolAndPeersByACount) {
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
                        nullptr, "secret", [](ContextSender::Options& o) {
                          o.on_request = nullptr;
                          o.max_waiting_blocks_factor = 1;
                          o.max_generation_peers = 2;
                        });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  // A generation rank whose pool is 32 times ours: its asks may still name only 128 blocks.
  auto g = RawGeneration::make(model, kTp1, 0, "big", Capacity::counts(4096, 8));
  ASSERT_TRUE(g);
  ASSERT_TRUE(g->connect(shmAddress(name), 1).isOk());
  std::vector<uint32_t> many(129);
  std::iota(many.begin(), many.end(), 0u);
  auto over = g->ask(wire::Message{g->request(1, 1, many)});
  ASSERT_TRUE(over.isOk()) << over.status().toString();
  EXPECT_EQ(over->status.code(), StatusCode::kResourceExhausted) << over->status.toString();
  EXPECT_NE(over->status.message().find("limits 4096 requests, 128 blocks"), std::string::npos)
      << over->status.toString();
  many.pop_back();
  ASSERT_TRUE(g->agent->sendMessage(g->peer, wire::encodeMessage(g->request(2, 1, many))).isOk());
  // Two generation ranks at most: a third Hello is refused naming the bound.
  auto second = RawGeneration::make(model, kTp1, 0, "second");
  auto third = RawGeneration::make(model, kTp1, 0, "third");
  ASSERT_TRUE(second && third);
  ASSERT_TRUE(second->connect(shmAddress(name), 1).isOk());
  auto refused = third->connect(shmAddress(name), 1);
  EXPECT_FALSE(refused.isOk());
  EXPECT_NE(refused.status().message().find("max_generation_peers=2"), std::string::npos)
      << refused.status().toString();
  (void)g->agent->disconnect(g->peer);
  (void)second->agent->disconnect(second->peer);
  EXPECT_TRUE(waitUntil([&] { return c->sender->connectedPeers() == 0; }));
  expectPagesFree(*c->cache, "ctx");
  EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
}

// Round 3, finding 4: which generation ranks will ask for a request is worked out once per peer,
// at its Hello. A token holder claiming tp 4096 once made every request id cost 4096 plans on
// the progress thread under its lock (70-250 ms each): an honest peer waited seconds.
TEST(Bounds, APeerClaimingAHugeTpCostsOnePassAtItsHelloNotOnePerRequest) {
  const ModelSpec model = tinyModel();
  const std::string name = uniqueName("ctx");
  auto c = startContext(model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(512, 256),
                        nullptr, "secret");
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  auto wide = RawGeneration::make(model, ParallelConfig{4096, 1, {}}, 0, "wide");
  ASSERT_TRUE(wide);
  ASSERT_TRUE(wide->connect(shmAddress(name), 1).isOk());
  for (uint64_t id = 1000; id < 1200; ++id) {
    ASSERT_TRUE(wide->agent->sendMessage(wide->peer, wire::encodeMessage(wide->request(id, 1, {0})))
                    .isOk());
  }
  auto honest = RawGeneration::make(model, kTp1, 0, "honest");
  ASSERT_TRUE(honest);
  const auto start = Clock::now();
  ASSERT_TRUE(honest->connect(shmAddress(name), 1).isOk());
  auto done = honest->ask(wire::Message{honest->request(5, 1, {0, 1})});
  ASSERT_TRUE(done.isOk()) << done.status().toString();
  EXPECT_TRUE(done->status.isOk()) << done->status.toString();
  // 200 asks at >= 70 ms each stood in front of it before; now they cost a lookup each.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  (void)wide->agent->disconnect(wide->peer);
  (void)honest->agent->disconnect(honest->peer);
}

// Finding 10: records of ended ids are bounded in number and expire on the timer, whether or
// not anything else happens.
TEST(Bounds, RememberedIdsAreBoundedAndExpireOnTheirOwn) {
  const ModelSpec model = tinyModel();
  auto c = startContext(model, kTp1, 0, uniqueName("ctx"), StateLayout::kPaged,
                        Capacity::counts(32, 8), nullptr, "secret", [](ContextSender::Options& o) {
                          o.max_remembered_ids = 16;
                          o.lease_timeout = milliseconds(100);
                        });
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  for (uint64_t id = 1; id <= 1000; ++id) ASSERT_TRUE(c->sender->cancel(id).isOk());
  EXPECT_EQ(c->sender->rememberedIds(), 16u);
  // The newest are the ones kept: marking one of them ready says it is dead.
  ASSERT_TRUE(c->cache->allocate(1000, 10).isOk());
  EXPECT_EQ(c->sender->markReady(1000).code(), StatusCode::kCancelled);
  EXPECT_TRUE(waitUntil([&] { return c->sender->rememberedIds() == 0; }));
  expectPagesFree(*c->cache, "ctx");
}

// Forwards to an inner agent, but every postWrite yields a transfer that never makes progress:
// it ends only when cancelled (unless `ignore_cancel`) or when its peer is disconnected.
class StallAgent final : public Agent {
 public:
  StallAgent(std::unique_ptr<Agent> inner, bool ignore_cancel)
      : inner_(std::move(inner)), ignore_cancel_(ignore_cancel) {}
  const transport::Capabilities& capabilities() const override { return inner_->capabilities(); }
  std::string localAddress() const override { return inner_->localAddress(); }
  StatusOr<std::vector<uint8_t>> registerRegion(const Region& r,
                                                transport::RegionAccess access) override {
    return inner_->registerRegion(r, access);
  }
  Status deregisterRegion(uint32_t id) override { return inner_->deregisterRegion(id); }
  StatusOr<transport::PeerId> connect(const std::string& a) override { return inner_->connect(a); }
  Status disconnect(transport::PeerId p) override {
    std::vector<std::shared_ptr<transport::detail::TransferCore>> ended;
    {
      std::lock_guard lock(mu_);
      auto it = held_.find(p);
      if (it != held_.end()) {
        ended = std::move(it->second);
        held_.erase(it);
      }
    }
    for (auto& core : ended) core->complete(Unavailable("peer disconnected"));
    return inner_->disconnect(p);
  }
  Status addRemoteRegion(transport::PeerId p, uint32_t id, uint64_t len,
                         std::span<const uint8_t> key) override {
    return inner_->addRemoteRegion(p, id, len, key);
  }
  StatusOr<transport::Transfer> postWrite(transport::PeerId p,
                                          std::vector<transport::WriteOp> ops) override {
    uint64_t bytes = 0;
    for (const auto& op : ops) bytes += op.bytes;
    auto core = std::make_shared<transport::detail::TransferCore>(bytes, ops.size());
    if (!ignore_cancel_) {
      core->setCancelHook([weak = std::weak_ptr(core)] {
        if (auto c = weak.lock()) c->complete(Cancelled("cancelled"));
      });
    }
    std::lock_guard lock(mu_);
    held_[p].push_back(core);
    return transport::Transfer(core);
  }
  void requireWriteGrants() override { inner_->requireWriteGrants(); }
  Status grantWrites(transport::PeerId p) override { return inner_->grantWrites(p); }
  Status sendMessage(transport::PeerId p, std::span<const uint8_t> payload) override {
    return inner_->sendMessage(p, payload);
  }
  std::optional<transport::Event> pollEvent(milliseconds timeout) override {
    return inner_->pollEvent(timeout);
  }
  void wakeEventWaiter() override { inner_->wakeEventWaiter(); }

 private:
  std::unique_ptr<Agent> inner_;
  const bool ignore_cancel_;
  std::mutex mu_;
  std::map<transport::PeerId, std::vector<std::shared_ptr<transport::detail::TransferCore>>>
      held_;  // guarded by mu_
};

// Finding 10: a write that makes no progress ends within stall_timeout on both sides, and one
// that does not even stop when cancelled ends with its peer's connection.
TEST(Faults, WriteWithoutProgressIsCancelledAndBothSidesFailTheRequest) {
  for (bool ignore_cancel : {false, true}) {
    SCOPED_TRACE(ignore_cancel ? "cancel ignored" : "cancel honoured");
    const ModelSpec model = tinyModel();
    const std::string name = uniqueName("ctx");
    auto c = startContext(
        model, kTp1, 0, name, StateLayout::kPaged, Capacity::counts(128, 32),
        [&](std::unique_ptr<Agent> a) {
          return std::make_unique<StallAgent>(std::move(a), ignore_cancel);
        },
        "", [](ContextSender::Options& o) { o.stall_timeout = milliseconds(200); });
    ASSERT_TRUE(c.isOk()) << c.status().toString();
    auto g = startGeneration(model, kTp1, 0, StateLayout::kPaged, Capacity::counts(64, 8), kTp1,
                             {shmAddress(name)}, milliseconds(60000));
    ASSERT_TRUE(g.isOk());
    ASSERT_TRUE((*g)->rx->waitForPeers(deadline()).isOk());
    ASSERT_TRUE((*g)->start(1, 50).isOk());
    auto r = (*g)->rx->wait(1, deadline());
    ASSERT_TRUE(r.isOk());
    ASSERT_EQ(r->state, RequestResult::State::kFailed);
    if (ignore_cancel) {
      EXPECT_EQ(r->status.code(), StatusCode::kUnavailable) << r->status.toString();
    } else {
      EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
      EXPECT_NE(r->status.message().find("made no progress in 200 ms"), std::string::npos)
          << r->status.toString();
    }
    EXPECT_EQ(c->sender->metrics().writes_stalled, 1u);
    ASSERT_TRUE((*g)->rx->release(1).isOk());
    expectPagesFree(*c->cache, "ctx");
    expectPagesFree(*(*g)->cache, "gen");
    EXPECT_TRUE(c->sender->selfCheck().isOk()) << c->sender->selfCheck().toString();
  }
}

// Finding 9: shutdown() waits for a connect that hangs (a context rank whose listener never
// accepts) without holding the receiver's lock, so no other call waits with it.
TEST(Faults, ShutdownWaitingForAHangingConnectBlocksNoOtherCall) {
  const ModelSpec model = tinyModel();
  const std::string hole_name = uniqueName("hole");
  int hole = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(hole, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, hole_name.data(), hole_name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + hole_name.size());
  ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&sa), len), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(hole, 16), 0);  // never accepted

  auto cache = HybridCacheManager::create(model, kTp1, 0, 0, StateLayout::kPaged,
                                          Capacity::counts(64, 8), Region::Backing::kMemfd);
  ASSERT_TRUE(cache.isOk());
  transport::AgentConfig ac;
  ac.backend = "shm";
  ac.connect_timeout = milliseconds(3000);
  auto agent = transport::createAgent(ac);
  ASSERT_TRUE(agent.isOk());
  GenerationReceiver::Options ro;
  ro.model = model;
  ro.parallel = kTp1;
  ro.ctx_parallel = kTp1;
  ro.ctx_addresses = {shmAddress(hole_name)};
  auto rx = GenerationReceiver::create(ro, cache->get(), std::move(*agent));
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  ASSERT_TRUE((*rx)->startRequest(1, 50).isOk());  // queued behind the connect
  std::this_thread::sleep_for(milliseconds(200));  // the connect is under way
  std::atomic<bool> shut{false};
  std::thread closer([&] {
    (*rx)->shutdown();
    shut = true;
  });
  std::this_thread::sleep_for(milliseconds(300));  // shutdown is waiting on the connect now
  const auto t0 = Clock::now();
  auto r = (*rx)->poll(1);
  (void)(*rx)->activeRequests();
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - t0);
  const bool shutdown_still_waiting = !shut.load();
  closer.join();
  ::close(hole);
  EXPECT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_TRUE(shutdown_still_waiting) << "the connect ended too early to prove anything";
  EXPECT_LT(took.count(), 1500) << "poll waited for shutdown's connect";
  expectPagesFree(**cache, "gen");
}

// UCX active-message path: the receiving agent checks every incoming write against its OWN
// registered regions, whatever lengths the writer was told.
TEST(HostilePeer, UcxActiveMessageWritesOutsideRegisteredRegionsAreRefused) {
  const auto backends = transport::availableBackends();
  if (std::find(backends.begin(), backends.end(), "ucx") == backends.end()) {
    GTEST_SKIP() << "built without UCX";
  }
  LogCapture logs;
  auto config = [](const std::string& label) {
    transport::AgentConfig ac;
    ac.backend = "ucx";
    ac.label = label;
    ac.ucx_mode = transport::UcxMode::kAm;
    ac.ucx_options = {{"TLS", "tcp"}};
    return ac;
  };
  auto writer = transport::createAgent(config("writer"));
  auto receiver = transport::createAgent(config("receiver"));
  ASSERT_TRUE(writer.isOk() && receiver.isOk()) << writer.status().toString();
  constexpr uint64_t kLen = 64 << 10;
  auto dst = Region::allocate(7, kLen, Region::Backing::kAnonymous, "dst");
  auto src = Region::allocate(1, 4 * kLen, Region::Backing::kAnonymous, "src");
  ASSERT_TRUE(dst.isOk() && src.isOk());
  std::memset((*dst)->data(), kSentinel, kLen);
  std::memset((*src)->data(), 0x11, 4 * kLen);
  auto key = (*receiver)->registerRegion(**dst, transport::RegionAccess::kRemoteWritable);
  ASSERT_TRUE(key.isOk());
  ASSERT_TRUE((*writer)->registerRegion(**src, transport::RegionAccess::kLocalSource).isOk());
  auto peer = (*writer)->connect((*receiver)->localAddress());
  ASSERT_TRUE(peer.isOk()) << peer.status().toString();
  // The writer holds a forged key (the key's length field, bytes 8..15, says 4x the registered
  // length), so its own bounds check passes; and it believes a region 8 exists.
  std::vector<uint8_t> forged = *key;
  ASSERT_GE(forged.size(), 16u);
  for (int i = 0; i < 8; ++i) forged[8 + i] = static_cast<uint8_t>((4 * kLen) >> (8 * i));
  ASSERT_TRUE((*writer)->addRemoteRegion(*peer, 7, 4 * kLen, forged).isOk());
  ASSERT_TRUE((*writer)->addRemoteRegion(*peer, 8, 4 * kLen, forged).isOk());
  struct Bad {
    std::string what;
    transport::WriteOp op;
  };
  const std::vector<Bad> bad = {
      {"crossing the end", {1, 0, 7, kLen - 100, 4096}},
      {"past the end", {1, 0, 7, 2 * kLen, 4096}},
      {"an unregistered region", {1, 0, 8, 0, 4096}},
  };
  for (const Bad& b : bad) {
    auto t = (*writer)->postWrite(*peer, {b.op});
    if (!t.isOk()) {
      EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << b.what;
      continue;
    }
    Status s = t->wait(deadline());
    EXPECT_FALSE(s.isOk()) << b.what;
    EXPECT_NE(t->poll(), transport::TransferState::kInProgress) << b.what;
  }
  // A good write still lands, and not one byte outside it was touched.
  auto good = (*writer)->postWrite(*peer, {{1, 0, 7, 1024, 512}});
  ASSERT_TRUE(good.isOk());
  ASSERT_TRUE(good->wait(deadline()).isOk());
  uint64_t stray = 0;
  for (uint64_t i = 0; i < kLen; ++i) {
    const bool inside = i >= 1024 && i < 1024 + 512;
    stray += (*dst)->data()[i] != (inside ? 0x11 : kSentinel);
  }
  EXPECT_EQ(stray, 0u);
  EXPECT_TRUE(logs.has({"refusing a write", "does not fit region id=7"})) << logs.all();
  EXPECT_TRUE(logs.has({"refusing a write", "not registered here"})) << logs.all();
}

}  // namespace
}  // namespace hxfer::engine
