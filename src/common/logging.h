// Logging through spdlog. One logger named "hxfer", writing to stderr; level from
// setLogLevel() (the CLI's --log-level) and nothing else. Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string_view>

namespace hxfer {

spdlog::logger& logger();
// "trace", "debug", "info", "warn", "error", "off". Unknown names leave the level unchanged
// and return false.
bool setLogLevel(std::string_view level);

// Lets through the first of a kind of line at once, then at most one per `interval`, telling
// how many it held back meanwhile: what a peer can make a rank say is bounded (a connection
// flood once wrote 568k warnings in 25 s). Thread-safe.
class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::milliseconds interval = std::chrono::seconds(1))
      : interval_(interval) {}
  // Whether to log now; `*suppressed` (set only when true) is how many were held back since
  // the last line that went out.
  bool admit(uint64_t* suppressed);

 private:
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_{};  // guarded by mu_
  uint64_t held_ = 0;                             // guarded by mu_
};

}  // namespace hxfer

#define HXFER_LOG_DEBUG(...) ::hxfer::logger().debug(__VA_ARGS__)
#define HXFER_LOG_INFO(...) ::hxfer::logger().info(__VA_ARGS__)
#define HXFER_LOG_WARN(...) ::hxfer::logger().warn(__VA_ARGS__)
#define HXFER_LOG_ERROR(...) ::hxfer::logger().error(__VA_ARGS__)
