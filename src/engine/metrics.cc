#include "engine/metrics.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace hxfer::engine {

std::string_view failureCauseName(FailureCause c) {
  switch (c) {
    case FailureCause::kTimeout:
      return "timeout";
    case FailureCause::kPeerLost:
      return "peer_lost";
    case FailureCause::kRefused:
      return "refused";
    case FailureCause::kTransport:
      return "transport";
    case FailureCause::kChecksum:
      return "checksum";
    case FailureCause::kCancelled:
      return "cancelled";
    case FailureCause::kExhausted:
      return "exhausted";
    case FailureCause::kOther:
      return "other";
  }
  return "other";
}

FailureCause causeOf(const Status& status) {
  switch (status.code()) {
    case StatusCode::kTimeout:
    case StatusCode::kExpired:
      return FailureCause::kTimeout;
    case StatusCode::kUnavailable:
      return FailureCause::kPeerLost;
    case StatusCode::kIncompatible:
    case StatusCode::kInvalidArgument:
      return FailureCause::kRefused;
    case StatusCode::kCorruption:
      return FailureCause::kChecksum;
    case StatusCode::kCancelled:
      return FailureCause::kCancelled;
    case StatusCode::kResourceExhausted:
      return FailureCause::kExhausted;
    default:
      return FailureCause::kOther;
  }
}

// Bucket b holds latencies in (upperBound(b-1), upperBound(b)]; upperBound(b) = 1 us * 2^(b/4).
size_t LatencyHistogram::bucketOf(std::chrono::nanoseconds latency) {
  const double us = static_cast<double>(latency.count()) / 1000.0;
  if (us <= 1.0) return 0;
  const double b = std::ceil(4.0 * std::log2(us));
  return static_cast<size_t>(std::min<double>(b, kBuckets - 1));
}

std::chrono::nanoseconds LatencyHistogram::upperBound(size_t bucket) {
  return std::chrono::nanoseconds(
      static_cast<int64_t>(std::llround(1000.0 * std::exp2(static_cast<double>(bucket) / 4.0))));
}

void LatencyHistogram::record(std::chrono::nanoseconds latency) {
  ++buckets_[bucketOf(latency)];
  ++count_;
  max_ = std::max(max_, latency);
  sum_ += latency;
}

uint64_t LatencyHistogram::countAtMost(std::chrono::nanoseconds bound) const {
  uint64_t n = 0;
  for (size_t b = 0; b < kBuckets && upperBound(b) <= bound; ++b) n += buckets_[b];
  return n;
}

std::chrono::nanoseconds LatencyHistogram::quantile(double q) const {
  if (count_ == 0) return std::chrono::nanoseconds(0);
  q = std::clamp(q, 0.0, 1.0);
  // The smallest bucket whose cumulative count reaches ceil(q * count), at least 1.
  const uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * count_)));
  uint64_t seen = 0;
  for (size_t b = 0; b < kBuckets; ++b) {
    seen += buckets_[b];
    if (seen >= rank) return std::min(upperBound(b), max_);
  }
  return max_;
}

void LatencyHistogram::merge(const LatencyHistogram& other) {
  for (size_t b = 0; b < kBuckets; ++b) buckets_[b] += other.buckets_[b];
  count_ += other.count_;
  max_ = std::max(max_, other.max_);
  sum_ += other.sum_;
}

void MetricsSnapshot::merge(const MetricsSnapshot& o) {
  requests_started += o.requests_started;
  requests_ok += o.requests_ok;
  requests_failed += o.requests_failed;
  requests_cancelled += o.requests_cancelled;
  bytes += o.bytes;
  ops += o.ops;
  staged_parts += o.staged_parts;
  staging_copies += o.staging_copies;
  staging_bytes += o.staging_bytes;
  streamed_ranges += o.streamed_ranges;
  writes_posted += o.writes_posted;
  storm_parts += o.storm_parts;
  storm_copies += o.storm_copies;
  staging_windows += o.staging_windows;
  for (size_t i = 0; i < kNumFailureCauses; ++i) failures[i] += o.failures[i];
  leases_expired += o.leases_expired;
  quarantined_requests += o.quarantined_requests;
  handshakes_ok += o.handshakes_ok;
  handshakes_refused += o.handshakes_refused;
  peers_lost += o.peers_lost;
  reconnects += o.reconnects;
  stale_messages += o.stale_messages;
  writes_stalled += o.writes_stalled;
  connections_superseded += o.connections_superseded;
  requests_over_limit += o.requests_over_limit;
  auth_failures += o.auth_failures;
  unauthenticated_dropped += o.unauthenticated_dropped;
  connections_refused += o.connections_refused;
  peers_over_limit += o.peers_over_limit;
  ranks_without_token += o.ranks_without_token;
  accounting_errors += o.accounting_errors;
  latency.merge(o.latency);
}

std::string prometheusLabel(std::string_view name, std::string_view value) {
  std::string out(name);
  out += "=\"";
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string MetricsSnapshot::toPrometheus(std::string_view labels) const {
  std::string out;
  const std::string base(labels);
  auto with = [&](const std::string& more) {
    if (base.empty()) return more.empty() ? std::string() : "{" + more + "}";
    return "{" + base + (more.empty() ? "" : "," + more) + "}";
  };
  auto metric = [&](const char* name, const char* type, const char* help) {
    out += std::string("# HELP hxfer:") + name + " " + help + "\n# TYPE hxfer:" + name + " " +
           type + "\n";
  };
  auto sample = [&](const char* name, const std::string& more, double value) {
    char number[64];
    std::snprintf(number, sizeof(number), "%.17g", value);
    out += std::string("hxfer:") + name + with(more) + " " + number + "\n";
  };
  auto counter = [&](const char* name, const char* help, uint64_t value) {
    metric(name, "counter", help);
    sample(name, "", static_cast<double>(value));
  };
  metric("requests_total", "counter",
         "Request parts by outcome (generation: started by the serving code; context: served).");
  sample("requests_total", "outcome=\"started\"", static_cast<double>(requests_started));
  sample("requests_total", "outcome=\"ok\"", static_cast<double>(requests_ok));
  sample("requests_total", "outcome=\"failed\"", static_cast<double>(requests_failed));
  sample("requests_total", "outcome=\"cancelled\"", static_cast<double>(requests_cancelled));
  metric("failures_total", "counter", "Failed request parts by cause.");
  for (size_t i = 0; i < kNumFailureCauses; ++i) {
    sample("failures_total",
           "cause=\"" + std::string(failureCauseName(static_cast<FailureCause>(i))) + "\"",
           static_cast<double>(failures[i]));
  }
  counter("bytes_total", "Bytes moved by successful request parts.", bytes);
  counter("ops_total", "Copy ops posted.", ops);
  counter("writes_posted_total", "Writes posted (one per part, or per streamed layer range).",
          writes_posted);
  counter("staged_parts_total", "Parts staged on the context rank (element orders differ).",
          staged_parts);
  counter("staging_bytes_total", "Bytes gathered into staging areas.", staging_bytes);
  counter("staging_copies_total", "Local copies of staged parts (gather or scatter runs).",
          staging_copies);
  counter("streamed_ranges_total", "Ranges of layers marked ready while more were to come.",
          streamed_ranges);
  counter("storm_parts_total", "Parts of many small ops sent as one staged write.", storm_parts);
  counter("storm_copies_total",
          "Local copies of storm parts (context: gathered ops; "
          "generation: scattered runs).",
          storm_copies);
  counter("staging_windows_total",
          "Windows of parts larger than the staging region (device pools behind a host agent).",
          staging_windows);
  counter("leases_expired_total", "Source pages freed because no generation rank asked in time.",
          leases_expired);
  counter("quarantined_requests_total", "Requests freed while writes were in flight.",
          quarantined_requests);
  metric("handshakes_total", "counter", "Engine handshakes by result.");
  sample("handshakes_total", "result=\"ok\"", static_cast<double>(handshakes_ok));
  sample("handshakes_total", "result=\"refused\"", static_cast<double>(handshakes_refused));
  counter("peers_lost_total", "Peers whose connection broke.", peers_lost);
  counter("reconnects_total", "Reconnections to a context rank.", reconnects);
  counter("writes_stalled_total", "Writes cancelled for making no progress.", writes_stalled);
  counter("stale_messages_total", "Messages about an earlier use of a request id, ignored.",
          stale_messages);
  counter("connections_superseded_total",
          "Connections dropped for a newer one from the same generation rank.",
          connections_superseded);
  counter("requests_over_limit_total", "Requests refused over a peer's bounds.",
          requests_over_limit);
  counter("auth_failures_total", "Transport handshakes refused (token, uid, timeout).",
          auth_failures);
  counter("connections_refused_total",
          "Unauthenticated connections closed (over max_unauthenticated, or no fd).",
          connections_refused);
  counter("unauthenticated_dropped_total", "Frames from connections not yet authenticated.",
          unauthenticated_dropped);
  counter("peers_over_limit_total", "Peers dropped for exceeding a per-peer bound.",
          peers_over_limit);
  metric("ranks_without_token", "gauge", "Ranks whose transport has no auth token configured.");
  sample("ranks_without_token", "", static_cast<double>(ranks_without_token));
  metric("accounting_errors", "gauge", "Ranks whose self-check failed when this was taken.");
  sample("accounting_errors", "", static_cast<double>(accounting_errors));
  metric("transfer_latency_seconds", "histogram",
         "Request start (or ask) to completion, successful parts.");
  for (size_t b = 0; b < LatencyHistogram::kBuckets; b += 4) {  // 1 us x 2^k
    const auto bound = LatencyHistogram::upperBound(b);
    if (bound > std::chrono::hours(2)) break;
    char le[32];
    std::snprintf(le, sizeof(le), "%.9g", static_cast<double>(bound.count()) / 1e9);
    sample("transfer_latency_seconds_bucket", std::string("le=\"") + le + "\"",
           static_cast<double>(latency.countAtMost(bound)));
  }
  sample("transfer_latency_seconds_bucket", "le=\"+Inf\"", static_cast<double>(latency.count()));
  sample("transfer_latency_seconds_sum", "", static_cast<double>(latency.sum().count()) / 1e9);
  sample("transfer_latency_seconds_count", "", static_cast<double>(latency.count()));
  return out;
}

std::string MetricsSnapshot::toJson() const {
  nlohmann::json j;
  j["requests_started"] = requests_started;
  j["requests_ok"] = requests_ok;
  j["requests_failed"] = requests_failed;
  j["requests_cancelled"] = requests_cancelled;
  j["bytes"] = bytes;
  j["ops"] = ops;
  j["staged_parts"] = staged_parts;
  j["staging_copies"] = staging_copies;
  j["staging_bytes"] = staging_bytes;
  j["streamed_ranges"] = streamed_ranges;
  j["writes_posted"] = writes_posted;
  j["storm_parts"] = storm_parts;
  j["storm_copies"] = storm_copies;
  j["staging_windows"] = staging_windows;
  nlohmann::json f = nlohmann::json::object();
  for (size_t i = 0; i < kNumFailureCauses; ++i) {
    f[std::string(failureCauseName(static_cast<FailureCause>(i)))] = failures[i];
  }
  j["failures"] = f;
  j["leases_expired"] = leases_expired;
  j["quarantined_requests"] = quarantined_requests;
  j["handshakes_ok"] = handshakes_ok;
  j["handshakes_refused"] = handshakes_refused;
  j["peers_lost"] = peers_lost;
  j["reconnects"] = reconnects;
  j["stale_messages"] = stale_messages;
  j["writes_stalled"] = writes_stalled;
  j["connections_superseded"] = connections_superseded;
  j["requests_over_limit"] = requests_over_limit;
  j["auth_failures"] = auth_failures;
  j["unauthenticated_dropped"] = unauthenticated_dropped;
  j["connections_refused"] = connections_refused;
  j["peers_over_limit"] = peers_over_limit;
  j["ranks_without_token"] = ranks_without_token;
  j["accounting_errors"] = accounting_errors;
  auto us = [](std::chrono::nanoseconds ns) { return static_cast<double>(ns.count()) / 1000.0; };
  j["latency_us"] = {{"count", latency.count()},
                     {"p50", us(latency.quantile(0.5))},
                     {"p99", us(latency.quantile(0.99))},
                     {"max", us(latency.max())}};
  return j.dump();
}

void Metrics::requestStarted() {
  std::lock_guard lock(mu_);
  ++s_.requests_started;
}

void Metrics::requestOk(uint64_t bytes, std::chrono::nanoseconds latency) {
  std::lock_guard lock(mu_);
  ++s_.requests_ok;
  s_.bytes += bytes;
  s_.latency.record(latency);
}

void Metrics::requestFailed(FailureCause cause) {
  std::lock_guard lock(mu_);
  ++s_.requests_failed;
  if (cause == FailureCause::kCancelled) ++s_.requests_cancelled;
  ++s_.failures[static_cast<size_t>(cause)];
}

void Metrics::staged(uint64_t copies, uint64_t bytes) {
  std::lock_guard lock(mu_);
  ++s_.staged_parts;
  s_.staging_copies += copies;
  s_.staging_bytes += bytes;
}

void Metrics::opsPosted(uint64_t n) {
  std::lock_guard lock(mu_);
  s_.ops += n;
  ++s_.writes_posted;
}

void Metrics::stagingWindow() {
  std::lock_guard lock(mu_);
  ++s_.staging_windows;
}

void Metrics::stormStaged(uint64_t copies) {
  std::lock_guard lock(mu_);
  ++s_.storm_parts;
  s_.storm_copies += copies;
}

void Metrics::rangeStreamed() {
  std::lock_guard lock(mu_);
  ++s_.streamed_ranges;
}

void Metrics::leaseExpired() {
  std::lock_guard lock(mu_);
  ++s_.leases_expired;
}

void Metrics::quarantined() {
  std::lock_guard lock(mu_);
  ++s_.quarantined_requests;
}

void Metrics::handshake(bool ok) {
  std::lock_guard lock(mu_);
  ++(ok ? s_.handshakes_ok : s_.handshakes_refused);
}

void Metrics::peerLost() {
  std::lock_guard lock(mu_);
  ++s_.peers_lost;
}

void Metrics::reconnected() {
  std::lock_guard lock(mu_);
  ++s_.reconnects;
}

void Metrics::staleMessage() {
  std::lock_guard lock(mu_);
  ++s_.stale_messages;
}

void Metrics::writeStalled() {
  std::lock_guard lock(mu_);
  ++s_.writes_stalled;
}

void Metrics::connectionSuperseded() {
  std::lock_guard lock(mu_);
  ++s_.connections_superseded;
}

void Metrics::requestOverLimit() {
  std::lock_guard lock(mu_);
  ++s_.requests_over_limit;
}

MetricsSnapshot Metrics::snapshot() const {
  std::lock_guard lock(mu_);
  return s_;
}

MetricsSnapshot Metrics::snapshot(const transport::AgentStats& agent) const {
  MetricsSnapshot s = snapshot();
  s.auth_failures = agent.auth_failures;
  s.unauthenticated_dropped = agent.unauthenticated_dropped;
  s.connections_refused = agent.connections_refused;
  s.peers_over_limit = agent.peers_over_limit;
  s.ranks_without_token = agent.token_configured ? 0 : 1;
  return s;
}

}  // namespace hxfer::engine
