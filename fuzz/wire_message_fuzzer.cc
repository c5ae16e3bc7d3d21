// libFuzzer target: decodeMessage on arbitrary bytes, twice: as given (exercising the framing
// and checksum) and with the CRC trailer recomputed (so that mutations reach the body decoders).
// Beyond "never crashes, never reads out of bounds" (ASan, UBSan) it checks the decoder's
// contract: an accepted frame re-encodes to a frame that decodes to the same value, and to the
// very same bytes when it is of this build's minor version.
#include <cstdint>
#include <cstdlib>
#include <variant>

#include "common/crc32c.h"
#include "wire/examples.h"
#include "wire/messages.h"

namespace {

using namespace hxfer;
using namespace hxfer::wire;

const RankLayout& someLayout() {
  static const RankLayout layout = [] {
    auto info = examples::rankInfo(examples::models()[0], {2, 1, {}}, 1, StateLayout::kPaged,
                                   InstanceRole::kGeneration);
    if (!info.isOk()) std::abort();
    return info->layout;
  }();
  return layout;
}

void checkOne(std::span<const uint8_t> in) {
  auto m = decodeMessage(in);
  if (!m.isOk()) return;
  if (!checkMessage(*m).isOk()) std::abort();  // decode and check must agree
  const Bytes again = encodeMessage(*m);
  auto back = decodeMessage(again);
  if (!back.isOk() || !(*back == *m)) std::abort();
  // A frame of another minor re-encodes at this build's (older: with the appended fields'
  // defaults; newer: without the fields this build skipped), so only this minor's frames must
  // come back byte for byte.
  bool exact = (in[6] | in[7] << 8) == kWireVersionMinor;
  if (const auto* hello = std::get_if<Hello>(&*m)) {
    exact = exact && hello->rank_info.version_minor <= kWireVersionMinor;
  }
  if (exact && !std::equal(again.begin(), again.end(), in.begin(), in.end())) std::abort();
  if (const auto* req = std::get_if<TransferRequest>(&*m)) {
    (void)checkDestination(*req, someLayout());
  }
  (void)summarize(*m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  checkOne(std::span<const uint8_t>(data, size));
  if (size >= kFrameHeaderBytes + kFrameTrailerBytes) {
    Bytes sealed(data, data + size);
    storeFixed32(sealed.data() + size - kFrameTrailerBytes,
                 crc32c(sealed.data(), size - kFrameTrailerBytes));
    checkOne(sealed);
  }
  return 0;
}
