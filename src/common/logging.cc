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

}  // namespace hxfer
