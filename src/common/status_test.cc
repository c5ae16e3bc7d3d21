#include "common/status.h"

#include <gtest/gtest.h>

namespace hxfer {
namespace {

StatusOr<int> half(int v) {
  if (v % 2) return InvalidArgument("v=" + std::to_string(v) + " is odd");
  return v / 2;
}

Status quarterInto(int v, int* out) {
  ASSIGN_OR_RETURN(int h, half(v));
  ASSIGN_OR_RETURN(*out, half(h));
  return OkStatus();
}

TEST(Status, OkByDefaultAndNamesCodeInToString) {
  EXPECT_TRUE(Status().isOk());
  Status s = Incompatible("ctx tp=3 does not divide n_groups=8");
  EXPECT_FALSE(s.isOk());
  EXPECT_EQ(s.toString(), "Incompatible: ctx tp=3 does not divide n_groups=8");
  EXPECT_EQ(s.withContext("peer 2").message(), "peer 2: ctx tp=3 does not divide n_groups=8");
}

TEST(Status, AssignOrReturnPropagatesTheFirstError) {
  int out = -1;
  EXPECT_TRUE(quarterInto(8, &out).isOk());
  EXPECT_EQ(out, 2);
  out = -1;
  Status s = quarterInto(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "v=3 is odd");
  EXPECT_EQ(out, -1);
}

TEST(StatusOr, OkStatusIsTurnedIntoInternalError) {
  StatusOr<int> s = OkStatus();
  EXPECT_EQ(s.status().code(), StatusCode::kInternal);
}

TEST(StatusOrDeathTest, ValueOfErrorAborts) {
  StatusOr<int> s = NotFound("request 7");
  EXPECT_DEATH((void)s.value(), "NotFound: request 7");
}

}  // namespace
}  // namespace hxfer
