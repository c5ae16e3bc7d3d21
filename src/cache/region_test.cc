#include "cache/region.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

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

TEST(Region, BorrowWrapsEngineMemoryWithoutOwningIt) {
  std::vector<uint8_t> engine(8192, 7);
  {
    auto r = Region::borrow(3, engine.data(), engine.size());
    ASSERT_TRUE(r.isOk()) << r.status().toString();
    EXPECT_TRUE((*r)->borrowed());
    EXPECT_EQ((*r)->data(), engine.data());
    EXPECT_EQ((*r)->fd(), -1);
  }
  EXPECT_EQ(engine[100], 7);  // still the engine's, not unmapped
  auto memfd = Region::allocate(0, 4096, Region::Backing::kMemfd, "x");
  ASSERT_TRUE(memfd.isOk());
  {
    auto r = Region::borrow(1, (*memfd)->data(), 4096, (*memfd)->fd());
    ASSERT_TRUE(r.isOk()) << r.status().toString();
  }
  EXPECT_GE(fcntl((*memfd)->fd(), F_GETFD), 0);  // not closed by the borrower
  // The fd must be the memory at `data`, from offset 0.
  auto other = Region::allocate(0, 8192, Region::Backing::kMemfd, "y");
  ASSERT_TRUE(other.isOk());
  auto wrong_fd = Region::borrow(1, (*memfd)->data(), 4096, (*other)->fd());
  EXPECT_EQ(wrong_fd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_fd.status().message().find("does not back the buffer"), std::string::npos)
      << wrong_fd.status().toString();
  auto inside = Region::borrow(1, (*other)->data() + 4096, 4096, (*other)->fd());
  EXPECT_EQ(inside.status().code(), StatusCode::kInvalidArgument) << inside.status().toString();
  auto too_long = Region::borrow(1, (*memfd)->data(), 1 << 20, (*memfd)->fd());
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  auto not_memfd = Region::borrow(1, engine.data(), engine.size(), 0);
  EXPECT_EQ(not_memfd.status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Region::borrow(1, nullptr, 10).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hxfer
