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

Status executeOps(std::span<const CopyOp> ops, const RankMemory& src, const RankMemory& dst) {
  for (const CopyOp& op : ops) {
    auto s = regionBytes(src, op.src_region, op.src_offset, op.bytes);
    if (!s.isOk()) return s.status().withContext("source");
    auto d = regionBytes(dst, op.dst_region, op.dst_offset, op.bytes);
    if (!d.isOk()) return d.status().withContext("destination");
  }
  for (const CopyOp& op : ops) {
    std::memcpy(dst[op.dst_region].data + op.dst_offset, src[op.src_region].data + op.src_offset,
                op.bytes);
  }
  return OkStatus();
}

}  // namespace hxfer
