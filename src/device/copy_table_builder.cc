#include "device/copy_table_builder.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <string>

namespace hxfer::device {

CopyTable HostCopyTable::view() const {
  return CopyTable{runs.data(), first_chunk.data(), static_cast<uint32_t>(runs.size()),
                   first_chunk.empty() ? 0 : first_chunk.back()};
}

uint64_t HostCopyTable::bytes() const {
  uint64_t n = 0;
  for (const CopyRun& r : runs) n += r.bytes;
  return n;
}

StatusOr<HostCopyTable> copyTable(std::span<const CopyRun> runs) {
  HostCopyTable t;
  t.runs.reserve(runs.size());
  t.first_chunk.reserve(runs.size() + 1);
  t.first_chunk.push_back(0);
  for (const CopyRun& r : runs) {
    if (r.bytes == 0) continue;
    if (t.runs.size() == std::numeric_limits<uint32_t>::max() - 1) {
      return InvalidArgument("a batched copy of more than " + std::to_string(t.runs.size()) +
                             " runs");
    }
    t.runs.push_back(r);
    t.first_chunk.push_back(t.first_chunk.back() + chunksOf(r.bytes));
  }
  return t;
}

StatusOr<HostCopyTable> copyTable(std::span<const CopyOp> ops, const RankMemory& src,
                                  const RankMemory& dst, std::span<const uint8_t> scratch) {
  std::vector<CopyRun> runs;
  runs.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const CopyOp& op = ops[i];
    auto s = sourceBytes(src, scratch, op);
    if (!s.isOk()) return s.status().withContext("op " + std::to_string(i) + " source");
    auto d = regionBytes(dst, op.dst_region, op.dst_offset, op.bytes);
    if (!d.isOk()) return d.status().withContext("op " + std::to_string(i) + " destination");
    runs.push_back(
        CopyRun{reinterpret_cast<uint64_t>(*s), reinterpret_cast<uint64_t>(*d), op.bytes});
  }
  return copyTable(runs);
}

ShuffledRuns shuffledRuns(uint64_t src, uint64_t dst, uint32_t count, uint64_t run_bytes,
                          uint64_t seed) {
  ShuffledRuns s;
  s.order.resize(count);
  std::iota(s.order.begin(), s.order.end(), 0u);
  std::mt19937_64 rng(seed);
  std::shuffle(s.order.begin(), s.order.end(), rng);
  s.runs.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    s.runs.push_back(
        CopyRun{src + uint64_t{i} * run_bytes, dst + uint64_t{s.order[i]} * run_bytes, run_bytes});
  }
  return s;
}

PackTable HostPackTable::view() const {
  return PackTable{packs.data(), first_element.data(), static_cast<uint32_t>(packs.size()),
                   first_element.empty() ? 0 : first_element.back()};
}

StatusOr<HostPackTable> packTable(const RankPlan& plan, const RankMemory& src, uint64_t scratch,
                                  uint64_t scratch_bytes) {
  RETURN_IF_ERROR(checkPackOps(plan, src, scratch_bytes));
  HostPackTable t;
  t.first_element.push_back(0);
  for (size_t i = 0; i < plan.pack_ops.size(); ++i) {
    const PackOp& op = plan.pack_ops[i];
    const uint64_t elements = op.elements();
    if (elements == 0) continue;
    Pack p;
    p.src = reinterpret_cast<uint64_t>(src[op.src_region].data) + op.src_offset;
    p.dst = scratch + op.scratch_offset;
    p.element_bytes = op.element_bytes;
    std::vector<BoxDim> dims;
    for (const BoxDim& d : op.dims) {
      if (d.size == 1) continue;
      // An inner dim that continues this one on both sides (stride = size x inner stride)
      // merges with it.
      if (!dims.empty() && dims.back().a_stride == d.size * d.a_stride &&
          dims.back().b_stride == d.size * d.b_stride) {
        dims.back() = BoxDim{dims.back().size * d.size, d.a_stride, d.b_stride};
        continue;
      }
      dims.push_back(d);
    }
    if (dims.size() > kMaxPackDims) {
      return InvalidArgument("pack op " + std::to_string(i) + ": a box of " +
                             std::to_string(dims.size()) + " dims, the device pack takes " +
                             std::to_string(kMaxPackDims));
    }
    p.ndims = static_cast<uint32_t>(dims.size());
    for (size_t k = 0; k < dims.size(); ++k) {
      p.size[k] = dims[k].size;
      p.src_stride[k] = dims[k].a_stride;
      p.dst_stride[k] = dims[k].b_stride;
    }
    t.packs.push_back(p);
    t.first_element.push_back(t.first_element.back() + elements);
  }
  if (t.packs.size() > std::numeric_limits<uint32_t>::max() - 1) {
    return InvalidArgument("a pack of more than " + std::to_string(t.packs.size()) + " boxes");
  }
  return t;
}

void runOnHost(const CopyTable& t, uint32_t threads) {
  for (uint64_t c = 0; c < t.num_chunks; ++c) {
    for (uint32_t th = 0; th < threads; ++th) copyChunk(t, c, th, threads);
  }
}

void runOnHost(const PackTable& t) {
  for (uint64_t e = 0; e < t.num_elements; ++e) packElement(t, e);
}

}  // namespace hxfer::device
