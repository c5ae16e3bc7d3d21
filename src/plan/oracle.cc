#include "plan/oracle.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace hxfer {
namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t word(uint64_t seed, uint64_t k) { return mix64(seed + (k + 1) * kGamma); }

// One section of a record as held by a rank: global units [first, first + count).
struct LocalSection {
  uint32_t first = 0, count = 0;
  uint64_t unit_bytes = 0, offset = 0;
};

std::vector<LocalSection> localSections(const RankLayout& layout, const PoolView& view) {
  std::vector<LocalSection> out;
  uint64_t off = 0;
  for (const Section& s : view.sections) {
    // REQUIRES of the callers: the layout validated, so the section shards.
    const UnitRange r = shardUnits(s.units, layout.tp, layout.tp_rank, s.name).value();
    out.push_back({r.first, r.count, s.unit_bytes, off});
    off += uint64_t{r.count} * s.unit_bytes;
  }
  return out;
}

// Counts differing bytes of two words and returns the index of the first one.
inline int firstDiff(uint64_t a, uint64_t b, uint64_t n, uint64_t* count) {
  uint8_t x[8], y[8];
  std::memcpy(x, &a, 8);
  std::memcpy(y, &b, 8);
  int first = -1;
  for (uint64_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) {
      ++*count;
      if (first < 0) first = static_cast<int>(i);
    }
  }
  return first;
}

void checkUnit(uint64_t seed, const uint8_t* p, uint64_t bytes, OracleReport* report,
               const OracleMismatch& where, uint64_t unit_offset) {
  const uint64_t words = bytes / 8;
  for (uint64_t k = 0; k <= words; ++k) {
    const uint64_t n = k < words ? 8 : bytes % 8;
    if (n == 0) break;
    const uint64_t expect = word(seed, k);
    uint64_t got = 0;
    if (n == 8) {
      std::memcpy(&got, p + 8 * k, 8);
      if (got == expect) continue;
    } else {
      uint64_t e = 0;
      std::memcpy(&got, p + 8 * k, n);
      std::memcpy(&e, &expect, n);
      if (got == e) continue;
    }
    const int i = firstDiff(expect, got, n, &report->mismatched_bytes);
    if (i >= 0 && !report->first) {
      OracleMismatch m = where;
      m.byte = 8 * k + i;
      m.expected = oracleByte(seed, m.byte);
      m.actual = p[m.byte];
      m.offset = unit_offset + m.byte;
      report->first = m;
    }
  }
  report->bytes_checked += bytes;
}

// Bytes [begin, begin + n) of the unit with seed `seed`.
void fillRange(uint64_t seed, uint64_t begin, uint8_t* out, uint64_t n) {
  while (n > 0) {
    const uint64_t off = begin % 8, take = std::min<uint64_t>(8 - off, n);
    const uint64_t w = word(seed, begin / 8);
    std::memcpy(out, reinterpret_cast<const uint8_t*>(&w) + off, take);
    out += take;
    begin += take;
    n -= take;
  }
}

// For a described record (view.record): calls fn(section, unit (global), seed-free byte in the
// unit, offset in the record, bytes) for every run of every local unit, the unit's bytes taken
// in hxfer's own order (the oracle's byte numbering) and placed where the layout puts them.
template <typename Fn>
void forEachDescribedRun(const RankLayout& layout, const PoolView& view, Fn&& fn) {
  const RecordLayout& r = *view.record;
  const LogicalDims ld = logicalDims(view.kind, view.role);
  const std::vector<uint32_t> inner = innerSizesOf(r, ld);
  const std::vector<uint32_t> local =
      localUnitCounts(view.sections, layout.tp, layout.tp_rank).value();
  for (uint32_t s = 0; s < view.sections.size(); ++s) {
    const Section& sec = view.sections[s];
    const uint32_t first = shardUnits(sec.units, layout.tp, layout.tp_rank, sec.name).value().first;
    const uint32_t len = unitLength(sec, r.element_bytes, inner).value();
    const SectionPlacement p = placeSection(r, ld, view.sections, local, s, len);
    // One unit in hxfer's own order (the oracle's byte numbering) against its placement here.
    const RecordLayout unit =
        canonicalRecordLayout(view.kind, view.role, {sec}, {1}, r.element_bytes, inner).value();
    std::vector<BoxDim> box = {{len, unit.find(ld.unit_dim)->stride, p.within_stride}};
    for (const std::string& n : ld.inner) {
      // hxfer's order never splits a dim: the refinement is r's own split.
      std::vector<BoxDim> factors = logicalBox(unit, r, n).value();
      box.insert(box.end(), factors.begin(), factors.end());
    }
    for (uint32_t u = 0; u < local[s]; ++u) {
      forEachRun(box, r.element_bytes, 0, p.base + u * p.unit_stride,
                 [&](uint64_t a, uint64_t b, uint64_t n) { fn(s, first + u, a, b, n); });
    }
  }
}

// Calls fn(view, local_layer, position, region, record_offset, record_ptr) for every record of
// the request: kv records of positions [blocks.first_block, blocks.end()) and the slot records.
template <typename Fn>
Status forEachRecord(const RankLayout& layout, const RankMemory& mem, const RankIds& ids,
                     BlockRange blocks, Fn&& fn) {
  for (const PoolView& v : layout.views) {
    const uint64_t first = v.indexedByBlock() ? blocks.first_block : 0;
    const uint64_t end = v.indexedByBlock() ? blocks.end() : 1;
    if (v.indexedByBlock() && end > ids.blocks.size()) {
      return InvalidArgument(std::to_string(ids.blocks.size()) +
                             " block ids given, positions up to " + std::to_string(end) +
                             " needed");
    }
    if (v.state_group > ids.group_slots.size()) {
      return InvalidArgument("state group " + std::to_string(v.state_group) + " has no id (" +
                             std::to_string(ids.group_slots.size()) + " group slots given)");
    }
    for (uint64_t pos = first; pos < end; ++pos) {
      const uint32_t index = v.indexedByBlock() ? ids.blocks[pos] : ids.stateId(v.state_group);
      if (index >= v.num_indices) {
        return InvalidArgument(std::string(v.indexedByBlock() ? "block id " : "slot ") +
                               std::to_string(index) + " >= " + std::to_string(v.num_indices));
      }
      for (uint32_t l = 0; l < v.layers.size(); ++l) {
        const uint64_t off = v.offset(index, l);
        ASSIGN_OR_RETURN(uint8_t * p, regionBytes(mem, v.region_id, off, v.span()));
        fn(v, l, static_cast<uint32_t>(pos), v.region_id, off, p);
      }
    }
  }
  return OkStatus();
}

}  // namespace

uint64_t oracleUnitSeed(uint64_t request_id, uint32_t layer, Role role, std::string_view section,
                        uint32_t unit, uint64_t token) {
  uint64_t name = 0xcbf29ce484222325ull;  // FNV-1a of the section's name
  for (char c : section) name = (name ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  uint64_t h = mix64(request_id ^ 0x6878666572ull);  // "hxfer"
  h = mix64(h ^ layer);
  h = mix64(h ^ (uint64_t{static_cast<uint8_t>(role)} << 56) ^ name);
  h = mix64(h ^ unit);
  return mix64(h ^ (token << 1 | 1));
}

void oracleFillUnit(uint64_t seed, uint8_t* out, uint64_t bytes) {
  const uint64_t words = bytes / 8;
  for (uint64_t k = 0; k < words; ++k) {
    const uint64_t w = word(seed, k);
    std::memcpy(out + 8 * k, &w, 8);
  }
  if (bytes % 8) {
    const uint64_t w = word(seed, words);
    std::memcpy(out + 8 * words, &w, bytes % 8);
  }
}

uint8_t oracleByte(uint64_t seed, uint64_t byte) {
  const uint64_t w = word(seed, byte / 8);
  uint8_t b[8];
  std::memcpy(b, &w, 8);
  return b[byte % 8];
}

std::string OracleMismatch::toString() const {
  return "request " + std::to_string(request_id) + " layer " + std::to_string(layer) + " " +
         std::string(roleName(role)) + " section " + std::to_string(section) + " (" + section_name +
         ") unit " + std::to_string(unit) + " position " + std::to_string(position) +
         (role == Role::kKv ? " token " + std::to_string(token) : std::string()) + " byte " +
         std::to_string(byte) + ": expected " + std::to_string(expected) + " got " +
         std::to_string(actual) + " (region " + std::to_string(region) + " offset " +
         std::to_string(offset) + ")";
}

void OracleReport::merge(const OracleReport& other) {
  bytes_checked += other.bytes_checked;
  mismatched_bytes += other.mismatched_bytes;
  if (!first && other.first) first = other.first;
}

std::string OracleReport::toString() const {
  if (ok()) return "ok: " + std::to_string(bytes_checked) + " bytes";
  std::string s =
      std::to_string(mismatched_bytes) + " of " + std::to_string(bytes_checked) + " bytes differ";
  if (first) s += "; first: " + first->toString();
  return s;
}

namespace {

// The oracle's pieces of one record: a piece is the bytes one seed numbers. For conv and ssm a
// piece is a whole unit; for kv it is one token row of a unit (head), so that the pattern does
// not depend on tokens per block and two ranks with different block sizes agree token by token.
// Calls fn(section, global unit, token (kv: in the request; else 0), byte in the piece, offset
// in the record, bytes) for every run of the record, in hxfer's own byte order per piece.
template <typename Fn>
void forEachPiece(const RankLayout& layout, const PoolView& view, uint32_t position, Fn&& fn) {
  const bool kv = view.indexedByBlock();
  const uint64_t t = layout.tokens_per_block;
  const uint64_t first_token = kv ? uint64_t{position} * t : 0;
  if (view.record) {
    forEachDescribedRun(layout, view,
                        [&](uint32_t s, uint32_t unit, uint64_t byte, uint64_t at, uint64_t n) {
                          if (!kv) {
                            fn(s, unit, 0, byte, at, n);
                            return;
                          }
                          const uint64_t row = view.sections[s].unit_bytes / t;
                          while (n > 0) {
                            const uint64_t off = byte % row, take = std::min(row - off, n);
                            fn(s, unit, first_token + byte / row, off, at, take);
                            byte += take;
                            at += take;
                            n -= take;
                          }
                        });
    return;
  }
  const std::vector<LocalSection> secs = localSections(layout, view);
  for (uint32_t s = 0; s < secs.size(); ++s) {
    const LocalSection& ls = secs[s];
    const uint64_t rows = kv ? t : 1, row = ls.unit_bytes / rows;
    for (uint32_t u = 0; u < ls.count; ++u) {
      for (uint64_t r = 0; r < rows; ++r) {
        fn(s, ls.first + u, first_token + (kv ? r : 0), 0, ls.offset + u * ls.unit_bytes + r * row,
           row);
      }
    }
  }
}

}  // namespace

void fillRecord(const RankLayout& layout, const PoolView& view, uint32_t local_layer,
                uint32_t position, uint64_t request_id, uint8_t* record) {
  const uint32_t layer = view.layers[local_layer];
  forEachPiece(
      layout, view, position,
      [&](uint32_t s, uint32_t unit, uint64_t token, uint64_t byte, uint64_t at, uint64_t n) {
        const uint64_t seed =
            oracleUnitSeed(request_id, layer, view.role, view.sections[s].name, unit, token);
        fillRange(seed, byte, record + at, n);
      });
}

void checkRecord(const RankLayout& layout, const PoolView& view, uint32_t local_layer,
                 uint32_t position, uint64_t request_id, const uint8_t* record, uint32_t region,
                 uint64_t record_offset, OracleReport* report, uint64_t token_end) {
  OracleMismatch where;
  where.request_id = request_id;
  where.layer = view.layers[local_layer];
  where.role = view.role;
  where.position = view.indexedByBlock() ? position : 0;
  where.region = region;
  std::vector<uint8_t> expect;  // the expected bytes of one run not starting a piece
  forEachPiece(
      layout, view, position,
      [&](uint32_t s, uint32_t unit, uint64_t token, uint64_t byte, uint64_t at, uint64_t n) {
        if (view.indexedByBlock() && token >= token_end) return;
        const uint64_t seed =
            oracleUnitSeed(request_id, where.layer, view.role, view.sections[s].name, unit, token);
        where.section = s;
        where.section_name = view.sections[s].name;
        where.unit = unit;
        where.token = view.indexedByBlock() ? token : 0;
        if (byte == 0) {  // the common case: a whole piece, checked a word at a time
          checkUnit(seed, record + at, n, report, where, record_offset + at);
          return;
        }
        report->bytes_checked += n;
        expect.resize(n);
        fillRange(seed, byte, expect.data(), n);
        if (std::memcmp(expect.data(), record + at, n) == 0) return;
        for (uint64_t i = 0; i < n; ++i) {
          if (record[at + i] == expect[i]) continue;
          ++report->mismatched_bytes;
          if (!report->first) {
            OracleMismatch m = where;
            m.byte = byte + i;
            m.expected = expect[i];
            m.actual = record[at + i];
            m.offset = record_offset + at + i;
            report->first = m;
          }
        }
      });
}

Status fillRank(const RankLayout& layout, const RankMemory& mem, const RankIds& ids,
                uint64_t request_id) {
  const BlockRange all{0, static_cast<uint32_t>(ids.blocks.size())};
  return forEachRecord(layout, mem, ids, all,
                       [&](const PoolView& v, uint32_t l, uint32_t pos, uint32_t, uint64_t,
                           uint8_t* p) { fillRecord(layout, v, l, pos, request_id, p); });
}

StatusOr<OracleReport> checkRank(const RankLayout& layout, const RankMemory& mem,
                                 const RankIds& ids, uint64_t request_id, BlockRange blocks,
                                 uint64_t token_end) {
  OracleReport report;
  RETURN_IF_ERROR(forEachRecord(layout, mem, ids, blocks,
                                [&](const PoolView& v, uint32_t l, uint32_t pos, uint32_t region,
                                    uint64_t off, const uint8_t* p) {
                                  checkRecord(layout, v, l, pos, request_id, p, region, off,
                                              &report, token_end);
                                }));
  return report;
}

}  // namespace hxfer
