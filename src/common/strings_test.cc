#include "common/strings.h"

#include <gtest/gtest.h>

namespace hxfer {
namespace {

TEST(Strings, SplitListKeepsTheNonEmptyItemsInOrder) {
  EXPECT_EQ(splitList("a,b,,c"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(splitList(",x,"), (std::vector<std::string>{"x"}));
  EXPECT_TRUE(splitList("").empty());
  EXPECT_TRUE(splitList(",,").empty());
  EXPECT_EQ(splitList("ucx:10.0.0.1:7000"), (std::vector<std::string>{"ucx:10.0.0.1:7000"}));
  EXPECT_EQ(splitList("1:2 3", ' '), (std::vector<std::string>{"1:2", "3"}));
}

}  // namespace
}  // namespace hxfer
