#include "cache/id_pool.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace hxfer {
namespace {

using Ids = std::vector<uint32_t>;

TEST(IdPool, FreshPoolHandsOutLowestContiguousIds) {
  IdPool p(10);
  EXPECT_EQ(*p.take(3), (Ids{0, 1, 2}));
  EXPECT_EQ(*p.take(2), (Ids{3, 4}));
  EXPECT_EQ(p.freeCount(), 5u);
  EXPECT_EQ(p.runCount(), 1u);
}

TEST(IdPool, PrefersAContiguousRunOverLowerScatteredIds) {
  IdPool p(10);
  ASSERT_TRUE(p.take(10).isOk());
  ASSERT_TRUE(p.give(Ids{1, 3, 6, 7, 8}).isOk());  // runs {1}, {3}, {6,7,8}
  EXPECT_EQ(p.runCount(), 3u);
  EXPECT_EQ(*p.take(3), (Ids{6, 7, 8}));
  EXPECT_EQ(*p.take(1), (Ids{1}));
}

TEST(IdPool, FallsBackToLowestIdsWhenNoRunIsLongEnough) {
  IdPool p(10);
  ASSERT_TRUE(p.take(10).isOk());
  ASSERT_TRUE(p.give(Ids{9, 2, 5, 4}).isOk());  // runs {2}, {4,5}, {9}
  EXPECT_EQ(*p.take(3), (Ids{2, 4, 5}));
  EXPECT_EQ(*p.take(1), (Ids{9}));
  EXPECT_EQ(p.freeCount(), 0u);
}

TEST(IdPool, GiveMergesNeighbouringRuns) {
  IdPool p(6);
  ASSERT_TRUE(p.take(6).isOk());
  ASSERT_TRUE(p.give(Ids{0, 1}).isOk());
  ASSERT_TRUE(p.give(Ids{4, 5}).isOk());
  EXPECT_EQ(p.runCount(), 2u);
  ASSERT_TRUE(p.give(Ids{3, 2}).isOk());
  EXPECT_EQ(p.runCount(), 1u);
  EXPECT_EQ(*p.take(6), (Ids{0, 1, 2, 3, 4, 5}));
}

TEST(IdPool, ExhaustionTakesNothing) {
  IdPool p(4);
  ASSERT_TRUE(p.take(3).isOk());
  auto r = p.take(2);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("need 2 ids, 1 of 4 free"), std::string::npos);
  EXPECT_EQ(p.freeCount(), 1u);
}

TEST(IdPool, GiveRejectsFreeDuplicateAndOutOfRangeIdsAtomically) {
  IdPool p(8);
  ASSERT_TRUE(p.take(4).isOk());                                      // 0..3 taken
  EXPECT_EQ(p.give(Ids{1, 5}).code(), StatusCode::kInvalidArgument);  // 5 is free
  EXPECT_EQ(p.give(Ids{1, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.give(Ids{2, 8}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.freeCount(), 4u);
  EXPECT_FALSE(p.isFree(1));
  EXPECT_FALSE(p.isFree(2));
  EXPECT_TRUE(p.isFree(5));
}

TEST(IdPool, RandomTakeGiveMatchesASetModel) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    std::mt19937 rng(seed);
    IdPool p(64);
    std::set<uint32_t> taken;
    std::vector<Ids> held;
    for (int step = 0; step < 3000; ++step) {
      if (held.empty() || rng() % 2) {
        const uint32_t n = rng() % 9;
        auto r = p.take(n);
        if (n > 64 - taken.size()) {
          ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
          continue;
        }
        ASSERT_TRUE(r.isOk());
        ASSERT_EQ(r->size(), n);
        for (uint32_t id : *r) ASSERT_TRUE(taken.insert(id).second) << "id " << id << " reused";
        held.push_back(*r);
      } else {
        const size_t i = rng() % held.size();
        ASSERT_TRUE(p.give(held[i]).isOk());
        for (uint32_t id : held[i]) taken.erase(id);
        held.erase(held.begin() + static_cast<long>(i));
      }
      ASSERT_EQ(p.freeCount(), 64 - taken.size());
      for (uint32_t id = 0; id < 64; ++id) ASSERT_EQ(p.isFree(id), !taken.count(id));
    }
    for (const Ids& ids : held) ASSERT_TRUE(p.give(ids).isOk());
    EXPECT_EQ(p.freeCount(), 64u);
    EXPECT_EQ(p.runCount(), 1u);
  }
}

}  // namespace
}  // namespace hxfer

namespace hxfer {
namespace {

TEST(IdPool, TakeIdsSplitsRunsAndRefusesTakenDuplicateOrOutOfRangeIdsAtomically) {
  IdPool p(10);
  const std::vector<uint32_t> chosen = {7, 2, 3};
  ASSERT_TRUE(p.takeIds(chosen).isOk());
  EXPECT_EQ(p.freeCount(), 7u);
  EXPECT_EQ(p.runCount(), 3u);  // [0,2) [4,7) [8,10)
  for (uint32_t id : chosen) EXPECT_FALSE(p.isFree(id));
  const std::vector<uint32_t> taken = {1, 3}, twice = {5, 5}, outside = {4, 10};
  Status s = p.takeIds(taken);
  EXPECT_NE(s.message().find("id 3 is not free"), std::string::npos) << s.toString();
  s = p.takeIds(twice);
  EXPECT_NE(s.message().find("id 5 listed twice"), std::string::npos) << s.toString();
  s = p.takeIds(outside);
  EXPECT_NE(s.message().find("id 10 >= capacity 10"), std::string::npos) << s.toString();
  EXPECT_EQ(p.freeCount(), 7u);
  EXPECT_TRUE(p.isFree(1));
  EXPECT_TRUE(p.isFree(4));
  ASSERT_TRUE(p.give(chosen).isOk());
  EXPECT_EQ(p.runCount(), 1u);
  EXPECT_EQ(p.freeCount(), 10u);
}

}  // namespace
}  // namespace hxfer
