#include "cache/region.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

namespace hxfer {
namespace {

TEST(Region, AnonymousIsZeroedAndWritable) {
  auto r = Region::allocate(3, 10000, Region::Backing::kAnonymous, "t");
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ((*r)->id(), 3u);
  EXPECT_EQ((*r)->length(), 10000u);
  EXPECT_EQ((*r)->fd(), -1);
  for (uint64_t i = 0; i < 10000; ++i) ASSERT_EQ((*r)->data()[i], 0);
  std::memset((*r)->data(), 7, 10000);
  EXPECT_TRUE((*r)->contains(0, 10000));
  EXPECT_FALSE((*r)->contains(1, 10000));
  EXPECT_FALSE((*r)->contains(~uint64_t{0}, 2));
}

TEST(Region, MemfdMappedTwiceSharesBytes) {
  auto a = Region::allocate(0, 8192, Region::Backing::kMemfd, "kv0");
  ASSERT_TRUE(a.isOk());
  int fd = dup((*a)->fd());
  auto b = Region::mapFd(0, fd, 8192);
  ASSERT_TRUE(b.isOk()) << b.status().toString();
  (*a)->data()[5000] = 42;
  EXPECT_EQ((*b)->data()[5000], 42);
}

TEST(Region, MapFdRejectsShortFile) {
  auto a = Region::allocate(0, 4096, Region::Backing::kMemfd, "x");
  ASSERT_TRUE(a.isOk());
  auto b = Region::mapFd(0, dup((*a)->fd()), 1 << 20);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hxfer
