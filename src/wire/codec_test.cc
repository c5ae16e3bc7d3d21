#include "wire/codec.h"

#include <gtest/gtest.h>

namespace hxfer::wire {
namespace {

Bytes varintBytes(uint64_t v) {
  Bytes b;
  putVarint64(b, v);
  return b;
}

TEST(WireReader, ReadsCanonicalVarintsUpToTheirLimit) {
  for (uint64_t v : {uint64_t{0}, uint64_t{127}, uint64_t{128}, uint64_t{1} << 35, UINT64_MAX}) {
    Bytes b = varintBytes(v);
    WireReader r(b, "x.");
    uint64_t got = 0;
    ASSERT_TRUE(r.varint("v", UINT64_MAX, &got).isOk()) << v;
    EXPECT_EQ(got, v);
    EXPECT_EQ(r.remaining(), 0u);
  }
}

TEST(WireReader, NonCanonicalVarintIsRefusedSoEveryInputReencodesIdentically) {
  const Bytes padded_zero = {0x80, 0x00};
  WireReader r(padded_zero, "rank_info.");
  uint64_t v = 0;
  Status s = r.varint("tp", 100, &v);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("rank_info.tp"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("non-canonical"), std::string::npos) << s.message();
}

TEST(WireReader, VarintOverflowingSixtyFourBitsIsRefused) {
  const Bytes eleven = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
  WireReader r(eleven, "");
  uint64_t v = 0;
  Status s = r.varint("big", UINT64_MAX, &v);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("overflows"), std::string::npos) << s.message();
}

TEST(WireReader, VarintAboveItsLimitNamesFieldValueAndLimit) {
  Bytes b = varintBytes(5000);
  WireReader r(b, "rank_info.layout.");
  uint32_t v = 0;
  Status s = r.varint32("tp", 4096, &v);
  EXPECT_EQ(s.message(), "rank_info.layout.tp=5000 exceeds the limit 4096");
}

TEST(WireReader, CountLargerThanTheRemainingBytesIsRefusedBeforeAnyAllocation) {
  Bytes b = varintBytes(1000);
  b.resize(b.size() + 10, 0);  // room for 10 one-byte elements, not 1000
  WireReader r(b, "");
  size_t n = 0;
  Status s = r.count("ids.count", 1u << 20, 1, &n);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("only 10 remain"), std::string::npos) << s.message();
}

TEST(WireReader, TruncatedFixedFieldsNameTheFieldAndNeverReadPastTheEnd) {
  const Bytes three = {1, 2, 3};
  WireReader r(three, "done.");
  uint64_t v = 0;
  Status s = r.u64Fixed("checksum", &v);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("done.checksum: truncated"), std::string::npos) << s.message();
  EXPECT_EQ(r.position(), 0u);
}

TEST(WireReader, LengthPrefixOverTheLimitIsRefused) {
  Bytes b;
  putString(b, std::string(300, 'a'));
  WireReader r(b, "");
  std::string out;
  Status s = r.string("name", 256, &out);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("name.length=300 exceeds the limit 256"), std::string::npos)
      << s.message();
}

TEST(WireReader, EnumAndBooleanBytesOutsideTheirRangeAreRefused) {
  const Bytes b = {2, 5};
  WireReader r(b, "");
  bool flag = false;
  EXPECT_EQ(r.boolean("has_slot", &flag).code(), StatusCode::kCorruption);
  uint8_t e = 0;
  Status s = r.enumByte("role", 4, &e);
  EXPECT_NE(s.message().find("role: unknown value 5 (largest known is 4)"), std::string::npos)
      << s.message();
}

TEST(WireReader, ScopesPrefixFieldNamesAndUnwind) {
  const Bytes empty;
  WireReader r(empty, "rank_info.");
  {
    auto a = r.element("views", 3);
    auto b = r.element("sections", 1);
    EXPECT_EQ(r.name("units"), "rank_info.views[3].sections[1].units");
  }
  EXPECT_EQ(r.name("tp"), "rank_info.tp");
}

}  // namespace
}  // namespace hxfer::wire
