#include "plan/memory.h"

#include <cstring>
#include <optional>
#include <string>

namespace hxfer {

StatusOr<uint8_t*> regionBytes(const RankMemory& mem, uint32_t id, uint64_t offset,
                               uint64_t bytes) {
  if (id >= mem.size() || mem[id].data == nullptr) {
    return InvalidArgument("region " + std::to_string(id) + " has no memory");
  }
  const RegionMemory& r = mem[id];
  if (offset > r.length || bytes > r.length - offset) {
    return InvalidArgument("bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                           ") run past region " + std::to_string(id) + " of length " +
                           std::to_string(r.length));
  }
  return r.data + offset;
}

StatusOr<const uint8_t*> sourceBytes(const RankMemory& mem, std::span<const uint8_t> scratch,
                                     const CopyOp& op) {
  if (op.src_region != kScratchRegion) {
    ASSIGN_OR_RETURN(uint8_t * p, regionBytes(mem, op.src_region, op.src_offset, op.bytes));
    return static_cast<const uint8_t*>(p);
  }
  if (op.src_offset > scratch.size() || op.bytes > scratch.size() - op.src_offset) {
    return InvalidArgument("bytes [" + std::to_string(op.src_offset) + ", +" +
                           std::to_string(op.bytes) + ") run past the staging area of " +
                           std::to_string(scratch.size()) + " bytes");
  }
  return scratch.data() + op.src_offset;
}

Status executeOps(std::span<const CopyOp> ops, const RankMemory& src, const RankMemory& dst,
                  std::span<const uint8_t> scratch) {
  for (const CopyOp& op : ops) {
    auto s = sourceBytes(src, scratch, op);
    if (!s.isOk()) return s.status().withContext("source");
    auto d = regionBytes(dst, op.dst_region, op.dst_offset, op.bytes);
    if (!d.isOk()) return d.status().withContext("destination");
  }
  for (const CopyOp& op : ops) {
    std::memcpy(dst[op.dst_region].data + op.dst_offset, *sourceBytes(src, scratch, op), op.bytes);
  }
  return OkStatus();
}

namespace {

// One past the last byte of `op`'s box on one side (`b`: the staging area), or nullopt on
// overflow.
std::optional<uint64_t> boxEnd(const PackOp& op, uint64_t base, bool b) {
  uint64_t end = base;
  for (const BoxDim& d : op.dims) {
    uint64_t reach = 0;
    if (d.size == 0) return base;
    if (__builtin_mul_overflow(d.size - 1, b ? d.b_stride : d.a_stride, &reach) ||
        __builtin_add_overflow(end, reach, &end)) {
      return std::nullopt;
    }
  }
  if (__builtin_add_overflow(end, uint64_t{op.element_bytes}, &end)) return std::nullopt;
  return end;
}

// Copies the elements of `op`'s box, `E` bytes each (0: op.element_bytes), the innermost dim in
// one tight loop: for a transposition, contiguous writes and strided reads.
template <uint32_t E>
void gather(const PackOp& op, const uint8_t* src, uint8_t* dst) {
  const uint64_t e = E ? E : op.element_bytes;
  const std::vector<BoxDim>& d = op.dims;
  if (d.empty()) {
    std::memcpy(dst, src, e);
    return;
  }
  const size_t last = d.size() - 1;
  const BoxDim in = d[last];
  std::vector<uint64_t> at(last, 0);
  while (true) {
    uint64_t a = 0, b = 0;
    for (size_t i = 0; i < last; ++i) {
      a += at[i] * d[i].a_stride;
      b += at[i] * d[i].b_stride;
    }
    const uint8_t* s = src + a;
    uint8_t* t = dst + b;
    for (uint64_t k = 0; k < in.size; ++k) {
      std::memcpy(t + k * in.b_stride, s + k * in.a_stride, E ? E : e);
    }
    size_t i = last;
    while (i > 0 && ++at[i - 1] == d[i - 1].size) at[--i] = 0;
    if (i == 0) break;
  }
}

}  // namespace

Status checkPackOps(const RankPlan& plan, const RankMemory& src, uint64_t scratch_bytes) {
  if (scratch_bytes < plan.scratch_bytes) {
    return InvalidArgument("staging area of " + std::to_string(scratch_bytes) +
                           " bytes, the plan needs " + std::to_string(plan.scratch_bytes));
  }
  for (const PackOp& op : plan.pack_ops) {
    const std::optional<uint64_t> src_end = boxEnd(op, op.src_offset, false);
    const std::optional<uint64_t> dst_end = boxEnd(op, op.scratch_offset, true);
    if (!src_end || !dst_end) return InvalidArgument("pack op box overflows 64 bits");
    auto s = regionBytes(src, op.src_region, op.src_offset, *src_end - op.src_offset);
    if (!s.isOk()) return s.status().withContext("staging source");
    if (op.element_bytes == 0 || *dst_end > plan.scratch_bytes) {
      return InvalidArgument("pack op to staging bytes [" + std::to_string(op.scratch_offset) +
                             ", " + std::to_string(*dst_end) + ") outside the staging area of " +
                             std::to_string(plan.scratch_bytes) + " bytes");
    }
  }
  return OkStatus();
}

Status packScratch(const RankPlan& plan, const RankMemory& src, std::span<uint8_t> scratch) {
  RETURN_IF_ERROR(checkPackOps(plan, src, scratch.size()));
  for (const PackOp& op : plan.pack_ops) {
    if (op.elements() == 0) continue;  // an empty box (the planner makes none)
    const uint8_t* from = src[op.src_region].data + op.src_offset;
    uint8_t* to = scratch.data() + op.scratch_offset;
    switch (op.element_bytes) {
      case 2:
        gather<2>(op, from, to);
        break;
      case 4:
        gather<4>(op, from, to);
        break;
      case 8:
        gather<8>(op, from, to);
        break;
      default:
        gather<0>(op, from, to);
    }
  }
  return OkStatus();
}

Status executePlan(const RankPlan& plan, const RankMemory& src, const RankMemory& dst) {
  std::vector<uint8_t> scratch(plan.scratch_bytes);
  RETURN_IF_ERROR(packScratch(plan, src, scratch));
  return executeOps(plan.ops, src, dst, scratch);
}

}  // namespace hxfer
