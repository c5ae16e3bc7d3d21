// A Prometheus scrape endpoint for `hxfer serve --metrics-port`: a thread that answers
// GET /metrics with the text a callback renders (MetricsSnapshot::toPrometheus), and 404
// otherwise. One connection at a time, each bounded (a request line within 4 KiB and 2 s), so a
// slow or hostile client costs a bounded wait, never the serving rank.
//
// Thread-safety: the callback runs on the server's thread; start() and the destructor (which
// stops the thread) from the owner's.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"

namespace hxfer::cli {

class MetricsServer {
 public:
  // Listens on host:port (port 0 picks one). InvalidArgument for a host that is not an IPv4
  // address; Unavailable when the port cannot be bound.
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, uint16_t port,
                                                        std::function<std::string()> render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  uint16_t port() const { return port_; }

 private:
  MetricsServer(int fd, uint16_t port, std::function<std::string()> render);
  void run();
  void answer(int client);

  int fd_;
  uint16_t port_;
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hxfer::cli
