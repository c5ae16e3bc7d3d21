#include "common/coding.h"

#include <gtest/gtest.h>

#include <random>

namespace hxfer {
namespace {

TEST(Coding, FixedAndVarintRoundTrip) {
  std::mt19937_64 rng(1);
  Bytes b;
  std::vector<uint64_t> values = {0, 1, 127, 128, 16383, 16384, ~uint64_t{0}};
  for (int i = 0; i < 1000; ++i) values.push_back(rng() >> (rng() % 64));
  for (uint64_t v : values) {
    putVarint64(b, v);
    putFixed64(b, v);
    putFixed32(b, static_cast<uint32_t>(v));
  }
  Decoder d(b);
  for (uint64_t v : values) {
    uint64_t a, c;
    uint32_t f;
    ASSERT_TRUE(d.getVarint64("a", &a).isOk());
    ASSERT_TRUE(d.getFixed64("c", &c).isOk());
    ASSERT_TRUE(d.getFixed32("f", &f).isOk());
    EXPECT_EQ(a, v);
    EXPECT_EQ(c, v);
    EXPECT_EQ(f, static_cast<uint32_t>(v));
  }
  EXPECT_TRUE(d.done());
}

TEST(Coding, FixedIsLittleEndian) {
  Bytes b;
  putFixed32(b, 0x04030201);
  EXPECT_EQ(b, (Bytes{1, 2, 3, 4}));
}

TEST(Coding, TruncationNamesTheField) {
  Bytes b = {1, 2};
  Decoder d(b);
  uint32_t v = 99;
  Status s = d.getFixed32("regions[2].length", &v);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("regions[2].length"), std::string::npos);
  EXPECT_EQ(v, 99u);  // untouched on error
}

TEST(Coding, OverlongVarintIsCorruption) {
  Bytes b(11, 0xff);
  Decoder d(b);
  uint64_t v;
  EXPECT_EQ(d.getVarint64("x", &v).code(), StatusCode::kCorruption);
  Bytes overflow = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02};
  Decoder d2(overflow);
  EXPECT_EQ(d2.getVarint64("x", &v).code(), StatusCode::kCorruption);
}

TEST(Coding, LengthPrefixLargerThanCapOrBufferIsRejected) {
  Bytes b;
  putVarint64(b, uint64_t{1} << 60);
  Decoder d(b);
  std::string s;
  Status st = d.getString("instance_id", 256, &s);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("instance_id.length"), std::string::npos);

  Bytes c;
  putVarint64(c, 10);
  c.push_back('a');
  Decoder d2(c);
  EXPECT_EQ(d2.getString("name", 256, &s).code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace hxfer
