// MetricsServer (`hxfer serve --metrics-port`) against slow, idle and hostile clients, and the
// Prometheus text it serves.
#include "cli/metrics_http.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "engine/metrics.h"

namespace hxfer::cli {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

// A connected client socket (closed by the destructor), reads bounded by 20 s.
struct Conn {
  explicit Conn(uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{20, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~Conn() { ::close(fd); }
  void send(const std::string& s) const { (void)!::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }
  std::string readAll() const {
    std::string out;
    char buf[65536];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
    return out;
  }
  int fd = -1;
  bool connected = false;
};

std::string get(uint16_t port, const std::string& path) {
  Conn c(port);
  c.send("GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
  return c.readAll();
}

std::unique_ptr<MetricsServer> startServer(std::function<std::string()> render,
                                           MetricsServer::Limits limits = {}) {
  auto s = MetricsServer::start("127.0.0.1", 0, std::move(render), limits);
  EXPECT_TRUE(s.isOk()) << s.status().toString();
  return s.isOk() ? std::move(*s) : nullptr;
}

TEST(MetricsServer, IdleConnectionsDoNotHoldBackAScrape) {
  MetricsServer::Limits limits;
  limits.client_deadline = seconds(10);
  auto server = startServer([] { return std::string("hxfer:x 1\n"); }, limits);
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<Conn>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<Conn>(server->port()));
    ASSERT_TRUE(idle.back()->connected);
  }
  idle[3]->send("GET /metr");  // and one that stops in the middle of its request line
  // Served one at a time, the scrape would wait out the idle ones' deadlines (80 s).
  const auto t0 = Clock::now();
  const std::string reply = get(server->port(), "/metrics");
  EXPECT_LT(Clock::now() - t0, seconds(5));
  EXPECT_NE(reply.find("HTTP/1.1 200 OK"), std::string::npos) << reply;
  EXPECT_NE(reply.find("\r\n\r\nhxfer:x 1\n"), std::string::npos) << reply;
}

TEST(MetricsServer, PastMaxClientsTheOldestConnectionIsClosed) {
  MetricsServer::Limits limits;
  limits.client_deadline = seconds(30);
  limits.max_clients = 2;
  auto server = startServer([] { return std::string(); }, limits);
  ASSERT_NE(server, nullptr);
  Conn first(server->port()), second(server->port()), third(server->port());
  ASSERT_TRUE(first.connected && second.connected && third.connected);
  // Closed by the server (recv gives 0), long before its deadline or the read's own timeout.
  const auto t0 = Clock::now();
  char byte;
  EXPECT_EQ(::recv(first.fd, &byte, 1, 0), 0);
  EXPECT_LT(Clock::now() - t0, seconds(10));
  EXPECT_NE(get(server->port(), "/metrics").find("200 OK"), std::string::npos);
}

TEST(MetricsServer, RendersAtMostOncePerIntervalAndNotFor404) {
  std::atomic<int> renders{0};
  MetricsServer::Limits limits;
  limits.render_interval = std::chrono::hours(1);
  auto server =
      startServer([&] { return "hxfer:renders " + std::to_string(++renders) + "\n"; }, limits);
  ASSERT_NE(server, nullptr);
  EXPECT_NE(get(server->port(), "/other").find("404 Not Found"), std::string::npos);
  EXPECT_EQ(renders.load(), 0);
  for (int i = 0; i < 10; ++i) {
    EXPECT_NE(get(server->port(), "/metrics").find("hxfer:renders 1\n"), std::string::npos);
  }
  EXPECT_EQ(renders.load(), 1);

  std::atomic<int> fresh{0};
  limits.render_interval = milliseconds(0);
  auto every = startServer([&] { return std::to_string(++fresh) + "\n"; }, limits);
  ASSERT_NE(every, nullptr);
  EXPECT_NE(get(every->port(), "/").find("\r\n\r\n1\n"), std::string::npos);
  EXPECT_NE(get(every->port(), "/").find("\r\n\r\n2\n"), std::string::npos);
}

TEST(MetricsServer, AClientThatNeverReadsHoldsNobodyElseNorTheShutdown) {
  MetricsServer::Limits limits;
  limits.client_deadline = seconds(3);
  auto server = startServer([] { return std::string(16 << 20, 'x'); }, limits);
  ASSERT_NE(server, nullptr);
  Conn stuck(server->port());
  ASSERT_TRUE(stuck.connected);
  stuck.send("GET /metrics HTTP/1.1\r\n\r\n");  // 16 MiB it never reads
  const std::string reply = get(server->port(), "/metrics");
  EXPECT_NE(reply.find("Content-Length: 16777216\r\n"), std::string::npos);
  EXPECT_EQ(reply.size() - reply.find("\r\n\r\n") - 4, size_t{16} << 20);
  const auto t0 = Clock::now();
  server.reset();  // with the stuck client still connected
  EXPECT_LT(Clock::now() - t0, seconds(5));
}

TEST(MetricsServer, RefusesLimitsOfZeroAndAHostThatIsNoAddress) {
  MetricsServer::Limits limits;
  limits.max_clients = 0;
  auto s = MetricsServer::start(
      "127.0.0.1", 0, [] { return std::string(); }, limits);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.status().message().find("max_clients 0"), std::string::npos) << s.status().message();
  auto h = MetricsServer::start("localhost", 0, [] { return std::string(); });
  ASSERT_FALSE(h.isOk());
  EXPECT_NE(h.status().message().find("'localhost' is not an IPv4 address"), std::string::npos);
}

// A name with a quote, a backslash or a newline stays one label value (unescaped, Prometheus
// rejects the whole scrape).
TEST(PrometheusText, LabelValuesAreEscaped) {
  EXPECT_EQ(engine::prometheusLabel("instance", "a\"b\\c\nd"), R"(instance="a\"b\\c\nd")");
  EXPECT_EQ(engine::prometheusLabel("rank", "0"), R"(rank="0")");
  engine::MetricsSnapshot m;
  m.storm_copies = 7;
  m.stale_messages = 3;
  m.ranks_without_token = 1;
  const std::string text = m.toPrometheus(engine::prometheusLabel("instance", "q\"x"));
  EXPECT_NE(text.find("hxfer:storm_copies_total{instance=\"q\\\"x\"} 7\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("hxfer:stale_messages_total{instance=\"q\\\"x\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("hxfer:ranks_without_token{instance=\"q\\\"x\"} 1\n"), std::string::npos);
}

}  // namespace
}  // namespace hxfer::cli
