#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace hxfer {
namespace {

// Test vectors from RFC 3720 (iSCSI), appendix B.4.
TEST(Crc32c, MatchesRfc3720Vectors) {
  uint8_t buf[32];
  std::memset(buf, 0, sizeof(buf));
  EXPECT_EQ(crc32c(buf, 32), 0x8a9136aau);
  std::memset(buf, 0xff, sizeof(buf));
  EXPECT_EQ(crc32c(buf, 32), 0x62a8ab43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(crc32c(buf, 32), 0x46dd794eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(31 - i);
  EXPECT_EQ(crc32c(buf, 32), 0x113fdb5cu);
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);
}

TEST(Crc32c, ExtendEqualsWhole) {
  std::string s = "hybrid cache state moves between instances";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    uint32_t a = crc32cExtend(crc32c(s.data(), cut), s.data() + cut, s.size() - cut);
    EXPECT_EQ(a, crc32c(s.data(), s.size()));
  }
}

}  // namespace
}  // namespace hxfer
