// The public API over engine-owned memory: layouts and pools by engine, buffer registration,
// the transceivers in every engine layout with the engine choosing pages, and the page
// lifetime contract (a page is never handed back while a write into or out of it may run).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "api/api_impl.h"
#include "cache/engine_layout.h"
#include "cache/record_layout.h"
#include "device/fake_device.h"
#include "hxfer/hxfer.h"
#include "plan/oracle.h"

namespace hxfer {
namespace {

using namespace std::chrono_literals;

LayoutOptions options(std::string engine, uint32_t tp, uint32_t tp_rank, uint32_t blocks = 16,
                      uint32_t slots = 4) {
  LayoutOptions o;
  o.engine = std::move(engine);
  o.tp = tp;
  o.tp_rank = tp_rank;
  o.num_blocks = blocks;
  o.num_slots = slots;
  // One dtype per role on every engine, so that layouts of different engines pair up (each
  // engine's own defaults differ: ApiLayout.EachEngineKeepsItsOwnStateDtypesByDefault).
  o.conv_dtype = "bf16";
  o.ssm_dtype = "fp32";
  return o;
}

// One rank of an engine: its layout, the pools it allocated itself, and hxfer's view of them.
// With `fake`, the pools are its device memory (on device `ordinal`), which the host reaches
// only through fake->hostView().
struct EngineRank {
  Layout layout;
  std::map<std::string, std::vector<uint8_t>> pools;
  std::map<std::string, std::shared_ptr<SharedBuffer>> shared;
  std::optional<Memory> memory;
  std::map<std::string, std::shared_ptr<Region>> device_pools;
  device::FakeDevice* fake = nullptr;

  static EngineRank make(const LayoutOptions& o, bool shareable = false,
                         device::FakeDevice* fake = nullptr, int ordinal = 0) {
    auto l = Layout::engine(o);
    EXPECT_TRUE(l.isOk()) << l.status().toString();
    EngineRank r{*l, {}, {}, std::nullopt, {}, fake};
    std::map<std::string, Buffer> buffers;
    for (const PoolInfo& p : r.layout.pools()) {
      if (fake != nullptr) {
        auto a = fake->allocate(ordinal, p.bytes);
        EXPECT_TRUE(a.isOk()) << a.status().toString();
        r.device_pools[p.name] = *a;
        buffers[p.name] = Buffer{(*a)->data(), p.bytes, MemoryKind::kCuda};
        buffers[p.name].device = ordinal;
      } else if (shareable) {
        auto sb = SharedBuffer::allocate(p.bytes, p.name);
        EXPECT_TRUE(sb.isOk()) << sb.status().toString();
        r.shared[p.name] = *sb;
        buffers[p.name] = (*sb)->buffer();
      } else {
        auto& v = r.pools[p.name];
        v.assign(p.bytes, 0);
        buffers[p.name] = Buffer{v.data(), v.size()};
      }
    }
    auto m = Memory::wrap(r.layout, buffers);
    EXPECT_TRUE(m.isOk()) << m.status().toString();
    r.memory = *m;
    return r;
  }

  RankMemory rankMemory() const {
    const RankLayout& l = layout.impl().layout;
    RankMemory mem(l.regions.size());
    for (const RegionSpec& spec : l.regions) {
      auto it = pools.find(spec.name);
      uint8_t* data = fake != nullptr     ? fake->hostView(device_pools.at(spec.name)->data())
                      : it != pools.end() ? const_cast<uint8_t*>(it->second.data())
                                          : static_cast<uint8_t*>(shared.at(spec.name)->data());
      mem[spec.id] = RegionMemory{data, spec.length};
    }
    return mem;
  }
  const RankLayout& rankLayout() const { return layout.impl().layout; }
};

// Ids whose pages were reported released, in order.
struct Released {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> ids;
  std::function<void(uint64_t)> callback() {
    return [this](uint64_t id) {
      std::lock_guard lock(mu);
      ids.push_back(id);
      cv.notify_all();
    };
  }
  bool waitFor(uint64_t id, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout,
                       [&] { return std::find(ids.begin(), ids.end(), id) != ids.end(); });
  }
  size_t count(uint64_t id) {
    std::lock_guard lock(mu);
    return std::count(ids.begin(), ids.end(), id);
  }
};

// A generation rank of `gen` reading from `tx`, handshake done; nullptr (a test failure) when
// it cannot be had.
std::unique_ptr<Receiver> connectedReceiver(EngineRank& gen, const Sender& tx, Released* released,
                                            ReceiverOptions ro = {}) {
  ro.instance = "gen";
  ro.peers = {tx.address()};
  if (released != nullptr) ro.on_released = released->callback();
  auto rx = Receiver::create(gen.layout, *gen.memory, ro);
  if (!rx.isOk()) {
    ADD_FAILURE() << rx.status().toString();
    return nullptr;
  }
  if (Status s = (*rx)->waitForPeers(10s); !s.isOk()) {
    ADD_FAILURE() << s.toString();
    return nullptr;
  }
  return std::move(*rx);
}

// A Sender over `ctx`'s memory on the inproc backend, reporting releases to `released`; `so`
// carries any other option. nullptr (a test failure) when it cannot be had.
std::unique_ptr<Sender> createdSender(EngineRank& ctx, const SenderOptions& so) {
  auto tx = Sender::create(ctx.layout, *ctx.memory, so);
  if (!tx.isOk()) {
    ADD_FAILURE() << tx.status().toString();
    return nullptr;
  }
  return std::move(*tx);
}

std::unique_ptr<Sender> inprocSender(EngineRank& ctx, Released& released, SenderOptions so = {}) {
  so.backend = "inproc";
  so.on_released = released.callback();
  return createdSender(ctx, so);
}

// A Sender over `ctx`'s memory on ucx over tcp (the path across hosts, on this one); `so`
// carries any other option.
std::unique_ptr<Sender> ucxSender(EngineRank& ctx, SenderOptions so = {}) {
  so.instance = "ctx";
  so.backend = "ucx";
  so.ucx_options = {{"TLS", "tcp"}};
  return createdSender(ctx, so);
}

// A Receiver over `gen`'s memory connected to `tx` over ucx over tcp.
std::unique_ptr<Receiver> ucxReceiver(EngineRank& gen, const Sender& tx, Released* released,
                                      ReceiverOptions ro = {}) {
  ro.ucx_options = {{"TLS", "tcp"}};
  return connectedReceiver(gen, tx, released, ro);
}

TEST(ApiLayout, PoolsNameEveryRegionOfTheEngineLayoutWithItsBytes) {
  auto l = Layout::engine(options("sglang", 2, 0, 64, 8));
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  const RankLayout& rl = l->impl().layout;
  ASSERT_EQ(l->pools().size(), rl.regions.size());
  std::set<std::string> names;
  for (size_t i = 0; i < rl.regions.size(); ++i) {
    const PoolInfo& p = l->pools()[i];
    EXPECT_EQ(p.name, rl.regions[i].name);
    EXPECT_EQ(p.bytes, rl.regions[i].length);
    ASSERT_EQ(p.shape.size(), p.strides.size());
    uint64_t extent = 1;
    for (size_t d = 0; d < p.shape.size(); ++d)
      extent = std::max(extent, p.shape[d] * p.strides[d]);
    EXPECT_EQ(extent, p.bytes) << p.name;
    names.insert(p.name);
  }
  // sglang keeps per-layer k/v buffers and layer-major conv/ssm pools.
  EXPECT_TRUE(names.count("conv0")) << ::testing::PrintToString(names);
  EXPECT_TRUE(std::any_of(names.begin(), names.end(),
                          [](const std::string& n) { return n.rfind("k.", 0) == 0; }));
  EXPECT_TRUE(l->hasKv());
  EXPECT_TRUE(l->hasState());
  EXPECT_EQ(l->blocksFor(60), 2u);
  EXPECT_NE(l->describe().find("sglang"), std::string::npos) << l->describe();
}

// records() must say where every element lies: fill a request with the oracle (which writes
// through the layout's own description) and read every element back through records(),
// numbering its bytes the way the oracle does (a unit's bytes in hxfer's order: unit dim, then
// inner dims; kv seeded per token row).
TEST(ApiLayout, RecordsLocateEveryElementWhereTheOracleWroteIt) {
  for (const EngineLayout& e : allEngineLayouts()) {
    LayoutOptions o = options(std::string(engineName(e.engine)), 2, 1);
    if (e.engine == Engine::kHxfer) o.state_layout = std::string(stateLayoutName(e.state));
    if (e.engine == Engine::kVllm || e.engine == Engine::kTrtllmV2) {
      o.kv_layout = e.kv == KvOrder::kNhd ? "nhd" : "hnd";
    }
    if (e.engine == Engine::kVllm) o.conv_layout = e.conv == ConvOrder::kSd ? "sd" : "ds";
    SCOPED_TRACE(e.toString());
    EngineRank r = EngineRank::make(o);
    const uint32_t block = 5, slot = 2;
    const uint64_t id = 99;
    ASSERT_TRUE(fillRank(r.rankLayout(), r.rankMemory(), RankIds{{block}, slot}, id).isOk());
    ASSERT_FALSE(r.layout.layers().empty());
    uint64_t checked = 0;
    for (uint32_t layer : r.layout.layers()) {
      for (std::string role : {"kv", "conv", "ssm"}) {
        auto parts = r.layout.records(layer, role);
        if (!parts.isOk()) {
          EXPECT_EQ(parts.status().code(), StatusCode::kNotFound) << parts.status().toString();
          continue;
        }
        const Role rl = role == "kv" ? Role::kKv : role == "conv" ? Role::kConv : Role::kSsm;
        for (const RecordPart& part : *parts) {
          const uint8_t* pool = r.pools.at(part.pool).data();
          const uint8_t* rec =
              pool + part.offset + (rl == Role::kKv ? block : slot) * part.index_stride;
          // Inner dims: every dim but the section dim ("kv") and the unit dim.
          std::vector<RecordDim> inner;
          for (const RecordDim& d : part.dims) {
            if (d.name != "kv" && d.name != "head" && d.name != "channel") inner.push_back(d);
          }
          for (const RecordSection& sec : part.sections) {
            for (uint32_t u = 0; u < sec.units; ++u) {
              for (uint32_t c = 0; c < sec.unit_len; ++c) {
                // Walk the inner dims in the canonical order (logical names) of the role.
                const LogicalDims ld =
                    logicalDims(rl == Role::kKv ? LayerKind::kAttention
                                                : r.layout.impl().model.layers[layer].recurrent,
                                rl);
                std::vector<const RecordDim*> order;
                for (const std::string& n : ld.inner) {
                  for (const RecordDim& d : inner) {
                    if (d.name == n) order.push_back(&d);
                  }
                }
                ASSERT_EQ(order.size(), inner.size());
                uint64_t count = 1;
                for (auto* d : order) count *= d->size;
                for (uint64_t flat = 0; flat < count; ++flat) {
                  uint64_t rest = flat, at = sec.base + u * sec.unit_stride + c * sec.within_stride;
                  uint64_t token = 0, numbered = c;  // the oracle's element number in the unit
                  for (size_t k = order.size(); k-- > 0;) {
                    const uint64_t idx = rest % order[k]->size;
                    rest /= order[k]->size;
                    at += idx * order[k]->stride;
                  }
                  rest = flat;
                  std::vector<uint64_t> idx(order.size());
                  for (size_t k = order.size(); k-- > 0;) {
                    idx[k] = rest % order[k]->size;
                    rest /= order[k]->size;
                  }
                  for (size_t k = 0; k < order.size(); ++k) {
                    if (order[k]->name == "token") {
                      token = idx[k];
                      continue;
                    }
                    numbered = numbered * order[k]->size + idx[k];
                  }
                  const uint64_t seed =
                      oracleUnitSeed(id, layer, rl, sec.name, sec.first_unit + u, token);
                  for (uint32_t b = 0; b < part.element_bytes; ++b) {
                    ASSERT_EQ(rec[at + b], oracleByte(seed, numbered * part.element_bytes + b))
                        << "layer " << layer << " " << role << " " << sec.name << " unit "
                        << sec.first_unit + u << " c " << c << " flat " << flat;
                  }
                  ++checked;
                }
              }
            }
          }
        }
      }
    }
    EXPECT_GT(checked, 1000u);
  }
  auto l = Layout::engine(options("sglang", 1, 0));
  ASSERT_TRUE(l.isOk());
  EXPECT_EQ(l->records(0, "weights").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l->records(999, "kv").status().code(), StatusCode::kNotFound);
}

// Layout::records() read the other way: every named layout, described record by record
// (what a connector does from the engine's tensors), is the same rank layout again, for every
// engine and option (vLLM's shared tensors and CPU orders included) at tp 1 and 2.
LayoutDescription describedAs(const Layout& l) {
  LayoutDescription d;
  d.options = l.options();
  d.options.engine = "described";
  for (const PoolInfo& p : l.pools()) d.pools.push_back({p.name, p.bytes});
  for (uint32_t layer : l.layers()) {
    for (const char* role : {"kv", "conv", "ssm"}) {
      auto parts = l.records(layer, role);
      if (!parts.isOk()) continue;
      for (const RecordPart& part : *parts) {
        std::string role_name = role;
        (role_name == "kv"     ? d.options.kv_dtype
         : role_name == "conv" ? d.options.conv_dtype
                               : d.options.ssm_dtype) = part.dtype;
        RecordSpec r;
        r.layer = layer;
        r.role = role;
        r.pool = part.pool;
        r.offset = part.offset;
        r.index_stride = part.index_stride;
        r.state_group = part.state_group;
        if (std::string(role) == "kv" && part.sections.size() == 1) {
          r.section = part.sections[0].name;
        }
        r.dims = part.dims;
        d.records.push_back(std::move(r));
      }
    }
  }
  d.state_groups = l.stateGroups();
  d.joint_ids = l.jointIds();
  return d;
}

TEST(ApiLayout, EveryNamedLayoutDescribedRecordByRecordIsTheSameRankLayout) {
  std::vector<EngineLayout> all = allEngineLayouts();
  for (const EngineLayout& e : sharedEngineLayouts()) all.push_back(e);
  for (const EngineLayout& e : cpuEngineLayouts()) all.push_back(e);
  for (const EngineLayout& e : all) {
    for (uint32_t tp : {1u, 2u}) {
      LayoutOptions o = options(std::string(engineName(e.engine)), tp, tp - 1, 64, 8);
      o.model = "nemotron-h-8b";
      o.tokens_per_block = 1056;
      if (isVllm(e.engine) || e.engine == Engine::kTrtllmV2) o.kv_layout = kvOrderName(e.kv);
      if (isVllm(e.engine)) {
        o.conv_layout = e.conv == ConvOrder::kSd ? "sd" : "ds";
        o.shared_tensors = e.shared ? "on" : "off";
      }
      if (e.engine == Engine::kHxfer) o.state_layout = std::string(stateLayoutName(e.state));
      auto l = Layout::engine(o);
      ASSERT_TRUE(l.isOk()) << e.toString() << ": " << l.status().toString();
      auto back = Layout::fromRecords(describedAs(*l));
      ASSERT_TRUE(back.isOk()) << e.toString() << " tp " << tp << ": " << back.status().toString();
      // Undescribed views come back described in hxfer's own order: the same bytes.
      EXPECT_EQ(back->impl().layout.regions, l->impl().layout.regions) << e.toString();
      // Every record where it was, element by element (hxfer's multi-layer views come back one
      // per layer).
      for (uint32_t layer : l->layers()) {
        for (const char* role : {"kv", "conv", "ssm"}) {
          auto a = l->records(layer, role);
          auto b = back->records(layer, role);
          ASSERT_EQ(a.isOk(), b.isOk()) << e.toString() << " layer " << layer << " " << role;
          if (!a.isOk()) continue;
          ASSERT_EQ(a->size(), b->size());
          for (size_t i = 0; i < a->size(); ++i) {
            EXPECT_EQ((*a)[i].pool, (*b)[i].pool);
            EXPECT_EQ((*a)[i].offset, (*b)[i].offset);
            EXPECT_EQ((*a)[i].index_stride, (*b)[i].index_stride);
            EXPECT_EQ((*a)[i].dims, (*b)[i].dims) << e.toString() << " layer " << layer;
            EXPECT_EQ((*a)[i].state_group, (*b)[i].state_group);
          }
        }
      }
      EXPECT_EQ(back->impl().layout.model_fingerprint, l->impl().layout.model_fingerprint);
      EXPECT_EQ(back->stateGroups(), l->stateGroups());
      EXPECT_NE(back->describe().find("described nemotron-h-8b"), std::string::npos)
          << back->describe();
      ASSERT_NE(back->description(), nullptr);
      EXPECT_EQ(l->description(), nullptr);
    }
  }
}

// A description that leaves a record out, names a pool that is not there, places a record
// where this rank holds none, or overlaps two records is refused, naming it.
TEST(ApiLayout, FromRecordsRefusesAnIncompleteOrOverlappingDescriptionNamingTheRecord) {
  LayoutOptions o = options("vllm", 1, 0, 64, 8);
  auto l = Layout::engine(o);
  ASSERT_TRUE(l.isOk());
  const LayoutDescription good = describedAs(*l);
  ASSERT_TRUE(Layout::fromRecords(good).isOk());
  auto expectRefused = [](const LayoutDescription& d, const std::string& needle) {
    auto r = Layout::fromRecords(d);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().toString();
  };
  LayoutDescription missing = good;
  missing.records.pop_back();
  expectRefused(missing, "is not described");
  LayoutDescription twice = good;
  twice.records.push_back(good.records.front());
  expectRefused(twice, "described twice");
  LayoutDescription pool = good;
  pool.records[0].pool = "nowhere";
  expectRefused(pool, "pool 'nowhere' is not one of the pools");
  LayoutDescription layer = good;
  layer.records[0].layer = 99;
  expectRefused(layer, "this rank holds no such record");
  LayoutDescription overlap = good;
  overlap.records[1].pool = overlap.records[0].pool;
  overlap.records[1].offset = overlap.records[0].offset;
  overlap.records[1].index_stride = overlap.records[0].index_stride;
  auto r = Layout::fromRecords(overlap);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().toString();
  LayoutDescription dims = good;
  dims.records[0].dims.front().name = "nonsense";
  expectRefused(dims, "record dim nonsense is not a dim of a");
}

// The layout's own check names views and regions by index; a described layout's errors name
// the records and pools of the description instead (records[i], pools[n]).
TEST(ApiLayout, FromRecordsNamesTheRecordsAndThePoolThatOverlapOrRunPast) {
  auto l = Layout::engine(options("vllm", 1, 0, 64, 8));
  ASSERT_TRUE(l.isOk());
  const LayoutDescription good = describedAs(*l);
  ASSERT_GE(good.records.size(), 2u);
  auto refusal = [](const LayoutDescription& d) {
    auto r = Layout::fromRecords(d);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().toString();
    return r.status().message();
  };
  auto named = [&](size_t i) {
    return "records[" + std::to_string(i) + "] (layer " + std::to_string(good.records[i].layer) +
           " " + good.records[i].role + ")";
  };
  size_t pool_index = 0;
  while (good.pools[pool_index].name != good.records[0].pool) ++pool_index;
  const std::string pool =
      "pool '" + good.records[0].pool + "' (pools[" + std::to_string(pool_index) + "])";

  LayoutDescription overlap = good;
  overlap.records[1].pool = overlap.records[0].pool;
  overlap.records[1].offset = overlap.records[0].offset;
  overlap.records[1].index_stride = overlap.records[0].index_stride;
  std::string m = refusal(overlap);
  EXPECT_NE(m.find(named(0) + " and " + named(1) + " overlap in " + pool), std::string::npos) << m;
  EXPECT_EQ(m.find("view"), std::string::npos) << m;

  LayoutDescription past = good;
  past.records[0].offset = good.pools[pool_index].bytes;
  m = refusal(past);
  EXPECT_NE(m.find(named(0) + " records run past " + pool + " of length " +
                   std::to_string(good.pools[pool_index].bytes)),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("region"), std::string::npos) << m;
}

// The dtypes an engine keeps its state in unless told: vLLM 0.32 the model dtype except for
// NemotronH (fp32, MambaStateDtypeCalculator and its NemotronH hook), SGLang conv bf16 and ssm
// fp32, TensorRT-LLM ssm in the model dtype, hxfer fp32; an explicit dtype wins.
TEST(ApiLayout, EachEngineKeepsItsOwnStateDtypesByDefault) {
  auto dtypes = [](const std::string& engine, const std::string& model, std::string ssm = "") {
    LayoutOptions o;
    o.engine = engine;
    o.model = model;
    o.num_blocks = 4;
    o.num_slots = 2;
    o.tokens_per_block = 2048;
    o.ssm_dtype = ssm;
    auto l = Layout::engine(o);
    EXPECT_TRUE(l.isOk()) << engine << " " << model << ": " << l.status().toString();
    if (!l.isOk()) return std::string();
    const RankLayout& r = l->impl().layout;
    return std::string(dtypeName(r.conv_dtype)) + "/" + std::string(dtypeName(r.ssm_dtype));
  };
  EXPECT_EQ(dtypes("vllm", "qwen3-next-80b-a3b"), "bf16/bf16");
  EXPECT_EQ(dtypes("vllm", "nemotron-h-8b"), "bf16/fp32");
  EXPECT_EQ(dtypes("vllm", "qwen3-next-80b-a3b", "fp32"), "bf16/fp32");
  EXPECT_EQ(dtypes("sglang", "qwen3-next-80b-a3b"), "bf16/fp32");
  EXPECT_EQ(dtypes("trtllm-v2", "nemotron-h-8b"), "bf16/bf16");
  EXPECT_EQ(dtypes("hxfer", "qwen3-next-80b-a3b"), "bf16/fp32");
  LayoutOptions o = options("vllm", 1, 0);
  auto l = Layout::engine(o);
  ASSERT_TRUE(l.isOk());
  EXPECT_EQ(l->reservedBlocks(), std::vector<uint32_t>{0});
  o.engine = "trtllm-v2";
  EXPECT_TRUE(Layout::engine(o)->reservedBlocks().empty());
}

TEST(ApiLayout, ErrorsNameTheOptionAndTheValue) {
  auto expect = [](LayoutOptions o, StatusCode code, std::string words) {
    auto l = Layout::engine(o);
    ASSERT_FALSE(l.isOk());
    EXPECT_EQ(l.status().code(), code) << l.status().toString();
    EXPECT_NE(l.status().message().find(words), std::string::npos) << l.status().toString();
  };
  LayoutOptions o = options("nonesuch", 1, 0);
  expect(o, StatusCode::kInvalidArgument, "nonesuch");
  o = options("hxfer", 2, 2);
  expect(o, StatusCode::kInvalidArgument, "tp_rank=2");
  o = options("hxfer", 1, 0);
  o.kv_dtype = "int3";
  expect(o, StatusCode::kInvalidArgument, "kv_dtype");
  o = options("hxfer", 1, 0);
  o.model = "no-such-dir/config.json";
  expect(o, StatusCode::kNotFound, "no-such-dir/config.json");
  o = options("hxfer", 1, 0);
  o.tokens_per_block = 0;
  expect(o, StatusCode::kInvalidArgument, "tokens_per_block=0");
  o = options("vllm", 1, 0);
  o.state_layout = "layer-major";
  expect(o, StatusCode::kInvalidArgument, "vllm");
}

TEST(ApiMemory, RefusesAMissingPoolAnUnknownNameAShortBufferAndMalformedDeviceMemory) {
  auto l = Layout::engine(options("vllm", 1, 0));
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  std::map<std::string, std::vector<uint8_t>> pools;
  std::map<std::string, Buffer> buffers;
  for (const PoolInfo& p : l->pools()) {
    pools[p.name].assign(p.bytes, 0);
    buffers[p.name] = Buffer{pools[p.name].data(), p.bytes};
  }
  ASSERT_TRUE(Memory::wrap(*l, buffers).isOk());
  const std::string first = l->pools()[0].name;

  auto missing = buffers;
  missing.erase(first);
  auto m = Memory::wrap(*l, missing);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("pool " + first + " has no buffer"), std::string::npos)
      << m.status().toString();

  auto extra = buffers;
  extra["k.99"] = buffers[first];
  m = Memory::wrap(*l, extra);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("'k.99'"), std::string::npos) << m.status().toString();

  auto short_buffer = buffers;
  short_buffer[first].bytes -= 1;
  m = Memory::wrap(*l, short_buffer);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(std::to_string(l->pools()[0].bytes - 1) + " bytes"),
            std::string::npos)
      << m.status().toString();

  // Round 3, finding 10: two pools over the same bytes were accepted.
  const std::string second = l->pools()[1].name;
  auto aliased = buffers;
  std::vector<uint8_t> both(l->pools()[0].bytes + l->pools()[1].bytes);
  aliased[first] = Buffer{both.data(), l->pools()[0].bytes};
  aliased[second] = Buffer{both.data() + l->pools()[0].bytes - 1, l->pools()[1].bytes};
  m = Memory::wrap(*l, aliased);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(
      m.status().message().find("overlap: " + second + " starts " +
                                std::to_string(l->pools()[0].bytes - 1) + " bytes into " + first),
      std::string::npos)
      << m.status().toString();
  aliased[second] = Buffer{both.data() + l->pools()[0].bytes, l->pools()[1].bytes};
  EXPECT_TRUE(Memory::wrap(*l, aliased).isOk()) << "adjacent pools do not overlap";

  // Device memory: malformed buffers name the field, well-formed ones the missing path.
  auto device = buffers;
  device[first].kind = MemoryKind::kCuda;
  m = Memory::wrap(*l, device);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().toString();
  EXPECT_NE(m.status().message().find("pool " + first + ": CUDA buffer without a device"),
            std::string::npos)
      << m.status().toString();
  device[first].device = 1;
  device[first].fd = 5;
  m = Memory::wrap(*l, device);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("fd 5 given with memory of CUDA device 1"), std::string::npos)
      << m.status().toString();
  device[first].fd = -1;
  device[first].device_uuid = {0x5f, 0x0a, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66,
                               0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee};
  if (!deviceRuntime().isOk()) {
    // No CUDA here (no driver, or a build without the toolkit): said, naming pool and device.
    m = Memory::wrap(*l, device);
    ASSERT_FALSE(m.isOk());
    EXPECT_EQ(m.status().code(), StatusCode::kUnavailable) << m.status().toString();
    EXPECT_NE(m.status().message().find("pool " + first +
                                        ": memory of CUDA device 1 "
                                        "(GPU-5f0a1122-3344-5566-7788-99aabbccddee) cannot be "
                                        "moved here: "),
              std::string::npos)
        << m.status().toString();
  }
  {
    // With a runtime: host memory posing as device memory is named.
    auto fake = std::make_shared<device::FakeDevice>(device::FakeDeviceOptions{.devices = 2});
    setDeviceRuntimeForTesting(fake);
    m = Memory::wrap(*l, device);
    setDeviceRuntimeForTesting(nullptr);
    ASSERT_FALSE(m.isOk());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().toString();
    EXPECT_NE(m.status().message().find("pool " + first + ": the buffer is not " +
                                        std::to_string(l->pools()[0].bytes) +
                                        " bytes of device memory (CUDA device 1 (GPU-5f0a"),
              std::string::npos)
        << m.status().toString();
  }
  auto unknown = buffers;
  unknown[first].kind = static_cast<MemoryKind>(7);
  m = Memory::wrap(*l, unknown);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("unknown MemoryKind 7"), std::string::npos)
      << m.status().toString();

  auto bad_fd = buffers;
  bad_fd[first].fd = 0;  // stdin: not a sealed memfd
  m = Memory::wrap(*l, bad_fd);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().code(), StatusCode::kPermissionDenied) << m.status().toString();
}

// A context instance at tp 2 in layout `ctx` and a generation instance at tp 1 in layout `gen`,
// in one process over `backend`: the engine picks scattered pages on both sides, the oracle
// fills the context pages and checks every generation byte. With `fake`, every pool is its
// device memory (context ranks on devices 0 and 1, the generation rank on 0), and a pair whose
// plan packs is packed on the context rank's device (`*packed`: whether planTransfer says the
// pair packs).
// `fake`: the pools of both sides are its device memory, unless `host_ctx` or `host_gen` keep
// that side's in host memory.
void moveOneRequest(const EngineLayout& ctx, const EngineLayout& gen, const std::string& backend,
                    bool shareable, device::FakeDevice* fake = nullptr, bool* packed = nullptr,
                    bool host_ctx = false, bool host_gen = false, uint64_t staging_bytes = 0) {
  SCOPED_TRACE(ctx.toString() + " -> " + gen.toString() + " over " + backend +
               (fake == nullptr ? ""
                : host_ctx      ? ", generation pools on the device"
                : host_gen      ? ", context pools on the device"
                                : ", both sides' pools on the device"));
  auto side = [](const EngineLayout& e, uint32_t tp, uint32_t rank) {
    LayoutOptions o = options(std::string(engineName(e.engine)), tp, rank);
    if (e.engine == Engine::kHxfer) o.state_layout = std::string(stateLayoutName(e.state));
    if (e.engine == Engine::kVllm || e.engine == Engine::kTrtllmV2) {
      o.kv_layout = e.kv == KvOrder::kNhd ? "nhd" : "hnd";
    }
    if (e.engine == Engine::kVllm) o.conv_layout = e.conv == ConvOrder::kSd ? "sd" : "ds";
    if (e.shared) o.shared_tensors = "on";
    return o;
  };
  // A side's pages of the request: its blocks, its slot and, with several state groups (vllm
  // shared tensors), the further groups' ids from `first` on, pages the blocks do not use.
  auto pagesOf = [](const Layout& l, std::vector<uint32_t> blocks, uint32_t slot, uint32_t first) {
    RankPages p{std::move(blocks), slot};
    for (uint32_t g = 1; g < l.stateGroups(); ++g) p.group_slots.push_back(first + g - 1);
    return p;
  };
  auto idsOfPages = [](const RankPages& p) { return RankIds{p.blocks, *p.slot, p.group_slots}; };
  Released ctx_released, gen_released;
  std::vector<EngineRank> ctx_ranks;
  std::vector<std::unique_ptr<Sender>> senders;
  std::vector<std::string> addresses;
  for (uint32_t r = 0; r < 2; ++r) {
    ctx_ranks.push_back(EngineRank::make(side(ctx, 2, r), shareable, host_ctx ? nullptr : fake,
                                         static_cast<int>(r)));
  }
  for (uint32_t r = 0; r < 2; ++r) {
    SenderOptions so;
    so.instance = "ctx";
    so.backend = backend;
    so.token = "secret";
    so.ucx_options = {{"TLS", "tcp"}};
    so.on_released = ctx_released.callback();
    auto s = Sender::create(ctx_ranks[r].layout, *ctx_ranks[r].memory, so);
    ASSERT_TRUE(s.isOk()) << s.status().toString();
    EXPECT_EQ((*s)->backend(), backend) << (*s)->routing();
    addresses.push_back((*s)->address());
    senders.push_back(std::move(*s));
  }
  EngineRank g = EngineRank::make(side(gen, 1, 0), shareable, host_gen ? nullptr : fake, 0);
  ReceiverOptions ro;
  ro.instance = "gen";
  ro.peers = addresses;
  ro.token = "secret";
  ro.ucx_options = {{"TLS", "tcp"}};
  ro.on_released = gen_released.callback();
  if (staging_bytes > 0) ro.staging_bytes = staging_bytes;
  auto rx = Receiver::create(g.layout, *g.memory, ro);
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  ASSERT_TRUE((*rx)->waitForPeers(20s).isOk());

  const uint64_t id = 7;
  const uint32_t tokens = 60;  // 2 blocks of 32, the last one partial
  const RankPages gen_pages = pagesOf(g.layout, {9, 0}, 2, 12);
  for (uint32_t r = 0; r < 2; ++r) {
    const RankPages ctx_pages = pagesOf(ctx_ranks[r].layout, {11, 3}, 1, 4);
    ASSERT_TRUE(
        fillRank(ctx_ranks[r].rankLayout(), ctx_ranks[r].rankMemory(), idsOfPages(ctx_pages), id)
            .isOk());
    ASSERT_TRUE(senders[r]->markReady(id, ctx_pages, r == 0 ? "tok" : "").isOk());
    EXPECT_TRUE(senders[r]->holds(id));
  }
  if (packed != nullptr) {
    std::vector<Layout> ctx_layouts{ctx_ranks[0].layout, ctx_ranks[1].layout};
    std::vector<RankPages> ctx_pages{pagesOf(ctx_layouts[0], {11, 3}, 1, 4),
                                     pagesOf(ctx_layouts[1], {11, 3}, 1, 4)};
    auto plan = planTransfer(ctx_layouts, ctx_pages, g.layout, gen_pages, tokens);
    *packed = plan.status().code() == StatusCode::kIncompatible;
  }
  ASSERT_TRUE((*rx)->start(id, tokens, gen_pages).isOk());
  auto res = (*rx)->wait(id, 30s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  ASSERT_TRUE(res->ok()) << res->status.toString();
  EXPECT_EQ(res->aux, "tok");
  EXPECT_GT(res->bytes, 0u);
  auto report = checkRank(g.rankLayout(), g.rankMemory(), idsOfPages(gen_pages), id,
                          BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk()) << report.status().toString();
  EXPECT_TRUE(report->ok()) << report->toString();
  EXPECT_GT(report->bytes_checked, 0u);

  // The generation pages stay fenced until release; the context ones until answered.
  EXPECT_TRUE((*rx)->holds(id));
  EXPECT_EQ(gen_released.count(id), 0u);
  ASSERT_TRUE((*rx)->release(id).isOk());
  EXPECT_TRUE(gen_released.waitFor(id));
  EXPECT_FALSE((*rx)->holds(id));
  EXPECT_TRUE(ctx_released.waitFor(id));
  for (auto& s : senders) {
    for (int i = 0; i < 200 && s->holds(id); ++i) std::this_thread::sleep_for(10ms);
    EXPECT_FALSE(s->holds(id));
    EXPECT_EQ(s->metrics().requests_held, 0u);
  }
  EXPECT_EQ((*rx)->metrics().requests_ok, 1u);
  EXPECT_EQ((*rx)->metrics().requests_held, 0u);
}

TEST(ApiTransfer, EngineMemoryInEveryEngineLayoutMovesEveryByte) {
  const std::vector<EngineLayout> all = allEngineLayouts();
  // Every layout is a context once and a generation once, paired with the next one.
  for (size_t i = 0; i < all.size(); ++i) {
    moveOneRequest(all[i], all[(i + 3) % all.size()], "inproc", false);
  }
}

// vLLM's shared tensors through the public API: RankPages carry the group slots, both ways and
// between two such layouts, in memory and over shm.
TEST(ApiTransfer, VllmSharedTensorsMoveEveryByteWithTheirGroupSlots) {
  const std::vector<EngineLayout> shared = sharedEngineLayouts();
  const std::vector<EngineLayout> all = allEngineLayouts();
  moveOneRequest(shared[0], all[3], "inproc", false);
  moveOneRequest(all.back(), shared[1], "inproc", false);
  moveOneRequest(shared[1], shared[0], "shm", true);
}

// The pages of a request with several state groups must name each group's id once, none a
// block: refused naming the count or the page, nothing fenced.
TEST(ApiTransfer, VllmSharedTensorsRefuseMissingOrCollidingGroupSlots) {
  LayoutOptions o = options("vllm", 1, 0);
  o.shared_tensors = "on";
  EngineRank c = EngineRank::make(o);
  ASSERT_GT(c.layout.stateGroups(), 1u);
  EXPECT_TRUE(c.layout.jointIds());
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  auto s = Sender::create(c.layout, *c.memory, so);
  ASSERT_TRUE(s.isOk()) << s.status().toString();
  Status st = (*s)->markReady(1, std::vector<uint32_t>{0, 1}, 2);
  EXPECT_NE(st.message().find("0 group slots given besides the slot"), std::string::npos)
      << st.toString();
  RankPages colliding{{0, 1}, 2};
  colliding.group_slots.assign(c.layout.stateGroups() - 1, 3);
  colliding.group_slots.back() = 1;
  st = (*s)->markReady(1, colliding);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("listed twice"), std::string::npos) << st.toString();
  EXPECT_FALSE((*s)->holds(1));
}

// Round 3, finding 8: without a name a transceiver takes one unique to its process, which only
// an instance of one rank may do; the ranks of a larger instance must share a name.
TEST(ApiTransfer, AnUnnamedInstanceOfSeveralRanksIsRefusedNamingTheOption) {
  EngineRank two = EngineRank::make(options("vllm", 2, 1));
  SenderOptions so;
  so.backend = "inproc";
  auto s = Sender::create(two.layout, *two.memory, so);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("instance is empty, and the instance has 2 ranks"),
            std::string::npos)
      << s.status().toString();
  ReceiverOptions ro;
  ro.backend = "inproc";
  ro.peers = {"inproc:nowhere"};
  auto r = Receiver::create(two.layout, *two.memory, ro);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().toString();
  EngineRank one = EngineRank::make(options("vllm", 1, 0));
  s = Sender::create(one.layout, *one.memory, so);
  EXPECT_TRUE(s.isOk()) << s.status().toString();
}

TEST(ApiTransfer, SharedBuffersMoveOverShm) {
  const std::vector<EngineLayout> all = allEngineLayouts();
  moveOneRequest(all.front(), all.back(), "shm", true);
}

TEST(ApiTransfer, PrivateMemoryMovesOverUcx) {
  const std::vector<EngineLayout> all = allEngineLayouts();
  moveOneRequest(all.back(), all.front(), "ucx", false);
}

TEST(ApiRouting, AutoPicksShmForSharedBuffersAndUcxForPrivateMemorySayingWhy) {
  EngineRank shared = EngineRank::make(options("hxfer", 1, 0), true);
  EngineRank priv = EngineRank::make(options("hxfer", 1, 0), false);
  EXPECT_TRUE(shared.memory->shareable());
  EXPECT_FALSE(priv.memory->shareable());
  SenderOptions so;
  so.instance = "ctx";
  so.listen = "127.0.0.1:0";
  auto s1 = Sender::create(shared.layout, *shared.memory, so);
  ASSERT_TRUE(s1.isOk()) << s1.status().toString();
  EXPECT_EQ((*s1)->backend(), "shm") << (*s1)->routing();
  EXPECT_EQ((*s1)->address().rfind("shm:", 0), 0u) << (*s1)->address();
  auto s2 = Sender::create(priv.layout, *priv.memory, so);
  ASSERT_TRUE(s2.isOk()) << s2.status().toString();
  EXPECT_EQ((*s2)->backend(), "ucx");
  EXPECT_NE((*s2)->routing().find("private memory"), std::string::npos) << (*s2)->routing();
  EXPECT_EQ((*s2)->address().rfind("ucx:127.0.0.1:", 0), 0u) << (*s2)->address();

  // A receiver with private memory cannot take shm peers; shm asked by name with private
  // memory is refused, naming both.
  EngineRank gen = EngineRank::make(options("hxfer", 1, 0), false);
  ReceiverOptions ro;
  ro.instance = "gen";
  ro.peers = {(*s1)->address()};
  auto rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_FALSE(rx.isOk());
  EXPECT_NE(rx.status().message().find("shareable"), std::string::npos) << rx.status().toString();
  so.backend = "shm";
  auto s3 = Sender::create(gen.layout, *gen.memory, so);
  ASSERT_FALSE(s3.isOk());
  EXPECT_NE(s3.status().message().find("backend=shm"), std::string::npos) << s3.status().toString();
  // Addresses that mix backends, or name none, are refused.
  ro.peers = {"shm:a", "ucx:127.0.0.1:1"};
  ro.peer_tp = 2;
  rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_FALSE(rx.isOk());
  EXPECT_NE(rx.status().message().find("mix"), std::string::npos) << rx.status().toString();
  ro.peers = {"somewhere"};
  ro.peer_tp = 0;
  rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_FALSE(rx.isOk());
  EXPECT_NE(rx.status().message().find("somewhere"), std::string::npos) << rx.status().toString();
}

// The fake device as the process's device runtime for one test: pools in its memory, which
// the host cannot touch (a host read or write of a pool faults), on two devices.
// `options` gives other devices and faults.
struct FakeDeviceRuntime {
  std::shared_ptr<device::FakeDevice> fake;
  explicit FakeDeviceRuntime(device::FakeDeviceOptions options = {.devices = 2,
                                                                  .host_inaccessible = true})
      : fake(std::make_shared<device::FakeDevice>(options)) {
    setDeviceRuntimeForTesting(fake);
  }
  ~FakeDeviceRuntime() { setDeviceRuntimeForTesting(nullptr); }
};

// Pools in device memory through the public API over cuda: every engine layout as a context
// and as a generation, context ranks on two devices, every byte moved; pairs that order a
// state record's elements differently (conv sd against ds) are packed on the device first.
// Nothing on the host reads or writes the pools: they fault where it does.
TEST(ApiDevice, PoolsInDeviceMemoryMoveOverCudaInEveryEngineLayout) {
  FakeDeviceRuntime rt;
  const std::vector<EngineLayout> all = allEngineLayouts();
  size_t packing_pairs = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    bool packed = false;
    moveOneRequest(all[i], all[(i + 3) % all.size()], "cuda", false, rt.fake.get(), &packed);
    packing_pairs += packed ? 1 : 0;
  }
  moveOneRequest(sharedEngineLayouts()[1], all.front(), "cuda", false, rt.fake.get());
  EXPECT_GT(packing_pairs, 0u) << "no pair packs: the device pack path went untested";
  EXPECT_GT(rt.fake->opsRun(), 0u);
}

// Device pools behind ucx (the path across hosts, named here on one host): a context rank
// copies each part on the device into pinned host memory and writes it from there; a
// generation rank asks for every part staged and copies it into its pools on the device. Both
// sides on the device, and each side alone, over engine pairs of every kind, packing ones among
// them: every byte by the oracle, and nothing on the host touches the pools (they fault).
TEST(ApiDevice, DevicePoolsMoveOverUcxThroughPinnedHostMemory) {
  FakeDeviceRuntime rt;
  const std::vector<EngineLayout> all = allEngineLayouts();
  std::vector<size_t> packing_pairs;
  for (size_t i = 0; i < all.size(); i += 2) {
    bool packed = false;
    moveOneRequest(all[i], all[(i + 3) % all.size()], "ucx", false, rt.fake.get(), &packed);
    if (packed) packing_pairs.push_back(i);
  }
  ASSERT_FALSE(packing_pairs.empty())
      << "no pair packs: the device pack into host memory went untested";
  const uint64_t before = rt.fake->opsRun();
  moveOneRequest(all[1], all[4], "ucx", false, rt.fake.get(), nullptr, false, /*host_gen=*/true);
  moveOneRequest(all[3], all[0], "ucx", false, rt.fake.get(), nullptr, /*host_ctx=*/true, false);
  // Parts larger than a 4 KiB staging region go window by window (2 KiB each), gathered on the
  // host, or packed and copied on the device.
  moveOneRequest(all[3], all[0], "ucx", false, rt.fake.get(), nullptr, /*host_ctx=*/true, false,
                 4096);
  const size_t p = packing_pairs.front();
  moveOneRequest(all[p], all[(p + 3) % all.size()], "ucx", false, rt.fake.get(), nullptr, false,
                 false, 4096);
  moveOneRequest(sharedEngineLayouts()[1], all[2], "ucx", false, rt.fake.get());
  EXPECT_GT(rt.fake->opsRun(), before);
}

// A device pack that fails fails its part: the copy after it on the stream succeeds, but the
// scratch area it should have filled must not go (device pools behind ucx, a pair that packs).
TEST(ApiDevice, AFailedDevicePackBehindUcxFailsItsRequest) {
  FakeDeviceRuntime rt({.devices = 1, .fail_every = 3, .host_inaccessible = true});
  LayoutOptions ctx_options = options("vllm", 1, 0);
  ctx_options.conv_layout = "sd";
  LayoutOptions gen_options = options("vllm", 1, 0);
  gen_options.conv_layout = "ds";
  EngineRank ctx = EngineRank::make(ctx_options, false, rt.fake.get(), 0);
  EngineRank gen = EngineRank::make(gen_options);  // host memory: no device op there
  std::unique_ptr<Sender> tx = ucxSender(ctx);
  ASSERT_NE(tx, nullptr);
  std::unique_ptr<Receiver> rx = ucxReceiver(gen, *tx, nullptr);
  ASSERT_NE(rx, nullptr);
  const uint32_t tokens = 40;
  const RankPages ctx_pages{{3, 5}, 1}, gen_pages{{2, 7}, 3};
  auto move = [&](uint64_t id) {
    EXPECT_TRUE(
        fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{ctx_pages.blocks, 1}, id).isOk());
    EXPECT_TRUE(tx->markReady(id, ctx_pages).isOk());
    EXPECT_TRUE(rx->start(id, tokens, gen_pages).isOk());
    auto res = rx->wait(id, 20s);
    EXPECT_TRUE(res.isOk()) << res.status().toString();
    return res.isOk() ? *res : Result{};
  };
  // Request 1: the pack is device op 1, the copy op 2.
  const Result first = move(1);
  ASSERT_TRUE(first.ok()) << first.status.toString();
  auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 3}, 1,
                          BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  ASSERT_TRUE(rx->release(1).isOk());
  // Request 2: the pack is op 3 and fails; the copy (op 4) runs.
  const Result second = move(2);
  EXPECT_EQ(second.state, Result::State::kFailed);
  EXPECT_NE(second.status.message().find("the device pack failed: fake device: op 3 failed"),
            std::string::npos)
      << second.status.toString();
  EXPECT_EQ(rt.fake->opsRun(), 4u);
}

// A generation rank with device pools behind ucx copies each staged part into its pools on the
// device while its progress thread goes on: a request times out naming that copy while it runs,
// its pages stay fenced until it is done, and shutdown waits for a copy still running.
TEST(ApiDevice, AGenerationRankGoesOnWhileTheDeviceCopiesAStagedPart) {
  FakeDeviceRuntime rt({.devices = 1, .op_delay = 5s, .host_inaccessible = true});
  EngineRank ctx = EngineRank::make(options("sglang", 1, 0));  // host memory: no device op there
  EngineRank gen = EngineRank::make(options("sglang", 1, 0), false, rt.fake.get(), 0);
  std::unique_ptr<Sender> tx = ucxSender(ctx);
  ASSERT_NE(tx, nullptr);
  Released released;
  ReceiverOptions ro;
  ro.request_timeout = 2s;  // shorter than the device's copy (op_delay)
  std::unique_ptr<Receiver> rx = ucxReceiver(gen, *tx, &released, ro);
  ASSERT_NE(rx, nullptr);
  const uint32_t tokens = 40;
  const RankPages ctx_pages{{3, 5}, 1}, gen_pages{{2, 7}, 3};
  ASSERT_TRUE(fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{ctx_pages.blocks, 1}, 1).isOk());
  ASSERT_TRUE(tx->markReady(1, ctx_pages).isOk());
  ASSERT_TRUE(rx->start(1, tokens, gen_pages).isOk());
  auto res = rx->wait(1, 20s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_EQ(res->status.code(), StatusCode::kTimeout) << res->status.toString();
  EXPECT_NE(res->status.message().find(
                "waiting for the device's copy of context rank 0's part into the pools"),
            std::string::npos)
      << res->status.toString();
  // The copy still runs: the pages stay fenced until it is done, then hxfer releases them.
  EXPECT_TRUE(rx->holds(1));
  EXPECT_EQ(released.count(1), 0u);
  EXPECT_TRUE(released.waitFor(1, 20s));
  EXPECT_FALSE(rx->holds(1));
  EXPECT_EQ(rt.fake->opsRun(), 1u);

  // Shut down while a copy runs: shutdown waits for it and releases the pages.
  ASSERT_TRUE(fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{ctx_pages.blocks, 1}, 2).isOk());
  ASSERT_TRUE(tx->markReady(2, ctx_pages).isOk());
  ASSERT_TRUE(rx->start(2, tokens, gen_pages).isOk());
  res = rx->wait(2, 20s);  // the timeout, the copy running
  ASSERT_TRUE(res.isOk() && res->state == Result::State::kFailed) << res.status().toString();
  EXPECT_EQ(released.count(2), 0u);
  rx.reset();
  EXPECT_TRUE(released.waitFor(2, 10s));
  EXPECT_EQ(rt.fake->opsRun(), 2u);
}

// A host-memory sglang context rank and a generation rank whose pools are on the fake device
// behind ucx, with a 4 KiB staging region: a request's part (about 30 KB) goes in 1 KiB windows,
// two at a time in its 2 KiB slot.
struct WindowedPair {
  static constexpr uint32_t kTokens = 40;
  const RankPages ctx_pages{{3, 5}, 1}, gen_pages{{2, 7}, 3};
  FakeDeviceRuntime rt;
  EngineRank ctx, gen;
  Released ctx_released, gen_released;
  std::unique_ptr<Sender> tx;
  std::unique_ptr<Receiver> rx;

  explicit WindowedPair(device::FakeDeviceOptions device,
                        std::chrono::milliseconds lease = std::chrono::milliseconds(30000))
      : rt(device),
        ctx(EngineRank::make(options("sglang", 1, 0))),
        gen(EngineRank::make(options("sglang", 1, 0), false, rt.fake.get(), 0)) {
    SenderOptions so;
    so.lease_timeout = lease;
    so.on_released = ctx_released.callback();
    tx = ucxSender(ctx, so);
    ReceiverOptions ro;
    ro.staging_bytes = 4096;
    if (tx) rx = ucxReceiver(gen, *tx, &gen_released, ro);
  }
  // Request `id`: filled and marked ready on the context rank, started on the generation rank.
  void start(uint64_t id) {
    EXPECT_TRUE(
        fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{ctx_pages.blocks, 1}, id).isOk());
    EXPECT_TRUE(tx->markReady(id, ctx_pages).isOk());
    EXPECT_TRUE(rx->start(id, kTokens, gen_pages).isOk());
  }
};

// A part larger than the staging region moves window by window, two in flight: the second is
// asked for, written and queued for its copy while the first one's copy runs, and the third
// waits for the first one's half of the slot; the context rank holds the request between
// windows. A cancel then lets the context rank free its pages at once (no further window is
// asked for), the generation pages staying fenced until both copies are done; so does the
// context rank going away between windows.
TEST(ApiDevice, BetweenTwoWindowsACancelOrALostContextRankEndsThePartOnBothSides) {
  WindowedPair p({.devices = 1, .op_delay = 3s, .host_inaccessible = true});
  ASSERT_TRUE(p.tx && p.rx);
  // Two windows landed and queued for their copies on the generation rank (3 s each), and no
  // third written by the context rank.
  auto counted = [](const std::string& json, const std::string& key) {
    const size_t at = json.find("\"" + key + "\":");
    return at == std::string::npos ? -1 : std::stoi(json.substr(at + key.size() + 3));
  };
  auto written = [&](int n) {
    for (auto until = std::chrono::steady_clock::now() + 2500ms;
         counted(p.rx->metrics().json, "staging_windows") < n &&
         std::chrono::steady_clock::now() < until;) {
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(100ms);  // long enough for a third, were it asked for
    return counted(p.rx->metrics().json, "staging_windows") == n &&
           counted(p.tx->metrics().json, "writes_posted") == n;
  };
  p.start(1);
  EXPECT_TRUE(written(2)) << p.rx->metrics().json << p.tx->metrics().json;
  EXPECT_TRUE(p.tx->holds(1)) << "the context rank let go before the last window";
  EXPECT_EQ(p.tx->metrics().requests_ok, 0u);
  ASSERT_TRUE(p.rx->cancel(1).isOk());
  EXPECT_TRUE(p.ctx_released.waitFor(1, 1500ms)) << "the context rank still waits for a window";
  EXPECT_TRUE(p.rx->holds(1));
  EXPECT_EQ(p.gen_released.count(1), 0u);
  auto res = p.rx->wait(1, 1s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->status.code(), StatusCode::kCancelled) << res->status.toString();
  EXPECT_TRUE(p.gen_released.waitFor(1, 15s));
  EXPECT_EQ(p.rt.fake->opsRun(), 2u) << "not two windows in flight, or one copied after the cancel";
  const auto ctx_metrics = p.tx->metrics();
  EXPECT_EQ(ctx_metrics.requests_started, 1u);
  EXPECT_EQ(ctx_metrics.requests_cancelled, 1u) << ctx_metrics.json;
  EXPECT_EQ(ctx_metrics.requests_held, 0u);

  p.start(2);
  EXPECT_TRUE(written(4)) << p.rx->metrics().json << p.tx->metrics().json;
  p.tx.reset();  // gone between two windows
  res = p.rx->wait(2, 5s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_NE(res->status.message().find("context rank 0"), std::string::npos)
      << res->status.toString();
  EXPECT_TRUE(p.gen_released.waitFor(2, 15s));
  EXPECT_EQ(p.rt.fake->opsRun(), 4u);
}

// A window's copy into the pools that fails fails the request, and the context rank, which
// answered that window and held the request for the next, is told at once (a Cancel): it frees
// its pages long before its lease (30 s) would.
TEST(ApiDevice, AFailedWindowCopyLetsTheContextRankGoAtOnce) {
  WindowedPair p({.devices = 1, .fail_every = 2, .host_inaccessible = true});
  ASSERT_TRUE(p.tx && p.rx);
  p.start(1);
  auto res = p.rx->wait(1, 20s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_NE(res->status.message().find("fake device: op 2 failed"), std::string::npos)
      << res->status.toString();
  EXPECT_TRUE(p.ctx_released.waitFor(1, 2s)) << "the context rank still waits for a window";
  // The third window may have been asked for (its half free) before the failure was seen;
  // nothing after it.
  EXPECT_TRUE(p.gen_released.waitFor(1, 5s));
  EXPECT_GE(p.rt.fake->opsRun(), 2u);
  EXPECT_LE(p.rt.fake->opsRun(), 3u);
}

// Windows that take longer in all than the context rank's lease: the lease runs from the last
// window answered, so the part completes.
TEST(ApiDevice, WindowsOfOnePartMayTakeLongerThanTheLease) {
  WindowedPair p({.devices = 1, .op_delay = 250ms, .host_inaccessible = true}, 1s);
  ASSERT_TRUE(p.tx && p.rx);
  p.start(1);
  auto res = p.rx->wait(1, 60s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  ASSERT_TRUE(res->ok()) << res->status.toString();
  EXPECT_GT(res->latency, 1500ms) << "too few windows to outlast the lease";
  auto report = checkRank(p.gen.rankLayout(), p.gen.rankMemory(), RankIds{p.gen_pages.blocks, 3}, 1,
                          BlockRange{0, 2, WindowedPair::kTokens}, WindowedPair::kTokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  EXPECT_TRUE(p.ctx_released.waitFor(1, 5s));
  EXPECT_EQ(p.tx->metrics().leases_expired, 0u);
}

// A context rank with device pools behind ucx copies each part on the device into a host area
// while its progress thread goes on: a generation rank's cancel is answered while the copy runs,
// and the context rank's pages stay held until the copy that reads them is done; the next
// request moves whole, and shutdown ends a part whose copy still runs before freeing its pages.
TEST(ApiDevice, AContextRankGoesOnWhileTheDeviceCopiesAPart) {
  FakeDeviceRuntime rt({.devices = 1, .op_delay = 5s, .host_inaccessible = true});
  EngineRank ctx = EngineRank::make(options("sglang", 1, 0), false, rt.fake.get(), 0);
  EngineRank gen = EngineRank::make(options("sglang", 1, 0));  // host memory: no device op there
  Released ctx_released, gen_released;
  SenderOptions so;
  so.on_released = ctx_released.callback();
  std::unique_ptr<Sender> tx = ucxSender(ctx, so);
  ASSERT_NE(tx, nullptr);
  std::unique_ptr<Receiver> rx = ucxReceiver(gen, *tx, &gen_released);
  ASSERT_NE(rx, nullptr);
  const uint32_t tokens = 40;
  const RankPages ctx_pages{{3, 5}, 1}, gen_pages{{2, 7}, 3};
  auto begin = [&](uint64_t id) {
    EXPECT_TRUE(
        fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{ctx_pages.blocks, 1}, id).isOk());
    EXPECT_TRUE(tx->markReady(id, ctx_pages).isOk());
    EXPECT_TRUE(rx->start(id, tokens, gen_pages).isOk());
    std::this_thread::sleep_for(1s);  // the context rank has the request: its copy runs
  };
  // Cancelled during the copy: the context rank answers long before the copy (5 s) ends, so
  // the generation rank's pages are released; its own stay held until the copy is done.
  begin(1);
  ASSERT_TRUE(rx->cancel(1).isOk());
  EXPECT_TRUE(gen_released.waitFor(1, 2s));
  EXPECT_EQ(rt.fake->opsRun(), 0u);
  EXPECT_EQ(ctx_released.count(1), 0u);
  auto res = rx->wait(1, 1s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_EQ(res->status.code(), StatusCode::kCancelled) << res->status.toString();
  EXPECT_TRUE(ctx_released.waitFor(1, 10s));
  EXPECT_EQ(rt.fake->opsRun(), 1u);
  // The next request waits for its copy and lands whole.
  begin(2);
  res = rx->wait(2, 30s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  ASSERT_TRUE(res->ok()) << res->status.toString();
  auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 3}, 2,
                          BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  EXPECT_EQ(rt.fake->opsRun(), 2u);
  ASSERT_TRUE(rx->release(2).isOk());
  // Shut down during a copy: the part ends unposted, the context rank's pages are freed, and
  // the generation rank learns its peer is gone.
  begin(3);
  tx.reset();
  EXPECT_TRUE(ctx_released.waitFor(3, 1s));
  EXPECT_EQ(rt.fake->opsRun(), 3u);  // shutdown waited for the copy before the area went
  res = rx->wait(3, 20s);
  ASSERT_TRUE(res.isOk()) << res.status().toString();
  EXPECT_EQ(res->state, Result::State::kFailed) << res->status.toString();
}

// Device copies queue on the context rank's one copy stream: each part's stall clock starts
// when the copies ahead of it are done, not when it was queued. Four parts whose copies take
// 1 s each, asked at once with a 2.5 s stall_timeout: the last one waits 3 s for its turn, and
// all four land (without the turn rule the third and fourth would time out).
TEST(ApiDevice, QueuedDeviceCopiesStartTheirStallClockWhenTheirTurnComes) {
  FakeDeviceRuntime rt({.devices = 1, .op_delay = 1s, .host_inaccessible = true});
  EngineRank ctx = EngineRank::make(options("sglang", 1, 0), false, rt.fake.get(), 0);
  EngineRank gen = EngineRank::make(options("sglang", 1, 0));  // host memory: no device op there
  SenderOptions so;
  so.stall_timeout = 2500ms;
  std::unique_ptr<Sender> tx = ucxSender(ctx, so);
  ASSERT_NE(tx, nullptr);
  std::unique_ptr<Receiver> rx = ucxReceiver(gen, *tx, nullptr);
  ASSERT_NE(rx, nullptr);
  const uint32_t tokens = 40, n = 4;
  auto ctx_pages = [](uint32_t i) { return RankPages{{2 * i, 2 * i + 1}, i}; };
  auto gen_pages = [](uint32_t i) { return RankPages{{8 + 2 * i, 9 + 2 * i}, i}; };
  for (uint32_t i = 0; i < n; ++i) {
    const RankPages c = ctx_pages(i);
    ASSERT_TRUE(
        fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{c.blocks, *c.slot}, 1 + i).isOk());
    ASSERT_TRUE(tx->markReady(1 + i, c).isOk());
  }
  for (uint32_t i = 0; i < n; ++i) ASSERT_TRUE(rx->start(1 + i, tokens, gen_pages(i)).isOk());
  for (uint32_t i = 0; i < n; ++i) {
    auto res = rx->wait(1 + i, 30s);
    ASSERT_TRUE(res.isOk()) << res.status().toString();
    EXPECT_TRUE(res->ok()) << "request " << 1 + i << ": " << res->status.toString();
    const RankPages g = gen_pages(i);
    auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{g.blocks, *g.slot}, 1 + i,
                            BlockRange{0, 2, tokens}, tokens);
    EXPECT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
    ASSERT_TRUE(rx->release(1 + i).isOk());
  }
  EXPECT_EQ(rt.fake->opsRun(), n);
  EXPECT_NE(tx->metrics().json.find("\"writes_stalled\":0"), std::string::npos)
      << tx->metrics().json;
}

// Starts requests 1..n on disjoint pages (context blocks {2i, 2i+1} and slot i, generation
// blocks {8+2i, 9+2i} and slot i; the context pages not filled) and waits for each: every one
// must fail Timeout naming `words`. Returns how long they took together.
std::chrono::steady_clock::duration expectAllStall(Sender& tx, Receiver& rx, uint32_t n,
                                                   const std::string& words) {
  const uint32_t tokens = 40;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_TRUE(tx.markReady(1 + i, RankPages{{2 * i, 2 * i + 1}, i}).isOk());
    EXPECT_TRUE(rx.start(1 + i, tokens, RankPages{{8 + 2 * i, 9 + 2 * i}, i}).isOk());
  }
  for (uint32_t i = 0; i < n; ++i) {
    auto res = rx.wait(1 + i, 30s);
    EXPECT_TRUE(res.isOk()) << res.status().toString();
    if (!res.isOk()) continue;
    EXPECT_EQ(res->state, Result::State::kFailed) << "request " << 1 + i;
    EXPECT_EQ(res->status.code(), StatusCode::kTimeout) << res->status.toString();
    EXPECT_NE(res->status.message().find(words), std::string::npos) << res->status.toString();
    EXPECT_TRUE(rx.release(1 + i).isOk());
  }
  return std::chrono::steady_clock::now() - t0;
}

// A copy that does not end (6 s against a 1 s stall_timeout) holds up the copies queued behind
// it; they still end: their clocks start when it stalled, and their parts are answered Timeout
// long before it is done.
TEST(ApiDevice, PartsQueuedBehindAStuckDeviceCopyStillTimeOut) {
  FakeDeviceRuntime rt({.devices = 1, .op_delay = 6s, .host_inaccessible = true});
  EngineRank ctx = EngineRank::make(options("sglang", 1, 0), false, rt.fake.get(), 0);
  EngineRank gen = EngineRank::make(options("sglang", 1, 0));  // host memory: no device op there
  SenderOptions so;
  so.stall_timeout = 1s;
  std::unique_ptr<Sender> tx = ucxSender(ctx, so);
  ASSERT_NE(tx, nullptr);
  std::unique_ptr<Receiver> rx = ucxReceiver(gen, *tx, nullptr);
  ASSERT_NE(rx, nullptr);
  EXPECT_LT(expectAllStall(*tx, *rx, 3, "device's copy into host memory"), 5s)
      << "the parts waited for the stuck copy";
  EXPECT_EQ(rt.fake->opsRun(), 0u);  // the first copy still runs
  EXPECT_NE(tx->metrics().json.find("\"writes_stalled\":3"), std::string::npos)
      << tx->metrics().json;
}

// The same over cuda, where each write waits for its part's device pack: a pack that does not
// end holds up the packs queued behind it, and their writes still time out.
TEST(ApiDevice, WritesWaitingBehindAStuckDevicePackStillTimeOut) {
  FakeDeviceRuntime rt({.devices = 1, .op_delay = 6s, .host_inaccessible = true});
  LayoutOptions ctx_options = options("vllm", 1, 0);
  ctx_options.conv_layout = "sd";
  LayoutOptions gen_options = options("vllm", 1, 0);
  gen_options.conv_layout = "ds";  // conv sd against ds: every part is packed first
  EngineRank ctx = EngineRank::make(ctx_options, false, rt.fake.get(), 0);
  EngineRank gen = EngineRank::make(gen_options, false, rt.fake.get(), 0);
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "cuda";
  so.stall_timeout = 1s;
  std::unique_ptr<Sender> tx = createdSender(ctx, so);
  ASSERT_NE(tx, nullptr);
  std::unique_ptr<Receiver> rx = connectedReceiver(gen, *tx, nullptr);
  ASSERT_NE(rx, nullptr);
  EXPECT_LT(expectAllStall(*tx, *rx, 2, "made no progress"), 5s)
      << "a write waited for the stuck pack";
  EXPECT_NE(tx->metrics().json.find("\"writes_stalled\":2"), std::string::npos)
      << tx->metrics().json;
}

// A generation rank with device pools behind ucx takes each part through its staging region:
// a part waits while the region holds another, one larger than the whole region goes window by
// window, and no staging region at all is refused at create, naming staging_bytes.
TEST(ApiDevice, DevicePoolsBehindUcxWaitForRoomAndTakeLargePartsInWindows) {
  FakeDeviceRuntime rt;
  LayoutOptions ctx_options = options("trtllm-v2", 2, 0);
  std::vector<EngineRank> ctx;
  for (uint32_t r = 0; r < 2; ++r) {
    ctx_options.tp_rank = r;
    ctx.push_back(EngineRank::make(ctx_options, false, rt.fake.get(), static_cast<int>(r)));
  }
  EngineRank gen = EngineRank::make(options("trtllm-v2", 1, 0), false, rt.fake.get(), 0);
  Released ctx_released, gen_released;
  std::vector<std::unique_ptr<Sender>> senders;
  std::vector<std::string> addresses;
  for (EngineRank& c : ctx) {
    SenderOptions so;
    so.instance = "ctx";
    so.backend = "ucx";
    so.ucx_options = {{"TLS", "tcp"}};
    so.on_released = ctx_released.callback();
    auto tx = Sender::create(c.layout, *c.memory, so);
    ASSERT_TRUE(tx.isOk()) << tx.status().toString();
    addresses.push_back((*tx)->address());
    senders.push_back(std::move(*tx));
  }
  auto receiver = [&](uint64_t staging_bytes) -> StatusOr<std::unique_ptr<Receiver>> {
    ReceiverOptions ro;
    ro.instance = "gen";
    ro.backend = "ucx";
    ro.peers = addresses;
    ro.ucx_options = {{"TLS", "tcp"}};
    ro.staging_bytes = staging_bytes;
    ro.request_timeout = 10s;
    ro.on_released = gen_released.callback();
    ASSIGN_OR_RETURN(std::unique_ptr<Receiver> rx, Receiver::create(gen.layout, *gen.memory, ro));
    RETURN_IF_ERROR(rx->waitForPeers(20s));
    return rx;
  };
  auto none = receiver(0);
  ASSERT_FALSE(none.isOk());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status().toString();
  EXPECT_NE(none.status().message().find("staging_bytes is 0"), std::string::npos)
      << none.status().toString();
  const uint32_t tokens = 64;
  const RankPages ctx_pages{{5, 2}, 1}, gen_pages{{3, 8}, 2};
  auto move = [&](Receiver& rx, uint64_t id) {
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_TRUE(
          fillRank(ctx[r].rankLayout(), ctx[r].rankMemory(), RankIds{ctx_pages.blocks, 1}, id)
              .isOk());
      EXPECT_TRUE(senders[r]->markReady(id, ctx_pages).isOk());
    }
    EXPECT_TRUE(rx.start(id, tokens, gen_pages).isOk());
    auto res = rx.wait(id, 30s);
    EXPECT_TRUE(res.isOk()) << res.status().toString();
    return res.isOk() ? *res : Result{};
  };
  // The request's bytes with room for both parts at once.
  auto roomy = receiver(64ull << 20);
  ASSERT_TRUE(roomy.isOk()) << roomy.status().toString();
  const Result first = move(**roomy, 1);
  ASSERT_TRUE(first.ok()) << first.status.toString();
  auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 2}, 1,
                          BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  ASSERT_TRUE((*roomy)->release(1).isOk());
  roomy->reset();
  const uint64_t part = first.bytes / 2;  // tp 2 -> 1: each context rank sends half
  ASSERT_EQ(part, 11008u) << "the windows counted below are for parts of 11,008 bytes";

  // Room for one part at a time: the second waits for the first to land, then comes.
  auto tight = receiver(part + part / 2);
  ASSERT_TRUE(tight.isOk()) << tight.status().toString();
  const Result second = move(**tight, 2);
  ASSERT_TRUE(second.ok()) << second.status.toString();
  report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 2}, 2,
                     BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  ASSERT_TRUE((*tight)->release(2).isOk());
  tight->reset();

  // Room is given first come, first served. A's first part holds its slot (the context ranks
  // have not marked A ready) and A's second waits for room; B's parts are smaller and one of
  // them would fit beside A's first, yet B waits behind A's second part.
  const uint32_t b_tokens = 20;  // one block
  const RankPages ctx_b{{7}, 2}, gen_b{{10}, 3};
  auto mark = [&](uint64_t id, const RankPages& pages) {
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_TRUE(
          fillRank(ctx[r].rankLayout(), ctx[r].rankMemory(), RankIds{pages.blocks, *pages.slot}, id)
              .isOk());
      EXPECT_TRUE(senders[r]->markReady(id, pages).isOk());
    }
  };
  auto roomy_b = receiver(64ull << 20);
  ASSERT_TRUE(roomy_b.isOk()) << roomy_b.status().toString();
  mark(4, ctx_b);
  ASSERT_TRUE((*roomy_b)->start(4, b_tokens, gen_b).isOk());
  auto b_alone = (*roomy_b)->wait(4, 30s);
  ASSERT_TRUE(b_alone.isOk() && b_alone->ok()) << b_alone.status().toString();
  ASSERT_TRUE((*roomy_b)->release(4).isOk());
  roomy_b->reset();
  const uint64_t b_part = b_alone->bytes / 2;
  ASSERT_LT(b_part, part);
  auto fifo = receiver(((part + 63) & ~uint64_t{63}) + b_part);
  ASSERT_TRUE(fifo.isOk()) << fifo.status().toString();
  ASSERT_TRUE((*fifo)->start(5, tokens, gen_pages).isOk());  // A: not marked ready yet
  mark(6, ctx_b);
  ASSERT_TRUE((*fifo)->start(6, b_tokens, gen_b).isOk());  // B: ready on both context ranks
  auto b_early = (*fifo)->wait(6, 1s);
  ASSERT_TRUE(b_early.isOk()) << b_early.status().toString();
  EXPECT_FALSE(b_early->terminal()) << "B went ahead of A's waiting part";
  mark(5, ctx_pages);
  for (uint64_t id : {5, 6}) {
    auto res = (*fifo)->wait(id, 30s);
    ASSERT_TRUE(res.isOk() && res->ok()) << id << ": " << res.status().toString();
  }
  report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 2}, 5,
                     BlockRange{0, 2, tokens}, tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_b.blocks, 3}, 6,
                     BlockRange{0, 1, b_tokens}, b_tokens);
  ASSERT_TRUE(report.isOk() && report->ok()) << (report.isOk() ? report->toString() : "");
  fifo->reset();

  // No room for a whole part: each goes window by window through a slot of half the region
  // (wire 1.7), two windows in flight in the slot's halves, the windows cutting runs anywhere,
  // and lands as a whole part would. A slot of 64 bytes (a 200-byte region) holds one window,
  // as does one below 128 bytes (the whole of a 100-byte region). The context ranks count the
  // request once, with all its bytes.
  // Both sides count the windows (staging_windows): the generation rank those copied into the
  // pools, each context rank those it wrote.
  auto counted = [](const std::string& json, const std::string& key) -> uint64_t {
    const size_t at = json.find("\"" + key + "\":");
    return at == std::string::npos ? ~uint64_t{0} : std::stoull(json.substr(at + key.size() + 3));
  };
  EXPECT_EQ(counted(senders[0]->metrics().json, "staging_windows"), 0u) << "parts went whole";
  const std::vector<uint64_t> regions = {part - 64, 4096, 200, 100};
  for (size_t i = 0; i < regions.size(); ++i) {
    const uint64_t region = regions[i];
    auto small = receiver(region);
    ASSERT_TRUE(small.isOk()) << small.status().toString();
    const uint64_t id = 10 + i;
    const uint64_t written = counted(senders[0]->metrics().json, "staging_windows") +
                             counted(senders[1]->metrics().json, "staging_windows");
    const auto before = senders[0]->metrics();
    const auto parts_at = before.json.find("\"storm_parts\":");
    ASSERT_NE(parts_at, std::string::npos) << before.json;
    const uint64_t before_parts = std::stoull(before.json.substr(parts_at + 14));
    const Result windowed = move(**small, id);
    ASSERT_TRUE(windowed.ok()) << region << ": " << windowed.status.toString();
    EXPECT_EQ(windowed.bytes, first.bytes);
    report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_pages.blocks, 2}, id,
                       BlockRange{0, 2, tokens}, tokens);
    ASSERT_TRUE(report.isOk() && report->ok())
        << region << ": " << (report.isOk() ? report->toString() : "");
    const auto after = senders[0]->metrics();
    EXPECT_EQ(after.requests_started - before.requests_started, 1u) << region;
    EXPECT_EQ(after.requests_ok - before.requests_ok, 1u) << region;
    EXPECT_EQ(after.bytes - before.bytes, part) << region;
    // Both sides count each part's storm once, whatever its windows.
    EXPECT_NE(after.json.find("\"storm_parts\":" + std::to_string(before_parts + 1)),
              std::string::npos)
        << after.json;
    EXPECT_NE((*small)->metrics().json.find("\"storm_parts\":2"), std::string::npos)
        << (*small)->metrics().json;
    // Two parts of 11,008 bytes: windows of 2,688 bytes (a 10,944-byte region, its 5,440-byte
    // slot in halves), 1,024 (4 KiB), 64 (200 bytes: a 64-byte slot, one half) and 100 (100
    // bytes: the whole region, one half).
    const uint64_t copied = counted((*small)->metrics().json, "staging_windows");
    EXPECT_EQ(copied, (std::vector<uint64_t>{10, 22, 344, 222}[i])) << region;
    EXPECT_EQ(counted(senders[0]->metrics().json, "staging_windows") +
                  counted(senders[1]->metrics().json, "staging_windows") - written,
              copied)
        << region;
    ASSERT_TRUE((*small)->release(id).isOk());
  }
}

// Device memory: auto picks cuda, saying why; the host paths are refused naming what is
// missing (shm/inproc by name, checksums, a mix of host and device pools, a buffer on another
// device than it says).
TEST(ApiDevice, AutoPicksCudaAndRefusesHostPathsNamingThem) {
  FakeDeviceRuntime rt;
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0), false, rt.fake.get(), 1);
  EngineRank gen = EngineRank::make(options("hxfer", 1, 0), false, rt.fake.get(), 0);
  EXPECT_TRUE(ctx.memory->device());
  EXPECT_FALSE(ctx.memory->shareable());
  SenderOptions so;
  so.instance = "ctx";
  so.listen = "127.0.0.1:0";  // a ucx address: not used by cuda
  auto tx = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_TRUE(tx.isOk()) << tx.status().toString();
  EXPECT_EQ((*tx)->backend(), "cuda");
  EXPECT_NE((*tx)->routing().find("CUDA device memory"), std::string::npos) << (*tx)->routing();
  EXPECT_EQ((*tx)->address().rfind("cuda:@", 0), 0u) << (*tx)->address();

  for (const char* host : {"shm", "inproc"}) {
    so.backend = host;
    auto s = Sender::create(gen.layout, *gen.memory, so);
    ASSERT_FALSE(s.isOk()) << host;
    EXPECT_NE(s.status().message().find(std::string("backend=") + host + " is impossible"),
              std::string::npos)
        << s.status().toString();
    EXPECT_NE(s.status().message().find("CUDA device memory"), std::string::npos)
        << s.status().toString();
  }
  so.backend = "auto";
  so.checksum = true;
  auto summed = Sender::create(gen.layout, *gen.memory, so);
  ASSERT_FALSE(summed.isOk());
  EXPECT_EQ(summed.status().code(), StatusCode::kIncompatible) << summed.status().toString();
  EXPECT_NE(summed.status().message().find("checksum=true"), std::string::npos);
  EXPECT_FALSE(gen.memory->impl().in_use) << "a refused Sender hands the memory back";

  ReceiverOptions ro;
  ro.instance = "gen";
  ro.peers = {(*tx)->address()};
  ro.checksum = true;
  auto rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_FALSE(rx.isOk());
  EXPECT_EQ(rx.status().code(), StatusCode::kIncompatible) << rx.status().toString();
  ro.checksum = false;
  rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  EXPECT_EQ((*rx)->backend(), "cuda");
  ASSERT_TRUE((*rx)->waitForPeers(10s).isOk());

  // Host and device pools in one Memory; a buffer on another device than it names.
  std::map<std::string, Buffer> buffers;
  std::vector<uint8_t> host;
  for (const PoolInfo& p : gen.layout.pools()) {
    buffers[p.name] = Buffer{gen.device_pools.at(p.name)->data(), p.bytes, MemoryKind::kCuda};
    buffers[p.name].device = 0;
  }
  const std::string first = gen.layout.pools()[0].name;
  const std::string last = gen.layout.pools().back().name;
  buffers[first].device = 1;
  auto m = Memory::wrap(gen.layout, buffers);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("pool " + first +
                                      ": Buffer::device is 1, and the memory is CUDA device 0's"),
            std::string::npos)
      << m.status().toString();
  buffers[first].device = 0;
  buffers[first].device_uuid[0] = 0x42;
  m = Memory::wrap(gen.layout, buffers);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find("Buffer::device_uuid is GPU-42"), std::string::npos)
      << m.status().toString();
  buffers[first].device_uuid = {};
  host.assign(gen.layout.pools().back().bytes, 0);
  buffers[last] = Buffer{host.data(), host.size()};
  m = Memory::wrap(gen.layout, buffers);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().message().find(" host memory: a Memory's pools are all host or all device"),
            std::string::npos)
      << m.status().toString();
}

// Whether the host view of every pool of `r` still holds `before` (pool by pool).
bool poolsUnchanged(const EngineRank& r,
                    const std::map<std::string, std::vector<uint8_t>>& before) {
  for (const auto& [name, bytes] : before) {
    const uint8_t* now = r.fake->hostView(r.device_pools.at(name)->data());
    if (std::memcmp(now, bytes.data(), bytes.size()) != 0) return false;
  }
  return true;
}

std::map<std::string, std::vector<uint8_t>> snapshot(const EngineRank& r) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const PoolInfo& p : r.layout.pools()) {
    const uint8_t* v = r.fake->hostView(r.device_pools.at(p.name)->data());
    out[p.name].assign(v, v + p.bytes);
  }
  return out;
}

void engineEventsFenceTheWrites(const std::string& ctx_conv);

// The engine's events fence hxfer's writes into device pools: nothing moves before the context
// side's "layers ready" event, nothing lands in generation pages before their "pages free"
// event (vLLM's overwrite race: a step still reading a slot that a transfer overwrote); a
// failed event fails the request naming it; events are refused for host pools, null, or not
// the device's.
TEST(ApiDevice, EngineEventsFenceTheWritesIntoDevicePools) {
  for (const char* ctx_conv : {"ds", "sd"}) {  // "sd" against "ds": packed on the device
    SCOPED_TRACE(std::string("context conv ") + ctx_conv);
    engineEventsFenceTheWrites(ctx_conv);
  }
}

void engineEventsFenceTheWrites(const std::string& ctx_conv) {
  FakeDeviceRuntime rt;
  LayoutOptions ctx_options = options("vllm", 1, 0);
  ctx_options.conv_layout = ctx_conv;
  LayoutOptions gen_options = options("vllm", 1, 0);
  gen_options.conv_layout = "ds";
  EngineRank ctx = EngineRank::make(ctx_options, false, rt.fake.get(), 1);
  EngineRank gen = EngineRank::make(gen_options, false, rt.fake.get(), 0);
  Released ctx_released, gen_released;
  SenderOptions so;
  so.instance = "ctx";
  so.on_released = ctx_released.callback();
  auto tx = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_TRUE(tx.isOk()) << tx.status().toString();
  ReceiverOptions ro;
  ro.request_timeout = 3s;  // above every wait below; the last request runs into it
  auto rx = connectedReceiver(gen, **tx, &gen_released, ro);
  ASSERT_NE(rx, nullptr);
  ASSERT_EQ(rx->backend(), "cuda");
  const uint32_t tokens = 40;
  auto move = [&](uint64_t id, const RankPages& from, const RankPages& to) {
    EXPECT_TRUE(
        fillRank(ctx.rankLayout(), ctx.rankMemory(), RankIds{from.blocks, *from.slot}, id).isOk());
  };
  auto check = [&](uint64_t id, const RankPages& to) {
    auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{to.blocks, *to.slot}, id,
                            BlockRange{0, static_cast<uint32_t>(to.blocks.size()), tokens}, tokens);
    ASSERT_TRUE(report.isOk()) << report.status().toString();
    EXPECT_TRUE(report->ok()) << report->toString();
  };

  // Layers ready: the context's kernels still write the pages (filled only after markReady
  // and start), so nothing may be read or moved before the event.
  const RankPages ctx1{{3, 5}, 1}, gen1{{2, 7}, 3};
  auto layers_ready = rt.fake->engineEvent();
  ASSERT_TRUE((*tx)->markReady(1, ctx1, DeviceEvent{layers_ready.get()}, "tok").isOk());
  const auto before1 = snapshot(gen);
  ASSERT_TRUE(rx->start(1, tokens, gen1).isOk());
  std::this_thread::sleep_for(100ms);
  move(1, ctx1, gen1);  // the prefill kernel's writes
  std::this_thread::sleep_for(100ms);
  auto res = rx->poll(1);
  ASSERT_TRUE(res.isOk());
  EXPECT_EQ(res->state, Result::State::kInProgress);
  EXPECT_TRUE(poolsUnchanged(gen, before1)) << "bytes moved before the layers were ready";
  // Meanwhile another request, ready now, moves: it does not wait behind request 1's event.
  const RankPages ctx9{{6, 8}, 2}, gen9{{4, 9}, 2};
  move(9, ctx9, gen9);
  ASSERT_TRUE((*tx)->markReady(9, ctx9).isOk());
  ASSERT_TRUE(rx->start(9, tokens, gen9).isOk());
  res = rx->wait(9, 5s);
  ASSERT_TRUE(res.isOk() && res->ok())
      << "a ready request waited behind another's event: " << res->status.toString();
  check(9, gen9);
  ASSERT_TRUE(rx->release(9).isOk());
  EXPECT_EQ(rx->poll(1)->state, Result::State::kInProgress);
  layers_ready->signal();
  res = rx->wait(1, 10s);
  ASSERT_TRUE(res.isOk() && res->ok()) << res->status.toString();
  EXPECT_EQ(res->aux, "tok");
  check(1, gen1);
  ASSERT_TRUE(rx->release(1).isOk());

  // Pages free: the generation engine still reads the slot and blocks it reuses.
  const RankPages ctx2{{0, 1}, 0}, gen2{{2, 7}, 3};
  move(2, ctx2, gen2);
  ASSERT_TRUE((*tx)->markReady(2, ctx2).isOk());
  auto pages_free = rt.fake->engineEvent();
  const auto before2 = snapshot(gen);
  ASSERT_TRUE(rx->start(2, tokens, gen2, DeviceEvent{pages_free.get()}).isOk());
  std::this_thread::sleep_for(200ms);
  res = rx->poll(2);
  ASSERT_TRUE(res.isOk());
  EXPECT_EQ(res->state, Result::State::kInProgress);
  EXPECT_TRUE(poolsUnchanged(gen, before2)) << "a write landed in pages the engine still used";
  pages_free->signal();
  res = rx->wait(2, 10s);
  ASSERT_TRUE(res.isOk() && res->ok()) << res->status.toString();
  check(2, gen2);
  ASSERT_TRUE(rx->release(2).isOk());

  // Failed events fail their request, naming them; pages come back on both sides.
  auto faulted = rt.fake->engineEvent();
  ASSERT_TRUE(rx->start(3, tokens, gen2, DeviceEvent{faulted.get()}).isOk());
  faulted->signal(Internal("illegal address in the decode step"));
  res = rx->wait(3, 10s);
  ASSERT_TRUE(res.isOk());
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_NE(res->status.message().find("the engine's pages-free event"), std::string::npos)
      << res->status.toString();
  EXPECT_NE(res->status.message().find("illegal address"), std::string::npos);
  EXPECT_TRUE(gen_released.waitFor(3));
  auto bad_layers = rt.fake->engineEvent();
  ASSERT_TRUE((*tx)->markReady(4, ctx2, DeviceEvent{bad_layers.get()}).isOk());
  ASSERT_TRUE(rx->start(4, tokens, gen2).isOk());
  bad_layers->signal(Internal("prefill kernel failed"));
  res = rx->wait(4, 10s);
  ASSERT_TRUE(res.isOk());
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_NE(res->status.message().find("the engine's layers-ready event: prefill kernel failed"),
            std::string::npos)
      << res->status.toString();
  EXPECT_TRUE(ctx_released.waitFor(4));
  // An event that never completes: the request times out, saying what it waited for.
  auto stuck = rt.fake->engineEvent();
  ASSERT_TRUE((*tx)->markReady(6, ctx2).isOk());
  ASSERT_TRUE(rx->start(6, tokens, gen2, DeviceEvent{stuck.get()}).isOk());
  res = rx->wait(6, 10s);
  ASSERT_TRUE(res.isOk());
  EXPECT_EQ(res->state, Result::State::kFailed);
  EXPECT_EQ(res->status.code(), StatusCode::kTimeout) << res->status.toString();
  EXPECT_NE(res->status.message().find("waiting for the engine's pages-free event"),
            std::string::npos)
      << res->status.toString();
  EXPECT_TRUE(gen_released.waitFor(6));
  stuck->signal();

  // Refused: a null event, one that is not the device's, and any event with host pools.
  Status st = rx->start(5, tokens, gen2, DeviceEvent{});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("DeviceEvent::cuda_event is null"), std::string::npos)
      << st.toString();
  int not_an_event = 0;
  st = (*tx)->markReady(5, ctx2, DeviceEvent{&not_an_event});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not an engine event"), std::string::npos) << st.toString();
  EXPECT_FALSE((*tx)->holds(5));
  EngineRank host = EngineRank::make(options("vllm", 1, 0));
  SenderOptions hso;
  hso.backend = "inproc";
  auto htx = Sender::create(host.layout, *host.memory, hso);
  ASSERT_TRUE(htx.isOk());
  st = (*htx)->markReady(1, ctx2, DeviceEvent{layers_ready.get()});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a DeviceEvent given with pools in host memory"), std::string::npos)
      << st.toString();
}

TEST(ApiPages, MarkReadyRefusesPagesOutsideOrTwiceAndLetsRequestsSharePages) {
  EngineRank ctx = EngineRank::make(options("trtllm-v2", 1, 0));
  Released released;
  auto tx = inprocSender(ctx, released);
  ASSERT_NE(tx, nullptr);
  const std::vector<uint32_t> outside = {3, 16}, twice = {3, 3}, ok = {3, 4};
  Status s = tx->markReady(1, outside, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block 16 is outside the pool of 16"), std::string::npos)
      << s.toString();
  s = tx->markReady(1, twice, 0);
  EXPECT_NE(s.message().find("block 3 listed twice"), std::string::npos) << s.toString();
  s = tx->markReady(1, ok, std::nullopt);
  EXPECT_NE(s.message().find("no slot given"), std::string::npos) << s.toString();
  s = tx->markReady(1, ok, 9);
  EXPECT_NE(s.message().find("slot 9 is outside"), std::string::npos) << s.toString();
  EXPECT_FALSE(tx->holds(1));

  ASSERT_TRUE(tx->markReady(1, ok, 0).isOk());
  const std::vector<uint32_t> overlap = {5, 4};
  s = tx->markReady(1, overlap, 1);
  EXPECT_NE(s.message().find("already known"), std::string::npos) << s.toString();
  s = tx->markReady(3, std::vector<uint32_t>{7}, 2, std::string(20000, 'x'));
  EXPECT_NE(s.message().find("aux is 20000 bytes"), std::string::npos) << s.toString();
  EXPECT_FALSE(tx->holds(3));

  // The sender only reads its pages, so requests may share them (a cached prompt prefix):
  // block 4 and slot 0 stay fenced until the last request naming them is released.
  ASSERT_TRUE(tx->markReady(2, overlap, 0).isOk());
  ASSERT_TRUE(tx->cancel(1).isOk());
  ASSERT_TRUE(released.waitFor(1));
  EXPECT_FALSE(tx->holds(1));
  EXPECT_TRUE(tx->holds(2));
  const CacheCounters c = ctx.memory->impl().cache->counters();
  EXPECT_EQ(c.free_blocks, 16u - 2u) << "blocks 4 and 5 are still read by request 2";
  EXPECT_EQ(c.free_slots, 4u - 1u);
  EXPECT_TRUE(ctx.memory->impl().cache->selfCheck().isOk());
  tx->shutdown();
  EXPECT_TRUE(released.waitFor(2));
  EXPECT_EQ(released.count(1), 1u);
  EXPECT_EQ(ctx.memory->impl().cache->counters().free_blocks, 16u);
  EXPECT_EQ(tx->markReady(4, ok, 0).code(), StatusCode::kUnavailable);
}

// A prompt prefix cached once on the context side: two requests in flight name the same
// block, both move, and both generation copies hold the shared block's bytes. Then a prefix
// cached once on the generation side: two requests name it as held, only their tails move.
TEST(ApiTransfer, RequestsSharingACachedPrefixBlockBothMove) {
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0));
  EngineRank gen = EngineRank::make(options("hxfer", 1, 0));
  const PoolInfo* kv = ctx.layout.pool("kv0");
  ASSERT_NE(kv, nullptr);
  ASSERT_GE(kv->shape.size(), 2u);  // [blocks, ...]: a block's bytes are one row
  ASSERT_EQ(kv->shape[0], 16u);
  const uint64_t row = kv->strides[0];
  auto& ctx_kv = ctx.pools.at("kv0");
  for (uint64_t i = 0; i < ctx_kv.size(); ++i) ctx_kv[i] = static_cast<uint8_t>(i * 7 / 3);
  Released released;
  auto tx = inprocSender(ctx, released);
  ASSERT_NE(tx, nullptr);
  auto rx = connectedReceiver(gen, *tx, nullptr);
  ASSERT_NE(rx, nullptr);
  // Block 2 is the shared prefix; 3 and 4 the requests' own tails.
  ASSERT_TRUE(tx->markReady(1, std::vector<uint32_t>{2, 3}, 0).isOk());
  ASSERT_TRUE(tx->markReady(2, std::vector<uint32_t>{2, 4}, 1).isOk());
  ASSERT_TRUE(rx->start(1, 64, std::vector<uint32_t>{0, 1}, 0).isOk());
  ASSERT_TRUE(rx->start(2, 64, std::vector<uint32_t>{5, 6}, 1).isOk());
  for (uint64_t id : {1, 2}) {
    auto r = rx->wait(id, 30s);
    ASSERT_TRUE(r.isOk() && r->ok()) << (r.isOk() ? r->status.toString() : "");
  }
  const auto& gen_kv = gen.pools.at("kv0");
  auto same = [&](const std::vector<uint8_t>& a, uint64_t ra, const std::vector<uint8_t>& b,
                  uint64_t rb) {
    return std::memcmp(a.data() + ra * row, b.data() + rb * row, row) == 0;
  };
  EXPECT_TRUE(same(gen_kv, 0, ctx_kv, 2));
  EXPECT_TRUE(same(gen_kv, 5, ctx_kv, 2));
  EXPECT_TRUE(same(gen_kv, 1, ctx_kv, 3));
  EXPECT_TRUE(same(gen_kv, 6, ctx_kv, 4));
  ASSERT_TRUE(released.waitFor(1));
  ASSERT_TRUE(released.waitFor(2));
  EXPECT_EQ(ctx.memory->impl().cache->counters().free_blocks, 16u);
  ASSERT_TRUE(rx->release(1).isOk());
  ASSERT_TRUE(rx->release(2).isOk());

  // The generation side holds the prefix (block 9, cached once): two requests name it as
  // their prefix while in flight together; only their tails arrive, block 9 is not written.
  auto& gen_kv_w = gen.pools.at("kv0");
  std::fill(gen_kv_w.begin() + 9 * row, gen_kv_w.begin() + 10 * row, uint8_t{0xEE});
  ASSERT_TRUE(tx->markReady(3, std::vector<uint32_t>{2, 3}, 0).isOk());
  ASSERT_TRUE(tx->markReady(4, std::vector<uint32_t>{2, 4}, 1).isOk());
  ASSERT_TRUE(rx->start(3, 64, std::vector<uint32_t>{9, 10}, 2, 32).isOk());
  ASSERT_TRUE(rx->start(4, 64, std::vector<uint32_t>{9, 11}, 3, 32).isOk());
  // A request that would write block 9 is refused while the prefix readers hold it.
  Status s = rx->start(5, 64, std::vector<uint32_t>{12, 9}, 0);
  EXPECT_NE(s.message().find("block 9 is still held by request"), std::string::npos)
      << s.toString();
  for (uint64_t id : {3, 4}) {
    auto r = rx->wait(id, 30s);
    ASSERT_TRUE(r.isOk() && r->ok()) << (r.isOk() ? r->status.toString() : "");
  }
  EXPECT_TRUE(same(gen_kv, 10, ctx_kv, 3));
  EXPECT_TRUE(same(gen_kv, 11, ctx_kv, 4));
  EXPECT_EQ(gen_kv[9 * row], 0xEE);
  EXPECT_EQ(gen_kv[10 * row - 1], 0xEE);
  ASSERT_TRUE(gen.memory->impl().cache->selfCheck().isOk());
  ASSERT_TRUE(rx->release(3).isOk());
  EXPECT_TRUE(rx->holds(4));
  ASSERT_TRUE(rx->release(4).isOk());
  EXPECT_EQ(gen.memory->impl().cache->counters().free_blocks, 16u);
}

TEST(ApiPages, UnaskedPagesAreReleasedWhenTheLeaseExpires) {
  EngineRank ctx = EngineRank::make(options("vllm", 1, 0));
  Released released;
  SenderOptions so;
  so.instance = "ctx";
  so.lease_timeout = 200ms;
  auto tx = inprocSender(ctx, released, so);
  ASSERT_NE(tx, nullptr);
  ASSERT_TRUE(tx->markReady(5, std::vector<uint32_t>{2}, 3).isOk());
  EXPECT_TRUE(tx->holds(5));
  ASSERT_TRUE(released.waitFor(5));
  EXPECT_FALSE(tx->holds(5));
  EXPECT_EQ(tx->metrics().leases_expired, 1u);
}

// A cancelled generation request stays fenced while its context rank may still answer: the
// context's progress thread is held inside on_request, so the Cancel cannot be answered yet.
TEST(ApiPages, CancelledRequestStaysFencedUntilTheContextRankAnswered) {
  EngineRank ctx = EngineRank::make(options("sglang", 1, 0));
  EngineRank gen = EngineRank::make(options("hxfer", 1, 0));
  std::mutex mu;
  std::condition_variable cv;
  bool asked = false, go = false;
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  so.on_request = [&](uint64_t, uint64_t, const std::string&) {
    std::unique_lock lock(mu);
    asked = true;
    cv.notify_all();
    cv.wait(lock, [&] { return go; });
  };
  auto tx = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_TRUE(tx.isOk()) << tx.status().toString();
  Released released;
  auto rx = connectedReceiver(gen, **tx, &released);
  ASSERT_NE(rx, nullptr);

  const std::vector<uint32_t> blocks = {4, 5};
  ASSERT_TRUE(rx->start(1, 40, blocks, 0).isOk());
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return asked; }));
  }
  ASSERT_TRUE(rx->cancel(1).isOk());
  auto r = rx->poll(1);
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, Result::State::kFailed);
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled);
  // Still fenced: the engine may not reuse the pages, and hxfer refuses them.
  EXPECT_TRUE(rx->holds(1));
  Status s = rx->start(2, 40, blocks, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("still held by request 1 (freed, fenced"), std::string::npos)
      << s.toString();
  EXPECT_EQ(released.count(1), 0u);
  {
    std::lock_guard lock(mu);
    go = true;
    cv.notify_all();
  }
  ASSERT_TRUE(released.waitFor(1));
  EXPECT_FALSE(rx->holds(1));
  EXPECT_TRUE(rx->release(1).isOk());  // forgets the failed result
  (*tx)->shutdown();
}

// The context instance goes away mid-request: the generation request fails, and its pages come
// back only once the connection is gone (no write can still land).
TEST(ApiPages, LostContextRankFailsTheRequestAndReleasesItsPages) {
  EngineRank ctx = EngineRank::make(options("trtllm-v1", 1, 0));
  EngineRank gen = EngineRank::make(options("vllm", 1, 0));
  Released ctx_released;
  auto tx = inprocSender(ctx, ctx_released);
  ASSERT_NE(tx, nullptr);
  Released released;
  auto rx = connectedReceiver(gen, *tx, &released);
  ASSERT_NE(rx, nullptr);
  ASSERT_TRUE(rx->start(3, 32, std::vector<uint32_t>{1}, 1).isOk());
  tx->shutdown();
  auto r = rx->wait(3, 10s);
  ASSERT_TRUE(r.isOk());
  EXPECT_EQ(r->state, Result::State::kFailed) << r->status.toString();
  ASSERT_TRUE(released.waitFor(3));
  EXPECT_FALSE(rx->holds(3));
  EXPECT_EQ(rx->metrics().requests_held, 0u);
  // The memory is free for another user once the sender is gone.
  EXPECT_NE(inprocSender(ctx, ctx_released), nullptr);
}

TEST(ApiPages, CallsRacingShutdownReturnUnavailableAndShutdownMayComeFromOnReleased) {
  EngineRank ctx = EngineRank::make(options("vllm", 1, 0));
  std::unique_ptr<Sender> tx;
  std::atomic<int> from_callback{0};
  constexpr uint64_t kTrigger = uint64_t{1} << 40;
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  so.on_released = [&](uint64_t id) {
    if (id == kTrigger) {
      tx->shutdown();  // called back in, on the dispatcher's own thread
      from_callback = 1;
    }
  };
  auto made = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  tx = std::move(*made);
  std::atomic<bool> go{true};
  std::atomic<uint64_t> unavailable{0};
  std::thread hammer([&] {
    for (uint64_t i = 0; go; ++i) {
      const std::vector<uint32_t> block = {static_cast<uint32_t>(i % 16)};
      Status s = tx->markReady(i, block, static_cast<uint32_t>(i % 4));
      if (s.code() == StatusCode::kUnavailable) ++unavailable;
      (void)tx->cancel(i);
      (void)tx->metrics();
      (void)tx->holds(i);
    }
  });
  std::this_thread::sleep_for(50ms);
  tx->shutdown();
  std::this_thread::sleep_for(20ms);
  go = false;
  hammer.join();
  EXPECT_GT(unavailable.load(), 0u);
  EXPECT_EQ(tx->markReady(2000, std::vector<uint32_t>{1}, 1).code(), StatusCode::kUnavailable);
  EXPECT_EQ(tx->metrics().requests_held, 0u);

  // shutdown() from inside on_released: no self-join, no exception.
  EngineRank other = EngineRank::make(options("hxfer", 1, 0));
  made = Sender::create(other.layout, *other.memory, so);
  ASSERT_TRUE(made.isOk()) << made.status().toString();
  tx = std::move(*made);
  ASSERT_TRUE(tx->markReady(kTrigger, std::vector<uint32_t>{0}, 0).isOk());
  ASSERT_TRUE(tx->cancel(kTrigger).isOk());
  for (int i = 0; i < 500 && from_callback == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(from_callback.load(), 1);
  EXPECT_EQ(tx->markReady(1001, std::vector<uint32_t>{1}, 1).code(), StatusCode::kUnavailable);
}

// A streamed markReady refused for its range (empty, leaving a gap) took nothing: the pages
// it fenced on the way are handed back unreported, so an engine that frees them on the error
// does not free them again in on_released (docs/api.md, the contract's rule 4).
TEST(ApiPages, AMarkReadyRefusedForItsLayersReportsNoRelease) {
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0));
  Released released;
  auto tx = inprocSender(ctx, released);
  ASSERT_NE(tx, nullptr);
  const LayerSpan stage = ctx.layout.stageLayers();
  ASSERT_GE(stage.count, 2u);
  const RankPages pages{{3, 4}, 0};
  Status s = tx->markReady(7, pages, LayerSpan{stage.first, 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
  EXPECT_NE(s.message().find("is empty"), std::string::npos) << s.toString();
  s = tx->markReady(8, pages, LayerSpan{stage.first + 1, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
  EXPECT_NE(s.message().find("not ready"), std::string::npos) << s.toString();
  EXPECT_FALSE(tx->holds(7));
  EXPECT_FALSE(tx->holds(8));
  EXPECT_EQ(ctx.memory->impl().cache->counters().free_blocks, 16u);
  std::this_thread::sleep_for(200ms);  // a release would have been delivered by now
  EXPECT_EQ(released.count(7), 0u);
  EXPECT_EQ(released.count(8), 0u);
  // The pages are the engine's again: a request may take them, and its release is reported.
  ASSERT_TRUE(tx->markReady(7, pages).isOk());
  ASSERT_TRUE(tx->cancel(7).isOk());
  EXPECT_TRUE(released.waitFor(7));
}

// on_released shuts its Sender down and goes on using it while another thread destroys it:
// the destructor waits for the callback, so it never runs on a half-destroyed Sender (the
// release thread used to be left detached, outliving the members it touches).
TEST(ApiPages, DestroyingASenderWaitsForTheCallbackThatShutItDown) {
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0));
  Sender* raw = nullptr;
  std::atomic<bool> shut{false}, done{false};
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  so.on_released = [&](uint64_t) {
    raw->shutdown();
    shut = true;
    std::this_thread::sleep_for(200ms);  // the other thread destroys the Sender meanwhile
    (void)raw->metrics();
    (void)raw->holds(1);
    done = true;
  };
  auto tx = createdSender(ctx, so);
  ASSERT_NE(tx, nullptr);
  raw = tx.get();
  ASSERT_TRUE(tx->markReady(1, std::vector<uint32_t>{0}, 0).isOk());
  ASSERT_TRUE(tx->cancel(1).isOk());
  for (int i = 0; i < 500 && !shut; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(shut.load());
  tx.reset();
  EXPECT_TRUE(done.load()) << "the Sender was destroyed under its running callback";
}

// waitForPeers racing shutdown(), or after it, answers Unavailable instead of waiting out its
// timeout (here a context rank that never answers).
TEST(ApiPages, WaitForPeersAnswersUnavailableOnceShutDown) {
  EngineRank gen = EngineRank::make(options("hxfer", 1, 0));
  ReceiverOptions ro;
  ro.instance = "gen";
  ro.backend = "inproc";
  ro.peers = {"inproc:nowhere"};
  auto rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  const auto t0 = std::chrono::steady_clock::now();
  Status waited;
  std::thread waiter([&] { waited = (*rx)->waitForPeers(60s); });
  std::this_thread::sleep_for(200ms);
  (*rx)->shutdown();
  waiter.join();
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable) << waited.toString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  const auto t1 = std::chrono::steady_clock::now();
  Status s = (*rx)->waitForPeers(60s);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.toString();
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 1s);
}

// A timeout option of 0 or less would end every lease, request or handshake at once: create()
// refuses it naming the option and the value. A call's own wait of 0 stays a poll.
TEST(ApiPages, CreateRefusesTimeoutOptionsThatAreNotPositive) {
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0));
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  so.lease_timeout = 0ms;
  auto tx = Sender::create(ctx.layout, *ctx.memory, so);
  EXPECT_EQ(tx.status().code(), StatusCode::kInvalidArgument) << tx.status().toString();
  EXPECT_NE(tx.status().message().find("lease_timeout=0 ms"), std::string::npos)
      << tx.status().toString();
  so.lease_timeout = -5ms;
  tx = Sender::create(ctx.layout, *ctx.memory, so);
  EXPECT_NE(tx.status().message().find("lease_timeout=-5 ms"), std::string::npos)
      << tx.status().toString();

  EngineRank gen = EngineRank::make(options("hxfer", 1, 0));
  ReceiverOptions ro;
  ro.instance = "gen";
  ro.backend = "inproc";
  ro.peers = {"inproc:nowhere"};
  ro.request_timeout = 0ms;
  auto rx = Receiver::create(gen.layout, *gen.memory, ro);
  EXPECT_EQ(rx.status().code(), StatusCode::kInvalidArgument) << rx.status().toString();
  EXPECT_NE(rx.status().message().find("request_timeout=0 ms"), std::string::npos)
      << rx.status().toString();
  ro.request_timeout = 1s;
  ro.handshake_timeout = -1ms;
  rx = Receiver::create(gen.layout, *gen.memory, ro);
  EXPECT_EQ(rx.status().code(), StatusCode::kInvalidArgument) << rx.status().toString();
  EXPECT_NE(rx.status().message().find("handshake_timeout=-1 ms"), std::string::npos)
      << rx.status().toString();

  // Neither refusal kept the memory: it serves a transceiver with positive timeouts, whose
  // waits of 0 poll.
  ro.handshake_timeout = 1s;
  rx = Receiver::create(gen.layout, *gen.memory, ro);
  ASSERT_TRUE(rx.isOk()) << rx.status().toString();
  EXPECT_EQ((*rx)->waitForPeers(0ms).code(), StatusCode::kTimeout);
  EXPECT_EQ((*rx)->wait(1, 0ms).status().code(), StatusCode::kNotFound);
  so.lease_timeout = 1s;
  EXPECT_TRUE(Sender::create(ctx.layout, *ctx.memory, so).isOk());
}

TEST(ApiPages, OneMemoryServesOneTransceiverAtATime) {
  EngineRank ctx = EngineRank::make(options("hxfer", 1, 0));
  SenderOptions so;
  so.instance = "ctx";
  so.backend = "inproc";
  auto a = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_TRUE(a.isOk()) << a.status().toString();
  auto b = Sender::create(ctx.layout, *ctx.memory, so);
  ASSERT_FALSE(b.isOk());
  EXPECT_NE(b.status().message().find("already used"), std::string::npos);
  EngineRank other = EngineRank::make(options("vllm", 1, 0));
  auto c = Sender::create(other.layout, *ctx.memory, so);
  ASSERT_FALSE(c.isOk());
  EXPECT_NE(c.status().message().find("another layout"), std::string::npos)
      << c.status().toString();
}

// planTransfer gives the fragments a Sender would write: run with memcpy, they put every byte
// of the request where the oracle expects it, each destination byte once.
TEST(ApiPlan, FragmentsRunWithMemcpyMoveEveryByteOnce) {
  LayoutOptions c0 = options("vllm", 2, 0), c1 = options("vllm", 2, 1);
  c0.conv_layout = c1.conv_layout = "ds";  // sglang's conv order (sd would need staging)
  LayoutOptions g = options("sglang", 1, 0);
  std::vector<EngineRank> ctx;
  ctx.push_back(EngineRank::make(c0));
  ctx.push_back(EngineRank::make(c1));
  EngineRank gen = EngineRank::make(g);
  const uint64_t id = 5;
  const uint32_t tokens = 60, prefix = 32;  // block 0 is a prefix the generation side holds
  const std::vector<uint32_t> ctx_blocks = {11, 3}, gen_blocks = {9, 4};
  std::vector<Layout> sources = {ctx[1].layout, ctx[0].layout};  // any order
  std::vector<RankPages> pages = {{ctx_blocks, 1}, {ctx_blocks, 1}};
  for (EngineRank& r : ctx) {
    ASSERT_TRUE(fillRank(r.rankLayout(), r.rankMemory(), RankIds{ctx_blocks, 1}, id).isOk());
  }
  auto plan = planTransfer(sources, pages, gen.layout, {gen_blocks, 2}, tokens, prefix);
  ASSERT_TRUE(plan.isOk()) << plan.status().toString();
  ASSERT_FALSE(plan->fragments.empty());

  std::vector<std::pair<uint64_t, uint64_t>> written;  // (pool << 48 | offset, end)
  uint64_t bytes = 0;
  for (const Fragment& f : plan->fragments) {
    ASSERT_LT(f.source, sources.size());
    const EngineRank& src = f.source == 0 ? ctx[1] : ctx[0];
    const PoolInfo& sp = src.layout.pools().at(f.src_pool);
    const PoolInfo& dp = gen.layout.pools().at(f.dst_pool);
    ASSERT_LE(f.src_offset + f.bytes, sp.bytes);
    ASSERT_LE(f.dst_offset + f.bytes, dp.bytes);
    ASSERT_GT(f.bytes, 0u);
    std::memcpy(gen.pools.at(dp.name).data() + f.dst_offset,
                src.pools.at(sp.name).data() + f.src_offset, f.bytes);
    written.emplace_back((uint64_t{f.dst_pool} << 48) | f.dst_offset,
                         ((uint64_t{f.dst_pool} << 48) | f.dst_offset) + f.bytes);
    bytes += f.bytes;
  }
  EXPECT_EQ(bytes, plan->bytes);
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i) {
    EXPECT_LE(written[i - 1].second, written[i].first) << "fragments overlap at " << i;
  }
  // Block 1 (the one past the prefix) and the slot arrive; the oracle checks every byte. With
  // the same tokens per block on both sides whole blocks move, the partial last one too.
  auto report = checkRank(gen.rankLayout(), gen.rankMemory(), RankIds{gen_blocks, 2}, id,
                          BlockRange{1, 1, 64}, 64);
  ASSERT_TRUE(report.isOk()) << report.status().toString();
  EXPECT_TRUE(report->ok()) << report->toString();
  EXPECT_EQ(report->bytes_checked, plan->bytes);
  // Nothing was written into the prefix block.
  const PoolInfo* k0 = gen.layout.pool("k.0");
  if (k0 != nullptr) {
    const auto& pool = gen.pools.at("k.0");
    const uint64_t row = k0->strides[0];
    EXPECT_TRUE(std::all_of(pool.begin() + gen_blocks[0] * row,
                            pool.begin() + (gen_blocks[0] + 1) * row,
                            [](uint8_t b) { return b == 0; }));
  }
}

TEST(ApiPlan, ErrorsNameTheFieldAndValue) {
  auto c = Layout::engine(options("vllm", 1, 0));
  LayoutOptions ds = options("vllm", 1, 0);
  ds.conv_layout = "ds";
  auto g = Layout::engine(ds);
  ASSERT_TRUE(c.isOk() && g.isOk());
  std::vector<Layout> sources = {*c};
  std::vector<RankPages> pages = {{{1, 2}, 0}};
  auto p = planTransfer(sources, pages, *g, {{3}, 1}, 60);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("1 blocks; 60 tokens need 2"), std::string::npos)
      << p.status().toString();
  p = planTransfer(sources, pages, *g, {{3, 4}, std::nullopt}, 60);
  EXPECT_NE(p.status().message().find("destination"), std::string::npos) << p.status().toString();
  EXPECT_NE(p.status().message().find("slot"), std::string::npos) << p.status().toString();
  p = planTransfer(sources, {}, *g, {{3, 4}, 1}, 60);
  EXPECT_NE(p.status().message().find("source_pages has 0 entries for 1 sources"),
            std::string::npos)
      << p.status().toString();
  p = planTransfer(sources, pages, *g, {{3, 99}, 1}, 60);
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().toString();
  EXPECT_NE(p.status().message().find("99"), std::string::npos) << p.status().toString();
  // sd against ds needs a staging copy: no fragment list can say that.
  p = planTransfer(sources, pages, *g, {{3, 4}, 1}, 60);
  EXPECT_EQ(p.status().code(), StatusCode::kIncompatible) << p.status().toString();
  EXPECT_NE(p.status().message().find("staging"), std::string::npos) << p.status().toString();
  // The same layout on both sides plans.
  p = planTransfer(sources, pages, *c, {{3, 4}, 1}, 60);
  ASSERT_TRUE(p.isOk()) << p.status().toString();
  EXPECT_GT(p->bytes, 0u);
}

}  // namespace
}  // namespace hxfer
