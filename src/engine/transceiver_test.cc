// End-to-end tests of the transceiver: context and generation ranks as threads of this process,
// each with its own cache manager and transport agent, over every backend. Every test ends by
// asserting that pool accounting is back to its start on every surviving rank.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "engine/cluster.h"
#include "model/presets.h"
#include "transport/transport.h"
#include "wire/codec.h"

namespace hxfer::engine {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Generous: the box may be loaded; nothing here asserts on time.
Clock::time_point deadline() { return Clock::now() + seconds(60); }

ModelSpec tinyModel() {
  auto m = loadPreset(kDefaultPreset);
  EXPECT_TRUE(m.isOk());
  return *m;
}

ClusterOptions baseOptions(const std::string& backend, ParallelConfig ctx, ParallelConfig gen) {
  ClusterOptions o;
  o.model = tinyModel();
  o.ctx = ctx;
  o.gen = gen;
  o.backend = backend;
  o.blocks = 32;
  o.slots = 4;
  if (backend == "ucx") o.ucx_options = {{"TLS", "tcp,self"}};
  return o;
}

void expectPagesFree(const LocalCluster& c) {
  std::string why;
  EXPECT_TRUE(c.waitAllPagesFree(deadline(), &why)) << why;
}

// Runs `n` requests through the cluster and checks every byte.
void transferAndVerify(LocalCluster& c, uint64_t first_id, int n, uint32_t tokens,
                       uint32_t prefix = 0) {
  for (int i = 0; i < n; ++i) {
    const uint64_t id = first_id + i;
    ASSERT_TRUE(c.prepareContext(id, tokens).isOk());
    ASSERT_TRUE(c.startGeneration(id, tokens, prefix).isOk());
  }
  for (int i = 0; i < n; ++i) {
    const uint64_t id = first_id + i;
    Status s = c.waitGeneration(id, deadline());
    ASSERT_TRUE(s.isOk()) << s.toString();
    auto report = c.check(id, prefix);
    ASSERT_TRUE(report.isOk()) << report.status().toString();
    EXPECT_TRUE(report->ok()) << report->toString();
    EXPECT_GT(report->bytes_checked, 0u);
    ASSERT_TRUE(c.release(id).isOk());
  }
}

// Waits (polling) until `pred` holds or the deadline; true when it held.
template <typename Pred>
bool eventually(Pred pred) {
  const auto until = deadline();
  while (!pred()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return true;
}

class Transceiver : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<LocalCluster> make(ClusterOptions o) {
    auto c = LocalCluster::create(std::move(o));
    EXPECT_TRUE(c.isOk()) << c.status().toString();
    if (!c.isOk()) return nullptr;
    for (auto& r : (*c)->receivers()) {
      Status s = r->waitForPeers(deadline());
      EXPECT_TRUE(s.isOk()) << s.toString();
    }
    return std::move(*c);
  }

  // A tp 1 -> 1 cluster streaming request `id` (90 tokens): asked for, its layers [0, 2) marked
  // ready and posted, the rest not. Null (with a failure) when that did not happen.
  std::unique_ptr<LocalCluster> streamingFirstLayers(uint64_t id) {
    auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
    o.stream_min_tokens = 0;
    auto c = make(o);
    if (c == nullptr) return nullptr;
    const bool ok = c->prepareContext(id, 90, /*mark_ready=*/false).isOk() &&
                    c->startGeneration(id, 90).isOk() &&
                    c->senders()[0]->markReady(id, LayerRange{0, 2}).isOk() &&
                    eventually([&] { return c->ctxMetrics().writes_posted >= 1; });
    EXPECT_TRUE(ok) << "request " << id << " did not start streaming";
    return ok ? std::move(c) : nullptr;
  }
};

TEST_P(Transceiver, SameTpMovesEveryByte) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 3, 100);
  EXPECT_EQ(c->genMetrics().requests_ok, 3u);
  expectPagesFree(*c);
}

TEST_P(Transceiver, TwoToOneGathersBothContextRanks) {
  auto c = make(baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->receivers()[0]->contextRanks().size(), 2u);
  transferAndVerify(*c, 1, 3, 77);
  expectPagesFree(*c);
}

TEST_P(Transceiver, OneToTwoSplitsToBothGenerationRanks) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {2, 1, {}}));
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 3, 64);
  // The one context rank served one part per generation rank per request.
  EXPECT_EQ(c->ctxMetrics().requests_ok, 6u);
  expectPagesFree(*c);
}

TEST_P(Transceiver, PpMismatchMovesOnlyOverlappingStages) {
  auto c = make(baseOptions(GetParam(), {1, 2, {}}, {2, 1, {}}));
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 2, 90);
  expectPagesFree(*c);
}

TEST_P(Transceiver, MixedLayoutsMapOntoEachOther) {
  auto o = baseOptions(GetParam(), {2, 1, {}}, {1, 2, {}});
  o.ctx_layout = StateLayout::kLayerMajor;
  o.gen_layout = StateLayout::kPaged;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 2, 50);
  expectPagesFree(*c);
}

// Engine layouts on both sides: the RankInfos carry the described records (wire 1.3), both
// sides plan from them, and the oracle checks every byte in the generation engine's order.
TEST_P(Transceiver, EngineLayoutsOnBothSidesMoveEveryByte) {
  struct Case {
    const char *ctx_engine, *ctx_kv, *ctx_conv, *gen_engine, *gen_kv, *gen_conv;
    ParallelConfig ctx, gen;
  };
  const Case cases[] = {
      {"vllm", "nhd", "sd", "vllm", "hnd", "sd", {2, 1, {}}, {1, 1, {}}},
      {"sglang", "", "", "trtllm-v2", "nhd", "", {1, 1, {}}, {2, 1, {}}},
      {"trtllm-v1", "", "", "vllm", "hnd", "ds", {1, 2, {}}, {2, 1, {}}},
      // Conv element order differs (SD against DS): staged on the context ranks.
      {"vllm", "nhd", "sd", "hxfer", "", "", {2, 1, {}}, {1, 1, {}}},
      {"trtllm-v2", "hnd", "", "vllm", "nhd", "sd", {1, 1, {}}, {2, 1, {}}},
  };
  for (const Case& k : cases) {
    auto o = baseOptions(GetParam(), k.ctx, k.gen);
    o.ctx_engine = *parseEngineLayout(k.ctx_engine, k.ctx_kv, k.ctx_conv);
    o.gen_engine = *parseEngineLayout(k.gen_engine, k.gen_kv, k.gen_conv);
    SCOPED_TRACE(o.ctx_engine->toString() + " -> " + o.gen_engine->toString());
    auto c = make(o);
    ASSERT_NE(c, nullptr);
    bool described = false;
    for (const PoolView& v : c->genCaches()[0]->layout().views) described |= v.record.has_value();
    for (const PoolView& v : c->ctxCaches()[0]->layout().views) described |= v.record.has_value();
    EXPECT_TRUE(described);
    transferAndVerify(*c, 1, 3, 70);
    expectPagesFree(*c);
  }
}

// vLLM's shared tensors on one side or both: block ids and a state id per Mamba group come
// from one pool on that side, the generation rank's group slots travel in the request (wire
// 1.5), and every byte verifies with checksums on, several requests in flight at once.
TEST_P(Transceiver, VllmSharedTensorsMoveEveryByteWithAStatePerGroupFromOnePool) {
  struct Case {
    const char *ctx_kv, *ctx_conv, *ctx_shared, *gen_engine, *gen_kv, *gen_conv, *gen_shared;
    ParallelConfig ctx, gen;
  };
  const Case cases[] = {
      {"nhd", "sd", "on", "hxfer", "", "", "", {2, 1, {}}, {1, 1, {}}},
      {"nhd", "sd", "off", "vllm", "hnd", "ds", "on", {1, 1, {}}, {2, 1, {}}},
      {"hnd", "ds", "on", "vllm", "nhd", "sd", "on", {1, 2, {}}, {2, 1, {}}},
  };
  for (const Case& k : cases) {
    auto o = baseOptions(GetParam(), k.ctx, k.gen);
    o.ctx_engine = *parseEngineLayout("vllm", k.ctx_kv, k.ctx_conv, "", k.ctx_shared);
    o.gen_engine = *parseEngineLayout(k.gen_engine, k.gen_kv, k.gen_conv, "", k.gen_shared);
    o.checksum = true;
    SCOPED_TRACE(o.ctx_engine->toString() + " -> " + o.gen_engine->toString());
    auto c = make(o);
    ASSERT_NE(c, nullptr);
    const RankLayout& shared =
        (o.gen_engine->shared ? c->genCaches() : c->ctxCaches())[0]->layout();
    ASSERT_TRUE(shared.joint_ids);
    ASSERT_GT(shared.state_groups, 1u);
    transferAndVerify(*c, 1, 3, 70);
    expectPagesFree(*c);
  }
}

// Different tokens per block on the two sides (a vLLM context with large pages, an SGLang or
// TensorRT-LLM generation side with small ones, and the reverse): kv moves by token ranges,
// the generation rank expects exactly the request's tokens, checksums cover them, and every
// byte of the request's tokens verifies, with and without a prefix.
TEST_P(Transceiver, DifferentTokensPerBlockMoveByTokenRanges) {
  struct Case {
    const char *ctx_engine, *gen_engine;
    uint32_t ctx_tpb, gen_tpb;
    ParallelConfig ctx, gen;
  };
  const Case cases[] = {
      {"hxfer", "hxfer", 16, 32, {2, 1, {}}, {1, 1, {}}},
      {"vllm", "sglang", 48, 8, {1, 1, {}}, {2, 1, {}}},
      {"trtllm-v2", "vllm", 8, 40, {2, 1, {}}, {1, 1, {}}},
  };
  for (const Case& k : cases) {
    auto o = baseOptions(GetParam(), k.ctx, k.gen);
    o.ctx_engine = *parseEngineLayout(k.ctx_engine);
    o.gen_engine = *parseEngineLayout(k.gen_engine);
    o.ctx_tokens_per_block = k.ctx_tpb;
    o.gen_tokens_per_block = k.gen_tpb;
    o.checksum = true;
    SCOPED_TRACE(o.ctx_engine->toString() + " T" + std::to_string(k.ctx_tpb) + " -> " +
                 o.gen_engine->toString() + " T" + std::to_string(k.gen_tpb));
    auto c = make(o);
    ASSERT_NE(c, nullptr);
    const uint64_t before = c->genMetrics().bytes;
    transferAndVerify(*c, 1, 2, 70);
    transferAndVerify(*c, 3, 1, 100, 45);  // prefix: the generation blocks before token 45
    // Two requests of 70 tokens and one of 100 - 40 (whole generation blocks before 45), the kv
    // of exactly those tokens plus one slot of state each, on every generation rank.
    uint64_t want = 0;
    for (const auto& cache : c->genCaches()) {
      const RankLayout& g = cache->layout();
      const uint64_t per_token = g.kvBytesPerBlock() / g.tokens_per_block;
      const uint64_t skipped = 45 / g.tokens_per_block * g.tokens_per_block;
      want += (2 * 70 + 100 - skipped) * per_token + 3 * g.stateBytesPerSlot();
    }
    EXPECT_EQ(c->genMetrics().bytes - before, want);
    EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kChecksum), 0u);
    expectPagesFree(*c);
  }
}

TEST_P(Transceiver, PrefixBlocksAreNotSent) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  const uint32_t tpb = c->options().model.tokens_per_block;
  transferAndVerify(*c, 1, 1, 5 * tpb, 2 * tpb);
  const uint64_t kv = c->genCaches()[0]->layout().kvBytesPerBlock();
  const uint64_t state = c->genCaches()[0]->layout().stateBytesPerSlot();
  EXPECT_EQ(c->genMetrics().bytes, 3 * kv + state);
  expectPagesFree(*c);
}

TEST_P(Transceiver, ReadyAfterRequestStartsTransferToo) {
  auto c = make(baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(9, 70, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(9, 70).isOk());
  ASSERT_TRUE(c->markReady(9).isOk());
  ASSERT_TRUE(c->waitGeneration(9, deadline()).isOk());
  auto report = c->check(9);
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok()) << report->toString();
  ASSERT_TRUE(c->release(9).isOk());
  expectPagesFree(*c);
}

TEST_P(Transceiver, ChecksumVerifiesOnArrival) {
  auto o = baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}});
  o.checksum = true;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 2, 64);
  EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kChecksum), 0u);
  expectPagesFree(*c);
}

// The context side's aux (e.g. the first sampled token) reaches the generation side with the
// Done: from the lowest context rank that gave one. An oversize aux is refused and changes
// nothing.
TEST_P(Transceiver, ContextAuxArrivesWithTheRequest) {
  auto c = make(baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  auto& senders = c->senders();
  ASSERT_EQ(senders.size(), 2u);
  ASSERT_TRUE(c->prepareContext(1, 80, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->prepareContext(2, 80, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->prepareContext(3, 80, /*mark_ready=*/false).isOk());
  const Bytes too_big(wire::kMaxAuxBytes + 1, 9);
  Status refused = senders[0]->markReady(1, too_big);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.toString();
  EXPECT_NE(refused.message().find("aux is 16385 bytes"), std::string::npos) << refused.toString();
  // Request 1: only rank 1 has the token. Request 2: both; rank 0's wins. Request 3: none.
  ASSERT_TRUE(senders[0]->markReady(1).isOk());
  ASSERT_TRUE(senders[1]->markReady(1, Bytes{7, 0, 0, 0}).isOk());
  ASSERT_TRUE(senders[0]->markReady(2, Bytes{1}).isOk());
  ASSERT_TRUE(senders[1]->markReady(2, Bytes{2, 2}).isOk());
  ASSERT_TRUE(c->markReady(3).isOk());
  const Bytes want[] = {Bytes{7, 0, 0, 0}, Bytes{1}, Bytes{}};
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_TRUE(c->startGeneration(id, 80).isOk());
    auto r = c->receivers()[0]->wait(id, deadline());
    ASSERT_TRUE(r.isOk());
    ASSERT_EQ(r->state, RequestResult::State::kDone) << r->status.toString();
    EXPECT_EQ(r->aux, want[id - 1]) << "request " << id;
    auto report = c->check(id);
    ASSERT_TRUE(report.isOk());
    EXPECT_TRUE(report->ok()) << report->toString();
    ASSERT_TRUE(c->release(id).isOk());
  }
  expectPagesFree(*c);
}

TEST_P(Transceiver, GenerationCancelBeforeReadyFreesBothSides) {
  auto c = make(baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(5, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(5, 60).isOk());
  ASSERT_TRUE(c->receivers()[0]->cancel(5).isOk());
  auto r = c->receivers()[0]->wait(5, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled);
  // The context side still owns its pages until the serving code marks or cancels them.
  ASSERT_TRUE(c->markReady(5).isOk());
  ASSERT_TRUE(c->release(5).isOk());
  // Nobody asks any more (the asks were cancelled), so the sources go when the asks are
  // answered: every expected rank has been answered.
  expectPagesFree(*c);
  EXPECT_GE(c->genMetrics().requests_cancelled, 1u);
}

TEST_P(Transceiver, ContextCancelFailsTheGenerationRequest) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(6, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(6, 60).isOk());
  ASSERT_TRUE(c->senders()[0]->cancel(6).isOk());
  EXPECT_EQ(c->senders()[0]->markReady(6).code(), StatusCode::kCancelled);
  auto r = c->receivers()[0]->wait(6, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled) << r->status.toString();
  ASSERT_TRUE(c->release(6).isOk());
  expectPagesFree(*c);
}

TEST_P(Transceiver, CancelAfterCompletionIsHarmless) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(7, 40).isOk());
  ASSERT_TRUE(c->startGeneration(7, 40).isOk());
  ASSERT_TRUE(c->waitGeneration(7, deadline()).isOk());
  ASSERT_TRUE(c->senders()[0]->cancel(7).isOk());
  ASSERT_TRUE(c->receivers()[0]->cancel(7).isOk());
  auto r = c->receivers()[0]->poll(7);
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(r->status.isOk());  // completed stays completed
  auto report = c->check(7);
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok());
  ASSERT_TRUE(c->release(7).isOk());
  expectPagesFree(*c);
}

TEST_P(Transceiver, LeaseExpiresWhenNobodyAsks) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.lease_timeout = milliseconds(50);
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(8, 60).isOk());
  expectPagesFree(*c);
  EXPECT_EQ(c->ctxMetrics().leases_expired, 1u);
  // A late ask is answered with the expiry, loudly, not served from freed pages.
  ASSERT_TRUE(c->startGeneration(8, 60).isOk());
  auto r = c->receivers()[0]->wait(8, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kExpired) << r->status.toString();
  EXPECT_NE(r->status.message().find("lease of request 8 expired"), std::string::npos)
      << r->status.toString();
  EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kTimeout), 1u);
  ASSERT_TRUE(c->release(8).isOk());
  expectPagesFree(*c);
}

TEST_P(Transceiver, WrongTokenIsRefusedAndCounted) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.ctx_token = "secret";
  o.gen_token = "guess";
  auto c = LocalCluster::create(o);
  ASSERT_TRUE(c.isOk()) << c.status().toString();
  Status s = (*c)->receivers()[0]->waitForPeers(deadline());
  EXPECT_FALSE(s.isOk());
  EXPECT_NE(s.toString().find("token"), std::string::npos) << s.toString();
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.toString();
  // The context rank's transport refused it: counted there, and the engine never saw a Hello.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*c)->ctxMetrics().auth_failures == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE((*c)->ctxMetrics().auth_failures, 1u);
  EXPECT_EQ((*c)->ctxMetrics().handshakes_ok, 0u);
  EXPECT_FALSE((*c)->startGeneration(1, 10).isOk());
  expectPagesFree(**c);
}

// Without a token every rank says so in its metrics (and logs a warning); a shared token
// clears it on every rank and the transfer runs as before.
TEST_P(Transceiver, RanksWithoutATokenAreReportedAndASharedTokenClearsIt) {
  auto plain = make(baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}}));
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->ctxMetrics().ranks_without_token, 2u);
  EXPECT_EQ(plain->genMetrics().ranks_without_token, 1u);
  plain.reset();
  auto o = baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}});
  o.ctx_token = o.gen_token = "shared secret";
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->ctxMetrics().ranks_without_token, 0u);
  EXPECT_EQ(c->genMetrics().ranks_without_token, 0u);
  transferAndVerify(*c, 1, 1, 40);
  expectPagesFree(*c);
}

TEST_P(Transceiver, IncompatiblePeerIsRefusedNamingTheField) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  auto c = LocalCluster::create(o);
  ASSERT_TRUE(c.isOk());
  // A generation rank of a model with another ssm dtype asks the same context rank.
  ModelSpec other = o.model;
  other.ssm_dtype = DType::kBf16;
  auto cache = HybridCacheManager::create(
      other, o.gen, 0, 0, StateLayout::kPaged, Capacity::counts(8, 2),
      o.backend == "shm" ? Region::Backing::kMemfd : Region::Backing::kAnonymous);
  ASSERT_TRUE(cache.isOk());
  transport::AgentConfig ac;
  ac.backend = o.backend;
  ac.ucx_options = o.ucx_options;
  auto agent = transport::createAgent(ac);
  ASSERT_TRUE(agent.isOk());
  GenerationReceiver::Options ro;
  ro.model = other;
  ro.parallel = o.gen;
  ro.ctx_parallel = o.ctx;
  ro.ctx_addresses = {(*c)->senders()[0]->address()};
  auto rx = GenerationReceiver::create(ro, cache->get(), std::move(*agent));
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  Status s = (*rx)->waitForPeers(deadline());
  EXPECT_EQ(s.code(), StatusCode::kIncompatible) << s.toString();
  EXPECT_NE(s.message().find("ssm dtype"), std::string::npos) << s.toString();
  (*rx)->shutdown();
  EXPECT_EQ((*cache)->counters().used_blocks, 0u);
  // The regular generation rank is unaffected.
  ASSERT_TRUE((*c)->receivers()[0]->waitForPeers(deadline()).isOk());
  transferAndVerify(**c, 1, 1, 32);
  expectPagesFree(**c);
}

TEST_P(Transceiver, DeadContextRankFailsItsRequests) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  // A request in flight towards a context rank that dies before serving it.
  ASSERT_TRUE(c->prepareContext(1, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(1, 60).isOk());
  c->senders()[0]->shutdown();  // frees nothing it does not own; request 1 is not ready
  ASSERT_TRUE(c->ctxCaches()[0]->free(1).isOk());
  auto r = c->receivers()[0]->wait(1, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kUnavailable) << r->status.toString();
  ASSERT_TRUE(c->release(1).isOk());
  EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kPeerLost), 1u);
  expectPagesFree(*c);
}

TEST_P(Transceiver, MarkReadyAfterShutdownLeavesThePagesWithTheCaller) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  c->senders()[0]->shutdown();
  ASSERT_TRUE(c->prepareContext(1, 60, /*mark_ready=*/false).isOk());
  Status s = c->senders()[0]->markReady(1);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
  // Nobody took them: the sender holds nothing, the caller still owns the allocation.
  EXPECT_EQ(c->senders()[0]->heldRequests(), 0u);
  ASSERT_TRUE(c->ctxCaches()[0]->free(1).isOk());
  expectPagesFree(*c);
}

TEST_P(Transceiver, MarkReadyAfterTheAskTimedOutFreesThePagesAndSaysSo) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.lease_timeout = milliseconds(300);
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->prepareContext(5, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(5, 60).isOk());
  auto r = c->receivers()[0]->wait(5, deadline());
  ASSERT_TRUE(r.isOk());
  ASSERT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  // The generation side gave up: marking it ready now must not pin the pages for a lease.
  Status m = c->senders()[0]->markReady(5);
  EXPECT_EQ(m.code(), StatusCode::kTimeout) << m.toString();
  EXPECT_NE(m.message().find("not marked ready"), std::string::npos) << m.toString();
  EXPECT_EQ(c->senders()[0]->heldRequests(), 0u);
  ASSERT_TRUE(c->release(5).isOk());
  expectPagesFree(*c);
  EXPECT_EQ(c->ctxMetrics().leases_expired, 0u);
}

// ---- streaming: markReady(id, layers) while prefill runs ----

uint32_t numLayers(const LocalCluster& c) { return c.options().model.numLayers(); }

// Every generation rank's ask reached every context rank it goes to.
bool asked(LocalCluster& c) {
  uint64_t parts = 0;
  for (const auto& r : c.receivers()) parts += r->contextRanks().size();
  return eventually([&] { return c.ctxMetrics().requests_started >= parts; });
}

// Layers marked one at a time go out as they are marked: writes are posted before the last
// layer is ready, the Done follows the last one, every byte is the oracle's, and the pages are
// freed on both sides. At tp 2 -> 1 and pp 2 -> 1, each context rank streams its own layers.
TEST_P(Transceiver, StreamedLayersGoBeforeTheLastAndEveryByteLands) {
  const std::pair<ParallelConfig, ParallelConfig> layouts[] = {{{2, 1, {}}, {1, 1, {}}},
                                                               {{1, 2, {}}, {2, 1, {}}}};
  for (const auto& [ctx, gen] : layouts) {
    auto o = baseOptions(GetParam(), ctx, gen);
    o.stream_min_tokens = 64;
    o.checksum = true;
    auto c = make(o);
    ASSERT_NE(c, nullptr);
    const uint32_t n = numLayers(*c);
    ASSERT_TRUE(c->prepareContext(3, 100, /*mark_ready=*/false).isOk());
    ASSERT_TRUE(c->startGeneration(3, 100).isOk());
    ASSERT_TRUE(asked(*c));
    for (uint32_t l = 0; l + 1 < n; ++l) {
      ASSERT_TRUE(c->markLayersReady(3, {l, 1}).isOk()) << "layer " << l;
    }
    // Every layer but the last went out already; the request is not done without the last.
    EXPECT_TRUE(eventually([&] {
      return c->ctxMetrics().writes_posted >= 2 * c->senders().size();
    })) << c->ctxMetrics().writes_posted;
    auto r = c->receivers()[0]->poll(3);
    ASSERT_TRUE(r.isOk());
    EXPECT_FALSE(r->terminal()) << r->status.toString() << " writes "
                                << c->ctxMetrics().writes_posted;
    ASSERT_TRUE(c->markLayersReady(3, {n - 1, 1}).isOk());
    ASSERT_TRUE(c->waitGeneration(3, deadline()).isOk());
    auto report = c->check(3);
    ASSERT_TRUE(report.isOk());
    EXPECT_TRUE(report->ok()) << report->toString();
    const MetricsSnapshot m = c->ctxMetrics();
    // Every call but each rank's last left layers to come.
    EXPECT_EQ(m.streamed_ranges, ctx.tp * n - c->senders().size());
    EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kChecksum), 0u);
    ASSERT_TRUE(c->release(3).isOk());
    expectPagesFree(*c);
  }
}

// Ranges ready before the request arrives go out with it in one piece; staged parts (vLLM's SD
// conv order against DS) stream too, with a checksum over every piece.
TEST_P(Transceiver, StreamedRangesBeforeTheAskAndStagedPartsMoveEveryByte) {
  auto o = baseOptions(GetParam(), {2, 1, {}}, {1, 1, {}});
  o.ctx_engine = *parseEngineLayout("vllm", "nhd", "sd");
  o.gen_engine = *parseEngineLayout("hxfer");
  o.stream_min_tokens = 0;
  o.gen_staging_bytes = 0;  // per-token kv runs here: storm control would send the part whole
  o.checksum = true;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  const uint32_t n = numLayers(*c);
  ASSERT_TRUE(c->prepareContext(4, 70, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->markLayersReady(4, {0, 3}).isOk());
  ASSERT_TRUE(c->startGeneration(4, 70).isOk());
  ASSERT_TRUE(asked(*c));
  ASSERT_TRUE(c->markLayersReady(4, {2, 3}).isOk());  // overlapping the previous range is fine
  ASSERT_TRUE(c->markLayersReady(4, {5, n - 5}).isOk());
  ASSERT_TRUE(c->waitGeneration(4, deadline()).isOk());
  auto report = c->check(4);
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok()) << report->toString();
  // One staging area per piece holding conv records: more than one per rank.
  EXPECT_GT(c->ctxMetrics().staged_parts, c->senders().size());
  EXPECT_EQ(c->genMetrics().failuresBy(FailureCause::kChecksum), 0u);
  ASSERT_TRUE(c->release(4).isOk());
  expectPagesFree(*c);
}

// Below stream_min_tokens a request waits for its last range and goes as one write.
TEST_P(Transceiver, ShortRequestsGoInOnePieceAfterTheLastRange) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.stream_min_tokens = 1000;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  const uint32_t n = numLayers(*c);
  ASSERT_TRUE(c->prepareContext(5, 100, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(5, 100).isOk());
  for (uint32_t l = 0; l + 1 < n; ++l) ASSERT_TRUE(c->markLayersReady(5, {l, 1}).isOk());
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(c->ctxMetrics().writes_posted, 0u);
  ASSERT_TRUE(c->markLayersReady(5, {n - 1, 1}).isOk());
  ASSERT_TRUE(c->waitGeneration(5, deadline()).isOk());
  EXPECT_EQ(c->ctxMetrics().writes_posted, 1u);
  auto report = c->check(5);
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok()) << report->toString();
  ASSERT_TRUE(c->release(5).isOk());
  expectPagesFree(*c);
}

// Ranges out of order are refused naming the range and the reason; nothing changes, and the
// request still completes.
TEST_P(Transceiver, BadLayerRangesAreRefusedNamingTheRange) {
  auto c = make(baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}}));
  ASSERT_NE(c, nullptr);
  const uint32_t n = numLayers(*c);
  ContextSender& s = *c->senders()[0];
  ASSERT_TRUE(c->prepareContext(6, 40, /*mark_ready=*/false).isOk());
  auto refused = [&](LayerRange l, const std::string& why) {
    Status st = s.markReady(6, l);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.toString();
    EXPECT_NE(st.message().find(why), std::string::npos) << st.toString();
  };
  refused({2, 2}, "layers [2, 4) leaves layers [0, 2) not ready");
  refused({0, 0}, "is empty");
  refused({0, n + 1}, "goes past this rank's layers [0, " + std::to_string(n) + ")");
  ASSERT_TRUE(s.markReady(6, LayerRange{0, 3}).isOk());
  refused({1, 2}, "was marked ready already (layers below 3 are)");
  ASSERT_TRUE(c->startGeneration(6, 40).isOk());
  ASSERT_TRUE(s.markReady(6, LayerRange{3, n - 3}).isOk());
  ASSERT_TRUE(c->waitGeneration(6, deadline()).isOk());
  auto report = c->check(6);
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok()) << report->toString();
  ASSERT_TRUE(c->release(6).isOk());
  expectPagesFree(*c);
}

// A generation cancel between two ranges ends that part there (its write cancelled, nothing
// more posted); the context pages stay with the sender while prefill may still write them and
// are freed at the last range, as a whole request cancelled before markReady is.
TEST_P(Transceiver, CancelBetweenRangesFreesThePagesAtTheLastRange) {
  auto c = streamingFirstLayers(7);
  ASSERT_NE(c, nullptr);
  ContextSender& s = *c->senders()[0];
  ASSERT_TRUE(c->receivers()[0]->cancel(7).isOk());
  auto r = c->receivers()[0]->wait(7, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled) << r->status.toString();
  ASSERT_TRUE(c->release(7).isOk());
  EXPECT_TRUE(eventually([&] { return c->ctxMetrics().requests_cancelled >= 1; }));
  EXPECT_EQ(s.heldRequests(), 1u);  // not freed under a running prefill
  EXPECT_TRUE(c->ctxCaches()[0]->find(7).isOk());
  const uint64_t writes = c->ctxMetrics().writes_posted;
  ASSERT_TRUE(s.markReady(7, LayerRange{2, 2}).isOk());
  EXPECT_EQ(s.heldRequests(), 1u);
  ASSERT_TRUE(s.markReady(7, LayerRange{4, numLayers(*c) - 4}).isOk());
  expectPagesFree(*c);
  EXPECT_EQ(c->ctxMetrics().writes_posted, writes);  // nothing posted after the cancel
  EXPECT_TRUE(s.selfCheck().isOk()) << s.selfCheck().toString();
}

// A request whose ranges stop coming times out like one never marked ready; the next range
// reports it and frees the pages.
TEST_P(Transceiver, RangesThatStopComingTimeOutAndTheNextOneSaysSo) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.lease_timeout = milliseconds(300);
  o.stream_min_tokens = 1000;  // the ask waits for the last range
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  ContextSender& s = *c->senders()[0];
  ASSERT_TRUE(c->prepareContext(9, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(9, 60).isOk());
  ASSERT_TRUE(s.markReady(9, LayerRange{0, 2}).isOk());
  auto r = c->receivers()[0]->wait(9, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  EXPECT_EQ(s.heldRequests(), 1u);
  Status next = s.markReady(9, LayerRange{2, 2});
  EXPECT_EQ(next.code(), StatusCode::kTimeout) << next.toString();
  EXPECT_NE(next.message().find("ended before its last layers were ready"), std::string::npos)
      << next.toString();
  EXPECT_EQ(s.heldRequests(), 0u);
  ASSERT_TRUE(c->release(9).isOk());
  expectPagesFree(*c);
}

// The same, ended by the engine's cancel instead of a next range: the cancel frees the pages
// (it once returned early, since the timer had marked the request cancelled, and the pages
// stayed fenced for good).
TEST_P(Transceiver, CancelAfterRangesTimedOutFreesThePages) {
  auto o = baseOptions(GetParam(), {1, 1, {}}, {1, 1, {}});
  o.lease_timeout = milliseconds(300);
  o.stream_min_tokens = 1000;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  ContextSender& s = *c->senders()[0];
  ASSERT_TRUE(c->prepareContext(10, 60, /*mark_ready=*/false).isOk());
  ASSERT_TRUE(c->startGeneration(10, 60).isOk());
  ASSERT_TRUE(s.markReady(10, LayerRange{0, 2}).isOk());
  auto r = c->receivers()[0]->wait(10, deadline());
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->status.code(), StatusCode::kTimeout) << r->status.toString();
  EXPECT_EQ(s.heldRequests(), 1u);
  ASSERT_TRUE(s.cancel(10).isOk());
  EXPECT_EQ(s.heldRequests(), 0u);
  EXPECT_FALSE(c->ctxCaches()[0]->find(10).isOk());
  ASSERT_TRUE(c->release(10).isOk());
  expectPagesFree(*c);
  EXPECT_TRUE(s.selfCheck().isOk()) << s.selfCheck().toString();
}

// The generation rank going away between ranges fails only its part; the last range frees
// the pages.
TEST_P(Transceiver, GenerationGoneBetweenRangesFreesThePagesAtTheLastRange) {
  auto c = streamingFirstLayers(8);
  ASSERT_NE(c, nullptr);
  ContextSender& s = *c->senders()[0];
  c->receivers()[0]->shutdown();
  ASSERT_TRUE(eventually([&] { return s.connectedPeers() == 0; }));
  EXPECT_EQ(s.heldRequests(), 1u);
  ASSERT_TRUE(s.markReady(8, LayerRange{2, numLayers(*c) - 2}).isOk());
  EXPECT_TRUE(eventually([&] { return c->ctxCaches()[0]->counters().pagesHeld() == 0; }));
  EXPECT_EQ(s.heldRequests(), 0u);
  EXPECT_TRUE(s.selfCheck().isOk()) << s.selfCheck().toString();
}

// ---- storm control: many small ops go as one staged write ----

// NHD and token-major kv at TP mismatch give one op per token and K|V half. The generation rank
// asks each context rank for its part as one write into a staging slot and scatters it: one op
// per part, every byte the oracle's, checksums over the pages after the scatter, slots reused.
TEST_P(Transceiver, StormPartsGoAsOneStagedWriteAndScatterEveryByte) {
  struct Case {
    const char *engine, *kv;
    ParallelConfig ctx, gen;
  };
  const Case cases[] = {{"trtllm-v2", "nhd", {4, 1, {}}, {1, 1, {}}},
                        {"sglang", "", {1, 1, {}}, {4, 1, {}}},
                        {"trtllm-v2", "nhd", {2, 1, {}}, {1, 2, {}}}};
  for (const Case& k : cases) {
    for (bool staging : {true, false}) {
      auto o = baseOptions(GetParam(), k.ctx, k.gen);
      o.ctx_engine = *parseEngineLayout(k.engine, k.kv);
      o.gen_engine = o.ctx_engine;
      o.ctx_tokens_per_block = o.gen_tokens_per_block = 16;
      o.blocks = 64;
      o.checksum = true;
      o.gen_staging_bytes = staging ? 16ull << 20 : 0;
      o.gen_stage_on_cheap_ops = true;
      SCOPED_TRACE(std::string(k.engine) + " tp " + std::to_string(k.ctx.tp) + "x" +
                   std::to_string(k.ctx.pp) + " -> " + std::to_string(k.gen.tp) + "x" +
                   std::to_string(k.gen.pp) + (staging ? " staged" : " direct"));
      auto c = make(o);
      ASSERT_NE(c, nullptr);
      transferAndVerify(*c, 1, 3, 300);
      const MetricsSnapshot ctx = c->ctxMetrics(), gen = c->genMetrics();
      uint64_t parts = 0;
      for (const auto& r : c->receivers()) parts += r->contextRanks().size();
      if (staging) {
        EXPECT_EQ(ctx.ops, 3 * parts);  // one op per part
        EXPECT_EQ(gen.storm_parts, 3 * parts);
        EXPECT_EQ(ctx.storm_parts, 3 * parts);
        EXPECT_GT(ctx.storm_copies, 3 * parts * 256);  // the ops gathered
        // The runs scattered: one per token and K|V half where the pages fragment (4:1).
        EXPECT_GT(gen.storm_copies, k.ctx.tp > k.gen.tp ? 3 * parts * 256 : 3 * parts);
      } else {
        EXPECT_GT(ctx.ops, 3 * parts * 256);
        EXPECT_EQ(gen.storm_parts, 0u);
      }
      EXPECT_EQ(gen.failuresBy(FailureCause::kChecksum), 0u);
      expectPagesFree(*c);
    }
  }
}

// NHD kv at 4:1 with 16-token pages: one op per token and K|V half on each context rank.
ClusterOptions stormOptions(const std::string& backend) {
  auto o = baseOptions(backend, {4, 1, {}}, {1, 1, {}});
  o.ctx_engine = *parseEngineLayout("trtllm-v2", "nhd");
  o.gen_engine = o.ctx_engine;
  o.ctx_tokens_per_block = o.gen_tokens_per_block = 16;
  o.blocks = 64;
  return o;
}

// Where a write's per-op cost is about a memcpy call (shm, inproc), staging's extra copies cost
// more than the ops: storm parts go direct unless asked otherwise. Over ucx they are staged.
TEST_P(Transceiver, StormPartsAreStagedOnlyWhereOpsAreDear) {
  ClusterOptions o = stormOptions(GetParam());
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 2, 300);
  const bool cheap = GetParam() != "ucx";
  EXPECT_EQ(c->genMetrics().storm_parts, cheap ? 0u : 8u);
  expectPagesFree(*c);
}

// Concurrent storm parts share a small staging region: those that find no free slot go as
// direct ops, slots come back as parts end, and every request verifies.
TEST_P(Transceiver, StormPartsWithoutAFreeSlotGoDirect) {
  ClusterOptions o = stormOptions(GetParam());
  o.gen_staging_bytes = 64 << 10;  // room for a few parts of the 8 in flight
  o.gen_stage_on_cheap_ops = true;
  auto c = make(o);
  ASSERT_NE(c, nullptr);
  transferAndVerify(*c, 1, 2, 300);
  transferAndVerify(*c, 10, 2, 300);
  const MetricsSnapshot gen = c->genMetrics();
  EXPECT_GT(gen.storm_parts, 0u);
  EXPECT_LT(gen.storm_parts, 16u);
  expectPagesFree(*c);
}

std::vector<std::string> backends() { return transport::availableBackends(); }

INSTANTIATE_TEST_SUITE_P(Backends, Transceiver, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace hxfer::engine
