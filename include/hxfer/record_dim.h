// One named dim of a record in memory: its size on this rank and the bytes between neighbours
// along it. Shared by the public API (Layout::records) and the layouts inside hxfer.
#pragma once

#include <cstdint>
#include <string>

namespace hxfer {

struct RecordDim {
  std::string name;
  uint32_t size = 0;    // elements along it on this rank
  uint64_t stride = 0;  // bytes between neighbours along it
  bool operator==(const RecordDim&) const = default;
};

}  // namespace hxfer
