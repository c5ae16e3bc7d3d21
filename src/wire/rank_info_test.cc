#include "wire/rank_info.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

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
void* operator new(size_t n) {
  if (g_track.load(std::memory_order_relaxed)) {
    size_t prev = g_largest.load(std::memory_order_relaxed);
    while (n > prev && !g_largest.compare_exchange_weak(prev, n)) {
    }
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
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
  // Replace the trailing "views.count=0, region_keys.count=0" by views.count=4096 and nothing.
  bytes.resize(bytes.size() - 2);
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

TEST(RankInfo, InstanceRoleNamesParseBack) {
  for (InstanceRole r : {InstanceRole::kContext, InstanceRole::kGeneration}) {
    auto parsed = parseInstanceRole(instanceRoleName(r));
    ASSERT_TRUE(parsed.isOk());
    EXPECT_EQ(*parsed, r);
  }
  EXPECT_EQ(parseInstanceRole("router").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hxfer::wire
