// Logging through spdlog. One logger named "hxfer", writing to stderr; level from
// setLogLevel() (the CLI's --log-level) and nothing else. Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace hxfer {

spdlog::logger& logger();
// "trace", "debug", "info", "warn", "error", "off". Unknown names leave the level unchanged
// and return false.
bool setLogLevel(std::string_view level);

}  // namespace hxfer

#define HXFER_LOG_DEBUG(...) ::hxfer::logger().debug(__VA_ARGS__)
#define HXFER_LOG_INFO(...) ::hxfer::logger().info(__VA_ARGS__)
#define HXFER_LOG_WARN(...) ::hxfer::logger().warn(__VA_ARGS__)
#define HXFER_LOG_ERROR(...) ::hxfer::logger().error(__VA_ARGS__)
