// A Prometheus scrape endpoint for `hxfer serve --metrics-port`: a thread that answers
// GET /metrics with the text a callback renders (MetricsSnapshot::toPrometheus), and 404
// otherwise. Clients are served side by side, each within a deadline for its request and its
// answer (a request line within 4 KiB); past `max_clients` a new connection closes the oldest.
// The text is rendered at most once per `render_interval` and shared by the scrapes within it,
// so a client scraping in a loop costs the serving rank one render per interval. A slow or
// hostile client costs a bounded wait of the endpoint, never the serving rank.
//
// Thread-safety: the callback runs on the server's thread; start() and the destructor (which
// stops the thread) from the owner's.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"

namespace hxfer::cli {

class MetricsServer {
 public:
  struct Limits {
    std::chrono::milliseconds client_deadline{2000};  // from accept to the last byte answered
    size_t max_clients = 32;
    std::chrono::milliseconds render_interval{1000};
  };

  // Listens on host:port (port 0 picks one). InvalidArgument for a host that is not an IPv4
  // address or limits of zero; Unavailable when the port cannot be bound.
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, uint16_t port,
                                                        std::function<std::string()> render,
                                                        Limits limits);
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, uint16_t port,
                                                        std::function<std::string()> render) {
    return start(host, port, std::move(render), Limits{});
  }
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  uint16_t port() const { return port_; }

 private:
  struct Client;
  MetricsServer(int fd, uint16_t port, std::function<std::string()> render, Limits limits);
  void run();
  // Reads what arrived, then sends what it can; false once the client is done with.
  bool serve(Client& c);
  std::string answer(const std::string& request);

  int fd_;
  uint16_t port_;
  std::function<std::string()> render_;
  Limits limits_;
  std::string rendered_;  // the server thread's only
  std::chrono::steady_clock::time_point rendered_at_{};
  bool have_rendered_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hxfer::cli
