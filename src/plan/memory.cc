#include "plan/memory.h"

#include <cstring>
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

Status packScratch(const RankPlan& plan, const RankMemory& src, std::span<uint8_t> scratch) {
  if (scratch.size() < plan.scratch_bytes) {
    return InvalidArgument("staging area of " + std::to_string(scratch.size()) +
                           " bytes, the plan needs " + std::to_string(plan.scratch_bytes));
  }
  for (const CopyOp& op : plan.pack_ops) {
    auto s = regionBytes(src, op.src_region, op.src_offset, op.bytes);
    if (!s.isOk()) return s.status().withContext("staging source");
    if (op.dst_region != kScratchRegion || op.dst_offset > plan.scratch_bytes ||
        op.bytes > plan.scratch_bytes - op.dst_offset) {
      return InvalidArgument("pack op to region " + std::to_string(op.dst_region) + " bytes [" +
                             std::to_string(op.dst_offset) + ", +" + std::to_string(op.bytes) +
                             ") outside the staging area of " + std::to_string(plan.scratch_bytes) +
                             " bytes");
    }
  }
  for (const CopyOp& op : plan.pack_ops) {
    std::memcpy(scratch.data() + op.dst_offset, src[op.src_region].data + op.src_offset, op.bytes);
  }
  return OkStatus();
}

Status executePlan(const RankPlan& plan, const RankMemory& src, const RankMemory& dst) {
  std::vector<uint8_t> scratch(plan.scratch_bytes);
  RETURN_IF_ERROR(packScratch(plan, src, scratch));
  return executeOps(plan.ops, src, dst, scratch);
}

}  // namespace hxfer
