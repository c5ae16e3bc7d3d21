// The pattern oracle (DESIGN §10): every byte of every record is a function of its logical
// coordinates (request id, global layer, role, section, global unit, token in the request for
// kv, byte), never of the rank, layout or address holding it. A context rank fills
// its records with it; the generation rank checks every byte it received against the same
// function. A mis-sharded section, an off-by-one stride or a lost op shows up as a mismatch
// naming all the coordinates. Replicated units hold the same bytes on every rank, by
// construction.
//
// Speed: one seed per (coordinates of a unit), then 8-byte words from splitmix64 of the seed
// and the word index, so filling and checking run near memory bandwidth (they are used on
// MiB-GiB of state by benchmarks and the demo).
//
// Pure functions over caller-owned memory; no threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "cache/layout.h"
#include "common/status.h"
#include "plan/memory.h"
#include "plan/planner.h"

namespace hxfer {

// Seed of one piece: a whole unit for conv/ssm (`token` 0), one token row of a unit (head) for
// kv, `token` counted from the request's first token. Seeding kv per token keeps the pattern
// independent of tokens per block, so ranks with different block sizes agree. The section is
// named ("K", "x"), so a layout holding K and V in views of their own fills the same bytes as
// one holding [K|V].
uint64_t oracleUnitSeed(uint64_t request_id, uint32_t layer, Role role, std::string_view section,
                        uint32_t unit, uint64_t token);
// Writes `bytes` bytes of the unit with seed `seed`.
void oracleFillUnit(uint64_t seed, uint8_t* out, uint64_t bytes);
// Expected byte `byte` of the unit with seed `seed`.
uint8_t oracleByte(uint64_t seed, uint64_t byte);

struct OracleMismatch {
  uint64_t request_id = 0;
  uint32_t layer = 0;  // global
  Role role = Role::kKv;
  uint32_t section = 0;  // index in the record's sections
  std::string section_name;
  uint32_t unit = 0;      // global unit
  uint32_t position = 0;  // block position in the request (kv), 0 otherwise
  uint64_t token = 0;     // token in the request (kv), 0 otherwise
  uint64_t byte = 0;      // byte in the unit (conv/ssm) or in the token row (kv)
  uint8_t expected = 0, actual = 0;
  uint32_t region = 0;  // where the byte lives on the checked rank
  uint64_t offset = 0;
  std::string toString() const;
};

struct OracleReport {
  uint64_t bytes_checked = 0;
  uint64_t mismatched_bytes = 0;
  std::optional<OracleMismatch> first;
  bool ok() const { return mismatched_bytes == 0; }
  void merge(const OracleReport& other);
  // "ok: 1234 bytes" or "3 of 1234 bytes differ; first: layer 2 conv section 1 (B) ..."
  std::string toString() const;
};

// Fills the record of (view, local_layer) at `record` (view.record_bytes bytes).
// REQUIRES: layout.validate() is ok and `view` is one of its views.
void fillRecord(const RankLayout& layout, const PoolView& view, uint32_t local_layer,
                uint32_t position, uint64_t request_id, uint8_t* record);
// Checks one record; adds to `report`. kv token rows at or past `token_end` are not checked.
void checkRecord(const RankLayout& layout, const PoolView& view, uint32_t local_layer,
                 uint32_t position, uint64_t request_id, const uint8_t* record, uint32_t region,
                 uint64_t record_offset, OracleReport* report, uint64_t token_end = UINT64_MAX);

// Fills every record of the request on a rank: kv records of every block in ids.blocks
// (position i = ids.blocks[i]) and the conv/ssm records of ids.slot, for every local layer.
// Errors: ids outside the pools, regions missing from `mem` or too short.
Status fillRank(const RankLayout& layout, const RankMemory& mem, const RankIds& ids,
                uint64_t request_id);
// Checks the records a generation rank received: kv records of positions `blocks` (token rows
// before `token_end`: a request shorter than its last block, moved from a rank with another
// block size, leaves the rest of that block unwritten; Planner::kvTokens says which) and the
// slot's conv/ssm records. Same errors as fillRank; mismatches go in the report.
StatusOr<OracleReport> checkRank(const RankLayout& layout, const RankMemory& mem,
                                 const RankIds& ids, uint64_t request_id, BlockRange blocks,
                                 uint64_t token_end = UINT64_MAX);

}  // namespace hxfer
