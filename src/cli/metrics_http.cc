#include "cli/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace hxfer::cli {

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host,
                                                              uint16_t port,
                                                              std::function<std::string()> render) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return InvalidArgument("metrics address '" + host + "' is not an IPv4 address");
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 16) != 0) {
    Status s = Unavailable("metrics endpoint " + host + ":" + std::to_string(port) + ": " +
                           std::strerror(errno));
    ::close(fd);
    return s;
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(fd, ntohs(a.sin_port), std::move(render)));
}

MetricsServer::MetricsServer(int fd, uint16_t port, std::function<std::string()> render)
    : fd_(fd), port_(port), render_(std::move(render)) {
  thread_ = std::thread([this] { run(); });
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  ::close(fd_);
}

void MetricsServer::run() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    answer(client);
    ::close(client);
  }
}

void MetricsServer::answer(int client) {
  // The request line and headers, up to the blank line, within 4 KiB and 2 s.
  std::string request;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 4096) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{client, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    char buf[1024];
    const ssize_t n = ::recv(client, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const bool metrics = request.rfind("GET /metrics ", 0) == 0 || request.rfind("GET / ", 0) == 0;
  const std::string body = metrics ? render_() : "not found: GET /metrics\n";
  const std::string head =
      std::string(metrics ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.1 404 Not Found\r\n") +
      "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
  const std::string all = head + body;
  size_t sent = 0;
  while (sent < all.size()) {
    const ssize_t n = ::send(client, all.data() + sent, all.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace hxfer::cli
