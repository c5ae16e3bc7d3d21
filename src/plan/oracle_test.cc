#include "plan/oracle.h"

#include <gtest/gtest.h>

#include <cstring>

#include "plan/local_transfer.h"
#include "plan/plan_test_util.h"

namespace hxfer {
namespace {

using namespace testing;

// fp8 conv with k=4 gives 3-byte units: the word generator's tails are exercised.
ModelSpec oddModel() {
  ModelSpec m = makeModel({attentionLayer(2, 3), mamba1Layer(8, 2, 4), mamba2Layer(4, 3, 1, 5, 3),
                           gdnLayer(2, 4, 3, 1, 2)},
                          3);
  m.conv_dtype = DType::kFp8;
  return m;
}

LocalTransferOptions heapOptions(uint32_t tp) {
  LocalTransferOptions o;
  o.use_regions = false;
  o.ctx.tp = tp;
  return o;
}

TEST(Oracle, FillThenCheckPassesOnEveryLayout) {
  for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    for (uint32_t tp : {1u, 2u, 4u}) {
      auto ranks = makeLocalInstance(oddModel(), {tp, 1, {}}, layout, 5, heapOptions(tp), 1, true);
      ASSERT_TRUE(ranks.isOk()) << ranks.status().toString();
      for (LocalRank& r : *ranks) {
        ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, 3).isOk());
        auto report = checkRank(r.layout, r.mem, r.ids, 3, {0, 5});
        ASSERT_TRUE(report.isOk());
        EXPECT_TRUE(report->ok()) << report->toString();
        EXPECT_EQ(report->bytes_checked,
                  5 * r.layout.kvBytesPerBlock() + r.layout.stateBytesPerSlot());
        // Another request id does not match.
        auto other = checkRank(r.layout, r.mem, r.ids, 4, {0, 5});
        ASSERT_TRUE(other.isOk());
        EXPECT_FALSE(other->ok());
      }
    }
  }
}

TEST(Oracle, MismatchReportNamesEveryCoordinate) {
  auto ranks =
      makeLocalInstance(oddModel(), {2, 1, {}}, StateLayout::kPaged, 5, heapOptions(2), 1, true);
  ASSERT_TRUE(ranks.isOk());
  LocalRank& r = (*ranks)[1];
  ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, 11).isOk());
  // Rank 1 at tp 2 holds mamba1 channels [4, 8); corrupt byte 2 of channel 6 in its conv record.
  const PoolView* conv = nullptr;
  for (const PoolView& v : r.layout.views) {
    if (v.role == Role::kConv && v.kind == LayerKind::kMamba1) conv = &v;
  }
  ASSERT_NE(conv, nullptr);
  const uint64_t unit_bytes = 3;  // (k-1) * fp8
  const uint64_t off = conv->offset(r.ids.slot, 0) + (6 - 4) * unit_bytes + 2;
  r.mem[conv->region_id].data[off] ^= 0x5a;
  auto report = checkRank(r.layout, r.mem, r.ids, 11, {0, 5});
  ASSERT_TRUE(report.isOk());
  ASSERT_FALSE(report->ok());
  EXPECT_EQ(report->mismatched_bytes, 1u);
  const OracleMismatch& m = *report->first;
  EXPECT_EQ(m.request_id, 11u);
  EXPECT_EQ(m.layer, 1u);
  EXPECT_EQ(m.role, Role::kConv);
  EXPECT_EQ(m.section, 0u);
  EXPECT_EQ(m.section_name, "channels");
  EXPECT_EQ(m.unit, 6u);
  EXPECT_EQ(m.byte, 2u);
  EXPECT_EQ(m.region, conv->region_id);
  EXPECT_EQ(m.offset, off);
  EXPECT_EQ(m.actual, m.expected ^ 0x5a);
  EXPECT_NE(report->toString().find("layer 1 conv section 0 (channels) unit 6"), std::string::npos)
      << report->toString();
}

TEST(Oracle, KvBytesDependOnBlockPositionNotBlockId) {
  auto ranks =
      makeLocalInstance(oddModel(), {1, 1, {}}, StateLayout::kPaged, 5, heapOptions(1), 1, true);
  ASSERT_TRUE(ranks.isOk());
  LocalRank& r = (*ranks)[0];
  ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, 1).isOk());
  // Swapping the ids of positions 1 and 2 must be detected (a block copied to the wrong place).
  RankIds swapped = r.ids;
  std::swap(swapped.blocks[1], swapped.blocks[2]);
  auto report = checkRank(r.layout, r.mem, swapped, 1, {0, 5});
  ASSERT_TRUE(report.isOk());
  EXPECT_FALSE(report->ok());
  EXPECT_EQ(report->first->position, 1u);
  EXPECT_EQ(report->first->role, Role::kKv);
}

TEST(Oracle, ReplicatedUnitsHoldTheSameBytesOnEveryHolder) {
  // mamba2 n_groups=1 at tp 4: B and C are replicated on all four ranks.
  const ModelSpec m = makeModel({mamba2Layer(4, 3, 1, 5, 3)});
  auto ranks =
      makeLocalInstance(m, {4, 1, {}}, StateLayout::kLayerMajor, 1, heapOptions(4), 1, true);
  ASSERT_TRUE(ranks.isOk());
  std::vector<std::vector<uint8_t>> bc;
  for (LocalRank& r : *ranks) {
    ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, 5).isOk());
    const PoolView& conv = r.layout.views[0];
    ASSERT_EQ(conv.role, Role::kConv);
    const uint8_t* rec = r.mem[conv.region_id].data + conv.offset(r.ids.slot, 0);
    const uint64_t x_bytes = 1 * 3 * 2 * 2;  // one head * P * (k-1) * bf16
    bc.emplace_back(rec + x_bytes, rec + conv.record_bytes);
  }
  for (size_t i = 1; i < bc.size(); ++i) EXPECT_EQ(bc[i], bc[0]) << "rank " << i;
}

TEST(Oracle, RangeErrorsAreReportedNotWritten) {
  auto ranks =
      makeLocalInstance(oddModel(), {1, 1, {}}, StateLayout::kPaged, 2, heapOptions(1), 1, true);
  ASSERT_TRUE(ranks.isOk());
  LocalRank& r = (*ranks)[0];
  RankIds bad = r.ids;
  bad.slot = 99;
  EXPECT_EQ(fillRank(r.layout, r.mem, bad, 1).code(), StatusCode::kInvalidArgument);
  RankMemory short_mem = r.mem;
  short_mem[0].length = 1;
  EXPECT_EQ(fillRank(r.layout, short_mem, r.ids, 1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hxfer
