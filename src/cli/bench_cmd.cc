// `hxfer bench transport`: moves SIZE bytes in OP-SIZE writes from this process into a peer
// process on this host (a forked child; inproc stays in one process) and prints GB/s next to
// baselines measured in the same run: memcpy of the same bytes in the same op size, and for
// ucx a plain TCP loopback socket sending the same bytes. Each iteration runs all of them back
// to back (so they share the machine's load); buffers are pre-faulted; figures are the median
// and best of --iterations runs after one warm-up; the destination is checked with a CRC.
//
// Processes: fork happens before any agent exists in either process (agents do not survive
// fork), so the parent creates its agent only after the children were started.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "cli/socket_util.h"
#include "common/coding.h"
#include "common/crc32c.h"
#include "transport/auth.h"
#include "transport/transport.h"

namespace hxfer::cli {
namespace {

using transport::Agent;
using transport::AgentConfig;
using transport::Clock;
using transport::Event;
using transport::PeerId;
using transport::WriteOp;
using namespace std::chrono_literals;

constexpr auto kDeadline = 60s;

struct BenchOptions {
  std::string backend = "shm";
  uint64_t size = 64ull << 20;
  uint64_t op_size = 0;  // 0: one op for the whole size
  std::string ucx_mode = "auto";
  std::string ucx_tls;  // empty: UCX_TLS from the environment (or UCX's default)
  int iterations = 7;
  bool json = false;
};

double gbps(uint64_t bytes, Clock::duration d) {
  const double s = std::chrono::duration<double>(d).count();
  return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0;
}

std::vector<WriteOp> makeOps(uint64_t size, uint64_t op_size) {
  std::vector<WriteOp> ops;
  for (uint64_t off = 0; off < size; off += op_size) {
    ops.push_back({1, off, 2, off, std::min(op_size, size - off)});
  }
  return ops;
}

std::unique_ptr<Region> allocate(uint32_t id, uint64_t size, const char* name) {
  auto r = Region::allocate(id, size, Region::Backing::kMemfd, name);
  if (!r.isOk()) return nullptr;
  return std::move(r).value();
}

// Timed runs of one thing; run 0 is a warm-up and not recorded.
struct Series {
  std::vector<double> gbps;
  double median() const {
    std::vector<double> v = gbps;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  }
  double best() const { return gbps.empty() ? 0.0 : *std::max_element(gbps.begin(), gbps.end()); }
};

// The raw TCP baseline: a loopback connection to a forked child that receives `size` bytes per
// run into a pre-faulted buffer and answers one byte. Started before any agent exists.
struct TcpPeer {
  pid_t child = -1;
  int fd = -1;

  static StatusOr<TcpPeer> start(uint64_t size) {
    sockaddr_in sa;
    ASSIGN_OR_RETURN(const int lfd, listenOnLoopback(&sa));
    TcpPeer t;
    t.child = fork();
    if (t.child < 0) return Unavailable("fork for the tcp baseline failed");
    if (t.child == 0) {
      close(lfd);
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) _exit(2);
      auto buf = allocate(9, size, "bench-tcp-recv");
      if (!buf) _exit(3);
      for (;;) {
        if (!recvAll(fd, buf->data(), size)) _exit(0);  // EOF: the bench is over
        uint8_t ack = 1;
        if (!sendAll(fd, &ack, 1)) _exit(4);
      }
    }
    t.fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    close(lfd);
    if (t.fd < 0) {
      t.stop();
      return Unavailable("tcp baseline accept failed");
    }
    return t;
  }

  bool run(const Region& src) {
    uint8_t ack = 0;
    return sendAll(fd, src.data(), src.length()) && recvAll(fd, &ack, 1);
  }

  void stop() {
    if (fd >= 0) close(fd);
    fd = -1;
    if (child > 0) waitpid(child, nullptr, 0);
    child = -1;
  }
};

// The receiving side: registers a region of `size`, sends its length and key on connect,
// answers "v" with the CRC of the region and exits on "q" or when the writer goes away.
int runReceiver(const AgentConfig& config, uint64_t size, int address_fd) {
  auto agent = transport::createAgent(config);
  if (!agent.isOk()) return 2;
  auto region = allocate(2, size, "bench-dst");
  if (!region) return 3;
  auto key = (*agent)->registerRegion(*region, transport::RegionAccess::kRemoteWritable);
  if (!key.isOk()) return 4;
  const std::string addr = (*agent)->localAddress();
  if (write(address_fd, addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) return 5;
  close(address_fd);
  for (;;) {
    auto e = (*agent)->pollEvent(kDeadline);
    if (!e || e->kind == Event::Kind::kPeerLost) return e ? 0 : 6;
    if (e->kind == Event::Kind::kPeerConnected) {
      Bytes msg;
      putFixed64(msg, region->length());
      msg.insert(msg.end(), key->begin(), key->end());
      if (!(*agent)->sendMessage(e->peer, msg).isOk()) return 7;
    } else if (!e->payload.empty() && e->payload[0] == 'v') {
      Bytes crc;
      putFixed32(crc, crc32c(region->data(), region->length()));
      if (!(*agent)->sendMessage(e->peer, crc).isOk()) return 8;
    } else {
      return 0;  // quit
    }
  }
}

std::optional<Event> nextMessage(Agent& agent) {
  const auto deadline = Clock::now() + kDeadline;
  while (Clock::now() < deadline) {
    auto e = agent.pollEvent(100ms);
    if (!e) continue;
    if (e->kind == Event::Kind::kMessage) return e;
    if (e->kind == Event::Kind::kPeerLost) return std::nullopt;
  }
  return std::nullopt;
}

struct Results {
  Series transport, memcpy, memcpy_n, tcp;
  unsigned threads = 1;  // of memcpy_n: the machine's cores (at most 4, as the copy helpers)
  bool has_tcp = false;
  bool verified = false;
};

// Runs transport, memcpy and (ucx) tcp back to back in every iteration, so that all three see
// the same machine load.
Status measure(const AgentConfig& config, const Region& src, const std::vector<WriteOp>& ops,
               uint64_t op_size, int iterations, Results* out) {
  const uint64_t size = src.length();
  TcpPeer tcp;
  if (config.backend == "ucx") {
    ASSIGN_OR_RETURN(tcp, TcpPeer::start(size));
    out->has_tcp = true;
  }
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return Unavailable("pipe failed");
  pid_t child = -1;
  std::thread in_process;  // inproc: the receiver is a thread of this process
  if (config.backend == "inproc") {
    in_process = std::thread([&] { runReceiver(config, size, pipe_fds[1]); });
  } else {
    child = fork();
    if (child < 0) return Unavailable("fork failed");
    if (child == 0) {
      close(pipe_fds[0]);
      _exit(runReceiver(config, size, pipe_fds[1]));
    }
    close(pipe_fds[1]);
  }
  auto finish = [&](Status s) -> Status {
    if (child > 0) waitpid(child, nullptr, 0);
    if (in_process.joinable()) in_process.join();
    tcp.stop();
    return s;
  };
  std::string addr(512, '\0');
  ssize_t n = read(pipe_fds[0], addr.data(), addr.size());
  close(pipe_fds[0]);
  if (n <= 0) return finish(Unavailable("the receiver did not start"));
  addr.resize(static_cast<size_t>(n));
  auto copy_dst = allocate(3, size, "bench-memcpy");
  if (!copy_dst) return finish(ResourceExhausted("allocating the memcpy destination failed"));

  Status status = OkStatus();
  {
    auto agent = transport::createAgent(config);
    if (!agent.isOk()) return finish(agent.status());
    Agent& a = **agent;
    auto key = a.registerRegion(src, transport::RegionAccess::kLocalSource);
    auto peer = key.isOk() ? a.connect(addr) : StatusOr<PeerId>(key.status());
    if (!peer.isOk()) return finish(peer.status());
    auto msg = nextMessage(a);
    if (!msg || msg->payload.size() < 8) return finish(Unavailable("no key from the receiver"));
    const uint64_t length = loadFixed64(msg->payload.data());
    std::span<const uint8_t> rkey(msg->payload.data() + 8, msg->payload.size() - 8);
    status = a.addRemoteRegion(*peer, 2, length, rkey);
    auto runTransport = [&](int i) {
      const auto t0 = Clock::now();
      auto t = a.postWrite(*peer, ops);
      status = t.isOk() ? t->wait(Clock::now() + kDeadline) : t.status();
      const auto t1 = Clock::now();
      if (status.isOk() && i > 0) out->transport.gbps.push_back(gbps(size, t1 - t0));
    };
    auto runMemcpy = [&](int i) {
      const auto t0 = Clock::now();
      for (uint64_t off = 0; off < size; off += op_size) {
        std::memcpy(copy_dst->data() + off, src.data() + off, std::min(op_size, size - off));
      }
      const auto t1 = Clock::now();
      if (i > 0) out->memcpy.gbps.push_back(gbps(size, t1 - t0));
    };
    // The same bytes split over one thread per core (at most 4): the machine's copy bandwidth,
    // which the shm and inproc backends reach for large requests with their copy helpers.
    out->threads = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
    auto runMemcpyN = [&](int i) {
      const uint64_t share = (size / out->threads + 4095) & ~uint64_t{4095};
      const auto t0 = Clock::now();
      std::vector<std::thread> copiers;
      for (unsigned k = 1; k < out->threads; ++k) {
        copiers.emplace_back([&, k] {
          const uint64_t off = std::min<uint64_t>(size, k * share);
          std::memcpy(copy_dst->data() + off, src.data() + off,
                      std::min<uint64_t>(share, size - off));
        });
      }
      std::memcpy(copy_dst->data(), src.data(), std::min<uint64_t>(share, size));
      for (auto& c : copiers) c.join();
      const auto t1 = Clock::now();
      if (i > 0) out->memcpy_n.gbps.push_back(gbps(size, t1 - t0));
    };
    auto runTcp = [&](int i) {
      if (!out->has_tcp) return;
      const auto t0 = Clock::now();
      if (!tcp.run(src)) status = Unavailable("tcp baseline connection failed");
      const auto t1 = Clock::now();
      if (status.isOk() && i > 0) out->tcp.gbps.push_back(gbps(size, t1 - t0));
    };
    for (int i = 0; status.isOk() && i <= iterations; ++i) {
      // Alternate the order so that no contender always runs with warm (or cold) caches.
      if (i % 2 == 0) {
        runTransport(i);
        if (status.isOk()) runMemcpy(i);
        if (status.isOk()) runMemcpyN(i);
        if (status.isOk()) runTcp(i);
      } else {
        runTcp(i);
        if (status.isOk()) runMemcpyN(i);
        if (status.isOk()) runMemcpy(i);
        if (status.isOk()) runTransport(i);
      }
    }
    if (status.isOk()) {
      const uint8_t verify = 'v';
      status = a.sendMessage(*peer, std::span<const uint8_t>(&verify, 1));
      auto crc = status.isOk() ? nextMessage(a) : std::nullopt;
      out->verified = crc && crc->payload.size() == 4 &&
                      loadFixed32(crc->payload.data()) == crc32c(src.data(), size);
      const uint8_t quit = 'q';
      (void)a.sendMessage(*peer, std::span<const uint8_t>(&quit, 1));
    }
  }
  return finish(status);
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

int run(const BenchOptions& o) {
  if (o.size == 0) return reportError(InvalidArgument("--size=0: nothing to move"));
  const uint64_t op_size = o.op_size == 0 ? o.size : o.op_size;
  if (o.iterations < 1) return reportError(InvalidArgument("--iterations must be >= 1"));
  auto mode = transport::parseUcxMode(o.ucx_mode);
  if (!mode.isOk()) return reportError(mode.status().withContext("--ucx-mode"));
  AgentConfig config;
  config.backend = o.backend;
  config.label = "bench";
  config.ucx_mode = *mode;
  auto token = transport::auth::randomToken();  // the forked receiver inherits it
  if (!token.isOk()) return reportError(token.status());
  config.auth_token = *token;
  if (!o.ucx_tls.empty()) config.ucx_options = {{"TLS", o.ucx_tls}};

  auto src = allocate(1, o.size, "bench-src");
  if (!src) return reportError(ResourceExhausted("allocating --size bytes failed"));
  for (uint64_t i = 0; i < o.size; i += 8) {
    const uint64_t v = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(src->data() + i, &v, std::min<uint64_t>(8, o.size - i));
  }
  const auto ops = makeOps(o.size, op_size);
  Results r;
  Status s = measure(config, *src, ops, op_size, o.iterations, &r);
  if (!s.isOk()) return reportError(s.withContext("bench transport --backend " + o.backend));

  if (o.json) {
    nlohmann::json j;
    j["backend"] = o.backend;
    if (o.backend == "ucx") j["ucx_mode"] = o.ucx_mode;
    j["bytes"] = o.size;
    j["op_size"] = op_size;
    j["ops"] = ops.size();
    j["iterations"] = o.iterations;
    auto series = [](const Series& x) {
      return nlohmann::json{{"median_gbps", x.median()}, {"best_gbps", x.best()}, {"runs", x.gbps}};
    };
    j["transport"] = series(r.transport);
    j["memcpy"] = series(r.memcpy);
    j["ratio_to_memcpy"] = ratio(r.transport.median(), r.memcpy.median());
    j["memcpy_threads"] = r.threads;
    j["memcpy_n"] = series(r.memcpy_n);
    j["ratio_to_memcpy_n"] = ratio(r.transport.median(), r.memcpy_n.median());
    if (r.has_tcp) {
      j["tcp"] = series(r.tcp);
      j["ratio_to_tcp"] = ratio(r.transport.median(), r.tcp.median());
    }
    j["verified"] = r.verified;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    const std::string mode_text = o.backend == "ucx" ? " (ucx-mode " + o.ucx_mode + ")" : "";
    std::printf("backend %s%s: %llu bytes in %zu ops of %llu bytes, %d runs each\n",
                o.backend.c_str(), mode_text.c_str(), static_cast<unsigned long long>(o.size),
                ops.size(), static_cast<unsigned long long>(op_size), o.iterations);
    std::printf("              median GB/s   best GB/s   ratio (median)\n");
    std::printf("  transport   %11.2f %11.2f\n", r.transport.median(), r.transport.best());
    std::printf("  memcpy      %11.2f %11.2f   transport/memcpy = %.2f\n", r.memcpy.median(),
                r.memcpy.best(), ratio(r.transport.median(), r.memcpy.median()));
    std::printf("  memcpy x%-3u %11.2f %11.2f   transport/memcpy x%u = %.2f\n", r.threads,
                r.memcpy_n.median(), r.memcpy_n.best(), r.threads,
                ratio(r.transport.median(), r.memcpy_n.median()));
    if (r.has_tcp) {
      std::printf("  tcp         %11.2f %11.2f   transport/tcp    = %.2f\n", r.tcp.median(),
                  r.tcp.best(), ratio(r.transport.median(), r.tcp.median()));
    }
    std::printf("  destination %s\n", r.verified ? "verified (crc32c)" : "MISMATCH");
  }
  return r.verified ? 0 : 1;
}

}  // namespace

void addBenchCommand(CLI::App& app) {
  auto* bench = app.add_subcommand(
      "bench",
      "Measure hxfer components against baselines; `hxfer bench` alone runs every workload "
      "(all)");
  bench->require_subcommand(0, 1);
  auto* cmd = bench->add_subcommand(
      "transport", "GB/s of one backend between two processes, next to memcpy (and raw TCP)");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("--backend", o->backend, "shm, ucx or inproc")
      ->check(CLI::IsMember({"shm", "ucx", "inproc"}))
      ->capture_default_str();
  cmd->add_option("--size", o->size, "total bytes per run")->capture_default_str();
  cmd->add_option("--op-size", o->op_size, "bytes per write op (default: --size)");
  cmd->add_option("--ucx-mode", o->ucx_mode, "auto, put or am (ucx only)")
      ->check(CLI::IsMember({"auto", "put", "am"}))
      ->capture_default_str();
  cmd->add_option("--ucx-tls", o->ucx_tls,
                  "UCX transports, e.g. tcp (default: UCX_TLS from the environment)");
  cmd->add_option("--iterations", o->iterations, "timed runs (after one warm-up)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->callback([o] {
    const int rc = run(*o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace hxfer::cli
