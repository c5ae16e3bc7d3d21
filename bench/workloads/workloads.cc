// The workloads of workloads.h.
//
// Method: ranks are threads of this process, each with its own cache manager and transport
// agent (engine::LocalCluster), so shm and ucx run their real data paths (memfd mappings, UCX
// over loopback). A timed request runs from the generation side's startRequest (which sends
// the TransferRequest; the context side was marked ready before) to the last rank's completion;
// filling the context pages with the oracle and checking the received bytes are outside the
// clock. Each measured configuration runs its baselines in the same loop (memcpy, TCP, hxfer,
// alternating the order) so all see the same machine load; --warmup runs are dropped and the
// figures are the median and the min..max spread of --repetitions runs.
//
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "workloads/workloads.h"

#include "cache/cache_manager.h"
#include "cli/socket_util.h"
#include "cli/table.h"
#include "common/logging.h"
#include "common/strings.h"
#include "engine/cluster.h"
#include "engine/handshake.h"
#include "plan/oracle.h"
#include "plan/planner.h"
#include "transport/auth.h"
#include "transport/transport.h"

namespace hxfer::bench {
namespace {

using cli::listenOnLoopback;
using cli::recvAll;
using cli::sendAll;
using cli::Table;

using engine::Clock;
using engine::ClusterOptions;
using engine::LocalCluster;
using namespace std::chrono_literals;

constexpr auto kRequestDeadline = 120s;

// ---------------------------------------------------------------------------------------------
// Options

StatusOr<std::vector<uint32_t>> parseCountList(const std::string& flag, const std::string& text) {
  std::vector<uint32_t> out;
  for (std::string item : splitList(text)) {
    uint64_t mult = 1;
    const char last = static_cast<char>(std::tolower(static_cast<unsigned char>(item.back())));
    if (last == 'k') mult = 1024;
    if (last == 'm') mult = 1024 * 1024;
    if (mult != 1) item.pop_back();
    char* end = nullptr;
    const unsigned long long v = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v == 0 || v * mult > (1ull << 31)) {
      return InvalidArgument(flag + ": '" + item + "' is not a count like 8k");
    }
    out.push_back(static_cast<uint32_t>(v * mult));
  }
  if (out.empty()) return InvalidArgument(flag + " is empty");
  return out;
}

StatusOr<std::vector<std::pair<uint32_t, uint32_t>>> parseTpPairs(const std::string& text) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const std::string& item : splitList(text)) {
    unsigned a = 0, b = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%u:%u%c", &a, &b, &tail) != 2 || a == 0 || b == 0) {
      return InvalidArgument("--tp-pairs: '" + item + "' is not ctx:gen like 2:1");
    }
    out.emplace_back(a, b);
  }
  if (out.empty()) return InvalidArgument("--tp-pairs is empty");
  return out;
}

std::string tokensLabel(uint32_t t) {
  if (t % (1024 * 1024) == 0) return std::to_string(t / (1024 * 1024)) + "m";
  if (t % 1024 == 0) return std::to_string(t / 1024) + "k";
  return std::to_string(t);
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string mib(uint64_t bytes) { return fmt("%.1f", static_cast<double>(bytes) / (1 << 20)); }

double peakRssMib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// ---------------------------------------------------------------------------------------------
// Samples and results

struct Samples {
  std::vector<double> v;  // seconds
  void add(double s) { v.push_back(s); }
  double quantile(double q) const {
    if (v.empty()) return 0.0;
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    // Nearest rank: the smallest sample with at least q of the samples at or below it.
    const double rank = std::ceil(q * static_cast<double>(s.size()));
    const size_t i = rank < 1 ? 0 : std::min(s.size() - 1, static_cast<size_t>(rank) - 1);
    return s[i];
  }
  double median() const {
    if (v.empty()) return 0.0;
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    const size_t n = s.size();
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
  double min() const { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }
  double max() const { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }
};

double gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// One measured configuration. Absent figures stay nullopt (and empty in the CSV).
struct Row {
  std::string workload, backend, model;
  uint32_t tokens = 0, layers = 0, tokens_per_block = 0, ctx_tp = 0, gen_tp = 0;
  uint32_t concurrency = 0, requests = 0;
  uint64_t bytes = 0;  // per request
  std::optional<uint64_t> ops, runs;
  Samples time;  // per request, or per round trip
  std::optional<double> memcpy_gbps, tcp_gbps;
  std::optional<double> ref_ratio;  // to the workload's reference (matched tp, large page)
  // The same, each side first divided by its own memcpy baseline: cancels load that changed
  // between the two configurations (they run minutes apart on a shared machine).
  std::optional<double> ref_ratio_norm;
  std::string ref;  // what ref_ratio compares with
  std::optional<double> req_per_s, load_gbps;
  std::optional<double> plan_us;  // planning one request (all rank pairs), outside the clock
  // streaming: the simulated prefill, and the median time from its end to the request
  // complete when the request is marked ready whole at the end (`time` holds the streamed
  // samples; ref_ratio is streamed / whole, the exposed fraction).
  std::optional<double> prefill_s, whole_exposed_s;
  bool verified = false;
  double peak_rss_mib = 0;

  // Bytes over the median time; none for streaming, whose times are not whole transfers.
  double goodput() const { return workload == "streaming" ? 0.0 : gbps(bytes, time.median()); }
  std::optional<double> ratioMemcpy() const {
    if (!memcpy_gbps || *memcpy_gbps <= 0 || bytes == 0) return std::nullopt;
    return goodput() / *memcpy_gbps;
  }
  std::optional<double> ratioTcp() const {
    if (!tcp_gbps || *tcp_gbps <= 0 || bytes == 0) return std::nullopt;
    return goodput() / *tcp_gbps;
  }
};

nlohmann::json rowJson(const Row& r) {
  nlohmann::json j;
  j["workload"] = r.workload;
  j["backend"] = r.backend;
  j["model"] = r.model;
  j["tokens"] = r.tokens;
  j["layers"] = r.layers;
  j["tokens_per_block"] = r.tokens_per_block;
  j["ctx_tp"] = r.ctx_tp;
  j["gen_tp"] = r.gen_tp;
  if (r.concurrency) j["concurrency"] = r.concurrency;
  j["requests"] = r.requests;
  j["bytes"] = r.bytes;
  if (r.ops) j["ops"] = *r.ops;
  if (r.runs) j["contiguous_runs"] = *r.runs;
  j["seconds"] = r.time.v;
  j["median_s"] = r.time.median();
  j["min_s"] = r.time.min();
  j["max_s"] = r.time.max();
  j["p50_us"] = r.time.quantile(0.5) * 1e6;
  j["p99_us"] = r.time.quantile(0.99) * 1e6;
  j["p999_us"] = r.time.quantile(0.999) * 1e6;
  if (r.bytes && r.goodput() > 0) {
    j["goodput_gbps"] = r.goodput();
    j["goodput_min_gbps"] = gbps(r.bytes, r.time.max());
    j["goodput_max_gbps"] = gbps(r.bytes, r.time.min());
  }
  if (r.memcpy_gbps) j["memcpy_gbps"] = *r.memcpy_gbps;
  if (r.tcp_gbps) j["tcp_gbps"] = *r.tcp_gbps;
  if (auto x = r.ratioMemcpy()) j["ratio_to_memcpy"] = *x;
  if (auto x = r.ratioTcp()) j["ratio_to_tcp"] = *x;
  if (r.ref_ratio) {
    j["ratio_to_ref"] = *r.ref_ratio;
    j["ref"] = r.ref;
  }
  if (r.ref_ratio_norm) j["ratio_to_ref_memcpy_normalised"] = *r.ref_ratio_norm;
  if (r.req_per_s) j["requests_per_s"] = *r.req_per_s;
  if (r.load_gbps) j["load_gbps"] = *r.load_gbps;
  if (r.plan_us) j["plan_us"] = *r.plan_us;
  if (r.prefill_s) j["prefill_ms"] = *r.prefill_s * 1e3;
  if (r.whole_exposed_s) j["unstreamed_exposed_ms"] = *r.whole_exposed_s * 1e3;
  j["verified"] = r.verified;
  j["peak_rss_mib"] = r.peak_rss_mib;
  return j;
}

std::string csvHeader() {
  return "workload,backend,model,tokens,layers,tokens_per_block,ctx_tp,gen_tp,concurrency,"
         "requests,bytes,ops,contiguous_runs,median_ms,min_ms,max_ms,p50_us,p99_us,p999_us,"
         "goodput_gbps,memcpy_gbps,tcp_gbps,ratio_to_memcpy,ratio_to_tcp,ratio_to_ref,"
         "ratio_to_ref_memcpy_normalised,ref,"
         "requests_per_s,load_gbps,plan_us,prefill_ms,unstreamed_exposed_ms,verified,peak_rss_mib";
}

std::string csvLine(const Row& r) {
  auto opt = [](std::optional<double> v) { return v ? fmt("%.6g", *v) : std::string(); };
  auto optu = [](std::optional<uint64_t> v) { return v ? std::to_string(*v) : std::string(); };
  std::ostringstream o;
  o << r.workload << ',' << r.backend << ',' << r.model << ',' << r.tokens << ',' << r.layers << ','
    << r.tokens_per_block << ',' << r.ctx_tp << ',' << r.gen_tp << ',' << r.concurrency << ','
    << r.requests << ',' << r.bytes << ',' << optu(r.ops) << ',' << optu(r.runs) << ','
    << fmt("%.6g", r.time.median() * 1e3) << ',' << fmt("%.6g", r.time.min() * 1e3) << ','
    << fmt("%.6g", r.time.max() * 1e3) << ',' << fmt("%.6g", r.time.quantile(0.5) * 1e6) << ','
    << fmt("%.6g", r.time.quantile(0.99) * 1e6) << ',' << fmt("%.6g", r.time.quantile(0.999) * 1e6)
    << ',' << (r.goodput() > 0 ? fmt("%.6g", r.goodput()) : std::string()) << ','
    << opt(r.memcpy_gbps) << ',' << opt(r.tcp_gbps) << ',' << opt(r.ratioMemcpy()) << ','
    << opt(r.ratioTcp()) << ',' << opt(r.ref_ratio) << ',' << opt(r.ref_ratio_norm) << ',' << r.ref
    << ',' << opt(r.req_per_s) << ',' << opt(r.load_gbps) << ',' << opt(r.plan_us) << ','
    << opt(r.prefill_s ? std::optional<double>(*r.prefill_s * 1e3) : std::nullopt) << ','
    << opt(r.whole_exposed_s ? std::optional<double>(*r.whole_exposed_s * 1e3) : std::nullopt)
    << ',' << (r.verified ? 1 : 0) << ',' << fmt("%.1f", r.peak_rss_mib);
  return o.str();
}

// A progress line on stderr while a configuration runs (only on a terminal; --quiet hides it).
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled && isatty(STDERR_FILENO)) {}
  void update(const std::string& what, size_t done, size_t total) {
    if (!enabled_) return;
    const int width = 24;
    const int filled = total ? static_cast<int>(width * done / total) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r  [%s] %zu/%zu %-48s", bar.c_str(), done, total, what.c_str());
    std::fflush(stderr);
  }
  void clear() {
    if (!enabled_) return;
    std::fprintf(stderr, "\r%*s\r", 90, "");
    std::fflush(stderr);
  }

 private:
  bool enabled_;
};

// ---------------------------------------------------------------------------------------------
// Baselines

// memcpy of `op_sizes` (back to back, the request's op sizes in plan order) between two
// pre-faulted buffers.
class MemcpyBaseline {
 public:
  static StatusOr<MemcpyBaseline> create(std::vector<uint64_t> op_sizes) {
    MemcpyBaseline b;
    uint64_t total = 0;
    for (uint64_t s : op_sizes) total += s;
    ASSIGN_OR_RETURN(b.src_, Region::allocate(1, total, Region::Backing::kAnonymous, "base-src"));
    ASSIGN_OR_RETURN(b.dst_, Region::allocate(2, total, Region::Backing::kAnonymous, "base-dst"));
    std::memset(b.src_->data(), 0x5a, total);
    b.op_sizes_ = std::move(op_sizes);
    b.total_ = total;
    return b;
  }
  double run() const {  // seconds
    const auto t0 = Clock::now();
    uint64_t off = 0;
    for (uint64_t s : op_sizes_) {
      std::memcpy(dst_->data() + off, src_->data() + off, s);
      off += s;
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  // The whole buffer in n contiguous shares (4 KiB aligned), one thread each, the caller's
  // included: the machine's copy bandwidth rather than one thread's. Seconds.
  double runThreads(unsigned n) const {
    const uint64_t share = (total_ / std::max(n, 1u) + 4095) & ~uint64_t{4095};
    auto copy = [&](uint64_t off) {
      if (off < total_) {
        std::memcpy(dst_->data() + off, src_->data() + off, std::min(share, total_ - off));
      }
    };
    const auto t0 = Clock::now();
    std::vector<std::thread> copiers;
    for (unsigned k = 1; k < n; ++k) copiers.emplace_back(copy, k * share);
    copy(0);
    for (auto& c : copiers) c.join();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  uint64_t bytes() const { return total_; }
  const uint8_t* source() const { return src_->data(); }

 private:
  std::unique_ptr<Region> src_, dst_;
  std::vector<uint64_t> op_sizes_;
  uint64_t total_ = 0;
};

// A raw TCP loopback connection: a receiver thread reads a length-prefixed message into a
// pre-faulted buffer and answers one byte, so a run measures bytes landed, like a Done.
class TcpBaseline {
 public:
  static StatusOr<std::unique_ptr<TcpBaseline>> create(uint64_t capacity) {
    std::unique_ptr<TcpBaseline> t(new TcpBaseline());
    ASSIGN_OR_RETURN(t->buf_,
                     Region::allocate(3, capacity, Region::Backing::kAnonymous, "base-tcp"));
    sockaddr_in sa;
    ASSIGN_OR_RETURN(const int lfd, listenOnLoopback(&sa));
    t->send_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (t->send_fd_ < 0 ||
        ::connect(t->send_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(lfd);
      return Unavailable(std::string("tcp baseline connect: ") + std::strerror(errno));
    }
    t->recv_fd_ = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(lfd);
    if (t->recv_fd_ < 0) return Unavailable("tcp baseline accept failed");
    const int one = 1;
    ::setsockopt(t->send_fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(t->recv_fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    TcpBaseline* self = t.get();
    t->thread_ = std::thread([self] { self->serve(); });
    return t;
  }
  ~TcpBaseline() {
    if (send_fd_ >= 0) ::shutdown(send_fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    if (send_fd_ >= 0) ::close(send_fd_);
    if (recv_fd_ >= 0) ::close(recv_fd_);
  }
  // Seconds to move `bytes` from `src` and get the receiver's acknowledgement.
  StatusOr<double> run(const uint8_t* src, uint64_t bytes) {
    if (bytes > buf_->length()) return InvalidArgument("tcp baseline: message over capacity");
    const auto t0 = Clock::now();
    uint8_t header[8];
    std::memcpy(header, &bytes, 8);
    uint8_t ack = 0;
    if (!sendAll(send_fd_, header, 8) || !sendAll(send_fd_, src, bytes) ||
        !recvAll(send_fd_, &ack, 1)) {
      return Unavailable("tcp baseline connection broke");
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

 private:
  TcpBaseline() = default;
  void serve() {
    for (;;) {
      uint8_t header[8];
      uint64_t n = 0;
      if (!recvAll(recv_fd_, header, 8)) return;
      std::memcpy(&n, header, 8);
      if (n > buf_->length() || !recvAll(recv_fd_, buf_->data(), n)) return;
      const uint8_t ack = 1;
      if (!sendAll(recv_fd_, &ack, 1)) return;
    }
  }

  std::unique_ptr<Region> buf_;
  int send_fd_ = -1, recv_fd_ = -1;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// The cluster side

// The model's layer pattern repeated (or cut) to `layers` layers.
ModelSpec withLayers(const ModelSpec& base, uint32_t layers) {
  ModelSpec m = base;
  m.layers.clear();
  for (uint32_t i = 0; i < layers; ++i) m.layers.push_back(base.layers[i % base.numLayers()]);
  if (layers != base.numLayers()) m.name = base.name + "x" + std::to_string(layers);
  return m;
}

// One attention layer and nothing else: with the whole prompt already on the generation side
// (prefix == tokens) a request moves zero bytes, which isolates the protocol's round trip.
ModelSpec controlProbeModel() {
  ModelSpec m;
  m.name = "control-probe";
  m.architecture = "ControlProbe";
  LayerSpec l;
  l.attention = AttentionShape{1, 8};
  m.layers.push_back(l);
  m.tokens_per_block = 16;
  return m;
}

std::vector<std::pair<std::string, std::string>> ucxOptionsFor(const std::string& backend) {
  // The reference transport for ucx on one host is TCP (what crosses hosts here).
  if (backend == "ucx") return {{"TLS", "tcp,self"}};
  return {};
}

// How a workload's cluster differs from hxfer's own layout on both sides.
struct ClusterShape {
  std::optional<EngineLayout> engine;  // both sides laid out as this engine keeps its cache
  uint64_t stream_min_tokens = 512;
  uint64_t staging_bytes = 64ull << 20;  // the generation ranks' staging regions (0: none)
  bool stage_on_cheap_ops = false;       // GenerationReceiver::Options::stage_on_cheap_ops
};

StatusOr<std::unique_ptr<LocalCluster>> makeCluster(const ModelSpec& model, uint32_t ctx_tp,
                                                    uint32_t gen_tp, const std::string& backend,
                                                    uint32_t blocks, uint32_t slots,
                                                    const ClusterShape& shape = {}) {
  ClusterOptions o;
  o.stream_min_tokens = shape.stream_min_tokens;
  o.ctx_engine = shape.engine;
  o.gen_engine = shape.engine;
  o.gen_staging_bytes = shape.staging_bytes;
  o.gen_stage_on_cheap_ops = shape.stage_on_cheap_ops;
  o.model = model;
  o.ctx = ParallelConfig{ctx_tp, 1, {}};
  o.gen = ParallelConfig{gen_tp, 1, {}};
  RETURN_IF_ERROR(checkShardable(model, o.ctx).withContext("ctx tp " + std::to_string(ctx_tp)));
  RETURN_IF_ERROR(checkShardable(model, o.gen).withContext("gen tp " + std::to_string(gen_tp)));
  o.backend = backend;
  o.blocks = std::max<uint32_t>(blocks, 1);
  o.slots = std::max<uint32_t>(slots, 1);
  o.ucx_options = ucxOptionsFor(backend);
  ASSIGN_OR_RETURN(o.ctx_token, transport::auth::randomToken());
  o.gen_token = o.ctx_token;
  o.request_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kRequestDeadline);
  o.lease_timeout = o.request_timeout;
  ASSIGN_OR_RETURN(auto c, LocalCluster::create(std::move(o)));
  for (auto& r : c->receivers()) {
    RETURN_IF_ERROR(r->waitForPeers(Clock::now() + 30s).withContext("handshake"));
  }
  return c;
}

uint32_t blocksFor(const ModelSpec& m, uint32_t tokens) {
  return (tokens + m.tokens_per_block - 1) / m.tokens_per_block;
}

// Waits until every page of the cluster is free (the context side frees its pages after the
// Done was sent, asynchronously). Spins briefly, then sleeps: the wait is outside the clock.
Status settle(const LocalCluster& c) {
  const auto deadline = Clock::now() + 30s;
  std::string why;
  for (int i = 0; !c.allPagesFree(&why); ++i) {
    if (Clock::now() > deadline) return Timeout("pages not freed: " + why);
    if (i < 200) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(50us);
    }
  }
  return OkStatus();
}

// Allocates the request on every context rank, fills it with the oracle (when `fill`) and
// marks it ready. Retries while the pools are exhausted (earlier requests still being freed).
Status prepareContext(LocalCluster& c, uint64_t id, uint32_t tokens, bool fill,
                      bool mark_ready = true) {
  for (size_t i = 0; i < c.ctxCaches().size(); ++i) {
    HybridCacheManager& cache = *c.ctxCaches()[i];
    const auto deadline = Clock::now() + 30s;
    StatusOr<Allocation> a = cache.allocate(id, tokens);
    while (!a.isOk() && a.status().code() == StatusCode::kResourceExhausted &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(20us);
      a = cache.allocate(id, tokens);
    }
    if (!a.isOk()) return a.status();
    if (fill) {
      RETURN_IF_ERROR(fillRank(cache.layout(), engine::cacheMemory(cache), idsOf(*a), id));
    }
    if (mark_ready) RETURN_IF_ERROR(c.senders()[i]->markReady(id));
  }
  return OkStatus();
}

// The ops of one request as the engine plans them: sizes (for the memcpy baseline), count, and
// the minimum number of runs contiguous on both sides (ops sorted by source address, merged
// when source and destination both continue).
struct Shape {
  uint64_t bytes = 0, ops = 0, runs = 0;
  std::vector<uint64_t> op_sizes;
  double plan_us = 0;
};

StatusOr<Shape> requestShape(LocalCluster& c, const std::vector<RankIds>& ctx_ids, uint64_t id) {
  Shape s;
  std::vector<RankLayout> ctx;
  for (auto& cache : c.ctxCaches()) ctx.push_back(cache->layout());
  for (auto& gen : c.genCaches()) {
    ASSIGN_OR_RETURN(Allocation a, gen->find(id));
    ASSIGN_OR_RETURN(Planner p, Planner::create(ctx, gen->layout()));
    const RankIds dst = idsOf(a);
    const BlockRange range{0, static_cast<uint32_t>(a.blocks.size())};
    RequestPlan plan;
    RETURN_IF_ERROR(p.planInto(ctx_ids, dst, range, &plan));  // warm
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(p.planInto(ctx_ids, dst, range, &plan));
    s.plan_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    for (const RankPlan& rp : plan.ranks) {
      std::vector<CopyOp> ops = rp.ops;
      for (const CopyOp& op : ops) s.op_sizes.push_back(op.bytes);
      s.ops += ops.size();
      s.bytes += rp.bytes;
      std::sort(ops.begin(), ops.end(), [](const CopyOp& a, const CopyOp& b) {
        return std::tie(a.src_region, a.src_offset) < std::tie(b.src_region, b.src_offset);
      });
      for (size_t i = 0; i < ops.size(); ++i) {
        const bool continues = i > 0 && ops[i].src_region == ops[i - 1].src_region &&
                               ops[i].dst_region == ops[i - 1].dst_region &&
                               ops[i].src_offset == ops[i - 1].src_offset + ops[i - 1].bytes &&
                               ops[i].dst_offset == ops[i - 1].dst_offset + ops[i - 1].bytes;
        if (!continues) ++s.runs;
      }
    }
  }
  return s;
}

// Context-side ids of a request (captured before the context frees them).
StatusOr<std::vector<RankIds>> contextIds(LocalCluster& c, uint64_t id) {
  std::vector<RankIds> ids;
  for (auto& cache : c.ctxCaches()) {
    ASSIGN_OR_RETURN(Allocation a, cache->find(id));
    ids.push_back(idsOf(a));
  }
  return ids;
}

struct TimedRequest {
  double seconds = 0;
  uint64_t bytes = 0;
};

// One request end to end: prepare (untimed), startRequest on every generation rank to the last
// completion (timed), oracle check (untimed, when `verify`), release and settle.
StatusOr<TimedRequest> timedRequest(LocalCluster& c, uint64_t id, uint32_t tokens, uint32_t prefix,
                                    bool fill, bool verify, std::optional<Shape>* shape) {
  RETURN_IF_ERROR(prepareContext(c, id, tokens, fill));
  std::vector<RankIds> ctx_ids;
  if (shape && !*shape) {
    ASSIGN_OR_RETURN(ctx_ids, contextIds(c, id));
  }
  const auto t0 = Clock::now();
  for (auto& r : c.receivers()) RETURN_IF_ERROR(r->startRequest(id, tokens, prefix).status());
  TimedRequest out;
  for (auto& r : c.receivers()) {
    ASSIGN_OR_RETURN(engine::RequestResult res, r->wait(id, Clock::now() + kRequestDeadline));
    if (!res.terminal()) return Timeout("request " + std::to_string(id) + " did not finish");
    if (!res.status.isOk()) return res.status.withContext("request " + std::to_string(id));
    out.bytes += res.bytes;
  }
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (shape && !*shape) {
    ASSIGN_OR_RETURN(Shape s, requestShape(c, ctx_ids, id));
    *shape = std::move(s);
  }
  if (verify) {
    ASSIGN_OR_RETURN(OracleReport rep, c.check(id, prefix));
    if (!rep.ok()) return Corruption("request " + std::to_string(id) + ": oracle mismatch");
  }
  RETURN_IF_ERROR(c.release(id));
  RETURN_IF_ERROR(settle(c));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Workloads

struct Context {
  const WorkloadOptions& o;
  ModelSpec model;
  std::vector<Row>* rows;
  Progress progress;
  uint64_t next_id = 1;
};

// The backends a workload may name; one of them not compiled in is skipped with a note.
constexpr std::array<std::string_view, 3> kWorkloadBackends = {"shm", "ucx", "inproc"};

// --backend's names, each one a workload may run over. Errors name --backend and the value.
Status checkBackendNames(const std::string& backends) {
  for (const std::string& b : splitList(backends)) {
    if (std::find(kWorkloadBackends.begin(), kWorkloadBackends.end(), b) ==
        kWorkloadBackends.end()) {
      return InvalidArgument("--backend " + b + " is not one of shm, ucx, inproc");
    }
  }
  return OkStatus();
}

// The backends to run: --backend or the workload's `fallback`, less those not built in (with a
// note). Unavailable when none is left.
StatusOr<std::vector<std::string>> backendsFor(const WorkloadOptions& o,
                                               const std::string& fallback) {
  const std::string asked = o.backends.empty() ? fallback : o.backends;
  RETURN_IF_ERROR(checkBackendNames(asked));
  const std::vector<std::string> available = transport::availableBackends();
  std::vector<std::string> out;
  for (const std::string& b : splitList(asked)) {
    if (std::find(available.begin(), available.end(), b) == available.end()) {
      std::fprintf(stderr, "bench: backend %s is not built in; skipped\n", b.c_str());
      continue;
    }
    out.push_back(b);
  }
  if (out.empty()) {
    std::string built;
    for (const std::string& b : available) built += (built.empty() ? "" : ", ") + b;
    return Unavailable("--backend " + asked +
                       ": none of these backends is built in (built in: " + built + ")");
  }
  return out;
}

// Measures `bytes` over `backend` (one configuration) with its memcpy and TCP baselines in the
// same loop. Fills row.time, bytes, ops, runs, baselines, verified.
Status measureRequest(Context& cx, LocalCluster& c, uint32_t tokens, Row* row, bool with_tcp) {
  const WorkloadOptions& o = cx.o;
  const int total = o.warmup + o.repetitions;
  std::optional<Shape> shape;
  std::optional<MemcpyBaseline> memcpy_base;
  std::unique_ptr<TcpBaseline> tcp;
  Samples memcpy_s, tcp_s;
  row->verified = !o.no_verify;
  const std::string label = row->workload + " " + row->backend + " T=" + tokensLabel(tokens) +
                            " tp " + std::to_string(row->ctx_tp) + ":" +
                            std::to_string(row->gen_tp);
  for (int i = 0; i < total; ++i) {
    cx.progress.update(label, static_cast<size_t>(i), static_cast<size_t>(total));
    const bool timed = i >= o.warmup;
    auto runHxfer = [&]() -> Status {
      ASSIGN_OR_RETURN(TimedRequest t, timedRequest(c, cx.next_id++, tokens, 0, true,
                                                    !o.no_verify && (i == 0 || timed), &shape));
      if (timed) row->time.add(t.seconds);
      row->bytes = t.bytes;
      return OkStatus();
    };
    auto runBaselines = [&]() -> Status {
      if (!shape) return OkStatus();
      if (!memcpy_base) {
        ASSIGN_OR_RETURN(MemcpyBaseline b, MemcpyBaseline::create(shape->op_sizes));
        memcpy_base.emplace(std::move(b));
        (void)memcpy_base->run();  // warm
      }
      const double m = memcpy_base->run();
      if (timed) memcpy_s.add(m);
      if (with_tcp) {
        if (!tcp) {
          ASSIGN_OR_RETURN(tcp, TcpBaseline::create(memcpy_base->bytes()));
          RETURN_IF_ERROR(tcp->run(memcpy_base->source(), memcpy_base->bytes()).status());
        }
        ASSIGN_OR_RETURN(double t, tcp->run(memcpy_base->source(), memcpy_base->bytes()));
        if (timed) tcp_s.add(t);
      }
      return OkStatus();
    };
    // Alternate the order so that neither side always runs with warm (or cold) caches.
    if (i % 2 == 0) {
      RETURN_IF_ERROR(runHxfer());
      RETURN_IF_ERROR(runBaselines());
    } else {
      RETURN_IF_ERROR(runBaselines());
      RETURN_IF_ERROR(runHxfer());
    }
  }
  cx.progress.clear();
  if (shape) {
    row->ops = shape->ops;
    row->runs = shape->runs;
    row->plan_us = shape->plan_us;
    if (shape->bytes != row->bytes) {
      return Internal("planned bytes " + std::to_string(shape->bytes) + " != received " +
                      std::to_string(row->bytes));
    }
  }
  if (!memcpy_s.v.empty()) row->memcpy_gbps = gbps(row->bytes, memcpy_s.median());
  if (!tcp_s.v.empty()) row->tcp_gbps = gbps(row->bytes, tcp_s.median());
  row->peak_rss_mib = peakRssMib();
  return OkStatus();
}

Row baseRow(const Context& cx, const ModelSpec& m, const char* workload, const std::string& be,
            uint32_t tokens, uint32_t ctx_tp, uint32_t gen_tp) {
  Row r;
  r.workload = workload;
  r.backend = be;
  r.model = m.name;
  r.tokens = tokens;
  r.layers = m.numLayers();
  r.tokens_per_block = m.tokens_per_block;
  r.ctx_tp = ctx_tp;
  r.gen_tp = gen_tp;
  r.requests = static_cast<uint32_t>(cx.o.repetitions);
  return r;
}

std::string optFmt(const char* f, std::optional<double> v) { return v ? fmt(f, *v) : "-"; }

std::string spread(const Row& r) {
  return fmt("%.2f", gbps(r.bytes, r.time.max())) + ".." + fmt("%.2f", gbps(r.bytes, r.time.min()));
}

Status runBaselineWorkload(Context& cx) {
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", cx.o.tokens.empty() ? "1k,8k,32k" : cx.o.tokens));
  Table t({"tokens", "MiB", "ops", "memcpy GB/s", "spread", "tcp GB/s", "spread"},
          {true, true, true, true, true, true, true});
  // The request's op list comes from a real plan (the shape of a tp ctx->gen request over
  // inproc); no transfer is timed here.
  const uint32_t max_tokens = *std::max_element(tokens.begin(), tokens.end());
  ASSIGN_OR_RETURN(auto c, makeCluster(cx.model, cx.o.ctx_tp, cx.o.gen_tp, "inproc",
                                       blocksFor(cx.model, max_tokens) + 1, 1));
  for (uint32_t T : tokens) {
    std::optional<Shape> shape;
    RETURN_IF_ERROR(timedRequest(*c, cx.next_id++, T, 0, false, false, &shape).status());
    ASSIGN_OR_RETURN(MemcpyBaseline mb, MemcpyBaseline::create(shape->op_sizes));
    ASSIGN_OR_RETURN(auto tcp, TcpBaseline::create(mb.bytes()));
    Samples m, n;
    const int total = cx.o.warmup + cx.o.repetitions;
    for (int i = 0; i < total; ++i) {
      cx.progress.update("baseline T=" + tokensLabel(T), static_cast<size_t>(i),
                         static_cast<size_t>(total));
      const double a = mb.run();
      ASSIGN_OR_RETURN(double b, tcp->run(mb.source(), mb.bytes()));
      if (i >= cx.o.warmup) {
        m.add(a);
        n.add(b);
      }
    }
    cx.progress.clear();
    for (int which = 0; which < 2; ++which) {
      Row r = baseRow(cx, cx.model, "baseline", which == 0 ? "memcpy" : "tcp", T, cx.o.ctx_tp,
                      cx.o.gen_tp);
      r.bytes = mb.bytes();
      r.ops = shape->ops;
      r.time = which == 0 ? m : n;
      r.verified = false;
      r.peak_rss_mib = peakRssMib();
      cx.rows->push_back(r);
    }
    const Row& rm = cx.rows->at(cx.rows->size() - 2);
    const Row& rt = cx.rows->back();
    t.add({tokensLabel(T), mib(mb.bytes()), std::to_string(shape->ops), fmt("%.2f", rm.goodput()),
           spread(rm), fmt("%.2f", rt.goodput()), spread(rt)});
  }
  std::printf("baseline (model %s, tp %u:%u, same bytes and op sizes as one request)\n",
              cx.model.name.c_str(), cx.o.ctx_tp, cx.o.gen_tp);
  t.print(stdout, 2);
  return OkStatus();
}

Status runRequestWorkload(Context& cx) {
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", cx.o.tokens.empty() ? "1k,8k,32k" : cx.o.tokens));
  const uint32_t max_tokens = *std::max_element(tokens.begin(), tokens.end());
  Table t({"backend", "tokens", "MiB", "ops", "median ms", "GB/s", "spread", "memcpy", "x memcpy",
           "tcp", "x tcp"},
          {false, true, true, true, true, true, true, true, true, true, true});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(cx.o, "shm,ucx"));
  for (const std::string& be : backends) {
    ASSIGN_OR_RETURN(auto c, makeCluster(cx.model, cx.o.ctx_tp, cx.o.gen_tp, be,
                                         blocksFor(cx.model, max_tokens) + 1, 1));
    for (uint32_t T : tokens) {
      Row r = baseRow(cx, cx.model, "request", be, T, cx.o.ctx_tp, cx.o.gen_tp);
      RETURN_IF_ERROR(measureRequest(cx, *c, T, &r, /*with_tcp=*/true)
                          .withContext("request " + be + " T=" + tokensLabel(T)));
      t.add({be, tokensLabel(T), mib(r.bytes), std::to_string(r.ops.value_or(0)),
             fmt("%.2f", r.time.median() * 1e3), fmt("%.2f", r.goodput()), spread(r),
             optFmt("%.2f", r.memcpy_gbps), optFmt("%.2f", r.ratioMemcpy()),
             optFmt("%.2f", r.tcp_gbps), optFmt("%.2f", r.ratioTcp())});
      cx.rows->push_back(std::move(r));
    }
  }
  std::printf("request (model %s, tp %u:%u, %d runs after %d warm-up; GB/s decimal)\n",
              cx.model.name.c_str(), cx.o.ctx_tp, cx.o.gen_tp, cx.o.repetitions, cx.o.warmup);
  t.print(stdout, 2);
  return OkStatus();
}

Status runMismatchWorkload(Context& cx) {
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", cx.o.tokens.empty() ? "8k" : cx.o.tokens));
  ASSIGN_OR_RETURN(auto pairs,
                   parseTpPairs(cx.o.tp_pairs.empty() ? "1:1,2:1,1:2,4:1,1:4" : cx.o.tp_pairs));
  Table t({"backend", "tokens", "tp", "ops", "median ms", "GB/s", "spread", "x memcpy", "x matched",
           "(norm)"},
          {false, true, false, true, true, true, true, true, true, true});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(cx.o, "shm"));
  for (const std::string& be : backends) {
    for (uint32_t T : tokens) {
      std::optional<double> matched, matched_norm;
      std::vector<size_t> mine;
      for (auto [a, b] : pairs) {
        ASSIGN_OR_RETURN(auto c, makeCluster(cx.model, a, b, be, blocksFor(cx.model, T) + 1, 1));
        Row r = baseRow(cx, cx.model, "mismatch", be, T, a, b);
        RETURN_IF_ERROR(measureRequest(cx, *c, T, &r, false)
                            .withContext("mismatch " + be + " tp " + std::to_string(a) + ":" +
                                         std::to_string(b)));
        if (a == b && !matched) {
          matched = r.goodput();
          matched_norm = r.ratioMemcpy();
        }
        mine.push_back(cx.rows->size());
        cx.rows->push_back(std::move(r));
      }
      for (size_t i : mine) {
        Row& r = (*cx.rows)[i];
        if (matched && *matched > 0) {
          r.ref_ratio = r.goodput() / *matched;
          r.ref = "matched tp";
        }
        if (matched_norm && *matched_norm > 0 && r.ratioMemcpy()) {
          r.ref_ratio_norm = *r.ratioMemcpy() / *matched_norm;
        }
        t.add({be, tokensLabel(T), std::to_string(r.ctx_tp) + ":" + std::to_string(r.gen_tp),
               std::to_string(r.ops.value_or(0)), fmt("%.2f", r.time.median() * 1e3),
               fmt("%.2f", r.goodput()), spread(r), optFmt("%.2f", r.ratioMemcpy()),
               optFmt("%.2f", r.ref_ratio), optFmt("%.2f", r.ref_ratio_norm)});
      }
    }
  }
  std::printf(
      "mismatch (model %s; x matched = goodput / goodput of the first matched pair; "
      "norm: both first divided by their own memcpy baseline)\n",
      cx.model.name.c_str());
  t.print(stdout, 2);
  return OkStatus();
}

Status runSmallPagesWorkload(Context& cx) {
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", cx.o.tokens.empty() ? "8k" : cx.o.tokens));
  ASSIGN_OR_RETURN(auto pairs, parseTpPairs(cx.o.tp_pairs.empty() ? "1:1,2:1" : cx.o.tp_pairs));
  ASSIGN_OR_RETURN(
      auto layers,
      parseCountList("--layers",
                     cx.o.layers.empty() ? std::to_string(cx.model.numLayers()) : cx.o.layers));
  Table t({"backend", "layers", "tp", "block", "ops", "runs", "ops/runs", "median ms", "GB/s",
           "x memcpy", "x large page", "(norm)"},
          {false, true, false, true, true, true, true, true, true, true, true, true});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(cx.o, "shm"));
  for (const std::string& be : backends) {
    for (uint32_t L : layers) {
      for (uint32_t T : tokens) {
        for (auto [a, b] : pairs) {
          std::optional<double> large, large_norm;
          // Large page first: it is the reference.
          for (uint32_t tpb : {cx.o.large_block, cx.o.small_block}) {
            ModelSpec m = withLayers(cx.model, L);
            m.tokens_per_block = tpb;
            ASSIGN_OR_RETURN(auto c, makeCluster(m, a, b, be, blocksFor(m, T) + 1, 1));
            Row r = baseRow(cx, m, "small-pages", be, T, a, b);
            RETURN_IF_ERROR(measureRequest(cx, *c, T, &r, false)
                                .withContext("small-pages block " + std::to_string(tpb)));
            if (tpb == cx.o.large_block) {
              large = r.goodput();
              large_norm = r.ratioMemcpy();
            } else if (large && *large > 0) {
              r.ref_ratio = r.goodput() / *large;
              r.ref = "tokens_per_block " + std::to_string(cx.o.large_block);
              if (large_norm && *large_norm > 0 && r.ratioMemcpy()) {
                r.ref_ratio_norm = *r.ratioMemcpy() / *large_norm;
              }
            }
            const double ratio = r.runs && *r.runs ? static_cast<double>(r.ops.value_or(0)) /
                                                         static_cast<double>(*r.runs)
                                                   : 0.0;
            t.add({be, std::to_string(L), std::to_string(a) + ":" + std::to_string(b),
                   std::to_string(tpb), std::to_string(r.ops.value_or(0)),
                   std::to_string(r.runs.value_or(0)), fmt("%.2f", ratio),
                   fmt("%.2f", r.time.median() * 1e3), fmt("%.2f", r.goodput()),
                   optFmt("%.2f", r.ratioMemcpy()), optFmt("%.2f", r.ref_ratio),
                   optFmt("%.2f", r.ref_ratio_norm)});
            cx.rows->push_back(std::move(r));
          }
        }
      }
    }
  }
  std::printf(
      "small-pages (model %s repeated to N layers, T=%s; runs = fewest ops contiguous on "
      "both sides)\n",
      cx.model.name.c_str(), cx.o.tokens.empty() ? "8k" : cx.o.tokens.c_str());
  t.print(stdout, 2);
  return OkStatus();
}

// Closed loop: `concurrency` workers each run requests back to back until `total` started.
struct LoadResult {
  Samples latency;
  double wall_s = 0;
  uint64_t bytes = 0;
};

StatusOr<LoadResult> runLoad(Context& cx, LocalCluster& c, uint32_t tokens, uint32_t concurrency,
                             uint32_t total, const std::string& label) {
  std::atomic<uint32_t> started{0}, finished{0};
  std::mutex mu;
  LoadResult out;
  Status first;
  const uint64_t base_id = cx.next_id;
  cx.next_id += total;
  auto worker = [&] {
    for (;;) {
      const uint32_t k = started.fetch_add(1);
      if (k >= total) return;
      const uint64_t id = base_id + k;
      Status s = prepareContext(c, id, tokens, /*fill=*/false);
      const auto t0 = Clock::now();
      uint64_t bytes = 0;
      for (auto& r : c.receivers()) {
        if (!s.isOk()) break;
        // Generation pages are freed by release(); retry while the pool is momentarily full.
        auto st = r->startRequest(id, tokens);
        const auto deadline = Clock::now() + 30s;
        while (!st.isOk() && st.status().code() == StatusCode::kResourceExhausted &&
               Clock::now() < deadline) {
          std::this_thread::sleep_for(20us);
          st = r->startRequest(id, tokens);
        }
        s = st.status();
      }
      for (auto& r : c.receivers()) {
        if (!s.isOk()) break;
        auto res = r->wait(id, Clock::now() + kRequestDeadline);
        if (!res.isOk()) {
          s = res.status();
        } else if (!res->status.isOk() || !res->terminal()) {
          s = res->terminal() ? res->status : Timeout("request did not finish");
        } else {
          bytes += res->bytes;
        }
      }
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      if (s.isOk()) s = c.release(id);
      std::lock_guard lock(mu);
      if (!s.isOk()) {
        if (first.isOk()) first = s.withContext("request " + std::to_string(id));
        started.store(total);
        return;
      }
      out.latency.add(dt);
      out.bytes += bytes;
      const uint32_t f = ++finished;
      if (f % 16 == 0) cx.progress.update(label, f, total);
    }
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < concurrency; ++i) threads.emplace_back(worker);
  for (auto& th : threads) th.join();
  out.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  cx.progress.clear();
  RETURN_IF_ERROR(first);
  RETURN_IF_ERROR(settle(c));
  return out;
}

Status runLoadWorkload(Context& cx) {
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", cx.o.tokens.empty() ? "1k" : cx.o.tokens));
  ASSIGN_OR_RETURN(
      auto conc,
      parseCountList("--concurrency", cx.o.concurrency.empty() ? "1,2,4,8" : cx.o.concurrency));
  const uint32_t max_c = *std::max_element(conc.begin(), conc.end());
  const uint32_t max_t = *std::max_element(tokens.begin(), tokens.end());
  Table t({"backend", "tokens", "conc", "requests", "req/s", "GB/s", "p50 ms", "p99 ms", "p999 ms",
           "max ms"},
          {false, true, true, true, true, true, true, true, true, true});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(cx.o, "shm,ucx"));
  for (const std::string& be : backends) {
    // Room for every in-flight request on both sides plus the ones being freed.
    ASSIGN_OR_RETURN(auto c, makeCluster(cx.model, cx.o.ctx_tp, cx.o.gen_tp, be,
                                         (max_c + 2) * blocksFor(cx.model, max_t), max_c + 2));
    for (uint32_t T : tokens) {
      for (uint32_t C : conc) {
        const std::string label = "load " + be + " T=" + tokensLabel(T) + " C=" + std::to_string(C);
        RETURN_IF_ERROR(
            runLoad(cx, *c, T, C, std::max<uint32_t>(2 * C, 8), label + " warm-up").status());
        ASSIGN_OR_RETURN(LoadResult lr, runLoad(cx, *c, T, C, cx.o.requests, label));
        Row r = baseRow(cx, cx.model, "load", be, T, cx.o.ctx_tp, cx.o.gen_tp);
        r.concurrency = C;
        r.requests = cx.o.requests;
        r.bytes = lr.bytes / std::max<uint32_t>(1, cx.o.requests);
        r.time = lr.latency;
        r.req_per_s = cx.o.requests / lr.wall_s;
        r.load_gbps = gbps(lr.bytes, lr.wall_s);
        r.peak_rss_mib = peakRssMib();
        t.add({be, tokensLabel(T), std::to_string(C), std::to_string(cx.o.requests),
               fmt("%.1f", *r.req_per_s), fmt("%.2f", *r.load_gbps),
               fmt("%.2f", r.time.quantile(0.5) * 1e3), fmt("%.2f", r.time.quantile(0.99) * 1e3),
               fmt("%.2f", r.time.quantile(0.999) * 1e3), fmt("%.2f", r.time.max() * 1e3)});
        cx.rows->push_back(std::move(r));
      }
    }
  }
  std::printf(
      "load (model %s, tp %u:%u, closed loop; latency = startRequest to completion; "
      "p999 of fewer than 1000 requests is the maximum)\n",
      cx.model.name.c_str(), cx.o.ctx_tp, cx.o.gen_tp);
  t.print(stdout, 2);
  return OkStatus();
}

// ---- storm ----

// KV layouts whose records fragment at TP mismatch (NHD, SGLang's token-major rows) against HND,
// with small pages: the ops a request takes, their size, and what they cost.
Status runStormWorkload(Context& cx) {
  const WorkloadOptions& o = cx.o;
  ASSIGN_OR_RETURN(auto tokens, parseCountList("--tokens", o.tokens.empty() ? "8k" : o.tokens));
  ASSIGN_OR_RETURN(auto pairs, parseTpPairs(o.tp_pairs.empty() ? "1:1,4:1,1:4" : o.tp_pairs));
  struct Kind {
    const char* label;
    const char* engine;
    const char* kv;
  };
  const Kind kinds[] = {
      {"hnd", "trtllm-v2", "hnd"}, {"nhd", "trtllm-v2", "nhd"}, {"token-major", "sglang", ""}};
  Table t({"backend", "kv", "tp", "staging", "planned ops", "posted ops", "bytes/op", "median ms",
           "GB/s", "x memcpy", "x hnd", "posted x matched", "target"},
          {false, false, false, false, true, true, true, true, true, true, true, true, false});
  ModelSpec m = cx.model;
  m.tokens_per_block = o.small_block;
  const int runs = o.warmup + o.repetitions;
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(o, "shm"));
  for (const std::string& be : backends) {
    for (uint32_t T : tokens) {
      // Posted ops of the matched pair per layout, goodput of hnd (direct) per tp pair.
      std::map<std::string, uint64_t> matched_ops;
      std::map<std::pair<uint32_t, uint32_t>, double> hnd_goodput;
      for (const Kind& k : kinds) {
        ASSIGN_OR_RETURN(EngineLayout e, parseEngineLayout(k.engine, k.kv));
        for (auto [a, b] : pairs) {
          for (bool staging : {false, true}) {
            // Staged rows stage on every backend, so that both ways are measured.
            ClusterShape shape{e, 512, staging ? o.staging_bytes : 0, true};
            ASSIGN_OR_RETURN(auto c, makeCluster(m, a, b, be, blocksFor(m, T) + 1, 1, shape));
            Row r =
                baseRow(cx, m, "storm", be + " " + k.label + (staging ? " staged" : ""), T, a, b);
            const uint64_t ops0 = c->ctxMetrics().ops;
            RETURN_IF_ERROR(
                measureRequest(cx, *c, T, &r, false).withContext(std::string("storm ") + k.label));
            const uint64_t posted = (c->ctxMetrics().ops - ops0) / static_cast<uint64_t>(runs);
            const std::string key = std::string(k.label) + (staging ? "+" : "");
            if (a == b) matched_ops[key] = posted;
            if (std::string(k.label) == "hnd" && !staging) {
              hnd_goodput[{a, b}] = r.goodput();
            } else if (auto h = hnd_goodput.find({a, b}); h != hnd_goodput.end() && h->second > 0) {
              r.ref_ratio = r.goodput() / h->second;
              r.ref = "hnd";
            }
            std::optional<double> ops_ratio;
            if (auto mo = matched_ops.find(key); mo != matched_ops.end() && mo->second > 0) {
              ops_ratio = static_cast<double>(posted) / static_cast<double>(mo->second);
            }
            const bool storm = a != b && std::string(k.label) != "hnd" && staging;
            t.add({be, k.label, std::to_string(a) + ":" + std::to_string(b), staging ? "on" : "off",
                   std::to_string(r.ops.value_or(0)), std::to_string(posted),
                   posted ? std::to_string(r.bytes / posted) : "-",
                   fmt("%.2f", r.time.median() * 1e3), fmt("%.2f", r.goodput()),
                   optFmt("%.2f", r.ratioMemcpy()), optFmt("%.2f", r.ref_ratio),
                   optFmt("%.1f", ops_ratio), storm ? ">= 0.7 x hnd, <= 2 x matched" : ""});
            cx.rows->push_back(std::move(r));
          }
        }
      }
    }
  }
  std::printf(
      "storm (model %s, %u tokens per block on both sides, each side laid out as the engine "
      "keeps kv: hnd = trtllm-v2 hnd, nhd = trtllm-v2 nhd, token-major = sglang; staging = the "
      "generation rank's staging region, %llu MiB or none; planned ops = the plan's, posted = "
      "the writes' ops per request; x memcpy = memcpy with the planned op sizes in the same "
      "loop; x hnd = against hnd without staging)\n",
      cx.model.name.c_str(), o.small_block, static_cast<unsigned long long>(o.staging_bytes >> 20));
  t.print(stdout, 2);
  return OkStatus();
}

// ---- copy-bandwidth ----

// One request next to memcpy of its bytes on 1..N threads (N = the machine's cores, at most
// 8), in the same loop: single-request goodput judged against the machine's copy bandwidth.
Status runCopyBandwidthWorkload(Context& cx) {
  const WorkloadOptions& o = cx.o;
  ASSIGN_OR_RETURN(auto tokens, parseCountList("--tokens", o.tokens.empty() ? "8k" : o.tokens));
  const unsigned cores = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
  Table t({"contender", "tokens", "MiB", "median ms", "GB/s", "spread", "x memcpy x1",
           "x memcpy xN", "target"},
          {false, true, true, true, true, false, true, true, false});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(o, "shm"));
  for (const std::string& be : backends) {
    const uint32_t max_t = *std::max_element(tokens.begin(), tokens.end());
    ASSIGN_OR_RETURN(
        auto c, makeCluster(cx.model, o.ctx_tp, o.gen_tp, be, 2 * blocksFor(cx.model, max_t), 2));
    for (uint32_t T : tokens) {
      Row req = baseRow(cx, cx.model, "copy-bandwidth", be, T, o.ctx_tp, o.gen_tp);
      std::vector<Samples> copies(cores);
      std::optional<MemcpyBaseline> base;
      const int total = o.warmup + o.repetitions;
      const std::string label = "copy-bandwidth " + be + " T=" + tokensLabel(T);
      for (int i = 0; i < total; ++i) {
        cx.progress.update(label, static_cast<size_t>(i), static_cast<size_t>(total));
        const bool timed = i >= o.warmup;
        ASSIGN_OR_RETURN(TimedRequest r,
                         timedRequest(*c, cx.next_id++, T, 0, true, !o.no_verify, nullptr));
        req.bytes = r.bytes;
        if (timed) req.time.add(r.seconds);
        if (!base) {
          ASSIGN_OR_RETURN(MemcpyBaseline b, MemcpyBaseline::create({r.bytes}));
          base.emplace(std::move(b));
          for (unsigned n = 1; n <= cores; ++n) (void)base->runThreads(n);  // fault in, warm
        }
        for (unsigned n = 1; n <= cores; ++n) {
          const double sec = base->runThreads(n);
          if (timed) copies[n - 1].add(sec);
        }
      }
      cx.progress.clear();
      req.verified = !o.no_verify;
      req.memcpy_gbps = gbps(req.bytes, copies[0].median());
      req.ref = "memcpy x" + std::to_string(cores);
      req.ref_ratio = req.goodput() / gbps(req.bytes, copies[cores - 1].median());
      req.peak_rss_mib = peakRssMib();
      const auto line = [&](const std::string& who, const Samples& smp, const char* target) {
        const double g = gbps(req.bytes, smp.median());
        t.add({who, tokensLabel(T), mib(req.bytes), fmt("%.2f", smp.median() * 1e3), fmt("%.2f", g),
               fmt("%.2f", gbps(req.bytes, smp.max())) + ".." +
                   fmt("%.2f", gbps(req.bytes, smp.min())),
               fmt("%.2f", g / *req.memcpy_gbps),
               fmt("%.2f", g / gbps(req.bytes, copies[cores - 1].median())), target});
      };
      line(be + " request", req.time, ">= 0.8 x memcpy xN");
      for (unsigned n = 1; n <= cores; ++n) {
        line("memcpy x" + std::to_string(n), copies[n - 1], "");
        Row m = baseRow(cx, cx.model, "copy-bandwidth", "memcpy x" + std::to_string(n), T, o.ctx_tp,
                        o.gen_tp);
        m.bytes = req.bytes;
        m.time = copies[n - 1];
        cx.rows->push_back(std::move(m));
      }
      cx.rows->push_back(std::move(req));
    }
  }
  std::printf(
      "copy-bandwidth (model %s, tp %u:%u; one request against memcpy of its bytes split over "
      "1..%u threads, same loop; N = %u)\n",
      cx.model.name.c_str(), o.ctx_tp, o.gen_tp, cores, cores);
  t.print(stdout, 2);
  return OkStatus();
}

// ---- streaming ----

// One request whose prefill is simulated: its layers take equal compute time one after the
// other (sleeps: on a serving machine the accelerator computes and the CPUs are free), and the
// context side marks each layer ready as it ends (`streamed`) or the whole request after the
// last one. The generation side asked before prefill began, as a disaggregated engine's does.
// Returns the time from the end of prefill to every generation rank holding every byte.
StatusOr<double> prefillAndTransfer(Context& cx, LocalCluster& c, uint32_t tokens, bool streamed,
                                    std::chrono::nanoseconds per_layer) {
  const uint64_t id = cx.next_id++;
  RETURN_IF_ERROR(prepareContext(c, id, tokens, /*fill=*/true, /*mark_ready=*/false));
  uint64_t parts = 0;
  for (auto& r : c.receivers()) parts += r->contextRanks().size();
  const uint64_t asked = c.ctxMetrics().requests_started + parts;
  for (auto& r : c.receivers()) RETURN_IF_ERROR(r->startRequest(id, tokens, 0).status());
  const auto ask_deadline = Clock::now() + 30s;
  while (c.ctxMetrics().requests_started < asked) {
    if (Clock::now() > ask_deadline) return Timeout("request " + std::to_string(id) + " not asked");
    std::this_thread::sleep_for(50us);
  }
  const uint32_t layers = c.options().model.numLayers();
  const auto start = Clock::now();
  const auto prefill_end = start + per_layer * layers;
  if (streamed) {
    for (uint32_t l = 0; l < layers; ++l) {
      std::this_thread::sleep_until(start + per_layer * (l + 1));
      RETURN_IF_ERROR(c.markLayersReady(id, LayerRange{l, 1}));
    }
  } else {
    std::this_thread::sleep_until(prefill_end);
    RETURN_IF_ERROR(c.markReady(id));
  }
  for (auto& r : c.receivers()) {
    ASSIGN_OR_RETURN(engine::RequestResult res, r->wait(id, Clock::now() + kRequestDeadline));
    if (!res.terminal()) return Timeout("request " + std::to_string(id) + " did not finish");
    if (!res.status.isOk()) return res.status.withContext("request " + std::to_string(id));
  }
  const double exposed = std::chrono::duration<double>(Clock::now() - prefill_end).count();
  if (!cx.o.no_verify) {
    ASSIGN_OR_RETURN(OracleReport rep, c.check(id));
    if (!rep.ok()) return Corruption("request " + std::to_string(id) + ": " + rep.toString());
  }
  RETURN_IF_ERROR(c.release(id));
  RETURN_IF_ERROR(settle(c));
  return exposed;
}

Status runStreamingWorkload(Context& cx) {
  const WorkloadOptions& o = cx.o;
  ASSIGN_OR_RETURN(auto tokens,
                   parseCountList("--tokens", o.tokens.empty() ? "256,8k,32k" : o.tokens));
  if (!(o.prefill_us_per_token > 0)) {
    return InvalidArgument("--prefill-us-per-token must be > 0, got " +
                           fmt("%g", o.prefill_us_per_token));
  }
  const uint32_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const uint32_t layers = cx.model.numLayers();
  Table t({"backend", "tokens", "MiB", "prefill ms", "whole ms", "streamed ms", "exposed", "spread",
           "writes", "target"},
          {false, true, true, true, true, true, true, false, true, false});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(o, "shm"));
  for (const std::string& be : backends) {
    ASSIGN_OR_RETURN(
        auto c, makeCluster(cx.model, o.ctx_tp, o.gen_tp, be, 2 * blocksFor(cx.model, max_t), 2,
                            ClusterShape{std::nullopt, o.stream_min_tokens}));
    for (uint32_t T : tokens) {
      const std::chrono::nanoseconds per_layer(static_cast<int64_t>(
          static_cast<double>(T) * o.prefill_us_per_token * 1e3 / std::max<uint32_t>(layers, 1)));
      Samples whole, streamed;
      const uint64_t writes0 = c->ctxMetrics().writes_posted;
      const int total = o.warmup + o.repetitions;
      const std::string label = "streaming " + be + " T=" + tokensLabel(T);
      for (int i = 0; i < total; ++i) {
        cx.progress.update(label, static_cast<size_t>(i), static_cast<size_t>(total));
        // Alternate which goes first, so that neither always runs on warm caches.
        for (int k = 0; k < 2; ++k) {
          const bool stream = (i + k) % 2 == 0;
          ASSIGN_OR_RETURN(double s, prefillAndTransfer(cx, *c, T, stream, per_layer));
          if (i >= o.warmup) (stream ? streamed : whole).add(s);
        }
      }
      cx.progress.clear();
      const double writes_per_request =
          static_cast<double>(c->ctxMetrics().writes_posted - writes0) / (2.0 * total);
      Row r = baseRow(cx, cx.model, "streaming", be, T, o.ctx_tp, o.gen_tp);
      r.time = streamed;
      r.prefill_s = std::chrono::duration<double>(per_layer * layers).count();
      r.whole_exposed_s = whole.median();
      r.ref = "not streamed";
      if (whole.median() > 0) r.ref_ratio = streamed.median() / whole.median();
      r.verified = !o.no_verify;
      uint64_t bytes = 0;
      for (auto& g : c->genCaches()) {
        bytes += uint64_t{blocksFor(cx.model, T)} * g->layout().kvBytesPerBlock() +
                 g->layout().stateBytesPerSlot();
      }
      r.bytes = bytes;
      r.peak_rss_mib = peakRssMib();
      const bool streams = T >= o.stream_min_tokens;
      t.add({be, tokensLabel(T), mib(bytes), fmt("%.1f", *r.prefill_s * 1e3),
             fmt("%.2f", whole.median() * 1e3), fmt("%.2f", streamed.median() * 1e3),
             optFmt("%.3f", r.ref_ratio),
             fmt("%.2f", streamed.min() * 1e3) + ".." + fmt("%.2f", streamed.max() * 1e3),
             fmt("%.1f", writes_per_request), streams ? "<= 0.15" : "<= 1 (whole)"});
      cx.rows->push_back(std::move(r));
    }
  }
  std::printf(
      "streaming (model %s, %u layers, tp %u:%u, prefill %.0f us/token spread evenly over the "
      "layers; ms = end of prefill to every byte landed, median of %d; exposed = streamed / "
      "whole; requests below %llu tokens go whole; writes = per request, both variants)\n",
      cx.model.name.c_str(), layers, o.ctx_tp, o.gen_tp, o.prefill_us_per_token, o.repetitions,
      static_cast<unsigned long long>(o.stream_min_tokens));
  t.print(stdout, 2);
  return OkStatus();
}

// Floors for the control round trip, measured in the same run: a round trip between two
// threads through a condition variable, and through a Unix socket pair (the shm backend's
// control channel). An engine round trip needs several such hand-offs (caller -> context agent
// -> context progress thread -> generation agent -> generation progress thread -> caller).
Samples condvarPingPong(uint32_t rounds) {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t turn = 0;  // even: the pinger's turn, odd: the ponger's; guarded by mu
  std::thread ponger([&] {
    for (uint32_t i = 0; i < rounds; ++i) {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return turn % 2 == 1; });
      ++turn;
      cv.notify_all();
    }
  });
  Samples s;
  for (uint32_t i = 0; i < rounds; ++i) {
    const auto t0 = Clock::now();
    std::unique_lock lock(mu);
    ++turn;
    cv.notify_all();
    cv.wait(lock, [&] { return turn % 2 == 0; });
    s.add(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ponger.join();
  return s;
}

StatusOr<Samples> socketPingPong(uint32_t rounds) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
    return Unavailable(std::string("socketpair: ") + std::strerror(errno));
  }
  std::thread ponger([&] {
    uint8_t b = 0;
    for (uint32_t i = 0; i < rounds; ++i) {
      if (!recvAll(fds[1], &b, 1) || !sendAll(fds[1], &b, 1)) return;
    }
  });
  Samples s;
  uint8_t b = 1;
  for (uint32_t i = 0; i < rounds; ++i) {
    const auto t0 = Clock::now();
    if (!sendAll(fds[0], &b, 1) || !recvAll(fds[0], &b, 1)) break;
    s.add(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ponger.join();
  ::close(fds[0]);
  ::close(fds[1]);
  return s;
}

// Threads that spin until destroyed, taking CPU time from every other thread of the machine.
class BusyThreads {
 public:
  explicit BusyThreads(uint32_t n) {
    try {
      for (uint32_t i = 0; i < n; ++i) {
        threads_.emplace_back([this] {
          uint64_t x = 0;
          while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223846793005ull + 1;
          sink_.fetch_add(x, std::memory_order_relaxed);
        });
      }
    } catch (...) {  // no thread left running when one could not start
      stop();
      throw;
    }
  }
  ~BusyThreads() { stop(); }
  BusyThreads(const BusyThreads&) = delete;
  BusyThreads& operator=(const BusyThreads&) = delete;

 private:
  void stop() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sink_{0};
  std::vector<std::thread> threads_;
};

Status runControlWorkload(Context& cx) {
  const ModelSpec m = controlProbeModel();
  const BusyThreads busy(cx.o.busy_threads);
  Table t({"backend", "rounds", "p50 us", "p99 us", "p999 us", "max us", "target p50 < 100 us"},
          {false, true, true, true, true, true, false});
  ASSIGN_OR_RETURN(const std::vector<std::string> backends, backendsFor(cx.o, "shm,ucx,inproc"));
  for (const std::string& be : backends) {
    ASSIGN_OR_RETURN(auto c, makeCluster(m, 1, 1, be, 4, 1));
    Row r = baseRow(cx, m, "control", be, m.tokens_per_block, 1, 1);
    const uint32_t rounds = cx.o.control_rounds;
    const uint32_t warm = std::max<uint32_t>(rounds / 10, 10);
    for (uint32_t i = 0; i < warm + rounds; ++i) {
      if (i % 64 == 0) cx.progress.update("control " + be, i, warm + rounds);
      ASSIGN_OR_RETURN(TimedRequest tr, timedRequest(*c, cx.next_id++, m.tokens_per_block,
                                                     m.tokens_per_block, false, false, nullptr));
      if (tr.bytes != 0) return Internal("control request moved " + std::to_string(tr.bytes));
      if (i >= warm) r.time.add(tr.seconds);
    }
    cx.progress.clear();
    r.requests = rounds;
    r.verified = true;  // zero bytes moved, checked above
    r.peak_rss_mib = peakRssMib();
    const double p50 = r.time.quantile(0.5) * 1e6;
    t.add({be, std::to_string(rounds), fmt("%.1f", p50), fmt("%.1f", r.time.quantile(0.99) * 1e6),
           fmt("%.1f", r.time.quantile(0.999) * 1e6), fmt("%.1f", r.time.max() * 1e6),
           be == "shm" ? (p50 < 100 ? "met" : "MISSED") : ""});
    cx.rows->push_back(std::move(r));
  }
  {
    const uint32_t rounds = cx.o.control_rounds;
    Row cv = baseRow(cx, m, "control", "condvar ping-pong (floor)", 0, 1, 1);
    cv.time = condvarPingPong(rounds);
    Row so = baseRow(cx, m, "control", "unix socket ping-pong (floor)", 0, 1, 1);
    ASSIGN_OR_RETURN(so.time, socketPingPong(rounds));
    for (Row* r : {&cv, &so}) {
      r->requests = rounds;
      r->peak_rss_mib = peakRssMib();
      t.add({r->backend, std::to_string(rounds), fmt("%.1f", r->time.quantile(0.5) * 1e6),
             fmt("%.1f", r->time.quantile(0.99) * 1e6), fmt("%.1f", r->time.quantile(0.999) * 1e6),
             fmt("%.1f", r->time.max() * 1e6), ""});
      cx.rows->push_back(std::move(*r));
    }
  }
  const std::string busy_note =
      cx.o.busy_threads == 0
          ? ""
          : "; " + std::to_string(cx.o.busy_threads) + " CPU-bound threads spinning beside them";
  std::printf(
      "control (zero-payload request round trip: startRequest to completion; the two "
      "ping-pongs are thread hand-off floors measured in the same run%s)\n",
      busy_note.c_str());
  t.print(stdout, 2);
  return OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The SVG plot: goodput against request size per backend (with the baselines), and latency
// percentiles (load and control) on a log scale. No dependencies: plain SVG 1.1.

std::string xmlEscape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += ch;
    }
  }
  return o;
}

class Svg {
 public:
  Svg(int w, int h) : w_(w), h_(h) {}
  void line(double x1, double y1, double x2, double y2, const std::string& color, double width = 1,
            const std::string& dash = "") {
    o_ << "<line x1='" << x1 << "' y1='" << y1 << "' x2='" << x2 << "' y2='" << y2 << "' stroke='"
       << color << "' stroke-width='" << width << "'"
       << (dash.empty() ? "" : " stroke-dasharray='" + dash + "'") << "/>\n";
  }
  void polyline(const std::vector<std::pair<double, double>>& pts, const std::string& color,
                const std::string& dash = "") {
    o_ << "<polyline fill='none' stroke='" << color << "' stroke-width='2'"
       << (dash.empty() ? "" : " stroke-dasharray='" + dash + "'") << " points='";
    for (auto [x, y] : pts) o_ << x << ',' << y << ' ';
    o_ << "'/>\n";
  }
  void circle(double x, double y, double r, const std::string& color) {
    o_ << "<circle cx='" << x << "' cy='" << y << "' r='" << r << "' fill='" << color << "'/>\n";
  }
  void rect(double x, double y, double w, double h, const std::string& fill,
            const std::string& stroke = "none") {
    o_ << "<rect x='" << x << "' y='" << y << "' width='" << w << "' height='" << h << "' fill='"
       << fill << "' stroke='" << stroke << "'/>\n";
  }
  void text(double x, double y, const std::string& s, int size = 12,
            const std::string& anchor = "start", const std::string& extra = "") {
    o_ << "<text x='" << x << "' y='" << y << "' font-family='sans-serif' font-size='" << size
       << "' text-anchor='" << anchor << "'" << extra << ">" << xmlEscape(s) << "</text>\n";
  }
  std::string str() const {
    std::ostringstream s;
    s << "<?xml version='1.0' encoding='UTF-8'?>\n<svg xmlns='http://www.w3.org/2000/svg' "
         "version='1.1' width='"
      << w_ << "' height='" << h_ << "' viewBox='0 0 " << w_ << ' ' << h_ << "'>\n"
      << "<rect x='0' y='0' width='" << w_ << "' height='" << h_ << "' fill='white'/>\n"
      << o_.str() << "</svg>\n";
    return s.str();
  }

 private:
  int w_, h_;
  std::ostringstream o_;
};

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                               "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

// A log10 axis over [lo, hi] rounded out to powers of ten (or of two for sizes).
struct LogAxis {
  double lo, hi, p0, p1;  // data range -> pixel range
  double map(double v) const {
    const double t = (std::log(std::max(v, lo)) - std::log(lo)) / (std::log(hi) - std::log(lo));
    return p0 + t * (p1 - p0);
  }
};

// A log axis of seconds over [lo, hi] rounded out to powers of ten, with its grid lines and
// labels drawn into the panel at (x0, y0, w, h).
LogAxis timeAxis(Svg& s, double lo, double hi, double x0, double y0, double w, double h) {
  LogAxis ya{std::pow(10, std::floor(std::log10(std::max(lo, 1e-9)))),
             std::pow(10, std::ceil(std::log10(std::max(hi, 1e-9)))), y0 + h, y0};
  if (ya.hi <= ya.lo) ya.hi = ya.lo * 10;
  for (double v = ya.lo; v <= ya.hi * 1.0001; v *= 10) {
    const double y = ya.map(v);
    s.line(x0, y, x0 + w, y, "#ddd");
    const std::string label = v < 1e-3 ? fmt("%g us", v * 1e6)
                              : v < 1  ? fmt("%g ms", v * 1e3)
                                       : fmt("%g s", v);
    s.text(x0 - 6, y + 4, label, 10, "end");
  }
  return ya;
}

void plotGoodput(Svg& s, const std::vector<Row>& rows, double x0, double y0, double w, double h) {
  s.text(x0 + w / 2, y0 - 12, "Goodput vs request size (request workload, median)", 14, "middle",
         " font-weight='bold'");
  s.rect(x0, y0, w, h, "none", "#444");
  // Series: each backend, plus memcpy and tcp baselines (first backend's runs carry both).
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  for (const Row& r : rows) {
    if (r.workload != "request" || r.bytes == 0) continue;
    const double mb = static_cast<double>(r.bytes) / (1 << 20);
    series[r.backend].push_back({mb, r.goodput()});
    if (r.memcpy_gbps) series["memcpy (baseline)"].push_back({mb, *r.memcpy_gbps});
    if (r.tcp_gbps) series["tcp (baseline)"].push_back({mb, *r.tcp_gbps});
  }
  if (series.empty()) {
    s.text(x0 + w / 2, y0 + h / 2, "no data: run `hxfer bench request` with --plot", 12, "middle");
    return;
  }
  double xmin = 1e300, xmax = 0, ymax = 0;
  for (auto& [name, pts] : series) {
    // Baselines are measured once per backend row: keep the best-known (median of duplicates).
    std::map<double, std::vector<double>> by_x;
    for (auto [x, y] : pts) by_x[x].push_back(y);
    pts.clear();
    for (auto& [x, ys] : by_x) {
      std::sort(ys.begin(), ys.end());
      pts.push_back({x, ys[ys.size() / 2]});
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, ys[ys.size() / 2]);
    }
  }
  LogAxis xa{std::pow(2, std::floor(std::log2(xmin))), std::pow(2, std::ceil(std::log2(xmax))), x0,
             x0 + w};
  if (xa.hi <= xa.lo) xa.hi = xa.lo * 2;
  const double ytop = std::max(1.0, std::ceil(ymax * 1.1));
  auto ymap = [&](double v) { return y0 + h - v / ytop * h; };
  for (double v = xa.lo; v <= xa.hi * 1.0001; v *= 2) {
    const double x = xa.map(v);
    s.line(x, y0, x, y0 + h, "#ddd");
    s.text(x, y0 + h + 16, v >= 1024 ? fmt("%.0f GiB", v / 1024) : fmt("%.0f MiB", v), 10,
           "middle");
  }
  const double ystep = ytop <= 5 ? 0.5 : ytop <= 12 ? 1 : ytop <= 30 ? 5 : 10;
  for (double v = 0; v <= ytop + 1e-9; v += ystep) {
    s.line(x0, ymap(v), x0 + w, ymap(v), "#ddd");
    s.text(x0 - 6, ymap(v) + 4, fmt("%g", v), 10, "end");
  }
  s.text(x0 + w / 2, y0 + h + 34, "bytes per request (log scale)", 12, "middle");
  s.text(x0 - 40, y0 + h / 2, "GB/s", 12, "middle",
         " transform='rotate(-90 " + fmt("%.1f", x0 - 40) + " " + fmt("%.1f", y0 + h / 2) + ")'");
  int k = 0;
  double ly = y0 + 16;
  for (const auto& [name, pts] : series) {
    const std::string color = kColors[k++ % 8];
    const bool base = name.find("baseline") != std::string::npos;
    std::vector<std::pair<double, double>> px;
    for (auto [x, y] : pts) px.push_back({xa.map(x), ymap(y)});
    s.polyline(px, color, base ? "6,4" : "");
    for (auto [x, y] : px) s.circle(x, y, 3.5, color);
    s.line(x0 + w - 170, ly - 4, x0 + w - 145, ly - 4, color, 2, base ? "6,4" : "");
    s.text(x0 + w - 140, ly, name, 11);
    ly += 16;
  }
}

void plotLatency(Svg& s, const std::vector<Row>& rows, double x0, double y0, double w, double h) {
  s.text(x0 + w / 2, y0 - 12, "Latency percentiles (load and control workloads)", 14, "middle",
         " font-weight='bold'");
  s.rect(x0, y0, w, h, "none", "#444");
  struct Cat {
    std::string label;
    double p50, p99, p999;
  };
  std::vector<Cat> cats;
  for (const Row& r : rows) {
    if (r.workload == "load") {
      cats.push_back(
          {r.backend + " C=" + std::to_string(r.concurrency) + " " + tokensLabel(r.tokens),
           r.time.quantile(0.5), r.time.quantile(0.99), r.time.quantile(0.999)});
    } else if (r.workload == "control") {
      cats.push_back({r.backend + " control", r.time.quantile(0.5), r.time.quantile(0.99),
                      r.time.quantile(0.999)});
    }
  }
  if (cats.empty()) {
    s.text(x0 + w / 2, y0 + h / 2, "no data: run `hxfer bench load` or `control` with --plot", 12,
           "middle");
    return;
  }
  double lo = 1e300, hi = 0;
  for (const Cat& c : cats) {
    lo = std::min(lo, c.p50);
    hi = std::max(hi, c.p999);
  }
  const LogAxis ya = timeAxis(s, lo, hi, x0, y0, w, h);
  const double slot = w / static_cast<double>(cats.size());
  const char* names[] = {"p50", "p99", "p999"};
  for (size_t i = 0; i < cats.size(); ++i) {
    const double cx = x0 + slot * (static_cast<double>(i) + 0.5);
    const double vals[] = {cats[i].p50, cats[i].p99, cats[i].p999};
    const double bw = std::min(14.0, slot / 4);
    for (int k = 0; k < 3; ++k) {
      const double x = cx + (k - 1.5) * bw;
      const double y = ya.map(vals[k]);
      s.rect(x, y, bw - 1, y0 + h - y, kColors[k]);
    }
    const double ty = y0 + h + 14;
    s.text(cx, ty, cats[i].label, 10, "end",
           " transform='rotate(-35 " + fmt("%.1f", cx) + " " + fmt("%.1f", ty) + ")'");
  }
  for (int k = 0; k < 3; ++k) {
    s.rect(x0 + w - 150 + k * 50, y0 + 8, 10, 10, kColors[k]);
    s.text(x0 + w - 136 + k * 50, y0 + 17, names[k], 11);
  }
}

// Bars in groups, one color per series, on a log time axis (seconds) or a linear GB/s one.
struct BarGroup {
  std::string label;
  std::vector<double> values;  // one per series
};
struct BarPanel {
  std::string title, empty_hint;
  std::vector<std::string> series;
  bool time_axis = true;  // else GB/s, linear from 0
};

void plotBars(Svg& s, const BarPanel& panel, const std::vector<BarGroup>& groups, double x0,
              double y0, double w, double h) {
  s.text(x0 + w / 2, y0 - 12, panel.title, 14, "middle", " font-weight='bold'");
  s.rect(x0, y0, w, h, "none", "#444");
  if (groups.empty()) {
    s.text(x0 + w / 2, y0 + h / 2, panel.empty_hint, 12, "middle");
    return;
  }
  double lo = 1e300, hi = 0;
  for (const BarGroup& g : groups) {
    for (double v : g.values) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  std::function<double(double)> map;
  if (panel.time_axis) {
    const LogAxis ya = timeAxis(s, lo, hi, x0, y0, w, h);
    map = [ya](double v) { return ya.map(v); };
  } else {
    const double top = hi > 0 ? hi * 1.1 : 1.0;
    for (int k = 0; k <= 4; ++k) {
      const double v = top * k / 4, y = y0 + h - h * k / 4;
      s.line(x0, y, x0 + w, y, "#ddd");
      s.text(x0 - 6, y + 4, fmt("%.1f GB/s", v), 10, "end");
    }
    map = [=](double v) { return y0 + h - h * std::max(v, 0.0) / top; };
  }
  const size_t n = panel.series.size();
  const double slot = w / static_cast<double>(groups.size());
  const double bw = std::min(18.0, slot / static_cast<double>(n + 1));
  for (size_t i = 0; i < groups.size(); ++i) {
    const double cx = x0 + slot * (static_cast<double>(i) + 0.5);
    for (size_t k = 0; k < n && k < groups[i].values.size(); ++k) {
      const double x = cx + (static_cast<double>(k) - n / 2.0) * bw;
      const double y = map(groups[i].values[k]);
      s.rect(x, y, bw - 1, y0 + h - y, kColors[k % 8]);
    }
    const double ty = y0 + h + 14;
    s.text(cx, ty, groups[i].label, 10, "end",
           " transform='rotate(-35 " + fmt("%.1f", cx) + " " + fmt("%.1f", ty) + ")'");
  }
  for (size_t k = 0; k < n; ++k) {
    s.rect(x0 + w - 170, y0 + 8 + k * 16, 10, 10, kColors[k % 8]);
    s.text(x0 + w - 156, y0 + 17 + k * 16, panel.series[k], 11);
  }
}

void plotStreaming(Svg& s, const std::vector<Row>& rows, double x0, double y0, double w, double h) {
  std::vector<BarGroup> groups;
  for (const Row& r : rows) {
    if (r.workload != "streaming" || !r.whole_exposed_s) continue;
    groups.push_back(
        {r.backend + " " + tokensLabel(r.tokens), {*r.whole_exposed_s, r.time.median()}});
  }
  plotBars(s,
           {"Exposed transfer after prefill (streaming workload, median)",
            "no data: run `hxfer bench streaming` with --plot",
            {"marked ready whole", "streamed per layer"},
            true},
           groups, x0, y0, w, h);
}

void plotStorm(Svg& s, const std::vector<Row>& rows, double x0, double y0, double w, double h) {
  // Rows come in pairs: staging off, then on, for each (kv, tp).
  std::vector<BarGroup> groups;
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    const Row& a = rows[i];
    const Row& b = rows[i + 1];
    if (a.workload != "storm" || b.workload != "storm" || b.backend != a.backend + " staged") {
      continue;
    }
    groups.push_back({a.backend + " " + std::to_string(a.ctx_tp) + ":" + std::to_string(a.gen_tp),
                      {a.goodput(), b.goodput()}});
  }
  plotBars(s,
           {"Descriptor storms: goodput (storm workload, median)",
            "no data: run `hxfer bench storm` with --plot",
            {"ops as planned", "staged"},
            false},
           groups, x0, y0, w, h);
}

void plotCopyBandwidth(Svg& s, const std::vector<Row>& rows, double x0, double y0, double w,
                       double h) {
  // The memcpy rows of a configuration come first, then its request row.
  std::vector<BarGroup> groups;
  std::vector<double> copies;
  std::vector<std::string> series;
  for (const Row& r : rows) {
    if (r.workload != "copy-bandwidth") continue;
    const double g = gbps(r.bytes, r.time.median());
    if (r.backend.rfind("memcpy x", 0) == 0) {
      copies.push_back(g);
      continue;
    }
    BarGroup grp{r.backend + " " + tokensLabel(r.tokens), {g}};
    grp.values.insert(grp.values.end(), copies.begin(), copies.end());
    if (series.empty()) {
      series.push_back("one request");
      for (size_t n = 1; n <= copies.size(); ++n) series.push_back("memcpy x" + std::to_string(n));
    }
    groups.push_back(std::move(grp));
    copies.clear();
  }
  plotBars(s,
           {"One request against the machine's copy bandwidth (copy-bandwidth, median)",
            "no data: run `hxfer bench copy-bandwidth` with --plot", series, false},
           groups, x0, y0, w, h);
}

Status writePlot(const std::string& path, const std::vector<Row>& rows, const std::string& title) {
  Svg s(1800, 1100);
  s.text(900, 24, title, 15, "middle", " font-weight='bold'");
  plotGoodput(s, rows, 80, 70, 460, 380);
  plotLatency(s, rows, 690, 70, 460, 380);
  plotStreaming(s, rows, 1290, 70, 460, 380);
  plotStorm(s, rows, 80, 610, 460, 380);
  plotCopyBandwidth(s, rows, 690, 610, 460, 380);
  std::ofstream out(path, std::ios::binary);
  out << s.str();
  if (!out) return Unavailable("--plot: cannot write '" + path + "'");
  return OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Driver

using Workload = Status (*)(Context&);

struct NamedWorkload {
  const char* name;
  const char* help;
  Workload fn;
};

const NamedWorkload kWorkloads[] = {
    {"baseline", "memcpy (request's op sizes) and raw TCP loopback for the request sizes",
     runBaselineWorkload},
    {"request", "one request's KV + recurrent state ctx -> gen per backend, for --tokens",
     runRequestWorkload},
    {"mismatch", "a request at several ctx:gen TP pairs (--tp-pairs), ratio to matched TP",
     runMismatchWorkload},
    {"small-pages", "tokens_per_block 16 vs a large page: ops, contiguous runs, goodput",
     runSmallPagesWorkload},
    {"storm", "nhd and token-major kv at tp mismatch with small pages: ops, bytes/op, goodput",
     runStormWorkload},
    {"copy-bandwidth", "one request against memcpy on 1..N threads (N = cores), same loop",
     runCopyBandwidthWorkload},
    {"streaming",
     "prefill simulated per layer: end of prefill to request complete, streamed vs whole",
     runStreamingWorkload},
    {"load", "N requests at concurrency C: requests/s, GB/s, p50/p99/p999", runLoadWorkload},
    {"control", "round trip of a zero-payload request (protocol overhead)", runControlWorkload},
};

std::string machineLine() {
  char host_cpus[64];
  std::snprintf(host_cpus, sizeof host_cpus, "%u cpus", std::thread::hardware_concurrency());
  double load[3] = {0, 0, 0};
  std::ifstream in("/proc/loadavg");
  in >> load[0] >> load[1] >> load[2];
  return std::string(host_cpus) + ", load average " + fmt("%.2f", load[0]) + " " +
         fmt("%.2f", load[1]) + " " + fmt("%.2f", load[2]);
}

Status runAll(const WorkloadOptions& o, const std::vector<const NamedWorkload*>& which) {
  if (o.repetitions < 1 || o.warmup < 0) {
    return InvalidArgument("--repetitions must be >= 1 and --warmup >= 0");
  }
  RETURN_IF_ERROR(checkBackendNames(o.backends));  // before any workload runs
  const ModelSpec* model = &o.model;
  std::vector<Row> rows;
  Context cx{o, *model, &rows, Progress(!o.quiet)};
  const std::string machine = machineLine();
  std::printf("hxfer bench: model %s (%u layers, tokens_per_block %u), %s\n", model->name.c_str(),
              model->numLayers(), model->tokens_per_block, machine.c_str());
  const auto t0 = Clock::now();
  for (const NamedWorkload* w : which) {
    const Status s = w->fn(cx);
    if (!s.isOk()) return s.withContext(std::string("bench ") + w->name);
    std::printf("\n");
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("peak RSS %.0f MiB, %.1f s\n", peakRssMib(), elapsed);
  if (!o.json_path.empty()) {
    nlohmann::json j;
    j["model"] = model->name;
    j["machine"] = machine;
    j["repetitions"] = o.repetitions;
    j["warmup"] = o.warmup;
    j["peak_rss_mib"] = peakRssMib();
    j["elapsed_s"] = elapsed;
    j["results"] = nlohmann::json::array();
    for (const Row& r : rows) j["results"].push_back(rowJson(r));
    std::ofstream out(o.json_path, std::ios::binary);
    out << j.dump(2) << "\n";
    if (!out) return Unavailable("--json: cannot write '" + o.json_path + "'");
  }
  if (!o.csv_path.empty()) {
    std::ofstream out(o.csv_path, std::ios::binary);
    out << csvHeader() << "\n";
    for (const Row& r : rows) out << csvLine(r) << "\n";
    if (!out) return Unavailable("--csv: cannot write '" + o.csv_path + "'");
  }
  if (!o.plot_path.empty()) {
    const Status s =
        writePlot(o.plot_path, rows, "hxfer bench: " + model->name + " (" + machine + ")");
    if (!s.isOk()) return s;
  }
  return OkStatus();
}

}  // namespace

const std::vector<WorkloadInfo>& workloads() {
  static const std::vector<WorkloadInfo> list = [] {
    std::vector<WorkloadInfo> out;
    for (const NamedWorkload& w : kWorkloads) out.push_back({w.name, w.help});
    return out;
  }();
  return list;
}

Status runWorkloads(const WorkloadOptions& options, const std::vector<std::string>& names) {
  std::vector<const NamedWorkload*> which;
  for (const std::string& name : names) {
    const NamedWorkload* found = nullptr;
    for (const NamedWorkload& w : kWorkloads) {
      if (name == w.name) found = &w;
    }
    if (found == nullptr) return InvalidArgument("bench: no workload '" + name + "'");
    which.push_back(found);
  }
  return runAll(options, which);
}

}  // namespace hxfer::bench
