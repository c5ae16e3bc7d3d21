// Metrics of one engine rank: counters and a latency histogram, readable at any time through
// snapshot() (the CLI prints them; tests assert on them).
//
// Failures are counted by cause, one FailureCause per failed request part, decided where the
// failure is decided (a timeout on the generation side, a lost peer, a refused handshake...).
// The latency histogram has log-spaced buckets (4 per power of two, 1 us .. ~1 h), so a
// percentile is exact to within 19 % and recording is one increment.
//
// Thread-safety: every method may be called from any thread at once (one mutex).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transport/transport.h"

namespace hxfer::engine {

enum class FailureCause : uint8_t {
  kTimeout = 0,  // a deadline passed (generation request timeout, handshake)
  kPeerLost,     // the peer's connection broke
  kRefused,      // the peer refused: wrong token, incompatible layout, bad destination
  kTransport,    // a write failed for another reason
  kChecksum,     // end-to-end checksum mismatch
  kCancelled,    // cancelled by either side
  kExhausted,    // no pages for the request
  kOther,        // anything else (a bug or an unexpected peer answer)
};
inline constexpr size_t kNumFailureCauses = 8;
std::string_view failureCauseName(FailureCause c);  // "timeout", "peer_lost", ...
// The cause a status counts as when nothing more specific is known.
FailureCause causeOf(const Status& status);

class LatencyHistogram {
 public:
  static constexpr size_t kBuckets = 128;
  void record(std::chrono::nanoseconds latency);
  uint64_t count() const { return count_; }
  // The upper bound of the bucket holding the q-quantile (0 <= q <= 1); 0 when empty.
  std::chrono::nanoseconds quantile(double q) const;
  std::chrono::nanoseconds max() const { return max_; }
  std::chrono::nanoseconds sum() const { return sum_; }
  // Recorded latencies at or below `bound` (whole buckets: exact for the bounds upperBound()
  // gives, 1 us x 2^(b/4)).
  uint64_t countAtMost(std::chrono::nanoseconds bound) const;
  void merge(const LatencyHistogram& other);
  static std::chrono::nanoseconds upperBound(size_t bucket);

 private:
  static size_t bucketOf(std::chrono::nanoseconds latency);

  std::array<uint64_t, kBuckets> buckets_{};
  uint64_t count_ = 0;
  std::chrono::nanoseconds max_{0};
  std::chrono::nanoseconds sum_{0};
};

struct MetricsSnapshot {
  // Requests (generation: started by the serving code; context: request parts served).
  uint64_t requests_started = 0;
  uint64_t requests_ok = 0;
  uint64_t requests_failed = 0;  // includes cancelled
  uint64_t requests_cancelled = 0;
  uint64_t bytes = 0;  // bytes moved by successful request parts
  uint64_t ops = 0;    // copy ops posted
  // Context: request parts staged (element order differs between the sides), their local
  // staging copies and staging bytes (RankPlan::pack_ops, scratch_bytes).
  uint64_t staged_parts = 0, staging_copies = 0, staging_bytes = 0;
  // Context: markReady calls that left layers to come (streaming), and writes posted (one per
  // request part sent whole, one per range of layers ready when a part streams).
  uint64_t streamed_ranges = 0, writes_posted = 0;
  // Storm control (plan/staging.h): request parts sent as one staged write, and the local
  // copies that took (context: ops gathered; generation: runs scattered).
  uint64_t storm_parts = 0, storm_copies = 0;
  // Device pools behind a host agent, parts larger than the generation rank's staging region:
  // the windows they moved in (generation: landed and queued for their copy into the pools;
  // context: posted). Many say staging_bytes is small for the requests.
  uint64_t staging_windows = 0;
  std::array<uint64_t, kNumFailureCauses> failures{};  // by FailureCause
  uint64_t leases_expired = 0;        // context: source pages freed because nobody asked in time
  uint64_t quarantined_requests = 0;  // requests freed while writes were in flight (lifetime)
  uint64_t handshakes_ok = 0;
  uint64_t handshakes_refused = 0;
  uint64_t peers_lost = 0;
  uint64_t reconnects = 0;
  // Messages about an earlier use of a request id (another epoch), ignored.
  uint64_t stale_messages = 0;
  // Context: posted writes that made no progress within stall_timeout and were cancelled.
  uint64_t writes_stalled = 0;
  // Context: connections dropped because a newer one claimed the same generation rank (a
  // restart, or a reconnect before the old connection's loss was seen).
  uint64_t connections_superseded = 0;
  // Context: TransferRequests refused because their rank had too many waiting (the per-peer
  // bounds of ContextSender::Options).
  uint64_t requests_over_limit = 0;
  // From the transport (transport::AgentStats): what it refused before the engine saw a peer.
  uint64_t auth_failures = 0;            // handshakes refused: bad token proof, uid, timeout
  uint64_t unauthenticated_dropped = 0;  // frames from connections that had not authenticated
  uint64_t connections_refused = 0;      // over the cap of connections authenticating, or no fd
  uint64_t peers_over_limit = 0;         // peers dropped for exceeding a per-peer bound
  uint64_t ranks_without_token = 0;      // ranks whose transport has no auth token configured
  uint64_t accounting_errors = 0;        // ranks whose selfCheck() failed when this was taken
  LatencyHistogram latency;              // request start (or ask) to completion, successful ones

  uint64_t failuresBy(FailureCause c) const { return failures[static_cast<size_t>(c)]; }
  // Adds another rank's snapshot (for instance-wide summaries).
  void merge(const MetricsSnapshot& other);
  // One JSON object (counters, failures by name, p50/p99/max latency in microseconds).
  std::string toJson() const;
  // Prometheus' text format (0.0.4), named as vLLM names its connector metrics (vllm:nixl_*):
  // hxfer:requests_total{outcome}, hxfer:failures_total{cause}, hxfer:bytes_total,
  // hxfer:transfer_latency_seconds (a histogram, buckets 1 us x 2^k), ...; every sample also
  // carries `labels` (e.g. role="context",instance="ctx",rank="0"; may be empty).
  std::string toPrometheus(std::string_view labels) const;
};

// One label of Prometheus' text format, `name="value"`, with the value's backslashes, double
// quotes and newlines escaped as the format requires (an instance name may hold any of them).
std::string prometheusLabel(std::string_view name, std::string_view value);

class Metrics {
 public:
  void requestStarted();
  void requestOk(uint64_t bytes, std::chrono::nanoseconds latency);
  void requestFailed(FailureCause cause);
  void opsPosted(uint64_t n);  // one write of n ops
  void rangeStreamed();
  void stormStaged(uint64_t copies);
  void stagingWindow();
  void staged(uint64_t copies, uint64_t bytes);
  void leaseExpired();
  void quarantined();
  void handshake(bool ok);
  void peerLost();
  void reconnected();
  void staleMessage();
  void writeStalled();
  void connectionSuperseded();
  void requestOverLimit();
  MetricsSnapshot snapshot() const;
  // snapshot() with the transport's counters filled in.
  MetricsSnapshot snapshot(const transport::AgentStats& agent) const;

 private:
  mutable std::mutex mu_;
  MetricsSnapshot s_;  // guarded by mu_
};

}  // namespace hxfer::engine
