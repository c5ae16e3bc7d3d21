// RankInfo: what one rank publishes about itself to its peers (DESIGN §4).
//
// It carries the complete cache::RankLayout (parallel position, layers per stage, dtypes, model
// fingerprint, regions and every pool view with its sections and strides), the transport
// address, and one opaque transport key per registered region (a UCX rkey; absent for shm).
// Encoded field by field, little-endian, never as a host struct; grammar in
// docs/wire-format.md ("rank_info").
//
// Invariant of every RankInfo that decodeRankInfo returns: checkRankInfo() is ok, i.e. every
// count is within its limit and layout.validate() holds (records inside their regions, strides
// overflow-free), every region key names a region of the layout, at most once.
//
// Pure values and functions: no I/O, no threads; safe to share read-only.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache/layout.h"
#include "common/coding.h"
#include "common/status.h"
#include "wire/codec.h"

namespace hxfer::wire {

enum class InstanceRole : uint8_t { kContext = 0, kGeneration = 1 };
inline constexpr uint8_t kMaxInstanceRole = 1;
std::string_view instanceRoleName(InstanceRole r);  // "context", "generation"
StatusOr<InstanceRole> parseInstanceRole(std::string_view name);

// The transport key bytes a peer needs to write into one region (e.g. a packed UCX rkey).
struct RegionKey {
  uint32_t region_id = 0;  // a RegionSpec::id of the layout
  Bytes key;
  bool operator==(const RegionKey&) const = default;
};

struct RankInfo {
  // The protocol version the publisher speaks. Decoding keeps the peer's values.
  uint16_t version_major = kWireVersionMajor;
  uint16_t version_minor = kWireVersionMinor;
  std::string instance_id;  // names the serving instance; <= kMaxIdBytes
  InstanceRole role = InstanceRole::kContext;
  Bytes address;  // transport address of this rank; <= kMaxAddressBytes
  RankLayout layout;
  std::vector<RegionKey> region_keys;  // regions without an entry have no key

  // Global rank in its instance: pp_rank * tp + tp_rank.
  uint32_t globalRank() const { return layout.pp_rank * layout.tp + layout.tp_rank; }
  // The key of region `region_id`, or nullptr when it has none.
  const Bytes* findKey(uint32_t region_id) const;
  bool operator==(const RankInfo&) const = default;
};

// Everything the decoder enforces, on a value built locally (run it before publishing a
// RankInfo to get the refusal a peer would give). Errors are Corruption naming the field.
Status checkRankInfo(const RankInfo& info);

// The first minor whose rank_info carries described records (engine layouts, "records").
inline constexpr uint16_t kRecordsMinor = 3;

// Whether a peer speaking `peer_minor` of this major reads `self` as it is: a peer older than
// kRecordsMinor drops the described records and would read every record in hxfer's own order,
// so a layout with one is Incompatible with it (naming the view and both versions).
Status checkPeerReadsLayout(const RankLayout& self, uint16_t peer_minor);

// The rank_info grammar. REQUIRES: checkRankInfo(info) is ok (otherwise a peer refuses it).
void encodeRankInfo(const RankInfo& info, Bytes& out);
Bytes encodeRankInfo(const RankInfo& info);

// Decodes exactly one rank_info occupying all of `in`. Strict and total: any truncation,
// out-of-range enum, over-limit count, non-canonical varint or invalid layout is Corruption
// naming the field; another major version is Incompatible naming both versions. Trailing
// bytes are accepted (and ignored) only when version_minor is newer than this build's.
StatusOr<RankInfo> decodeRankInfo(std::span<const uint8_t> in);

namespace internal {
// decodeRankInfo with errors naming fields under `path` (a Hello names "hello.rank_info.").
StatusOr<RankInfo> decodeRankInfo(std::span<const uint8_t> in, std::string path);
}  // namespace internal

}  // namespace hxfer::wire
