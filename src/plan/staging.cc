#include "plan/staging.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>

namespace hxfer {

StatusOr<std::vector<StagedRun>> stagingRuns(std::span<const CopyOp> ops) {
  std::vector<StagedRun> runs;
  runs.reserve(ops.size());
  for (const CopyOp& op : ops) {
    if (op.bytes != 0) runs.push_back({op.dst_region, op.dst_offset, 0, op.bytes});
  }
  std::sort(runs.begin(), runs.end(), [](const StagedRun& a, const StagedRun& b) {
    return std::tie(a.region, a.dst_offset) < std::tie(b.region, b.dst_offset);
  });
  size_t out = 0;
  uint64_t at = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const StagedRun& r = runs[i];
    if (out > 0) {
      StagedRun& last = runs[out - 1];
      const uint64_t last_end = last.dst_offset + last.bytes;
      if (last.region == r.region && r.dst_offset < last_end) {
        return InvalidArgument("ops write bytes [" + std::to_string(r.dst_offset) + ", " +
                               std::to_string(last_end) + ") of region " +
                               std::to_string(r.region) + " twice");
      }
      if (last.region == r.region && r.dst_offset == last_end) {
        last.bytes += r.bytes;
        at += r.bytes;
        continue;
      }
    }
    runs[out] = r;
    runs[out].stage_offset = at;
    at += r.bytes;
    ++out;
  }
  runs.resize(out);
  return runs;
}

uint64_t stagingBytes(std::span<const StagedRun> runs) {
  return runs.empty() ? 0 : runs.back().stage_offset + runs.back().bytes;
}

namespace {

// `window` with its length cut at the part's end (`total` bytes).
StatusOr<StagingWindow> resolve(StagingWindow window, uint64_t total) {
  if (window.offset > total) {
    return InvalidArgument("staging window at " + std::to_string(window.offset) +
                           " starts past the part's " + std::to_string(total) + " bytes");
  }
  window.bytes = std::min(window.bytes, total - window.offset);
  return window;
}

// `make(item, lo, hi)` for each of `items` that meets window `w` (resolved), [lo, hi) its part
// inside the window in part coordinates. `items` lie disjoint and ascending by `at(item)`, each
// `item.bytes` long: O(log n + the items in the window).
template <typename T, typename At, typename Make>
auto clipToWindow(std::span<const T> items, StagingWindow w, At at, Make make) {
  const uint64_t end = w.offset + w.bytes;
  // From the first item ending past the window's start to the first starting at its end.
  auto first =
      std::upper_bound(items.begin(), items.end(), w.offset,
                       [&](uint64_t x, const T& item) { return x < at(item) + item.bytes; });
  auto last = std::lower_bound(first, items.end(), end,
                               [&](const T& item, uint64_t x) { return at(item) < x; });
  std::vector<decltype(make(*first, uint64_t{}, uint64_t{}))> out;
  out.reserve(static_cast<size_t>(last - first));
  for (auto it = first; it != last; ++it) {
    const uint64_t lo = std::max(at(*it), w.offset);
    const uint64_t hi = std::min(at(*it) + it->bytes, end);
    if (lo < hi) out.push_back(make(*it, lo, hi));
  }
  return out;
}

}  // namespace

StatusOr<std::vector<StagedRun>> windowRuns(std::span<const StagedRun> runs, StagingWindow window) {
  ASSIGN_OR_RETURN(const StagingWindow w, resolve(window, stagingBytes(runs)));
  return clipToWindow(
      runs, w, [](const StagedRun& r) { return r.stage_offset; },
      [&](const StagedRun& r, uint64_t lo, uint64_t hi) {
        return StagedRun{r.region, r.dst_offset + (lo - r.stage_offset), lo - w.offset, hi - lo};
      });
}

namespace {

// Where op's destination bytes sit in the slot. REQUIRES: runs sorted (stagingRuns).
StatusOr<uint64_t> slotOffset(const std::vector<StagedRun>& runs, const CopyOp& op) {
  auto it = std::upper_bound(runs.begin(), runs.end(), std::make_pair(op.dst_region, op.dst_offset),
                             [](const std::pair<uint32_t, uint64_t>& key, const StagedRun& r) {
                               return key < std::make_pair(r.region, r.dst_offset);
                             });
  if (it != runs.begin()) {
    const StagedRun& r = *std::prev(it);
    if (r.region == op.dst_region && op.dst_offset >= r.dst_offset &&
        op.dst_offset - r.dst_offset + op.bytes <= r.bytes) {
      return r.stage_offset + (op.dst_offset - r.dst_offset);
    }
  }
  return InvalidArgument("op to region " + std::to_string(op.dst_region) + " bytes [" +
                         std::to_string(op.dst_offset) + ", +" + std::to_string(op.bytes) +
                         ") is in no staged run");
}

}  // namespace

StatusOr<std::vector<CopyOp>> gatherOps(std::span<const CopyOp> ops,
                                        const std::vector<StagedRun>& runs, uint32_t area) {
  std::vector<CopyOp> out;
  out.reserve(ops.size());
  for (const CopyOp& op : ops) {
    if (op.bytes == 0) continue;
    ASSIGN_OR_RETURN(uint64_t at, slotOffset(runs, op));
    out.push_back({op.src_region, op.src_offset, area, at, op.bytes});
  }
  return out;
}

StatusOr<SlotGather> slotGather(std::span<const CopyOp> ops, const std::vector<StagedRun>& runs) {
  SlotGather gather;
  ASSIGN_OR_RETURN(gather.ops, gatherOps(ops, runs, 0));
  std::sort(gather.ops.begin(), gather.ops.end(),
            [](const CopyOp& a, const CopyOp& b) { return a.dst_offset < b.dst_offset; });
  gather.bytes = stagingBytes(runs);
  return gather;
}

StatusOr<std::vector<CopyOp>> windowOps(const SlotGather& gather, uint32_t area,
                                        StagingWindow window) {
  ASSIGN_OR_RETURN(const StagingWindow w, resolve(window, gather.bytes));
  return clipToWindow(
      std::span<const CopyOp>(gather.ops), w, [](const CopyOp& op) { return op.dst_offset; },
      [&](const CopyOp& op, uint64_t lo, uint64_t hi) {
        return CopyOp{op.src_region, op.src_offset + (lo - op.dst_offset), area, lo - w.offset,
                      hi - lo};
      });
}

Status gatherStaged(const SlotGather& gather, const RankMemory& src,
                    std::span<const uint8_t> plan_scratch, std::span<uint8_t> slot,
                    StagingWindow window) {
  ASSIGN_OR_RETURN(const StagingWindow w, resolve(window, gather.bytes));
  if (slot.size() < w.bytes) {
    return InvalidArgument("staging slot of " + std::to_string(slot.size()) +
                           " bytes, the window needs " + std::to_string(w.bytes));
  }
  ASSIGN_OR_RETURN(const std::vector<CopyOp> ops, windowOps(gather, 0, w));
  std::vector<const uint8_t*> from;
  from.reserve(ops.size());
  for (const CopyOp& op : ops) {
    auto bytes = sourceBytes(src, plan_scratch, op);
    if (!bytes.isOk()) return bytes.status().withContext("staging gather source");
    from.push_back(*bytes);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(slot.data() + ops[i].dst_offset, from[i], ops[i].bytes);
  }
  return OkStatus();
}

std::vector<CopyOp> scatterOps(std::span<const StagedRun> runs, uint32_t staging,
                               uint64_t slot_offset) {
  std::vector<CopyOp> out;
  out.reserve(runs.size());
  for (const StagedRun& r : runs) {
    out.push_back({staging, slot_offset + r.stage_offset, r.region, r.dst_offset, r.bytes});
  }
  return out;
}

std::vector<CopyOp> backToBack(std::span<const CopyOp> ops, uint32_t area) {
  std::vector<CopyOp> out;
  out.reserve(ops.size());
  uint64_t at = 0;
  for (const CopyOp& op : ops) {
    out.push_back({op.src_region, op.src_offset, area, at, op.bytes});
    at += op.bytes;
  }
  return out;
}

Status scatterStaged(std::span<const StagedRun> runs, std::span<const uint8_t> slot,
                     const RankMemory& dst) {
  if (slot.size() < stagingBytes(runs)) {
    return InvalidArgument("staging slot of " + std::to_string(slot.size()) +
                           " bytes, the runs need " + std::to_string(stagingBytes(runs)));
  }
  for (const StagedRun& r : runs) {
    auto to = regionBytes(dst, r.region, r.dst_offset, r.bytes);
    if (!to.isOk()) return to.status().withContext("staging scatter destination");
  }
  for (const StagedRun& r : runs) {
    std::memcpy(dst[r.region].data + r.dst_offset, slot.data() + r.stage_offset, r.bytes);
  }
  return OkStatus();
}

}  // namespace hxfer
