#include "common/logging.h"

#include <gtest/gtest.h>

#include <thread>

namespace hxfer {
namespace {

// The first line goes out at once; the ones within the interval are held back and counted in
// the next line that goes out.
TEST(LogLimiter, LetsOneLineAnIntervalThroughAndCountsTheRest) {
  LogLimiter limiter(std::chrono::milliseconds(200));
  uint64_t held = 99;
  ASSERT_TRUE(limiter.admit(&held));
  EXPECT_EQ(held, 0u);
  int admitted = 0;
  for (int i = 0; i < 1000; ++i) admitted += limiter.admit(&held);
  // A loaded machine may cross one interval boundary during the loop, never five.
  EXPECT_LE(admitted, 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  held = 0;
  ASSERT_TRUE(limiter.admit(&held));
  if (admitted == 0) {
    EXPECT_EQ(held, 1000u);
  }
  EXPECT_LE(held, 1000u);
  EXPECT_GE(held, 1u);
}

}  // namespace
}  // namespace hxfer
