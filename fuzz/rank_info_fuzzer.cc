// libFuzzer target: decodeRankInfo on arbitrary bytes (no frame, no checksum in the way).
// Beyond "never crashes, never reads out of bounds" (ASan, UBSan) it checks the decoder's
// contract: an accepted RankInfo passes checkRankInfo, re-encodes to bytes that decode to the
// same value, and to the very same bytes unless it came from a newer minor version (whose
// unknown trailing fields are skipped).
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "wire/rank_info.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hxfer::wire;
  const std::span<const uint8_t> in(data, size);
  auto info = decodeRankInfo(in);
  if (!info.isOk()) return 0;
  if (!checkRankInfo(*info).isOk()) std::abort();
  const hxfer::Bytes again = encodeRankInfo(*info);
  auto back = decodeRankInfo(again);
  if (!back.isOk() || !(*back == *info)) std::abort();
  if (info->version_minor <= kWireVersionMinor &&
      !std::equal(again.begin(), again.end(), in.begin(), in.end())) {
    std::abort();
  }
  return 0;
}
