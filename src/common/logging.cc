#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <memory>
#include <string>

namespace hxfer {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> kLogger = [] {
    auto l = spdlog::stderr_color_mt("hxfer");
    l->set_level(spdlog::level::warn);
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] [pid %P] %v");
    return l;
  }();
  return *kLogger;
}

bool setLogLevel(std::string_view level) {
  auto parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") return false;
  logger().set_level(parsed);
  return true;
}

bool LogLimiter::admit(uint64_t* suppressed) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (now < next_) {
    ++held_;
    return false;
  }
  next_ = now + interval_;
  *suppressed = held_;
  held_ = 0;
  return true;
}

}  // namespace hxfer
