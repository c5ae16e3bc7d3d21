// CRC32C (Castagnoli), as used by iSCSI, leveldb and ext4. Hardware (SSE4.2) when the CPU has
// it, a slicing-by-8 table otherwise. Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hxfer {

// Extends `crc` (the CRC of earlier bytes, 0 to start) over data[0, n).
uint32_t crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32cExtend(0, data, n); }

}  // namespace hxfer
