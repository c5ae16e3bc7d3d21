// LocalCluster: a context instance and a generation instance inside one process, each rank with
// its own cache manager and transport agent, for engine tests and single-process tools.
// Helpers run the oracle end to end: fill the context pages, mark them ready, start the
// generation requests, and check every received byte.
//
// Not thread-safe: one thread drives a cluster (the engine objects inside have their own
// threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "common/status.h"
#include "engine/context_sender.h"
#include "engine/generation_receiver.h"
#include "plan/oracle.h"

namespace hxfer::engine {

struct ClusterOptions {
  ModelSpec model;
  ParallelConfig ctx, gen;
  StateLayout ctx_layout = StateLayout::kPaged;
  StateLayout gen_layout = StateLayout::kPaged;
  // When set, the side's pools are laid out as that engine keeps them (ctx_layout / gen_layout
  // then unused).
  std::optional<EngineLayout> ctx_engine, gen_engine;
  // Tokens per kv block of each side; 0: the model's. When they differ, kv moves by token
  // ranges.
  uint32_t ctx_tokens_per_block = 0, gen_tokens_per_block = 0;
  std::string backend = "inproc";
  uint32_t blocks = 64;  // per rank
  uint32_t slots = 8;    // per rank
  std::string ctx_token, gen_token;
  bool checksum = false;
  std::chrono::milliseconds lease_timeout{30000};
  std::chrono::milliseconds request_timeout{30000};
  uint64_t stream_min_tokens = 512;          // ContextSender::Options
  uint64_t gen_staging_bytes = 16ull << 20;  // GenerationReceiver::Options::staging_bytes
  bool gen_stage_on_cheap_ops = false;       // GenerationReceiver::Options::stage_on_cheap_ops
  // Applied to every agent (tests use it for UCX's TLS choice).
  std::vector<std::pair<std::string, std::string>> ucx_options;
};

class LocalCluster {
 public:
  static StatusOr<std::unique_ptr<LocalCluster>> create(ClusterOptions options);
  ~LocalCluster();

  // Context side of a request on every context rank: allocate, fill with the oracle, and mark
  // ready (unless !mark_ready).
  Status prepareContext(uint64_t request_id, uint32_t tokens, bool mark_ready = true);
  Status markReady(uint64_t request_id);
  // Streaming: marks the global layers `layers` ready on every context rank holding some of
  // them (each rank gets its share of the range).
  Status markLayersReady(uint64_t request_id, LayerRange layers);
  // Starts the request on every generation rank.
  Status startGeneration(uint64_t request_id, uint32_t tokens, uint32_t prefix_tokens = 0);
  // Waits on every generation rank; the first non-ok terminal status, Timeout at the deadline.
  Status waitGeneration(uint64_t request_id, Clock::time_point deadline);
  // Oracle check of every generation rank's pages of a completed request.
  StatusOr<OracleReport> check(uint64_t request_id, uint32_t prefix_tokens = 0);
  // Releases the request on every generation rank.
  Status release(uint64_t request_id);

  // True when every cache manager's counters show no used or quarantined page and nothing in
  // flight. `why` says which rank is not.
  bool allPagesFree(std::string* why) const;
  // Waits (polling) until allPagesFree or the deadline.
  bool waitAllPagesFree(Clock::time_point deadline, std::string* why) const;

  std::vector<std::unique_ptr<HybridCacheManager>>& ctxCaches() { return ctx_caches_; }
  std::vector<std::unique_ptr<HybridCacheManager>>& genCaches() { return gen_caches_; }
  std::vector<std::unique_ptr<ContextSender>>& senders() { return senders_; }
  std::vector<std::unique_ptr<GenerationReceiver>>& receivers() { return receivers_; }
  const ClusterOptions& options() const { return options_; }
  MetricsSnapshot ctxMetrics() const;
  MetricsSnapshot genMetrics() const;

 private:
  explicit LocalCluster(ClusterOptions options) : options_(std::move(options)) {}

  ClusterOptions options_;
  std::vector<std::unique_ptr<HybridCacheManager>> ctx_caches_, gen_caches_;
  std::vector<std::unique_ptr<ContextSender>> senders_;
  std::vector<std::unique_ptr<GenerationReceiver>> receivers_;
};

}  // namespace hxfer::engine
