#include "cli/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace hxfer::cli {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxRequestBytes = 4096;

}  // namespace

struct MetricsServer::Client {
  int fd = -1;
  Clock::time_point deadline;
  std::string request;
  std::string reply;  // empty until the request is whole
  size_t sent = 0;
};

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host,
                                                              uint16_t port,
                                                              std::function<std::string()> render,
                                                              Limits limits) {
  if (limits.client_deadline.count() <= 0 || limits.max_clients == 0 ||
      limits.render_interval.count() < 0) {
    return InvalidArgument("metrics endpoint limits: client_deadline " +
                           std::to_string(limits.client_deadline.count()) + " ms, max_clients " +
                           std::to_string(limits.max_clients) + ", render_interval " +
                           std::to_string(limits.render_interval.count()) +
                           " ms (the first two must be positive)");
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return InvalidArgument("metrics address '" + host + "' is not an IPv4 address");
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Unavailable(std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 64) != 0) {
    Status s = Unavailable("metrics endpoint " + host + ":" + std::to_string(port) + ": " +
                           std::strerror(errno));
    ::close(fd);
    return s;
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(fd, ntohs(a.sin_port), std::move(render), limits));
}

MetricsServer::MetricsServer(int fd, uint16_t port, std::function<std::string()> render,
                             Limits limits)
    : fd_(fd), port_(port), render_(std::move(render)), limits_(limits) {
  thread_ = std::thread([this] { run(); });
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  ::close(fd_);
}

void MetricsServer::run() {
  std::vector<Client> clients;
  std::vector<pollfd> fds;
  while (!stop_) {
    const auto now = Clock::now();
    std::erase_if(clients, [&](const Client& c) {
      if (now < c.deadline) return false;
      ::close(c.fd);
      return true;
    });
    auto wait = std::chrono::milliseconds(200);
    fds.assign(1, pollfd{fd_, POLLIN, 0});
    for (const Client& c : clients) {
      fds.push_back(pollfd{c.fd, static_cast<short>(c.reply.empty() ? POLLIN : POLLOUT), 0});
      wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(c.deadline - now));
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait.count(), 0))) < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    for (size_t i = 0; i < clients.size(); ++i) {
      if (fds[i + 1].revents == 0) continue;
      if (!serve(clients[i])) {
        ::close(clients[i].fd);
        clients[i].fd = -1;
      }
    }
    std::erase_if(clients, [](const Client& c) { return c.fd < 0; });
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of fds or memory, the connection stays queued and poll reports it again at once:
      // back off instead of spinning on it.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      continue;
    }
    if (clients.size() >= limits_.max_clients) {  // the oldest has waited longest
      ::close(clients.front().fd);
      clients.erase(clients.begin());
    }
    clients.push_back(Client{fd, Clock::now() + limits_.client_deadline, {}, {}, 0});
  }
  for (const Client& c : clients) ::close(c.fd);
}

bool MetricsServer::serve(Client& c) {
  while (c.reply.empty()) {
    char buf[1024];
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (n <= 0) return false;  // closed or failed before its request was whole
    c.request.append(buf, static_cast<size_t>(n));
    if (c.request.find("\r\n\r\n") != std::string::npos || c.request.size() >= kMaxRequestBytes) {
      c.reply = answer(c.request);
    }
  }
  while (c.sent < c.reply.size()) {
    const ssize_t n = ::send(c.fd, c.reply.data() + c.sent, c.reply.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (n <= 0) return false;
    c.sent += static_cast<size_t>(n);
  }
  return false;  // answered
}

std::string MetricsServer::answer(const std::string& request) {
  const bool metrics = request.rfind("GET /metrics ", 0) == 0 || request.rfind("GET / ", 0) == 0;
  if (metrics) {
    const auto now = Clock::now();
    if (!have_rendered_ || now - rendered_at_ >= limits_.render_interval) {
      rendered_ = render_();
      rendered_at_ = now;
      have_rendered_ = true;
    }
  }
  const std::string& body = metrics ? rendered_ : std::string("not found: GET /metrics\n");
  return std::string(metrics ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.1 404 Not Found\r\n") +
         "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
         "Content-Length: " +
         std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
}

}  // namespace hxfer::cli
