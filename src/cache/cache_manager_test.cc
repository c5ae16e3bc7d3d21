#include "cache/cache_manager.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <numeric>
#include <random>
#include <thread>

#include "cache/engine_layout.h"
#include "model/presets.h"

namespace hxfer {
namespace {

ModelSpec tinyHybrid() { return *loadPreset(kDefaultPreset); }

std::unique_ptr<HybridCacheManager> make(Capacity cap, StateLayout sl = StateLayout::kPaged,
                                         Region::Backing backing = Region::Backing::kAnonymous) {
  auto m = HybridCacheManager::create(tinyHybrid(), {1, 1, {}}, 0, 0, sl, cap, backing);
  EXPECT_TRUE(m.isOk()) << m.status().toString();
  return m.isOk() ? std::move(*m) : nullptr;
}

void expectBalanced(const CacheCounters& c) {
  EXPECT_EQ(c.free_blocks + c.used_blocks + c.quarantined_blocks, c.total_blocks);
  EXPECT_EQ(c.free_slots + c.used_slots + c.quarantined_slots, c.total_slots);
}

void expectAllFree(const CacheCounters& c) {
  expectBalanced(c);
  EXPECT_EQ(c.free_blocks, c.total_blocks);
  EXPECT_EQ(c.free_slots, c.total_slots);
  EXPECT_EQ(c.live_requests, 0u);
  EXPECT_EQ(c.quarantined_requests, 0u);
  EXPECT_EQ(c.inflight_requests, 0u);
  EXPECT_EQ(c.inflight_transfers, 0u);
  EXPECT_EQ(c.free_block_runs, c.total_blocks ? 1u : 0u);
}

TEST(CacheManager, CreateMapsOneWritableRegionPerPool) {
  for (auto backing : {Region::Backing::kAnonymous, Region::Backing::kMemfd}) {
    auto m = make(Capacity::counts(10, 4), StateLayout::kPaged, backing);
    ASSERT_NE(m, nullptr);
    const RankLayout& l = m->layout();
    ASSERT_EQ(m->regions().size(), l.regions.size());
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (size_t i = 0; i < l.regions.size(); ++i) {
      const Region& r = *m->regions()[i];
      EXPECT_EQ(r.id(), l.regions[i].id);
      EXPECT_EQ(r.length(), l.regions[i].length);
      EXPECT_EQ(m->regionBase(r.id()), r.data());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.data()) % page, 0u);
      EXPECT_EQ(r.fd() >= 0, backing == Region::Backing::kMemfd);
      std::memset(r.data(), 0xab, r.length());
    }
    EXPECT_EQ(m->regionBase(99), nullptr);
    EXPECT_EQ(m->region(99), nullptr);
    EXPECT_EQ(l.num_blocks, 10u);
    EXPECT_EQ(l.num_slots, 4u);
  }
}

TEST(CacheManager, AllocateTakesCeilTokensOverBlockSizeBlocksAndOneSlot) {
  auto m = make(Capacity::counts(16, 4));
  const uint32_t t = m->layout().tokens_per_block;
  EXPECT_EQ(m->blocksFor(0), 0u);
  EXPECT_EQ(m->blocksFor(1), 1u);
  EXPECT_EQ(m->blocksFor(t), 1u);
  EXPECT_EQ(m->blocksFor(t + 1), 2u);
  auto a = m->allocate(7, 3 * t + 1);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(a->request_id, 7u);
  EXPECT_EQ(a->blocks, (std::vector<uint32_t>{0, 1, 2, 3}));  // fresh pool: one low run
  ASSERT_TRUE(a->slot.has_value());
  EXPECT_EQ(*a->slot, 0u);
  EXPECT_EQ(*m->find(7), *a);
  CacheCounters c = m->counters();
  EXPECT_EQ(c.used_blocks, 4u);
  EXPECT_EQ(c.used_slots, 1u);
  EXPECT_EQ(c.live_requests, 1u);
  ASSERT_TRUE(m->free(7).isOk());
  expectAllFree(m->counters());
}

TEST(CacheManager, FreedHoleIsReusedAsOneContiguousRunWhenItFits) {
  auto m = make(Capacity::counts(12, 4));
  const uint32_t t = m->layout().tokens_per_block;
  ASSERT_TRUE(m->allocate(1, 2 * t).isOk());  // 0,1
  ASSERT_TRUE(m->allocate(2, 3 * t).isOk());  // 2,3,4
  ASSERT_TRUE(m->allocate(3, 1 * t).isOk());  // 5
  ASSERT_TRUE(m->free(2).isOk());
  ASSERT_TRUE(m->free(1).isOk());  // free runs: 0..4, 6..11
  EXPECT_EQ(m->allocate(4, 5 * t)->blocks, (std::vector<uint32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(m->allocate(5, 2 * t)->blocks, (std::vector<uint32_t>{6, 7}));
}

TEST(CacheManager, BudgetReservesTheSlotsThenGivesTheRestToBlocks) {
  auto probe = make(Capacity::counts(1, 1));
  const uint64_t per_block = probe->layout().kvBytesPerBlock();
  const uint64_t per_slot = probe->layout().stateBytesPerSlot();
  ASSERT_GT(per_block, 0u);
  ASSERT_GT(per_slot, 0u);
  auto m = make(Capacity::budget(3 * per_slot + 10 * per_block + per_block / 2, 3));
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->layout().num_slots, 3u);
  EXPECT_EQ(m->layout().num_blocks, 10u);

  auto small = HybridCacheManager::create(tinyHybrid(), {1, 1, {}}, 0, 0, StateLayout::kPaged,
                                          Capacity::budget(3 * per_slot, 3));
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(small.status().message().find("less than one kv block"), std::string::npos);
  auto tiny = HybridCacheManager::create(tinyHybrid(), {1, 1, {}}, 0, 0, StateLayout::kPaged,
                                         Capacity::budget(2 * per_slot, 3));
  EXPECT_EQ(tiny.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(tiny.status().message().find("cannot hold slots=3"), std::string::npos);
  auto no_slots = HybridCacheManager::create(tinyHybrid(), {1, 1, {}}, 0, 0, StateLayout::kPaged,
                                             Capacity::budget(1 << 30, 0));
  EXPECT_EQ(no_slots.status().code(), StatusCode::kInvalidArgument);
}

TEST(CacheManager, RankWithoutRecurrentLayersAllocatesNoSlot) {
  ModelSpec model = tinyHybrid();
  LayerSpec attn;
  attn.attention = AttentionShape{4, 8};
  model.layers = {attn, attn};
  auto m = HybridCacheManager::create(model, {1, 1, {}}, 0, 0, StateLayout::kPaged,
                                      Capacity::counts(4, 4));
  ASSERT_TRUE(m.isOk()) << m.status().toString();
  EXPECT_FALSE((*m)->hasState());
  auto a = (*m)->allocate(1, 40);
  ASSERT_TRUE(a.isOk());
  EXPECT_FALSE(a->slot.has_value());
  EXPECT_EQ((*m)->counters().total_slots, 0u);
}

TEST(CacheManager, PipelineStageWithoutAttentionAllocatesOnlyASlot) {
  ModelSpec model = tinyHybrid();
  LayerSpec mamba = model.layers[0];
  LayerSpec attn;
  attn.attention = AttentionShape{4, 8};
  model.layers = {mamba, mamba, attn, attn};
  auto m = HybridCacheManager::create(model, {1, 2, {}}, 0, 0, StateLayout::kLayerMajor,
                                      Capacity::counts(4, 2));
  ASSERT_TRUE(m.isOk()) << m.status().toString();
  EXPECT_FALSE((*m)->hasKv());
  auto a = (*m)->allocate(1, 1000);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_TRUE(a->blocks.empty());
  EXPECT_EQ(a->slot, std::optional<uint32_t>(0));
}

TEST(CacheManager, ExhaustionIsResourceExhaustedNamingThePoolAndTakesNothing) {
  auto m = make(Capacity::counts(4, 2));
  const uint32_t t = m->layout().tokens_per_block;
  ASSERT_TRUE(m->allocate(1, 3 * t).isOk());
  auto no_blocks = m->allocate(2, 2 * t);
  EXPECT_EQ(no_blocks.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(no_blocks.status().message().find("kv blocks exhausted"), std::string::npos);
  EXPECT_NE(no_blocks.status().message().find("needs 2 blocks"), std::string::npos);
  EXPECT_NE(no_blocks.status().message().find("1 of 4 free"), std::string::npos);
  ASSERT_TRUE(m->allocate(3, 1).isOk());
  auto no_slot = m->allocate(4, 0);
  EXPECT_EQ(no_slot.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(no_slot.status().message().find("state slots exhausted"), std::string::npos);
  CacheCounters c = m->counters();
  EXPECT_EQ(c.used_blocks, 4u);
  EXPECT_EQ(c.used_slots, 2u);
  EXPECT_EQ(c.exhausted, 2u);
  EXPECT_EQ(m->find(2).status().code(), StatusCode::kNotFound);
}

TEST(CacheManager, MisuseIsAnErrorNotUndefinedBehaviour) {
  auto m = make(Capacity::counts(8, 4));
  EXPECT_EQ(m->free(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->beginTransfer(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->endTransfer(1).code(), StatusCode::kNotFound);
  ASSERT_TRUE(m->allocate(1, 10).isOk());
  EXPECT_EQ(m->allocate(1, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->endTransfer(1).code(), StatusCode::kInvalidArgument);  // no begin
  ASSERT_TRUE(m->free(1).isOk());
  EXPECT_EQ(m->free(1).code(), StatusCode::kNotFound);  // double free
  // Double free of a quarantined request, and no new transfer on it.
  ASSERT_TRUE(m->allocate(2, 10).isOk());
  ASSERT_TRUE(m->beginTransfer(2).isOk());
  ASSERT_TRUE(m->free(2).isOk());
  EXPECT_EQ(m->free(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->beginTransfer(2).code(), StatusCode::kCancelled);
  EXPECT_EQ(m->allocate(2, 10).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(m->endTransfer(2).isOk());
  EXPECT_EQ(m->endTransfer(2).code(), StatusCode::kNotFound);
  expectAllFree(m->counters());
}

TEST(CacheManager, FreeInFlightQuarantinesUntilTheLastTransferEnds) {
  auto m = make(Capacity::counts(4, 2));
  const uint32_t t = m->layout().tokens_per_block;
  auto a = m->allocate(1, 2 * t);
  ASSERT_TRUE(a.isOk());
  ASSERT_TRUE(m->beginTransfer(1).isOk());
  ASSERT_TRUE(m->beginTransfer(1).isOk());
  ASSERT_TRUE(m->free(1).isOk());
  CacheCounters c = m->counters();
  EXPECT_EQ(c.quarantined_blocks, 2u);
  EXPECT_EQ(c.quarantined_slots, 1u);
  EXPECT_EQ(c.used_blocks, 0u);
  EXPECT_EQ(c.quarantined_requests, 1u);
  EXPECT_EQ(c.inflight_transfers, 2u);
  expectBalanced(c);
  // The quarantined pages are not handed out: only 2 blocks and 1 slot remain.
  EXPECT_EQ(m->allocate(2, 3 * t).status().code(), StatusCode::kResourceExhausted);
  auto b = m->allocate(3, 2 * t);
  ASSERT_TRUE(b.isOk());
  for (uint32_t id : b->blocks) {
    EXPECT_EQ(std::count(a->blocks.begin(), a->blocks.end(), id), 0);
  }
  EXPECT_NE(b->slot, a->slot);
  ASSERT_TRUE(m->endTransfer(1).isOk());
  EXPECT_EQ(m->counters().quarantined_blocks, 2u);
  ASSERT_TRUE(m->endTransfer(1).isOk());
  c = m->counters();
  EXPECT_EQ(c.quarantined_blocks, 0u);
  EXPECT_EQ(c.quarantine_releases, 1u);
  EXPECT_EQ(c.free_blocks, 2u);
  EXPECT_EQ(m->find(1).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(m->free(3).isOk());
  expectAllFree(m->counters());
}

TEST(CacheManager, LeaseEndsItsTransferExactlyOnce) {
  auto m = make(Capacity::counts(4, 2));
  ASSERT_TRUE(m->allocate(1, 1).isOk());
  {
    auto lease = m->leaseTransfer(1);
    ASSERT_TRUE(lease.isOk());
    EXPECT_TRUE(lease->held());
    TransferLease moved = std::move(*lease);
    EXPECT_FALSE(lease->held());
    EXPECT_EQ(moved.requestId(), 1u);
    ASSERT_TRUE(m->free(1).isOk());
    EXPECT_EQ(m->counters().quarantined_slots, 1u);
  }
  expectAllFree(m->counters());

  ASSERT_TRUE(m->allocate(2, 1).isOk());
  auto lease = m->leaseTransfer(2);
  ASSERT_TRUE(lease.isOk());
  EXPECT_TRUE(lease->release().isOk());
  EXPECT_TRUE(lease->release().isOk());  // no-op once released
  EXPECT_EQ(m->counters().inflight_transfers, 0u);
  EXPECT_EQ(m->leaseTransfer(99).status().code(), StatusCode::kNotFound);
}

TEST(CacheManager, RecordsOfEveryViewAreDisjointInRealMemory) {
  for (StateLayout sl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    auto m = make(Capacity::counts(3, 2), sl);
    const RankLayout& l = m->layout();
    // Fill every record with its own tag, then read every record back.
    auto tag = [](size_t v, uint32_t i, uint32_t layer) {
      return static_cast<uint8_t>(1 + (v * 31 + i * 7 + layer * 3) % 251);
    };
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t v = 0; v < l.views.size(); ++v) {
        for (uint32_t i = 0; i < l.views[v].num_indices; ++i) {
          for (uint32_t layer = 0; layer < l.views[v].layers.size(); ++layer) {
            auto rec = m->record(v, i, layer);
            ASSERT_TRUE(rec.isOk()) << rec.status().toString();
            ASSERT_EQ(rec->data(),
                      m->regionBase(l.views[v].region_id) + l.views[v].offset(i, layer));
            if (pass == 0) {
              std::memset(rec->data(), tag(v, i, layer), rec->size());
            } else {
              for (uint8_t byte : *rec) ASSERT_EQ(byte, tag(v, i, layer));
            }
          }
        }
      }
    }
    EXPECT_EQ(m->record(l.views.size(), 0, 0).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(m->record(0, l.views[0].num_indices, 0).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(m->record(0, 0, static_cast<uint32_t>(l.views[0].layers.size())).status().code(),
              StatusCode::kInvalidArgument);
  }
}

// A reference model of the manager, and random sequences checked against it step by step.
struct ModelRequest {
  Allocation alloc;
  uint32_t inflight = 0;
  bool freed = false;
};

void runRandomSequence(uint32_t seed, int steps) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr uint32_t kBlocks = 40, kSlots = 6;
  auto m = make(Capacity::counts(kBlocks, kSlots));
  ASSERT_NE(m, nullptr);
  const uint32_t t = m->layout().tokens_per_block;
  std::mt19937_64 rng(seed);
  std::map<uint64_t, ModelRequest> reqs;
  std::vector<int64_t> block_owner(kBlocks, -1), slot_owner(kSlots, -1);
  uint64_t next_id = 1;
  auto pick = [&]() -> uint64_t {
    auto it = reqs.begin();
    std::advance(it, static_cast<long>(rng() % reqs.size()));
    return it->first;
  };
  auto release = [&](uint64_t id) {
    for (uint32_t b : reqs[id].alloc.blocks) block_owner[b] = -1;
    if (reqs[id].alloc.slot) slot_owner[*reqs[id].alloc.slot] = -1;
    reqs.erase(id);
  };
  for (int step = 0; step < steps; ++step) {
    const uint32_t op = rng() % 100;
    if (op < 35 || reqs.empty()) {  // allocate
      const uint32_t tokens = static_cast<uint32_t>(rng() % (6 * t + 1));
      const uint32_t need = (tokens + t - 1) / t;
      const auto free_blocks = std::count(block_owner.begin(), block_owner.end(), -1);
      const auto free_slots = std::count(slot_owner.begin(), slot_owner.end(), -1);
      const uint64_t id = next_id++;
      auto a = m->allocate(id, tokens);
      if (need > free_blocks || free_slots == 0) {
        ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().toString();
        continue;
      }
      ASSERT_TRUE(a.isOk()) << a.status().toString();
      ASSERT_EQ(a->blocks.size(), need);
      ASSERT_TRUE(a->slot.has_value());
      for (uint32_t b : a->blocks) {
        ASSERT_LT(b, kBlocks);
        ASSERT_EQ(block_owner[b], -1) << "block " << b << " handed out while in use/in flight";
        block_owner[b] = static_cast<int64_t>(id);
      }
      ASSERT_EQ(slot_owner[*a->slot], -1) << "slot handed out while in use/in flight";
      slot_owner[*a->slot] = static_cast<int64_t>(id);
      reqs[id] = {*a, 0, false};
    } else if (op < 55) {  // free
      const uint64_t id = pick();
      ModelRequest& r = reqs[id];
      Status s = m->free(id);
      if (r.freed) {
        ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
      } else {
        ASSERT_TRUE(s.isOk()) << s.toString();
        r.freed = true;
        if (r.inflight == 0) release(id);
      }
    } else if (op < 75) {  // begin
      const uint64_t id = pick();
      Status s = m->beginTransfer(id);
      if (reqs[id].freed) {
        ASSERT_EQ(s.code(), StatusCode::kCancelled) << s.toString();
      } else {
        ASSERT_TRUE(s.isOk()) << s.toString();
        ++reqs[id].inflight;
      }
    } else if (op < 95) {  // end
      const uint64_t id = pick();
      ModelRequest& r = reqs[id];
      Status s = m->endTransfer(id);
      if (r.inflight == 0) {
        ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
      } else {
        ASSERT_TRUE(s.isOk()) << s.toString();
        if (--r.inflight == 0 && r.freed) release(id);
      }
    } else {  // an id the manager has never seen or already forgot
      const uint64_t id = next_id + 1000000;
      ASSERT_EQ(m->free(id).code(), StatusCode::kNotFound);
      ASSERT_EQ(m->endTransfer(id).code(), StatusCode::kNotFound);
    }
    // The counters match the reference model after every step, and the manager's own
    // recount agrees.
    {
      Status check = m->selfCheck();
      ASSERT_TRUE(check.isOk()) << "step " << step << ": " << check.toString();
    }
    CacheCounters c = m->counters();
    uint32_t used_b = 0, quar_b = 0, used_s = 0, quar_s = 0, live = 0, quar = 0, busy = 0;
    uint64_t transfers = 0;
    for (const auto& [id, r] : reqs) {
      const uint32_t nb = static_cast<uint32_t>(r.alloc.blocks.size());
      (r.freed ? quar_b : used_b) += nb;
      (r.freed ? quar_s : used_s) += 1;
      (r.freed ? quar : live) += 1;
      busy += r.inflight > 0;
      transfers += r.inflight;
    }
    ASSERT_EQ(c.used_blocks, used_b);
    ASSERT_EQ(c.quarantined_blocks, quar_b);
    ASSERT_EQ(c.used_slots, used_s);
    ASSERT_EQ(c.quarantined_slots, quar_s);
    ASSERT_EQ(c.free_blocks + c.used_blocks + c.quarantined_blocks, kBlocks);
    ASSERT_EQ(c.free_slots + c.used_slots + c.quarantined_slots, kSlots);
    ASSERT_EQ(c.live_requests, live);
    ASSERT_EQ(c.quarantined_requests, quar);
    ASSERT_EQ(c.inflight_requests, busy);
    ASSERT_EQ(c.inflight_transfers, transfers);
  }
  // Drain: end every transfer, free every live request.
  std::vector<std::pair<uint64_t, ModelRequest>> rest(reqs.begin(), reqs.end());
  for (auto& [id, r] : rest) {
    for (uint32_t i = 0; i < r.inflight; ++i) ASSERT_TRUE(m->endTransfer(id).isOk());
    if (!r.freed) {
      ASSERT_TRUE(m->free(id).isOk());
    }
  }
  CacheCounters c = m->counters();
  expectAllFree(c);
  EXPECT_EQ(c.allocations, c.frees);
  EXPECT_GT(c.quarantine_releases, 0u);  // the sequence did exercise the quarantine
  EXPECT_GT(c.exhausted, 0u);            // ... and exhaustion
}

TEST(CacheManager, RandomSequencesKeepAccountingAndNeverReuseBusyPages) {
  for (uint32_t seed : {1u, 42u, 20240601u}) runRandomSequence(seed, 5000);
}

// The serving thread allocates, starts transfers and frees (often while in flight); the
// transfer thread starts more transfers on those requests and ends them all.
TEST(CacheManager, ServingAndTransferThreadsTogetherLeaveThePoolsWhole) {
  auto m = make(Capacity::counts(64, 8));
  ASSERT_NE(m, nullptr);
  const uint32_t t = m->layout().tokens_per_block;
  std::mutex q_mu;
  std::condition_variable q_cv;
  std::deque<uint64_t> queue;  // requests with one transfer begun, to be ended
  bool done = false;
  std::atomic<int> balance_errors{0}, unexpected{0};
  auto checkBalance = [&] {
    CacheCounters c = m->counters();
    if (c.free_blocks + c.used_blocks + c.quarantined_blocks != c.total_blocks ||
        c.free_slots + c.used_slots + c.quarantined_slots != c.total_slots) {
      ++balance_errors;
    }
  };

  std::thread transfer([&] {
    std::mt19937 rng(7);
    for (;;) {
      uint64_t id;
      {
        std::unique_lock<std::mutex> lock(q_mu);
        q_cv.wait(lock, [&] { return done || !queue.empty(); });
        if (queue.empty()) return;
        id = queue.front();
        queue.pop_front();
      }
      // A second transfer on the same request: refused once the request is freed.
      Status again = m->beginTransfer(id);
      if (!again.isOk() && again.code() != StatusCode::kCancelled) ++unexpected;
      if (again.isOk() && !m->endTransfer(id).isOk()) ++unexpected;
      if (!m->endTransfer(id).isOk()) ++unexpected;
      if (rng() % 4 == 0) checkBalance();
    }
  });

  std::mt19937 rng(11);
  std::vector<uint64_t> live;
  for (uint64_t id = 1; id <= 4000; ++id) {
    auto a = m->allocate(id, static_cast<uint32_t>(rng() % (4 * t)));
    if (a.isOk()) {
      live.push_back(id);
      if (rng() % 2) {
        ASSERT_TRUE(m->beginTransfer(id).isOk());
        {
          std::lock_guard<std::mutex> lock(q_mu);
          queue.push_back(id);
        }
        q_cv.notify_one();
      }
    } else {
      ASSERT_EQ(a.status().code(), StatusCode::kResourceExhausted);
    }
    if (!live.empty() && rng() % 3 != 0) {
      const size_t i = rng() % live.size();
      ASSERT_TRUE(m->free(live[i]).isOk());
      live[i] = live.back();
      live.pop_back();
    }
    if (id % 16 == 0) checkBalance();
  }
  for (uint64_t id : live) ASSERT_TRUE(m->free(id).isOk());
  {
    std::lock_guard<std::mutex> lock(q_mu);
    done = true;
  }
  q_cv.notify_all();
  transfer.join();
  EXPECT_EQ(balance_errors.load(), 0);
  EXPECT_EQ(unexpected.load(), 0);
  CacheCounters c = m->counters();
  expectAllFree(c);
  EXPECT_EQ(c.allocations, c.frees);
}

}  // namespace
}  // namespace hxfer

namespace hxfer {
namespace {

// Pools an engine allocated itself (8 blocks, 2 slots of tiny-hybrid, paged), and a manager
// over them that only fences the pages the engine names.
struct EngineMemory {
  std::vector<std::vector<uint8_t>> pools;
  std::unique_ptr<HybridCacheManager> cache;
};

EngineMemory wrapEngineMemory() {
  EngineMemory e;
  auto layout = buildRankLayout(tinyHybrid(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 8, 2);
  EXPECT_TRUE(layout.isOk()) << layout.status().toString();
  if (!layout.isOk()) return e;
  std::vector<std::unique_ptr<Region>> regions;
  for (const RegionSpec& spec : layout->regions) {
    e.pools.emplace_back(spec.length);
    regions.push_back(*Region::borrow(spec.id, e.pools.back().data(), spec.length));
  }
  auto m = HybridCacheManager::wrap(*layout, std::move(regions));
  EXPECT_TRUE(m.isOk()) << m.status().toString();
  if (m.isOk()) e.cache = std::move(*m);
  return e;
}

// Engine-driven allocation: the engine owns the memory and names the pages; the manager
// fences them and says when they are released.
TEST(CacheManagerEngine, AdoptFencesTheEnginesPagesAndReportsTheirRelease) {
  EngineMemory e = wrapEngineMemory();
  ASSERT_NE(e.cache, nullptr);
  HybridCacheManager* m = e.cache.get();
  std::vector<uint64_t> released;
  m->setReleaseListener([&](uint64_t id, uint64_t owner) {
    released.push_back(id);
    EXPECT_EQ(owner, id == 4 ? 0u : 7u);  // allocate()'s request has no owner
  });
  EXPECT_EQ(m->regionBase(0), e.pools[0].data());

  const std::vector<uint32_t> blocks = {6, 1};
  auto a = m->adopt(1, 64, blocks, 1, 7);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  EXPECT_EQ(a->blocks, blocks);  // the engine's order (token order), not sorted
  EXPECT_EQ(a->slot, 1u);
  // Too few blocks, a page held, a missing slot: refused, nothing taken.
  EXPECT_NE(m->adopt(2, 100, std::vector<uint32_t>{0, 2}, 0)
                .status()
                .message()
                .find("100 tokens need 4 blocks"),
            std::string::npos);
  Status s = m->adopt(2, 32, std::vector<uint32_t>{1}, 0).status();
  EXPECT_NE(s.message().find("block 1 is still held by request 1"), std::string::npos)
      << s.toString();
  s = m->adopt(2, 32, std::vector<uint32_t>{0}, std::nullopt).status();
  EXPECT_NE(s.message().find("no slot given"), std::string::npos) << s.toString();
  s = m->adopt(2, 32, std::vector<uint32_t>{0}, 1).status();
  EXPECT_NE(s.message().find("slot 1 is still held by request 1"), std::string::npos);
  EXPECT_EQ(m->counters().used_blocks, 2u);

  // Freed while a transfer runs: fenced (quarantined) and named so; released at its end.
  ASSERT_TRUE(m->beginTransfer(1).isOk());
  ASSERT_TRUE(m->free(1).isOk());
  EXPECT_TRUE(released.empty());
  s = m->adopt(3, 32, std::vector<uint32_t>{6}, 0).status();
  EXPECT_NE(s.message().find("block 6 is still held by request 1 (freed, fenced"),
            std::string::npos)
      << s.toString();
  ASSERT_TRUE(m->endTransfer(1).isOk());
  EXPECT_EQ(released, std::vector<uint64_t>{1});
  ASSERT_TRUE(m->adopt(3, 32, std::vector<uint32_t>{6}, 1, 7).isOk());
  // Engine-chosen and manager-chosen pages share one space.
  auto own = m->allocate(4, 200);
  ASSERT_TRUE(own.isOk());
  EXPECT_EQ(std::count(own->blocks.begin(), own->blocks.end(), 6u), 0);
  ASSERT_TRUE(m->free(3).isOk());
  ASSERT_TRUE(m->free(4).isOk());
  EXPECT_EQ(released, (std::vector<uint64_t>{1, 3, 4}));
  ASSERT_TRUE(m->selfCheck().isOk());
  expectAllFree(m->counters());
}

// vLLM's shared tensors: blocks and states are pages of one pool, a request holds one state
// per group, and no page is a block of one request and a state of another (or of the same).
TEST(CacheManagerEngine, OneIdPoolHandsOutBlocksAndAStatePerGroupNeverTwice) {
  const ModelSpec model = *loadPreset("nemotron-h-8b");
  auto shared = parseEngineLayout("vllm", "", "", "", "on");
  ModelSpec big_pages = model;
  big_pages.tokens_per_block = 1056;  // vLLM's block size for the Mamba page
  auto made = HybridCacheManager::create(big_pages, {1, 1, {}}, 0, 0, *shared,
                                         Capacity::counts(8, 2), Region::Backing::kAnonymous);
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  HybridCacheManager& m = **made;
  const uint32_t groups = m.layout().state_groups;
  ASSERT_EQ(groups, 6u);
  EXPECT_EQ(m.counters().total_blocks, 8 + 2 * groups);  // the states of 2 requests on top
  EXPECT_EQ(m.counters().total_slots, 0u);
  auto a = m.allocate(1, 3000);  // 3 blocks and 6 states
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  ASSERT_EQ(a->group_slots.size(), groups - 1);
  std::vector<uint32_t> pages = a->blocks;
  for (uint32_t id : a->stateIds()) pages.push_back(id);
  std::sort(pages.begin(), pages.end());
  EXPECT_EQ(std::adjacent_find(pages.begin(), pages.end()), pages.end());
  EXPECT_EQ(m.counters().used_blocks, 3 + groups);
  ASSERT_TRUE(m.selfCheck().isOk()) << m.selfCheck().toString();
  // adopt(): a state that is a block of its own request or of another, or missing groups.
  std::vector<uint32_t> states(groups - 1);
  std::iota(states.begin(), states.end(), 15u);
  Status s = m.adopt(2, 10, std::vector<uint32_t>{14}, 14, 0, 0, states).status();
  EXPECT_NE(s.message().find("block 14 listed twice"), std::string::npos) << s.toString();
  s = m.adopt(2, 10, std::vector<uint32_t>{14}, a->blocks[0], 0, 0, states).status();
  EXPECT_NE(s.message().find("is still held by request 1"), std::string::npos) << s.toString();
  s = m.adopt(2, 10, std::vector<uint32_t>{14}, 13, 0, 0, std::vector<uint32_t>{15}).status();
  EXPECT_NE(s.message().find("1 group slots given besides the slot"), std::string::npos)
      << s.toString();
  auto b = m.adopt(2, 10, std::vector<uint32_t>{14}, 13, 0, 0, states);
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  EXPECT_EQ(b->group_slots, states);
  // Exhausted counting the states: 20 pages, 9 + 7 held.
  s = m.allocate(3, 2000).status();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("and 6 for its states"), std::string::npos) << s.toString();
  ASSERT_TRUE(m.beginTransfer(1).isOk());
  ASSERT_TRUE(m.free(1).isOk());
  EXPECT_EQ(m.counters().quarantined_blocks, 3 + groups);
  ASSERT_TRUE(m.selfCheck().isOk()) << m.selfCheck().toString();
  ASSERT_TRUE(m.endTransfer(1).isOk());
  ASSERT_TRUE(m.free(2).isOk());
  ASSERT_TRUE(m.selfCheck().isOk()) << m.selfCheck().toString();
  expectAllFree(m.counters());
}

TEST(CacheManagerEngine, WrapRefusesMissingOrShortRegions) {
  auto layout = buildRankLayout(tinyHybrid(), {1, 1, {}}, 0, 0, StateLayout::kPaged, 8, 2);
  ASSERT_TRUE(layout.isOk());
  std::vector<uint8_t> small(16);
  std::vector<std::unique_ptr<Region>> regions;
  auto m = HybridCacheManager::wrap(*layout, std::move(regions));
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  regions.clear();
  for (const RegionSpec& spec : layout->regions) {
    regions.push_back(*Region::borrow(spec.id, small.data(), small.size()));
  }
  m = HybridCacheManager::wrap(*layout, std::move(regions));
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("is 16 bytes, the layout needs"), std::string::npos)
      << m.status().toString();
}

}  // namespace
}  // namespace hxfer

namespace hxfer {
namespace {

// A context rank only reads its pages: with shared reads, requests may name the same page (a
// cached prompt prefix), and it returns to the free pool only with its last reader, fences
// (quarantine) included.
TEST(CacheManagerEngine, SharedReadsFenceAPageUntilItsLastReaderIsReleased) {
  EngineMemory e = wrapEngineMemory();
  ASSERT_NE(e.cache, nullptr);
  HybridCacheManager& c = *e.cache;
  std::vector<uint64_t> released;
  c.setReleaseListener([&](uint64_t id, uint64_t) { released.push_back(id); });
  ASSERT_TRUE(c.setFenceMode(HybridCacheManager::FenceMode::kSharedReads).isOk());
  ASSERT_TRUE(c.adopt(1, 64, std::vector<uint32_t>{0, 1}, 0).isOk());
  ASSERT_TRUE(c.adopt(2, 64, std::vector<uint32_t>{0, 2}, 0).isOk());  // shares block 0, slot 0
  EXPECT_NE(c.adopt(3, 64, std::vector<uint32_t>{3, 3}, 1).status().message().find("twice"),
            std::string::npos);
  EXPECT_EQ(c.counters().free_blocks, 5u);  // 0, 1, 2 held
  EXPECT_EQ(c.counters().free_slots, 1u);
  ASSERT_TRUE(c.selfCheck().isOk()) << c.selfCheck().toString();
  // The mode changes only on empty pools.
  EXPECT_EQ(c.setFenceMode(HybridCacheManager::FenceMode::kExclusive).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.beginTransfer(1).isOk());
  ASSERT_TRUE(c.free(1).isOk());  // quarantined: block 0 still read by 1 and 2
  ASSERT_TRUE(c.free(2).isOk());
  EXPECT_EQ(released, std::vector<uint64_t>{2});
  EXPECT_EQ(c.counters().free_blocks, 6u);  // block 2 back; 0 and 1 wait for request 1
  ASSERT_TRUE(c.selfCheck().isOk()) << c.selfCheck().toString();
  ASSERT_TRUE(c.endTransfer(1).isOk());
  EXPECT_EQ(released, (std::vector<uint64_t>{2, 1}));
  ASSERT_TRUE(c.selfCheck().isOk());
  expectAllFree(c.counters());
  // An exclusive manager refuses the same sharing, naming the holder...
  ASSERT_TRUE(c.setFenceMode(HybridCacheManager::FenceMode::kExclusive).isOk());
  ASSERT_TRUE(c.adopt(1, 64, std::vector<uint32_t>{0, 1}, 0).isOk());
  EXPECT_NE(c.adopt(2, 64, std::vector<uint32_t>{0, 2}, 1)
                .status()
                .message()
                .find("block 0 is still held by request 1"),
            std::string::npos);
  ASSERT_TRUE(c.free(1).isOk());
  // ...except for a read prefix (blocks a generation rank already holds and hxfer never
  // writes): two requests share block 0 as their prefix; a request writing it is refused.
  ASSERT_TRUE(c.adopt(3, 64, std::vector<uint32_t>{0, 1}, 0, 0, 1).isOk());
  ASSERT_TRUE(c.adopt(4, 64, std::vector<uint32_t>{0, 2}, 1, 0, 1).isOk());
  EXPECT_NE(
      c.adopt(5, 64, std::vector<uint32_t>{3, 0}, std::nullopt).status().message().find("no slot"),
      std::string::npos);
  c.setReleaseListener(nullptr);
  ASSERT_TRUE(c.selfCheck().isOk()) << c.selfCheck().toString();
  auto writer = c.adopt(5, 32, std::vector<uint32_t>{0}, 0);
  EXPECT_NE(writer.status().message().find("block 0 is still held by request"), std::string::npos)
      << writer.status().toString();
  ASSERT_TRUE(c.free(3).isOk());
  EXPECT_EQ(c.counters().free_blocks, 6u);  // 0 (read by 4) and 2 held
  ASSERT_TRUE(c.free(4).isOk());
  ASSERT_TRUE(c.selfCheck().isOk());
  expectAllFree(c.counters());
}

}  // namespace
}  // namespace hxfer
