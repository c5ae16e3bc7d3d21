#include "engine/cluster.h"

#include <algorithm>

#include <thread>

#include "engine/handshake.h"

namespace hxfer::engine {

StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::create(ClusterOptions o) {
  std::unique_ptr<LocalCluster> c(new LocalCluster(std::move(o)));
  const ClusterOptions& opt = c->options_;
  const auto backing = opt.backend == "shm" ? Region::Backing::kMemfd : Region::Backing::kAnonymous;
  auto makeAgent = [&](const std::string& label, const std::string& token) {
    transport::AgentConfig ac;
    ac.backend = opt.backend;
    ac.label = label;
    ac.auth_token = token;
    ac.ucx_options = opt.ucx_options;
    return transport::createAgent(ac);
  };
  ModelSpec ctx_model = opt.model, gen_model = opt.model;
  if (opt.ctx_tokens_per_block != 0) ctx_model.tokens_per_block = opt.ctx_tokens_per_block;
  if (opt.gen_tokens_per_block != 0) gen_model.tokens_per_block = opt.gen_tokens_per_block;
  std::vector<std::string> addresses;
  for (uint32_t p = 0; p < opt.ctx.pp; ++p) {
    for (uint32_t t = 0; t < opt.ctx.tp; ++t) {
      ASSIGN_OR_RETURN(auto cache,
                       HybridCacheManager::create(
                           ctx_model, opt.ctx, t, p,
                           opt.ctx_engine.value_or(EngineLayout{Engine::kHxfer, opt.ctx_layout}),
                           Capacity::counts(opt.blocks, opt.slots), backing));
      ASSIGN_OR_RETURN(auto agent, makeAgent("ctx", opt.ctx_token));
      ContextSender::Options so;
      so.instance_id = "ctx";
      so.model = ctx_model;
      so.parallel = opt.ctx;
      so.tp_rank = t;
      so.pp_rank = p;
      so.checksum = opt.checksum;
      so.lease_timeout = opt.lease_timeout;
      so.stream_min_tokens = opt.stream_min_tokens;
      ASSIGN_OR_RETURN(auto sender, ContextSender::create(so, cache.get(), std::move(agent)));
      addresses.push_back(sender->address());
      c->ctx_caches_.push_back(std::move(cache));
      c->senders_.push_back(std::move(sender));
    }
  }
  for (uint32_t p = 0; p < opt.gen.pp; ++p) {
    for (uint32_t t = 0; t < opt.gen.tp; ++t) {
      ASSIGN_OR_RETURN(auto cache,
                       HybridCacheManager::create(
                           gen_model, opt.gen, t, p,
                           opt.gen_engine.value_or(EngineLayout{Engine::kHxfer, opt.gen_layout}),
                           Capacity::counts(opt.blocks, opt.slots), backing));
      ASSIGN_OR_RETURN(auto agent, makeAgent("gen", opt.gen_token));
      GenerationReceiver::Options ro;
      ro.instance_id = "gen";
      ro.model = gen_model;
      ro.parallel = opt.gen;
      ro.tp_rank = t;
      ro.pp_rank = p;
      ro.checksum = opt.checksum;
      ro.staging_bytes = opt.gen_staging_bytes;
      ro.stage_on_cheap_ops = opt.gen_stage_on_cheap_ops;
      ro.ctx_parallel = opt.ctx;
      ro.ctx_addresses = addresses;
      ro.request_timeout = opt.request_timeout;
      ro.reconnect_interval = std::chrono::milliseconds(100);
      ASSIGN_OR_RETURN(auto receiver,
                       GenerationReceiver::create(ro, cache.get(), std::move(agent)));
      c->gen_caches_.push_back(std::move(cache));
      c->receivers_.push_back(std::move(receiver));
    }
  }
  return c;
}

LocalCluster::~LocalCluster() {
  // Receivers first: they stop asking; then senders finish and free.
  for (auto& r : receivers_) r->shutdown();
  for (auto& s : senders_) s->shutdown();
  receivers_.clear();
  senders_.clear();
}

Status LocalCluster::prepareContext(uint64_t request_id, uint32_t tokens, bool mark_ready) {
  for (size_t i = 0; i < ctx_caches_.size(); ++i) {
    HybridCacheManager& cache = *ctx_caches_[i];
    ASSIGN_OR_RETURN(Allocation a, cache.allocate(request_id, tokens));
    RETURN_IF_ERROR(fillRank(cache.layout(), cacheMemory(cache), idsOf(a), request_id));
    if (mark_ready) RETURN_IF_ERROR(senders_[i]->markReady(request_id));
  }
  return OkStatus();
}

Status LocalCluster::markReady(uint64_t request_id) {
  for (auto& s : senders_) RETURN_IF_ERROR(s->markReady(request_id));
  return OkStatus();
}

Status LocalCluster::markLayersReady(uint64_t request_id, LayerRange layers) {
  for (size_t i = 0; i < senders_.size(); ++i) {
    const LayerRange stage = ctx_caches_[i]->layout().stageLayers();
    const uint32_t lo = std::max(stage.first, layers.first),
                   hi = std::min(stage.end(), layers.end());
    if (lo >= hi) continue;
    RETURN_IF_ERROR(senders_[i]->markReady(request_id, LayerRange{lo, hi - lo}));
  }
  return OkStatus();
}

Status LocalCluster::startGeneration(uint64_t request_id, uint32_t tokens, uint32_t prefix_tokens) {
  for (auto& r : receivers_) {
    RETURN_IF_ERROR(r->startRequest(request_id, tokens, prefix_tokens).status());
  }
  return OkStatus();
}

Status LocalCluster::waitGeneration(uint64_t request_id, Clock::time_point deadline) {
  Status first;
  for (auto& r : receivers_) {
    ASSIGN_OR_RETURN(RequestResult res, r->wait(request_id, deadline));
    if (!res.terminal()) return Timeout("request " + std::to_string(request_id) + " still runs");
    if (!res.status.isOk() && first.isOk()) first = res.status;
  }
  return first;
}

StatusOr<OracleReport> LocalCluster::check(uint64_t request_id, uint32_t prefix_tokens) {
  OracleReport total;
  const bool by_token =
      ctx_caches_[0]->layout().tokens_per_block != gen_caches_[0]->layout().tokens_per_block;
  for (auto& cache : gen_caches_) {
    ASSIGN_OR_RETURN(Allocation a, cache->find(request_id));
    const uint32_t n = static_cast<uint32_t>(a.blocks.size());
    const uint32_t first = std::min(n, prefix_tokens / cache->layout().tokens_per_block);
    // By token ranges the last block holds the request's tokens only.
    ASSIGN_OR_RETURN(OracleReport r,
                     checkRank(cache->layout(), cacheMemory(*cache), idsOf(a), request_id,
                               BlockRange{first, n - first}, by_token ? a.num_tokens : UINT64_MAX));
    total.merge(r);
  }
  return total;
}

Status LocalCluster::release(uint64_t request_id) {
  for (auto& r : receivers_) RETURN_IF_ERROR(r->release(request_id));
  return OkStatus();
}

bool LocalCluster::allPagesFree(std::string* why) const {
  auto check = [&](const char* side, const auto& caches) {
    for (size_t i = 0; i < caches.size(); ++i) {
      const CacheCounters c = caches[i]->counters();
      if (c.used_blocks || c.used_slots || c.quarantined_blocks || c.quarantined_slots ||
          c.inflight_transfers || c.free_blocks != c.total_blocks ||
          c.free_slots != c.total_slots) {
        if (why) {
          *why = std::string(side) + " rank " + std::to_string(i) + ": used blocks " +
                 std::to_string(c.used_blocks) + " slots " + std::to_string(c.used_slots) +
                 ", quarantined blocks " + std::to_string(c.quarantined_blocks) + " slots " +
                 std::to_string(c.quarantined_slots) + ", in flight " +
                 std::to_string(c.inflight_transfers);
        }
        return false;
      }
    }
    return true;
  };
  return check("ctx", ctx_caches_) && check("gen", gen_caches_);
}

bool LocalCluster::waitAllPagesFree(Clock::time_point deadline, std::string* why) const {
  while (!allPagesFree(why)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

MetricsSnapshot LocalCluster::ctxMetrics() const {
  MetricsSnapshot m;
  for (const auto& s : senders_) m.merge(s->metrics());
  return m;
}

MetricsSnapshot LocalCluster::genMetrics() const {
  MetricsSnapshot m;
  for (const auto& r : receivers_) m.merge(r->metrics());
  return m;
}

}  // namespace hxfer::engine
