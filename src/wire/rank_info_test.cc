#include "wire/rank_info.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <tuple>

#include "cache/engine_layout.h"
#include "common/coding.h"
#include "model/presets.h"
#include "wire/examples.h"

// The largest single allocation made while `g_track` is set: proves a hostile count is refused
// before anything is sized from it.
namespace {
std::atomic<bool> g_track{false};
std::atomic<size_t> g_largest{0};
}  // namespace

// Replaced as a pair with malloc/free; GCC cannot see that they match.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
// Every form a test can reach (std::stable_sort's buffer uses the nothrow one), so that no
// block is allocated by one allocator and freed by the other.
namespace {
void* trackedMalloc(size_t n) {
  if (g_track.load(std::memory_order_relaxed)) {
    size_t prev = g_largest.load(std::memory_order_relaxed);
    while (n > prev && !g_largest.compare_exchange_weak(prev, n)) {
    }
  }
  return std::malloc(n ? n : 1);
}
}  // namespace
void* operator new(size_t n) {
  if (void* p = trackedMalloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) {
  if (void* p = trackedMalloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t n, const std::nothrow_t&) noexcept { return trackedMalloc(n); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return trackedMalloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace hxfer::wire {
namespace {

std::vector<RankInfo> allExampleRankInfos() {
  std::vector<RankInfo> out;
  for (const ModelSpec& m : examples::models()) {
    for (uint32_t tp : {1u, 2u, 4u}) {
      for (uint32_t pp : {1u, 2u}) {
        for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
          for (uint32_t rank = 0; rank < tp * pp; ++rank) {
            auto info =
                examples::rankInfo(m, {tp, pp, {}}, rank, layout,
                                   rank % 2 ? InstanceRole::kGeneration : InstanceRole::kContext);
            EXPECT_TRUE(info.isOk())
                << m.name << " tp=" << tp << " pp=" << pp << ": " << info.status().toString();
            if (info.isOk()) out.push_back(*info);
          }
        }
      }
    }
  }
  return out;
}

RankInfo sample(StateLayout layout = StateLayout::kPaged) {
  auto info =
      examples::rankInfo(examples::models()[0], {2, 1, {}}, 1, layout, InstanceRole::kGeneration);
  EXPECT_TRUE(info.isOk()) << info.status().toString();
  return *info;
}

// Decodes bytes that a test made hostile; expects a Corruption whose message contains `what`.
void expectCorruption(const Bytes& bytes, const std::string& what) {
  auto got = decodeRankInfo(bytes);
  ASSERT_FALSE(got.isOk()) << "accepted bytes that should have been refused for: " << what;
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().toString();
  EXPECT_NE(got.status().message().find(what), std::string::npos) << got.status().toString();
}

TEST(RankInfo, EveryExampleModelRoundTripsAtEveryTpPpRankAndBothLayouts) {
  std::vector<RankInfo> infos = allExampleRankInfos();
  ASSERT_GT(infos.size(), 100u);
  for (const RankInfo& info : infos) {
    ASSERT_TRUE(checkRankInfo(info).isOk()) << checkRankInfo(info).toString();
    Bytes bytes = encodeRankInfo(info);
    auto back = decodeRankInfo(bytes);
    ASSERT_TRUE(back.isOk()) << back.status().toString();
    EXPECT_EQ(*back, info);
    EXPECT_EQ(encodeRankInfo(*back), bytes);
  }
}

TEST(RankInfo, EveryPresetRoundTripsInBothLayouts) {
  for (const std::string& name : presetNames()) {
    auto model = loadPreset(name);
    ASSERT_TRUE(model.isOk()) << model.status().toString();
    for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
      auto info = examples::rankInfo(*model, {1, 1, {}}, 0, layout, InstanceRole::kContext);
      ASSERT_TRUE(info.isOk()) << name << ": " << info.status().toString();
      auto back = decodeRankInfo(encodeRankInfo(*info));
      ASSERT_TRUE(back.isOk()) << name << ": " << back.status().toString();
      EXPECT_EQ(*back, *info) << name;
    }
  }
}

TEST(RankInfo, PagedAndLayerMajorLayoutsKeepTheirOwnStridesOnTheWire) {
  RankInfo paged = sample(StateLayout::kPaged);
  RankInfo legacy = sample(StateLayout::kLayerMajor);
  auto p = decodeRankInfo(encodeRankInfo(paged));
  auto l = decodeRankInfo(encodeRankInfo(legacy));
  ASSERT_TRUE(p.isOk() && l.isOk());
  EXPECT_EQ(p->layout.state_layout, StateLayout::kPaged);
  EXPECT_EQ(l->layout.state_layout, StateLayout::kLayerMajor);
  // The conv view of layer-major strides over slots by one record; paged by all local layers.
  const PoolView& pc = p->layout.views[1];
  const PoolView& lc = l->layout.views[1];
  ASSERT_EQ(pc.role, Role::kConv);
  EXPECT_EQ(lc.index_stride, lc.record_bytes);
  EXPECT_EQ(pc.index_stride, pc.record_bytes * pc.layers.size());
}

TEST(RankInfo, CoalescedEqualSizePoolsShareOneRegionOnTheWire) {
  auto info = examples::rankInfo(examples::models()[4], {1, 1, {}}, 0, StateLayout::kPaged,
                                 InstanceRole::kContext);
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  auto back = decodeRankInfo(encodeRankInfo(*info));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  const auto& views = back->layout.views;
  ASSERT_EQ(views.size(), 3u);  // kv, conv, ssm
  EXPECT_EQ(views[1].region_id, views[2].region_id);
  EXPECT_EQ(views[1].base, views[1].record_bytes);  // [ssm|conv] interleaved
}

TEST(RankInfo, RegionKeysAndAddressRoundTripAndAreFoundById) {
  RankInfo info = sample();
  ASSERT_FALSE(info.region_keys.empty());
  auto back = decodeRankInfo(encodeRankInfo(info));
  ASSERT_TRUE(back.isOk());
  EXPECT_EQ(back->address, info.address);
  ASSERT_NE(back->findKey(0), nullptr);
  EXPECT_EQ(*back->findKey(0), info.region_keys[0].key);
  EXPECT_EQ(back->findKey(1), nullptr);
  EXPECT_EQ(back->globalRank(), 1u);
}

// Every byte replaced by every other value: the decoder either refuses or accepts a value that
// re-encodes to exactly the mutated bytes (nothing is silently normalized), and never crashes.
TEST(RankInfo, EverySingleByteChangeIsRefusedOrReencodesIdentically) {
  const Bytes good = encodeRankInfo(sample());
  size_t accepted = 0, refused = 0;
  Bytes bad = good;
  for (size_t i = 0; i < good.size(); ++i) {
    for (int v = 0; v < 256; ++v) {
      if (v == good[i]) continue;
      bad[i] = static_cast<uint8_t>(v);
      auto got = decodeRankInfo(bad);
      if (got.isOk()) {
        ++accepted;
        ASSERT_EQ(encodeRankInfo(*got), bad) << "byte " << i << " = " << v;
      } else {
        ++refused;
        ASSERT_TRUE(got.status().code() == StatusCode::kCorruption ||
                    got.status().code() == StatusCode::kIncompatible)
            << got.status().toString();
      }
    }
    bad[i] = good[i];
  }
  // Both outcomes occur: free-form bytes (ids, keys, fingerprint) are accepted, structure not.
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(refused, 0u);
}

TEST(RankInfo, EveryTruncationIsRefused) {
  for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    const Bytes good = encodeRankInfo(sample(layout));
    for (size_t n = 0; n < good.size(); ++n) {
      auto got = decodeRankInfo(std::span<const uint8_t>(good.data(), n));
      ASSERT_FALSE(got.isOk()) << "prefix of " << n << " bytes accepted";
      EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
    }
  }
}

TEST(RankInfo, NewerMinorVersionIsReadableAndItsTrailingFieldsAreSkipped) {
  RankInfo info = sample();
  info.version_minor = kWireVersionMinor + 1;
  Bytes bytes = encodeRankInfo(info);
  const Bytes extension = {0x05, 0xde, 0xad, 0xbe, 0xef, 0x00};
  bytes.insert(bytes.end(), extension.begin(), extension.end());
  auto got = decodeRankInfo(bytes);
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(*got, info);
  EXPECT_EQ(got->version_minor, kWireVersionMinor + 1);
}

TEST(RankInfo, TrailingBytesAtThisMinorVersionAreRefused) {
  Bytes bytes = encodeRankInfo(sample());
  bytes.push_back(0);
  expectCorruption(bytes, "rank_info.end: 1 unexpected trailing bytes");
}

TEST(RankInfo, AnotherMajorVersionIsRefusedNamingBothVersions) {
  RankInfo info = sample();
  info.version_major = kWireVersionMajor + 1;
  info.version_minor = 3;
  auto got = decodeRankInfo(encodeRankInfo(info));
  ASSERT_FALSE(got.isOk());
  EXPECT_EQ(got.status().code(), StatusCode::kIncompatible);
  const std::string theirs = std::to_string(kWireVersionMajor + 1) + ".3";
  const std::string ours =
      std::to_string(kWireVersionMajor) + "." + std::to_string(kWireVersionMinor);
  EXPECT_NE(got.status().message().find(theirs), std::string::npos) << got.status().message();
  EXPECT_NE(got.status().message().find(ours), std::string::npos) << got.status().message();
}

// version 1.0, empty id, role 0, empty address, tp 1, pp 1, ranks 0, then a layers_per_stage
// count of 2^60: 20 bytes that would ask for 4 EiB if the count were trusted.
TEST(RankInfo, TwentyByteBlobClaimingTwoToTheSixtyElementsIsRefusedWithoutAllocating) {
  Bytes blob = {0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x01, 0x00, 0x00};
  putVarint64(blob, uint64_t{1} << 60);
  while (blob.size() < 20) blob.push_back(0);
  ASSERT_EQ(blob.size(), 20u);
  g_largest = 0;
  g_track = true;
  auto got = decodeRankInfo(blob);
  g_track = false;
  ASSERT_FALSE(got.isOk());
  EXPECT_NE(
      got.status().message().find("rank_info.layout.layers_per_stage.count=1152921504606846976"
                                  " exceeds the limit 4096"),
      std::string::npos)
      << got.status().message();
  EXPECT_LT(g_largest.load(), 4096u);
}

TEST(RankInfo, CountWithinItsLimitButBeyondTheInputIsRefusedWithoutAllocating) {
  RankInfo info = sample();
  info.layout.views.clear();
  info.region_keys.clear();
  Bytes bytes = encodeRankInfo(info);
  // Replace the trailing "views.count=0, region_keys.count=0, records.count=0, joint_ids=0,
  // state_groups=1, state_group_views.count=0" by views.count=4096 and nothing.
  bytes.resize(bytes.size() - 6);
  putVarint64(bytes, 4096);
  g_largest = 0;
  g_track = true;
  auto got = decodeRankInfo(bytes);
  g_track = false;
  ASSERT_FALSE(got.isOk());
  EXPECT_NE(got.status().message().find("views.count: count 4096 needs at least"),
            std::string::npos)
      << got.status().message();
  EXPECT_LT(g_largest.load(), 4096u);
}

TEST(RankInfo, HostileStrideRunningPastItsRegionIsRefusedNamingTheView) {
  RankInfo info = sample();
  info.layout.views[1].index_stride += 1;
  expectCorruption(encodeRankInfo(info), "view 1 (conv) records run past region");
}

TEST(RankInfo, StridesWhoseProductOverflowsAreRefused) {
  RankInfo info = sample();
  PoolView& v = info.layout.views[0];
  v.index_stride = kMaxRegionBytes;
  v.layer_stride = kMaxRegionBytes;
  info.layout.num_blocks = UINT32_MAX;
  v.num_indices = UINT32_MAX;
  expectCorruption(encodeRankInfo(info), "records run past region");
}

TEST(RankInfo, StrideAboveTheByteLimitIsRefusedNamingTheField) {
  RankInfo info = sample();
  info.layout.views[2].layer_stride = kMaxRegionBytes + 1;
  expectCorruption(encodeRankInfo(info),
                   "rank_info.layout.views[2].layer_stride=281474976710657 exceeds the limit");
}

TEST(RankInfo, SectionWhoseBytesWouldWrapAroundIsRefused) {
  RankInfo info = sample();
  Section& s = info.layout.views[0].sections[0];
  s.units = UINT32_MAX;
  s.unit_bytes = kMaxRegionBytes;
  expectCorruption(encodeRankInfo(info), "rank_info.layout.views[0].sections[0].units=4294967295");
}

TEST(RankInfo, RecordBytesThatDisagreeWithTheSectionsAreRefused) {
  RankInfo info = sample();
  info.layout.views[0].record_bytes -= 2;
  expectCorruption(encodeRankInfo(info), "record_bytes=");
}

TEST(RankInfo, LayerOutsideThePipelineStageIsRefused) {
  auto info = examples::rankInfo(examples::models()[0], {1, 2, {}}, 0, StateLayout::kPaged,
                                 InstanceRole::kContext);
  ASSERT_TRUE(info.isOk());
  info->layout.views[0].layers.back() = 7;  // stage 0 holds layers [0, 4)
  expectCorruption(encodeRankInfo(*info), "is outside pp stage 0");
}

TEST(RankInfo, UnknownEnumValuesAreRefusedNamingTheField) {
  const Bytes good = encodeRankInfo(sample());
  // The instance role byte follows the 4 version bytes and the length-prefixed instance id.
  const RankInfo info = sample();
  Bytes bad = good;
  bad[4 + 1 + info.instance_id.size()] = 2;
  expectCorruption(bad, "rank_info.role: unknown value 2");
}

TEST(RankInfo, ViewNamingAMissingRegionIsRefused) {
  RankInfo info = sample();
  info.layout.views[0].region_id = 99;
  expectCorruption(encodeRankInfo(info), "names unknown region 99");
}

TEST(RankInfo, KeyForAMissingRegionOrASecondKeyIsRefused) {
  RankInfo info = sample();
  info.region_keys.push_back({77, {1, 2}});
  expectCorruption(encodeRankInfo(info), "region_keys[");
  RankInfo twice = sample();
  twice.region_keys.push_back(twice.region_keys[0]);
  expectCorruption(encodeRankInfo(twice), "has a second key");
}

TEST(RankInfo, CheckRankInfoGivesALocalValueThePeersVerdict) {
  RankInfo info = sample();
  EXPECT_TRUE(checkRankInfo(info).isOk());
  info.instance_id.assign(kMaxIdBytes + 1, 'x');
  Status s = checkRankInfo(info);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("rank_info.instance_id.length=1025"), std::string::npos)
      << s.message();
  EXPECT_FALSE(decodeRankInfo(encodeRankInfo(info)).isOk());
}

// Engine layouts (minor 3): the described records travel in rank_info.records.

RankInfo engineSample(std::string_view engine = "vllm", std::string_view kv = "",
                      std::string_view conv = "") {
  auto layout = parseEngineLayout(engine, kv, conv);
  EXPECT_TRUE(layout.isOk()) << layout.status().toString();
  auto info =
      examples::rankInfo(examples::models()[0], {2, 1, {}}, 1, *layout, InstanceRole::kGeneration);
  EXPECT_TRUE(info.isOk()) << info.status().toString();
  return *info;
}

size_t describedViews(const RankInfo& info) {
  size_t n = 0;
  for (const PoolView& v : info.layout.views) n += v.record.has_value();
  return n;
}

TEST(RankInfo, EveryEngineLayoutOfEveryExampleModelRoundTripsWithItsRecords) {
  size_t infos = 0, described = 0;
  std::vector<EngineLayout> layouts = allEngineLayouts();
  for (const EngineLayout& e : sharedEngineLayouts()) layouts.push_back(e);
  for (const ModelSpec& m : examples::models()) {
    for (const EngineLayout& e : layouts) {
      for (auto [tp, pp] : {std::pair{1u, 1u}, {2u, 1u}, {4u, 2u}}) {
        for (uint32_t rank = 0; rank < tp * pp; ++rank) {
          auto info = examples::rankInfo(m, {tp, pp, {}}, rank, e, InstanceRole::kContext);
          ASSERT_TRUE(info.isOk()) << m.name << " " << e.toString() << " tp=" << tp << " pp=" << pp
                                   << ": " << info.status().toString();
          ASSERT_TRUE(checkRankInfo(*info).isOk()) << checkRankInfo(*info).toString();
          auto got = decodeRankInfo(encodeRankInfo(*info));
          ASSERT_TRUE(got.isOk()) << m.name << " " << e.toString() << ": "
                                  << got.status().toString();
          ASSERT_EQ(*got, *info) << m.name << " " << e.toString();
          ++infos;
          described += describedViews(*info);
        }
      }
    }
  }
  EXPECT_EQ(infos, examples::models().size() * layouts.size() * (1 + 2 + 8));
  EXPECT_GT(described, infos);  // most engine layouts describe several views of each rank
}

TEST(RankInfo, HxferLayoutsCarryNoRecordsAndAnEmptyRecordsList) {
  RankInfo info = sample();
  ASSERT_EQ(describedViews(info), 0u);
  RankInfo older = info;
  older.version_minor = kRecordsMinor - 1;
  // The only difference at minor 5 is the trailing records.count = 0 and the id groups of a
  // layout with one slot per request: joint_ids 0, state_groups 1, no views listed.
  const Bytes now = encodeRankInfo(info), before = encodeRankInfo(older);
  ASSERT_EQ(now.size(), before.size() + 4);
  EXPECT_EQ(Bytes(now.end() - 4, now.end()), (Bytes{0, 0, 1, 0}));
  auto got = decodeRankInfo(before);
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(*got, older);
}

TEST(RankInfo, DescribedRecordNeedsMinorThreeAndAnOlderPeerIsRefusedNamingTheView) {
  RankInfo info = engineSample();
  ASSERT_GT(describedViews(info), 0u);
  info.version_minor = kRecordsMinor - 1;
  Status s = checkRankInfo(info);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("record: a described record needs version_minor >= 3"),
            std::string::npos)
      << s.message();
  // A 1.2 encoding of the same layout drops the records; a 1.3 reader reads hxfer's order
  // back, which validate() refuses (its records are laid out otherwise) or, where the bytes
  // agree, is a different layout: never the described one.
  Bytes old_bytes;
  {
    RankInfo stripped = info;
    for (PoolView& v : stripped.layout.views) v.record.reset();
    old_bytes = encodeRankInfo(stripped);
  }
  auto got = decodeRankInfo(old_bytes);
  if (got.isOk()) {
    EXPECT_NE(got->layout, engineSample().layout);
  }

  const RankLayout self = engineSample().layout;
  Status peer = checkPeerReadsLayout(self, 2);
  EXPECT_EQ(peer.code(), StatusCode::kIncompatible);
  EXPECT_NE(peer.message().find("peer speaks 1.2, which reads every record in hxfer's own order"),
            std::string::npos)
      << peer.message();
  EXPECT_NE(peer.message().find("views["), std::string::npos) << peer.message();
  EXPECT_NE(peer.message().find("need 1.3 or later"), std::string::npos) << peer.message();
  EXPECT_TRUE(checkPeerReadsLayout(self, 3).isOk());
  EXPECT_TRUE(checkPeerReadsLayout(sample().layout, 0).isOk());
}

// Minor 6: a record dim may be split (vLLM's CPU attention on AMX). The layout travels and
// decodes back the same; a peer older than 1.6 would refuse the repeated name, so it is told.
TEST(RankInfo, SplitRecordDimsTravelAndAPeerOlderThanSixIsRefused) {
  auto model = loadPreset("nemotron-h-8b");
  ASSERT_TRUE(model.isOk());
  model->tokens_per_block = 1056;
  auto l = buildEngineLayout(*model, {8, 1, {}}, 0, 0, *parseEngineLayout("vllm", "cpu-amx"), 2, 2);
  ASSERT_TRUE(l.isOk()) << l.status().toString();
  RankInfo info = sample();
  info.layout = *l;
  info.region_keys.clear();
  auto back = decodeRankInfo(encodeRankInfo(info));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(back->layout, *l);
  Status peer = checkPeerReadsLayout(*l, 5);
  EXPECT_EQ(peer.code(), StatusCode::kIncompatible);
  EXPECT_NE(peer.message().find("splits dim token"), std::string::npos) << peer.message();
  EXPECT_NE(peer.message().find("need 1.6 or later"), std::string::npos) << peer.message();
  EXPECT_TRUE(checkPeerReadsLayout(*l, 6).isOk());
}

TEST(RankInfo, EverySingleByteChangeOfTheRecordsIsRefusedOrReencodesIdentically) {
  for (auto [engine, kv, conv] :
       {std::tuple{"vllm", "hnd", "ds"}, {"sglang", "", ""}, {"trtllm-v2", "nhd", ""}}) {
    const RankInfo info = engineSample(engine, kv, conv);
    const Bytes good = encodeRankInfo(info);
    RankInfo plain = info;
    for (PoolView& v : plain.layout.views) v.record.reset();
    // Everything after the (empty) records list of the same layout without descriptions.
    const size_t from = encodeRankInfo(plain).size() - 1;
    ASSERT_LT(from, good.size());
    size_t accepted = 0, refused = 0;
    Bytes bad = good;
    for (size_t i = from; i < good.size(); ++i) {
      for (int v = 0; v < 256; ++v) {
        if (v == good[i]) continue;
        bad[i] = static_cast<uint8_t>(v);
        auto got = decodeRankInfo(bad);
        if (got.isOk()) {
          ++accepted;
          ASSERT_EQ(encodeRankInfo(*got), bad) << engine << " byte " << i << " = " << v;
        } else {
          ++refused;
          ASSERT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().toString();
        }
      }
      bad[i] = good[i];
    }
    EXPECT_GT(refused, 0u) << engine;
    // Dim names are free bytes only where the name stays one of the logical names: almost
    // every change is refused.
    EXPECT_LT(accepted, refused / 10) << engine;
    for (size_t n = from; n < good.size(); ++n) {
      ASSERT_FALSE(decodeRankInfo(std::span<const uint8_t>(good.data(), n)).isOk())
          << engine << ": prefix of " << n << " bytes accepted";
    }
  }
}

// Builds a rank_info whose records list is `records` (the bytes after region_keys).
Bytes withRecords(const RankInfo& info, const Bytes& records) {
  RankInfo plain = info;
  for (PoolView& v : plain.layout.views) v.record.reset();
  Bytes out = encodeRankInfo(plain);
  // records.count = 0, then id_groups: joint_ids 0, state_groups 1, state_group_views.count 0.
  const Bytes id_groups(out.end() - 3, out.end());
  out.resize(out.size() - 4);
  out.insert(out.end(), records.begin(), records.end());
  out.insert(out.end(), id_groups.begin(), id_groups.end());
  return out;
}

void putDim(Bytes& out, std::string_view name, uint64_t size, uint64_t stride) {
  putString(out, std::string(name));
  putVarint64(out, size);
  putVarint64(out, stride);
}

struct DimBytes {
  std::string name;
  uint64_t size = 0, stride = 0;
};

// A records list of one entry for `view`.
Bytes oneRecord(uint64_t view, uint64_t element_bytes, const std::vector<DimBytes>& dims) {
  Bytes r;
  putVarint64(r, 1);
  putVarint64(r, view);
  putVarint64(r, element_bytes);
  putVarint64(r, dims.size());
  for (const DimBytes& d : dims) putDim(r, d.name, d.size, d.stride);
  return r;
}

TEST(RankInfo, HostileRecordsAreRefusedNamingTheField) {
  const RankInfo info = sample();  // hxfer views: [0] kv, [1] conv, [2] ssm, ...
  const PoolView& conv = info.layout.views[1];
  ASSERT_EQ(conv.role, Role::kConv);
  const ModelSpec model = examples::models()[0];
  const uint32_t window = innerSizes(model, model.layers[conv.layers.front()], Role::kConv).at(0);
  const uint32_t el = static_cast<uint32_t>(dtypeSize(info.layout.conv_dtype));
  const uint64_t channels = conv.record_bytes / el / window;
  // (window, channel): vLLM's SD order.
  const std::vector<DimBytes> sd = {{"window", window, channels * el}, {"channel", channels, el}};
  {
    auto got = decodeRankInfo(withRecords(info, oneRecord(1, el, sd)));
    ASSERT_TRUE(got.isOk()) << got.status().toString();
    ASSERT_TRUE(got->layout.views[1].record.has_value());
    EXPECT_EQ(got->layout.views[1].record->toString().substr(0, 6), "window");
  }
  {  // two entries for one view
    Bytes r = oneRecord(1, el, sd);
    r[0] = 2;
    const Bytes second = oneRecord(1, el, sd);
    r.insert(r.end(), second.begin() + 1, second.end());
    expectCorruption(withRecords(info, r),
                     "rank_info.records[1].view=1 is not above the previous entry's view 1");
  }
  // a view past the layout's
  expectCorruption(withRecords(info, oneRecord(info.layout.views.size(), el, sd)),
                   "names no view (the layout has");
  {  // more entries than views
    Bytes r;
    putVarint64(r, info.layout.views.size() + 1);
    expectCorruption(withRecords(info, r), "rank_info.records.count");
  }
  // element size 0, and one of 17 bytes
  for (uint64_t bytes : {0ull, 17ull}) {
    expectCorruption(withRecords(info, oneRecord(1, bytes, sd)), "element_bytes");
  }
  // 17 dims
  expectCorruption(withRecords(info, oneRecord(1, el, std::vector<DimBytes>(17, {"window", 1, 1}))),
                   "rank_info.records[0].dims.count");
  // a dim name the conv record does not have
  expectCorruption(
      withRecords(info,
                  oneRecord(1, el, {{"token", window, channels * el}, {"channel", channels, el}})),
      "token");
  // a stride past the byte limit
  expectCorruption(
      withRecords(
          info,
          oneRecord(1, el, {{"window", window, kMaxRegionBytes + 1}, {"channel", channels, el}})),
      "rank_info.records[0].dims[0].stride");
  // strides that make two elements share a byte, and a record whose span runs past its region
  for (uint64_t window_stride : {uint64_t{el}, uint64_t{1} << 40}) {
    auto got = decodeRankInfo(withRecords(
        info, oneRecord(1, el, {{"window", window, window_stride}, {"channel", channels, el}})));
    ASSERT_FALSE(got.isOk()) << window_stride;
    EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().toString();
  }
}

TEST(RankInfo, InstanceRoleNamesParseBack) {
  for (InstanceRole r : {InstanceRole::kContext, InstanceRole::kGeneration}) {
    auto parsed = parseInstanceRole(instanceRoleName(r));
    ASSERT_TRUE(parsed.isOk());
    EXPECT_EQ(*parsed, r);
  }
  EXPECT_EQ(parseInstanceRole("router").status().code(), StatusCode::kInvalidArgument);
}

// vLLM's shared tensors (minor 5): one id pool and a state id per group travel in
// rank_info.id_groups; a peer older than minor 5 would read overlapping views of one group.
TEST(RankInfo, IdGroupsTravelFromMinorFiveAndAnOlderPeerIsRefused) {
  auto info = examples::rankInfo(examples::models()[0], {2, 1, {}}, 1, sharedEngineLayouts()[0],
                                 InstanceRole::kGeneration);
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  ASSERT_TRUE(info->layout.joint_ids);
  ASSERT_GT(info->layout.state_groups, 1u);
  auto got = decodeRankInfo(encodeRankInfo(*info));
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(*got, *info);
  Status older = checkPeerReadsLayout(info->layout, kStateGroupsMinor - 1);
  EXPECT_EQ(older.code(), StatusCode::kIncompatible);
  EXPECT_NE(older.message().find("needs 1.5 or later"), std::string::npos) << older.toString();
  EXPECT_TRUE(checkPeerReadsLayout(sample().layout, kStateGroupsMinor - 1).isOk());
  RankInfo at_four = *info;
  at_four.version_minor = kStateGroupsMinor - 1;
  EXPECT_NE(checkRankInfo(at_four).message().find("need version_minor >= 5"), std::string::npos)
      << checkRankInfo(at_four).toString();
}

TEST(RankInfo, HostileIdGroupsAreRefusedNamingTheField) {
  auto info = examples::rankInfo(examples::models()[0], {1, 1, {}}, 0, sharedEngineLayouts()[0],
                                 InstanceRole::kGeneration);
  ASSERT_TRUE(info.isOk());
  const Bytes good = encodeRankInfo(*info);
  // The id groups are the last bytes: joint_ids, state_groups, count, then (view, group) pairs.
  size_t listed = 0;
  for (const PoolView& v : info->layout.views) listed += v.state_group != 0;
  ASSERT_GT(listed, 0u);
  auto idGroups = [&](const Bytes& groups) {
    Bytes out(good.begin(), good.end() - 3 - 2 * listed);
    out.insert(out.end(), groups.begin(), groups.end());
    return out;
  };
  ASSERT_EQ(idGroups(Bytes(good.end() - 3 - 2 * listed, good.end())), good);
  const uint8_t groups = static_cast<uint8_t>(info->layout.state_groups);
  expectCorruption(idGroups({1, groups, 1, 0, 0}), "state_group=0 is the default");
  expectCorruption(idGroups({1, groups, 2, 5, 1, 4, 1}), "is not above the previous entry");
  expectCorruption(idGroups({1, groups, 1, 0x7f, 1}), "names no view");
  expectCorruption(idGroups({2, groups, 0}), "joint_ids");
  // Without the groups, the views of one tensor overlap: refused by validate().
  expectCorruption(idGroups({1, 1, 0}), "overlap in region");
  expectCorruption(idGroups({0, groups, 0}), "overlap in region");
}

}  // namespace
}  // namespace hxfer::wire
