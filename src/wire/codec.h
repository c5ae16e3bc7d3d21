// The wire's version, its size limits, and the strict field reader both decoders share.
//
// Every limit here is part of the format (docs/wire-format.md lists them): a decoder refuses a
// value above its limit before allocating anything for it, so a short hostile input can never
// make hxfer reserve memory out of proportion to its own length.
//
// WireReader is a bounds-checked cursor over untrusted bytes. Every read either succeeds or
// returns Corruption naming the full field path ("rank_info.layout.views[3].sections[1].units")
// and the values; it never reads past the end. Varints must be canonical (shortest form) so
// that every accepted input re-encodes to the same bytes. One reader per thread; no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/coding.h"
#include "common/status.h"

namespace hxfer::wire {

// Protocol version spoken by this build. A reader accepts every minor of its major (see
// docs/wire-format.md "Versions"); another major is refused.
inline constexpr uint16_t kWireVersionMajor = 1;
// 1: transfer_done.aux. 2: hello.incarnation, epochs in transfer_request / transfer_done /
// cancel, status code 11 (expired). 3: rank_info.records (engine layouts, record_layout.h).
// 4: transfer_request.staging (a part gathered into one write, scattered by the generation rank).
// 5: rank_info.id_groups and transfer_request.dst_group_slots (vLLM's shared per-group tensors:
// one id pool, a state id per group). 6: a record dim may be split (an inner dim named more
// than once, mixed radix; vLLM's CPU attention on AMX); no field changes. 7:
// transfer_request.staging_window (a part larger than the staging slot, asked for window by
// window).
inline constexpr uint16_t kWireVersionMinor = 7;
inline constexpr uint16_t kStagingMinor = 4;
inline constexpr uint16_t kStateGroupsMinor = 5;
inline constexpr uint16_t kSplitDimsMinor = 6;
inline constexpr uint16_t kStagingWindowMinor = 7;

// Limits (all inclusive). Changing one is a format change: document it.
inline constexpr uint64_t kMaxFrameBodyBytes = 16u << 20;  // one message body
inline constexpr uint64_t kMaxIdBytes = 1024;              // instance id
inline constexpr uint64_t kMaxNameBytes = 256;             // region and section names
inline constexpr uint64_t kMaxAddressBytes = 64u << 10;    // transport address
inline constexpr uint64_t kMaxKeyBytes = 64u << 10;        // one region's transport key
inline constexpr uint64_t kMaxTokenBytes = 4096;           // Hello auth token
inline constexpr uint64_t kMaxMessageBytes = 64u << 10;    // status/reason/error text
inline constexpr uint64_t kMaxAuxBytes = 16u << 10;        // aux payload, either direction
inline constexpr uint64_t kMaxTp = 4096;
inline constexpr uint64_t kMaxPp = 4096;
inline constexpr uint64_t kMaxLayers = 1u << 16;  // global layers of a model, and layer ids
inline constexpr uint64_t kMaxTokensPerBlock = 1u << 20;
inline constexpr uint64_t kMaxRegions = 4096;
inline constexpr uint64_t kMaxViews = 4096;
inline constexpr uint64_t kMaxSections = 64;      // per view
inline constexpr uint64_t kMaxRecordDims = 16;    // dims of one described record
inline constexpr uint64_t kMaxElementBytes = 16;  // element size of a described record
inline constexpr uint64_t kMaxBlockIds = 1u << 20;
inline constexpr uint64_t kMaxStateGroups = 1u << 16;  // state ids of a request on one rank
// Region lengths, offsets, strides and unit sizes: 2^48 bytes (256 TiB) keeps every sum of two
// of them far from overflowing 64 bits in the planner and the transports.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 48;

// Writers. Infallible; the matching reader is the authority on what is valid.
void putString(Bytes& out, std::string_view s);
void putBytes(Bytes& out, std::span<const uint8_t> b);

class WireReader {
 public:
  // `path` prefixes every field name in errors ("rank_info.").
  WireReader(std::span<const uint8_t> in, std::string path) : in_(in), path_(std::move(path)) {}

  Status u8(std::string_view field, uint8_t* v);
  Status u16(std::string_view field, uint16_t* v);
  Status u64Fixed(std::string_view field, uint64_t* v);
  // Canonical varint <= max.
  Status varint(std::string_view field, uint64_t max, uint64_t* v);
  Status varint32(std::string_view field, uint64_t max, uint32_t* v);
  // An enum byte <= max.
  Status enumByte(std::string_view field, uint8_t max, uint8_t* v);
  Status boolean(std::string_view field, bool* v);
  // An element count <= cap that also cannot exceed what is left: each element takes at least
  // `min_element_bytes` bytes, so a count larger than remaining()/min is refused before any
  // vector is sized from it.
  Status count(std::string_view field, uint64_t cap, size_t min_element_bytes, size_t* n);
  // Varint length <= max_len followed by that many bytes.
  Status span(std::string_view field, uint64_t max_len, std::span<const uint8_t>* v);
  Status string(std::string_view field, uint64_t max_len, std::string* v);
  Status bytes(std::string_view field, uint64_t max_len, Bytes* v);

  // Strict end: no bytes may be left over.
  Status expectEnd(std::string_view what) const;

  // Scoped path element: `auto s = r.scope("views[3].")` names fields of view 3 until s dies.
  class Scope {
   public:
    Scope(WireReader* r, std::string_view element) : r_(r), saved_(r->path_.size()) {
      r_->path_.append(element);
    }
    ~Scope() { r_->path_.resize(saved_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WireReader* r_;
    size_t saved_;
  };
  Scope scope(std::string_view element) { return Scope(this, element); }
  Scope element(std::string_view list, size_t index) {
    return Scope(this, std::string(list) + "[" + std::to_string(index) + "].");
  }

  // "<path><field>", for errors raised by callers.
  std::string name(std::string_view field) const;
  Status corrupt(std::string_view field, const std::string& what) const;

  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  std::span<const uint8_t> rest() const { return in_.subspan(pos_); }
  void skipRest() { pos_ = in_.size(); }

 private:
  Status need(std::string_view field, size_t n) const;

  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  std::string path_;
};

}  // namespace hxfer::wire
