#include "wire/messages.h"

#include <gtest/gtest.h>

#include <set>

#include "common/crc32c.h"
#include "wire/examples.h"

namespace hxfer::wire {
namespace {

// Rewrites the body length and CRC of a frame whose body a test edited.
void reseal(Bytes& frame) {
  frame.resize(frame.size() - kFrameTrailerBytes);
  storeFixed32(frame.data() + 9, static_cast<uint32_t>(frame.size() - kFrameHeaderBytes));
  putFixed32(frame, crc32c(frame.data(), frame.size()));
}

void expectRefused(const Bytes& frame, StatusCode code, const std::string& what) {
  auto got = decodeMessage(frame);
  ASSERT_FALSE(got.isOk()) << "accepted a frame that should be refused for: " << what;
  EXPECT_EQ(got.status().code(), code) << got.status().toString();
  EXPECT_NE(got.status().message().find(what), std::string::npos) << got.status().toString();
}

TransferRequest sampleRequest() {
  for (auto& [name, m] : examples::messages()) {
    if (name == "transfer_request") return std::get<TransferRequest>(m);
  }
  ADD_FAILURE() << "no transfer_request example";
  return {};
}

TEST(Messages, EveryExampleMessageRoundTripsAndReencodesIdentically) {
  auto all = examples::messages();
  ASSERT_EQ(all.size(), 12u);
  std::set<MessageType> types;
  for (const auto& [name, m] : all) {
    ASSERT_TRUE(checkMessage(m).isOk()) << name << ": " << checkMessage(m).toString();
    Bytes frame = encodeMessage(m);
    auto length = frameLength(std::span<const uint8_t>(frame.data(), kFrameHeaderBytes));
    ASSERT_TRUE(length.isOk()) << name;
    EXPECT_EQ(*length, frame.size()) << name;
    auto back = decodeMessage(frame);
    ASSERT_TRUE(back.isOk()) << name << ": " << back.status().toString();
    EXPECT_EQ(*back, m) << name;
    EXPECT_EQ(messageType(*back), messageType(m));
    EXPECT_EQ(encodeMessage(*back), frame) << name;
    types.insert(messageType(m));
    const std::string line = summarize(*back);
    EXPECT_EQ(line.rfind(std::string(messageTypeName(messageType(m))), 0), 0u) << line;
  }
  EXPECT_EQ(types.size(), kMaxMessageType - kMinMessageType + 1u);
}

TEST(Messages, HelloCarriesEitherLayoutAndTheToken) {
  for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    auto info =
        examples::rankInfo(examples::models()[1], {2, 2, {}}, 3, layout, InstanceRole::kGeneration);
    ASSERT_TRUE(info.isOk()) << info.status().toString();
    Hello hello{*info, "tok"};
    auto back = decodeMessage(encodeMessage(hello));
    ASSERT_TRUE(back.isOk()) << back.status().toString();
    const Hello& h = std::get<Hello>(*back);
    EXPECT_EQ(h, hello);
    EXPECT_EQ(h.rank_info.layout.state_layout, layout);
    EXPECT_EQ(h.rank_info.globalRank(), 3u);
  }
}

TEST(Messages, EverySingleByteChangeOfAFrameIsRefused) {
  for (const auto& [name, m] : examples::messages()) {
    const Bytes good = encodeMessage(m);
    Bytes bad = good;
    for (size_t i = 0; i < good.size(); ++i) {
      for (uint8_t x : {0x01, 0x80, 0xff}) {
        bad[i] = good[i] ^ x;
        auto got = decodeMessage(bad);
        ASSERT_FALSE(got.isOk()) << name << " byte " << i << " ^ " << int{x};
        // A changed major version is refused as such; everything else as corruption.
        EXPECT_TRUE(got.status().code() == StatusCode::kCorruption || (i == 4 || i == 5))
            << got.status().toString();
      }
      bad[i] = good[i];
    }
  }
}

TEST(Messages, EveryTruncationOfAFrameIsRefused) {
  for (const auto& [name, m] : examples::messages()) {
    const Bytes good = encodeMessage(m);
    for (size_t n = 0; n < good.size(); ++n) {
      auto got = decodeMessage(std::span<const uint8_t>(good.data(), n));
      ASSERT_FALSE(got.isOk()) << name << " prefix " << n;
      EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().toString();
    }
  }
}

// With the checksum recomputed, the body decoder itself must refuse or reproduce every change.
TEST(Messages, EveryBodyByteChangeWithAValidChecksumIsRefusedOrReencodesIdentically) {
  size_t accepted = 0, refused = 0;
  for (const auto& [name, m] : examples::messages()) {
    const Bytes good = encodeMessage(m);
    Bytes bad = good;
    for (size_t i = kFrameHeaderBytes; i + kFrameTrailerBytes < good.size(); ++i) {
      for (uint8_t x : {0x01, 0x02, 0x40, 0x80, 0xff}) {
        bad[i] = good[i] ^ x;
        reseal(bad);
        auto got = decodeMessage(bad);
        if (got.isOk()) {
          ++accepted;
          ASSERT_EQ(encodeMessage(*got), bad) << name << " byte " << i << " ^ " << int{x};
        } else {
          ++refused;
        }
      }
      bad = good;
    }
  }
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(refused, 0u);
}

TEST(Messages, NewerMinorFrameIsReadableAndSkipsAppendedFields) {
  const TransferRequest req = sampleRequest();
  Bytes frame = encodeMessage(req);
  frame[6] = static_cast<uint8_t>(kWireVersionMinor + 1);  // minor, low byte
  frame.insert(frame.end() - kFrameTrailerBytes, {0x01, 0x02, 0x03});
  reseal(frame);
  auto got = decodeMessage(frame);
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<TransferRequest>(*got), req);
}

TEST(Messages, AppendedFieldsAtThisMinorAreRefused) {
  Bytes frame = encodeMessage(Cancel{3, "x"});
  frame.insert(frame.end() - kFrameTrailerBytes, uint8_t{0});
  reseal(frame);
  expectRefused(frame, StatusCode::kCorruption, "cancel.end: 1 unexpected trailing bytes");
}

TEST(Messages, AnotherMajorVersionIsRefusedNamingBothVersions) {
  Bytes frame = encodeMessage(Cancel{3, "x"});
  frame[4] = static_cast<uint8_t>(kWireVersionMajor + 1);
  frame[6] = 7;
  reseal(frame);
  const std::string want = "peer speaks " + std::to_string(kWireVersionMajor + 1) +
                           ".7, this build speaks " + std::to_string(kWireVersionMajor) + "." +
                           std::to_string(kWireVersionMinor);
  expectRefused(frame, StatusCode::kIncompatible, want);
  // The stream helper refuses it from the header alone.
  auto length = frameLength(std::span<const uint8_t>(frame.data(), kFrameHeaderBytes));
  EXPECT_EQ(length.status().code(), StatusCode::kIncompatible);
}

TEST(Messages, BadMagicChecksumTypeAndTrailingBytesAreNamed) {
  Bytes frame = encodeMessage(Cancel{3, "x"});
  Bytes bad = frame;
  bad[0] = 'H';
  expectRefused(bad, StatusCode::kCorruption, "frame.magic");
  bad = frame;
  bad.back() ^= 1;
  expectRefused(bad, StatusCode::kCorruption, "frame.crc32c: stored");
  bad = frame;
  bad[8] = 42;
  reseal(bad);
  expectRefused(bad, StatusCode::kCorruption, "frame.type: unknown message type 42");
  bad = frame;
  bad.push_back(0);
  expectRefused(bad, StatusCode::kCorruption, "1 trailing bytes after the frame");
}

TEST(Messages, BodyLengthOverTheLimitIsRefusedFromTheHeader) {
  Bytes blob = encodeMessage(Cancel{3, "x"});
  storeFixed32(blob.data() + 9, 0xffffffffu);
  blob.resize(20);
  expectRefused(blob, StatusCode::kCorruption, "frame.body_length=4294967295 exceeds the limit");
}

TEST(Messages, BlockIdCountBeyondTheLimitOrTheBodyIsRefused) {
  Bytes frame = encodeMessage(TransferRequest{});
  // Body: request_id (8 bytes), gen_tp_rank, gen_pp_rank, then the block id count.
  const size_t count_at = kFrameHeaderBytes + 8 + 2;
  Bytes over = frame;
  over[count_at] = 0;
  Bytes count;
  putVarint64(count, kMaxBlockIds + 1);
  over.erase(over.begin() + count_at);
  over.insert(over.begin() + count_at, count.begin(), count.end());
  reseal(over);
  expectRefused(over, StatusCode::kCorruption,
                "transfer_request.dst_block_ids.count=1048577 exceeds the limit 1048576");
  Bytes beyond = frame;
  beyond[count_at] = 100;
  reseal(beyond);
  expectRefused(beyond, StatusCode::kCorruption, "dst_block_ids.count: count 100 needs at least");
}

TEST(Messages, FirstBlockPastTheBlockListIsRefused) {
  TransferRequest req = sampleRequest();
  req.first_block = static_cast<uint32_t>(req.dst_block_ids.size() + 1);
  EXPECT_EQ(checkMessage(req).code(), StatusCode::kCorruption);
  expectRefused(encodeMessage(req), StatusCode::kCorruption, "transfer_request.first_block");
}

TEST(Messages, AuxPayloadOverItsLimitIsRefused) {
  TransferRequest req = sampleRequest();
  req.aux.assign(kMaxAuxBytes, 7);
  EXPECT_TRUE(decodeMessage(encodeMessage(req)).isOk());
  req.aux.push_back(7);
  EXPECT_EQ(checkMessage(req).code(), StatusCode::kCorruption);
  expectRefused(encodeMessage(req), StatusCode::kCorruption,
                "transfer_request.aux.length=16385 exceeds the limit 16384");
}

TEST(Messages, TransferDoneAuxOverItsLimitIsRefused) {
  TransferDone done{7, OkStatus(), 10, std::nullopt, Bytes(kMaxAuxBytes, 1)};
  EXPECT_TRUE(decodeMessage(encodeMessage(done)).isOk());
  done.aux.push_back(1);
  EXPECT_EQ(checkMessage(done).code(), StatusCode::kCorruption);
  expectRefused(encodeMessage(done), StatusCode::kCorruption,
                "transfer_done.aux.length=16385 exceeds the limit 16384");
}

// Minor 1 appended transfer_done.aux: a minor-0 body, which ends after the checksum, still reads
// (aux empty), and a minor-0 frame is accepted by this build.
TEST(Messages, MinorZeroTransferDoneWithoutAuxStillReads) {
  const TransferDone done{9, OkStatus(), 4096, 0x55ull, Bytes{}};
  Bytes frame = encodeMessage(done);
  // The empty aux's length and the zero epoch end the body.
  ASSERT_EQ(frame[frame.size() - kFrameTrailerBytes - 1], 0);
  ASSERT_EQ(frame[frame.size() - kFrameTrailerBytes - 2], 0);
  frame.erase(frame.end() - kFrameTrailerBytes - 2, frame.end() - kFrameTrailerBytes);
  frame[6] = 0;  // minor 0
  reseal(frame);
  auto got = decodeMessage(frame);
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<TransferDone>(*got), done);
}

TEST(Messages, ErrorMustCarryAFailureAndAKnownCode) {
  Bytes frame = encodeMessage(Error{Internal("x")});
  Bytes ok = frame;
  ok[kFrameHeaderBytes] = 0;
  reseal(ok);
  expectRefused(ok, StatusCode::kCorruption, "error.status.code: 0 (ok) is not an error");
  Bytes unknown = frame;
  unknown[kFrameHeaderBytes] = 200;
  reseal(unknown);
  expectRefused(unknown, StatusCode::kCorruption, "error.status.code: unknown value 200");
}

TEST(Messages, TransferDoneCarriesEveryStatusCodeButPermissionDenied) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kExpired); ++c) {
    TransferDone done{42, Status(static_cast<StatusCode>(c), c ? "why" : ""), 99, std::nullopt, {},
                      0};
    if (static_cast<StatusCode>(c) == StatusCode::kPermissionDenied) {
      EXPECT_EQ(checkMessage(done).code(), StatusCode::kCorruption);
      continue;
    }
    auto back = decodeMessage(encodeMessage(done));
    ASSERT_TRUE(back.isOk()) << back.status().toString();
    EXPECT_EQ(std::get<TransferDone>(*back), done);
  }
}

// Minor 4 appended transfer_request.staging: it round-trips, a minor-3 frame reads without it,
// and a minor-3 reader skips it (the generation rank asks for staging only from minor-4 ranks).
TEST(Messages, StagingRoundTripsAndOlderFramesReadWithoutIt) {
  TransferRequest req;
  req.request_id = 5;
  req.dst_block_ids = {1, 2};
  req.num_tokens = 3;
  req.epoch = 7;
  req.staging = Staging{9, 4096, 65536};
  auto back = decodeMessage(encodeMessage(req));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(std::get<TransferRequest>(*back), req);
  // A minor-3 frame: the same bytes without the staging field (1 flag + 1 + 2 + 3 varint bytes),
  // minor 5's dst_group_slots.count and minor 7's staging_part and staging_window (1 byte each).
  Bytes frame = encodeMessage(req);
  frame.erase(frame.end() - kFrameTrailerBytes - 10, frame.end() - kFrameTrailerBytes);
  frame[6] = 3;
  reseal(frame);
  back = decodeMessage(frame);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_FALSE(std::get<TransferRequest>(*back).staging.has_value());
  EXPECT_EQ(std::get<TransferRequest>(*back).epoch, 7u);
  // Over the limits: refused naming the field.
  req.staging->bytes = kMaxRegionBytes + 1;
  EXPECT_NE(checkMessage(req).message().find("transfer_request.staging.bytes"), std::string::npos)
      << checkMessage(req).toString();
}

// The staging slot must lie inside a region of the rank's own RankInfo that is not a pool.
TEST(Messages, CheckDestinationRefusesAStagingSlotOutsideAStagingRegion) {
  auto info = examples::rankInfo(examples::models()[0], {1, 1, {}}, 0, StateLayout::kPaged,
                                 InstanceRole::kGeneration);
  ASSERT_TRUE(info.isOk());
  RankLayout layout = info->layout;
  const uint32_t staging_id = 1000;
  layout.regions.push_back({staging_id, 1 << 20, "staging"});
  TransferRequest req;
  req.dst_block_ids = {1, 2};
  req.dst_slot = 0;
  req.num_tokens = 3;
  req.staging = Staging{staging_id, 4096, 65536};
  EXPECT_TRUE(checkDestination(req, layout).isOk()) << checkDestination(req, layout).toString();
  req.staging = Staging{staging_id, (1 << 20) - 100, 200};
  Status s = checkDestination(req, layout);
  EXPECT_NE(s.message().find("is outside region 1000"), std::string::npos) << s.toString();
  req.staging = Staging{layout.views[0].region_id, 0, 16};
  s = checkDestination(req, layout);
  EXPECT_NE(s.message().find("is a pool, not a staging region"), std::string::npos) << s.toString();
  req.staging = Staging{77, 0, 16};
  s = checkDestination(req, layout);
  EXPECT_NE(s.message().find("is not a region of the rank"), std::string::npos) << s.toString();
}

// Minor 5: the state ids of groups 1.. (vLLM's shared tensors) travel in
// transfer_request.dst_group_slots; a minor-4 frame reads without them.
TEST(Messages, GroupSlotsRoundTripAndMinorFourFramesReadWithout) {
  TransferRequest req;
  req.request_id = 5;
  req.dst_block_ids = {1, 2};
  req.dst_slot = 3;
  req.num_tokens = 3;
  req.dst_group_slots = {4, 9, 300};
  auto back = decodeMessage(encodeMessage(req));
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(std::get<TransferRequest>(*back), req);
  // count 3, 1 + 1 + 2 varint bytes, then staging_part and staging_window, 0 each
  Bytes frame = encodeMessage(req);
  frame.erase(frame.end() - kFrameTrailerBytes - 7, frame.end() - kFrameTrailerBytes);
  frame[6] = 4;
  reseal(frame);
  back = decodeMessage(frame);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_TRUE(std::get<TransferRequest>(*back).dst_group_slots.empty());
  req.dst_slot.reset();
  EXPECT_NE(checkMessage(req).message().find("dst_slot is absent"), std::string::npos)
      << checkMessage(req).toString();
}

// Minor 7: a staged part's size and window travel last, in transfer_request.staging_part and
// staging_window; a minor-6 frame reads without them (the whole part), one without staging must
// say 0 for both, and a window needs the part's size.
TEST(Messages, StagingWindowRoundTripsAndMinorSixFramesReadWithout) {
  TransferRequest req;
  req.request_id = 5;
  req.dst_block_ids = {1, 2};
  req.num_tokens = 3;
  req.staging = Staging{9, 4096, 65536, 131072, 262144};
  Bytes frame = encodeMessage(req);
  auto back = decodeMessage(frame);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  EXPECT_EQ(std::get<TransferRequest>(*back), req);
  frame.erase(frame.end() - kFrameTrailerBytes - 6, frame.end() - kFrameTrailerBytes);  // 3 + 3
  frame[6] = 6;
  reseal(frame);
  back = decodeMessage(frame);
  ASSERT_TRUE(back.isOk()) << back.status().toString();
  ASSERT_TRUE(std::get<TransferRequest>(*back).staging.has_value());
  EXPECT_EQ(std::get<TransferRequest>(*back).staging->window, 0u);
  EXPECT_EQ(std::get<TransferRequest>(*back).staging->part, 0u);
  EXPECT_EQ(std::get<TransferRequest>(*back).staging->bytes, 65536u);
  // Without staging, a part or a window: refused naming the field; so is a window of a part of
  // size 0 (the whole part).
  TransferRequest plain;
  plain.dst_block_ids = {1};
  plain.num_tokens = 1;
  for (const auto& [at, what] :
       {std::pair<size_t, std::string>{2, "staging_part=5"}, {1, "staging_window=5"}}) {
    frame = encodeMessage(plain);
    ASSERT_EQ(frame[frame.size() - kFrameTrailerBytes - at], 0);
    frame[frame.size() - kFrameTrailerBytes - at] = 5;
    reseal(frame);
    back = decodeMessage(frame);
    ASSERT_FALSE(back.isOk());
    EXPECT_NE(back.status().message().find(what + " but has_staging is 0"), std::string::npos)
        << back.status().toString();
  }
  TransferRequest whole = req;
  whole.staging = Staging{9, 4096, 65536};
  frame = encodeMessage(whole);
  frame[frame.size() - kFrameTrailerBytes - 1] = 5;
  reseal(frame);
  back = decodeMessage(frame);
  ASSERT_FALSE(back.isOk());
  EXPECT_NE(back.status().message().find("staging_window=5 but staging_part is 0"),
            std::string::npos)
      << back.status().toString();
  whole.staging->window = 5;
  EXPECT_NE(checkMessage(whole).message().find("but staging_part is 0"), std::string::npos)
      << checkMessage(whole).toString();
  req.staging->window = kMaxRegionBytes + 1;
  EXPECT_NE(checkMessage(req).message().find("transfer_request.staging_window"), std::string::npos)
      << checkMessage(req).toString();
}

// The destination's state ids: as many as its layout's state groups, inside the pool, and
// with one id pool none also a block or another group's state.
TEST(Messages, CheckDestinationWantsOneStateIdPerGroupEachOnceInTheJointPool) {
  auto info = examples::rankInfo(examples::models()[0], {1, 1, {}}, 0, sharedEngineLayouts()[0],
                                 InstanceRole::kGeneration);
  ASSERT_TRUE(info.isOk()) << info.status().toString();
  const RankLayout& layout = info->layout;
  ASSERT_GT(layout.state_groups, 1u);
  ASSERT_GE(layout.num_blocks, 2 + layout.state_groups);
  TransferRequest req;
  req.dst_block_ids = {0, 1};
  req.dst_slot = 2;
  req.num_tokens = 3;
  for (uint32_t g = 1; g < layout.state_groups; ++g) req.dst_group_slots.push_back(2 + g);
  EXPECT_TRUE(checkDestination(req, layout).isOk()) << checkDestination(req, layout).toString();
  TransferRequest fewer = req;
  fewer.dst_group_slots.pop_back();
  EXPECT_NE(checkDestination(fewer, layout).message().find("state groups besides dst_slot's"),
            std::string::npos)
      << checkDestination(fewer, layout).toString();
  TransferRequest outside = req;
  outside.dst_group_slots.back() = layout.num_slots;
  EXPECT_NE(checkDestination(outside, layout).message().find(">= num_slots"), std::string::npos);
  TransferRequest block = req;
  block.dst_group_slots.front() = 1;
  EXPECT_NE(checkDestination(block, layout).message().find("names id 1 twice"), std::string::npos)
      << checkDestination(block, layout).toString();
  TransferRequest twice = req;
  twice.dst_group_slots.back() = 2;
  EXPECT_NE(checkDestination(twice, layout).message().find("names id 2 twice"), std::string::npos);
}

// Minor 2 appended the epochs and hello.incarnation, and the Expired code (11). A minor-1
// frame without them reads with zero epochs; Expired in a minor-1 frame is refused, since a
// minor-1 reader would not know it.
TEST(Messages, MinorOneFramesReadWithoutEpochsAndCannotSayExpired) {
  auto asMinorOne = [](Bytes frame, size_t drop) {
    frame.erase(frame.end() - kFrameTrailerBytes - drop, frame.end() - kFrameTrailerBytes);
    frame[6] = 1;
    reseal(frame);
    return frame;
  };
  TransferRequest req;
  req.request_id = 5;
  req.dst_block_ids = {1, 2};
  req.num_tokens = 3;
  // One varint byte, has_staging (minor 4), dst_group_slots.count (minor 5), staging_part and
  // staging_window (7).
  req.epoch = 7;
  auto got = decodeMessage(asMinorOne(encodeMessage(req), 5));
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<TransferRequest>(*got).epoch, 0u);
  EXPECT_EQ(std::get<TransferRequest>(*got).dst_block_ids, req.dst_block_ids);

  got = decodeMessage(asMinorOne(encodeMessage(Cancel{5, "r", 9}), 1));
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<Cancel>(*got), (Cancel{5, "r", 0}));

  got = decodeMessage(asMinorOne(encodeMessage(TransferDone{5, Timeout("t"), 0, {}, {}, 4}), 1));
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<TransferDone>(*got).epoch, 0u);

  auto info = examples::rankInfo(examples::models()[0], {1, 1, {}}, 0, StateLayout::kPaged,
                                 InstanceRole::kContext);
  ASSERT_TRUE(info.isOk());
  got = decodeMessage(asMinorOne(encodeMessage(Hello{*info, "", 0x1122334455667788ull}), 8));
  ASSERT_TRUE(got.isOk()) << got.status().toString();
  EXPECT_EQ(std::get<Hello>(*got).incarnation, 0u);

  expectRefused(asMinorOne(encodeMessage(TransferDone{5, Expired("e"), 0, {}, {}, 4}), 1),
                StatusCode::kCorruption,
                "transfer_done.status.code: 11 (Expired) does not travel in a frame of minor 1");
}

TEST(Messages, HelloWithAHostileRankInfoIsRefusedNamingTheNestedField) {
  auto info = examples::rankInfo(examples::models()[0], {1, 1, {}}, 0, StateLayout::kPaged,
                                 InstanceRole::kContext);
  ASSERT_TRUE(info.isOk());
  info->layout.views[0].base = 1;  // the last block now ends one byte past its region
  EXPECT_EQ(checkMessage(Hello{*info, ""}).code(), StatusCode::kCorruption);
  expectRefused(encodeMessage(Hello{*info, ""}), StatusCode::kCorruption,
                "hello.rank_info.layout: view 0 (kv) records run past region");
}

TEST(Messages, FrameLengthNeedsTheWholeHeader) {
  Bytes frame = encodeMessage(Cancel{1, ""});
  auto got = frameLength(std::span<const uint8_t>(frame.data(), kFrameHeaderBytes - 1));
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
}

class Destination : public ::testing::Test {
 protected:
  void SetUp() override {
    auto info = examples::rankInfo(examples::models()[0], {2, 1, {}}, 1, StateLayout::kPaged,
                                   InstanceRole::kGeneration);
    ASSERT_TRUE(info.isOk());
    layout_ = info->layout;
    req_ = sampleRequest();
    ASSERT_TRUE(checkDestination(req_, layout_).isOk())
        << checkDestination(req_, layout_).toString();
  }
  void expectRefused(const std::string& what) {
    Status s = checkDestination(req_, layout_);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.toString();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.toString();
  }
  RankLayout layout_;
  TransferRequest req_;
};

TEST_F(Destination, BlockIdOutsideThePoolIsRefused) {
  req_.dst_block_ids[1] = layout_.num_blocks;
  expectRefused("dst_block_ids holds block 6 >= num_blocks=6");
}

TEST_F(Destination, RepeatedBlockIdIsRefused) {
  req_.dst_block_ids[1] = req_.dst_block_ids[0];
  expectRefused("twice");
}

TEST_F(Destination, SlotOutsideThePoolOrMissingIsRefused) {
  req_.dst_slot = layout_.num_slots;
  expectRefused("dst_slot=3 >= num_slots=3");
  req_.dst_slot.reset();
  expectRefused("dst_slot is absent but the rank holds recurrent layers");
}

TEST_F(Destination, RequestForAnotherRankIsRefused) {
  req_.gen_tp_rank = 0;
  expectRefused("reached rank (tp 1, pp 0)");
}

TEST_F(Destination, MoreTokensThanTheBlocksHoldAreRefused) {
  req_.num_tokens = uint64_t{layout_.tokens_per_block} * req_.dst_block_ids.size() + 1;
  expectRefused("does not fit 4 blocks of 16 tokens");
}

}  // namespace
}  // namespace hxfer::wire
