// The control messages of the transfer protocol (DESIGN §7) and their framing.
//
//   generation -> context   Hello, TransferRequest, Cancel
//   context -> generation   Hello, TransferDone, Cancel
//   either way              Error
//
// Every message travels as one frame:
//   magic "hxfr" | version major u16 | minor u16 | type u8 | body length u32 | body | crc32c u32
// (little-endian; the CRC covers every byte before it). Grammar, limits and version rules:
// docs/wire-format.md.
//
// decodeMessage is strict and total: truncation, a bad magic or checksum, an unknown type or
// enum, a count over its limit, a non-canonical varint or an invalid RankInfo is Corruption
// naming the field ("transfer_request.dst_block_ids.count=1048577 exceeds the limit 1048576");
// a frame of another major version is Incompatible naming both versions. It never allocates
// more than a small multiple of its input, never reads outside it, never crashes.
//
// Pure values and functions: no I/O, no threads; safe to share read-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "cache/layout.h"
#include "common/coding.h"
#include "common/status.h"
#include "wire/codec.h"
#include "wire/rank_info.h"

namespace hxfer::wire {

enum class MessageType : uint8_t {
  kHello = 1,
  kTransferRequest = 2,
  kTransferDone = 3,
  kCancel = 4,
  kError = 5,
};
inline constexpr uint8_t kMinMessageType = 1;
inline constexpr uint8_t kMaxMessageType = 5;
// "hello", "transfer_request", "transfer_done", "cancel", "error"
std::string_view messageTypeName(MessageType t);

// First message on every connection, both ways.
struct Hello {
  RankInfo rank_info;
  std::string auth_token;  // always empty since the transports authenticate; <= kMaxTokenBytes
  // Minor 2: this connection's end, drawn at random when the sender or receiver object is
  // created; a restarted rank says a new one. 0 = not given (an older peer).
  uint64_t incarnation = 0;
  bool operator==(const Hello&) const = default;
};

// Minor 4: where a context rank writes its whole part of a request as one run, instead of into
// the pages: `bytes` at `offset` of the generation rank's region `region` (a region of its
// RankInfo that no view uses), the part's bytes in the order of their destination addresses
// (plan/staging.h). The generation rank scatters them into the pages before it completes the
// request. Asked for when the part's ops are many and small (a descriptor storm).
//
// Minor 7: a part larger than the slot is asked for window by window, one TransferRequest
// (same epoch) per window: `part` is the part's bytes as the generation rank counts them, and
// `window` where in the part's destination-ordered bytes the slot's `bytes` begin: 0, then each
// window's end, until the part's end. part 0 (and window 0): the slot holds the whole part, as
// before minor 7.
struct Staging {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t window = 0;
  uint64_t part = 0;
  bool operator==(const Staging&) const = default;
};

// Generation -> each overlapping context rank: "write request `request_id` into these pages of
// generation rank (gen_tp_rank, gen_pp_rank)". Block ids index every kv view of that rank (one
// block-id space, RankLayout::num_blocks); the slot indexes every conv/ssm view.
struct TransferRequest {
  uint64_t request_id = 0;
  uint32_t gen_tp_rank = 0;
  uint32_t gen_pp_rank = 0;
  std::vector<uint32_t> dst_block_ids;  // the request's blocks in token order; <= kMaxBlockIds
  std::optional<uint32_t> dst_slot;     // absent when the rank holds no recurrent layers
  // Index into dst_block_ids of the first block to send: blocks before it the generation side
  // already holds (a prefix-cache hit). 0 <= first_block <= dst_block_ids.size().
  uint32_t first_block = 0;
  uint64_t num_tokens = 0;  // prompt tokens whose state moves; <= kMaxTokens
  Bytes aux;                // opaque, e.g. the first sampled token; <= kMaxAuxBytes
  // Minor 2: which use of request_id this is, chosen by the generation rank (unique per
  // request it starts); TransferDone and Cancel of this request carry it back, so a message
  // about an earlier request with the same id can never end this one. 0 = not given.
  uint64_t epoch = 0;
  // Minor 4: write the part into this staging slot (above). A context rank of minor 4 or later
  // either does so or fails the part; the generation rank asks only such ranks.
  std::optional<Staging> staging;
  // Minor 5: the state ids of groups 1.. when the rank's layout has several (vLLM's shared
  // per-group tensors; RankLayout::state_groups - 1 of them), dst_slot being group 0's.
  std::vector<uint32_t> dst_group_slots;  // <= kMaxStateGroups
  bool operator==(const TransferRequest&) const = default;
};

// Context -> generation, once per TransferRequest: ok means every byte has landed (remote
// completion was observed before sending it).
struct TransferDone {
  uint64_t request_id = 0;
  Status status;                     // ok, or why this rank's part failed
  uint64_t bytes = 0;                // bytes this rank wrote for the request
  std::optional<uint64_t> checksum;  // end-to-end checksum of those bytes, when enabled
  // Opaque to hxfer, context -> generation (e.g. the first token sampled by prefill): what the
  // serving code gave ContextSender::markReady. Empty unless status is ok. <= kMaxAuxBytes.
  Bytes aux;
  uint64_t epoch = 0;  // minor 2: the TransferRequest's epoch (0 = not given)
  bool operator==(const TransferDone&) const = default;
};

// Either side: forget `request_id`. Best effort: writes already in flight still land, and a
// TransferDone may still arrive for it (the engine defines the cancellation contract).
struct Cancel {
  uint64_t request_id = 0;
  std::string reason;  // <= kMaxMessageBytes
  uint64_t epoch = 0;  // minor 2: the TransferRequest's epoch; 0 = every use of the id
  bool operator==(const Cancel&) const = default;
};

// Either side: a refusal that is not about one request (bad handshake, wrong token,
// incompatible peer, undecodable message). status is never ok.
struct Error {
  Status status;
  bool operator==(const Error&) const = default;
};

using Message = std::variant<Hello, TransferRequest, TransferDone, Cancel, Error>;

inline constexpr uint64_t kMaxTokens = kMaxBlockIds * kMaxTokensPerBlock;
inline constexpr uint32_t kFrameMagic = 0x72667868;  // "hxfr" little-endian
inline constexpr size_t kFrameHeaderBytes = 13;
inline constexpr size_t kFrameTrailerBytes = 4;

MessageType messageType(const Message& m);

// Everything decodeMessage enforces, on a locally built value (run it before sending to get the
// refusal the peer would give).
Status checkMessage(const Message& m);

// One frame holding `m`. REQUIRES: checkMessage(m) is ok (otherwise the peer refuses it).
Bytes encodeMessage(const Message& m);

// Decodes exactly one frame occupying all of `frame`.
// `frame_minor`, when given, receives the frame's minor version (on success only): a
// connection pins the minor its peer's Hello came in, and refuses a frame of another.
StatusOr<Message> decodeMessage(std::span<const uint8_t> frame, uint16_t* frame_minor = nullptr);

// Corruption for a frame of minor `minor` on a connection whose Hello came in `pinned`.
Status mixedMinor(const Message& m, uint16_t minor, uint16_t pinned);

// For stream transports: from the first kFrameHeaderBytes of a frame (magic, version, type,
// body length checked), the total length of the frame. Fewer bytes is Corruption.
StatusOr<size_t> frameLength(std::span<const uint8_t> header);

// Checks a decoded request against the generation rank's own layout before any byte moves:
// the rank index matches, every block id is < num_blocks and appears once, the slot is present
// exactly when the rank has recurrent views and is < num_slots, num_tokens fits the blocks.
// InvalidArgument naming the field.
Status checkDestination(const TransferRequest& req, const RankLayout& dst);

// One line for logs: "transfer_request id=7 gen=(1,0) blocks=12 first=4 slot=3 tokens=380 aux=4B"
std::string summarize(const Message& m);

}  // namespace hxfer::wire
