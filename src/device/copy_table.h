// The index arithmetic of hxfer's device kernels, as functions that compile for the host and
// for CUDA devices alike, so the CPU tests run exactly what a kernel's threads run.
//
// A batched copy moves many runs in one launch: every run is cut into chunks of kChunkBytes,
// one thread block per chunk, and a chunk finds its run by binary search over the runs' first
// chunks (a storm of 262,528 small runs is one launch, not one call per run). A pack gathers
// the elements of strided boxes (PackOp: SD<->DS conv transposes, NHD<->HND head slices, SSM
// head ranges) into the staging area, one thread per element, which finds its box the same way.
//
// Addresses are plain integers: host pointers on the CPU, device pointers on a GPU. Nothing
// here allocates or checks: the builders in copy_table_builder.h make tables whose every range
// was checked against the memory it names.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HXFER_HD __host__ __device__
#else
#define HXFER_HD
#endif

namespace hxfer::device {

// One contiguous run: `bytes` from address `src` to address `dst`. REQUIRES: bytes > 0.
struct CopyRun {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

// The bytes one thread block copies of a run (256 threads of 16 bytes).
inline constexpr uint64_t kChunkBytes = 4096;

// A batched copy: `num_runs` runs; first_chunk[i] is run i's first chunk, first_chunk[num_runs]
// the number of chunks (num_chunks).
struct CopyTable {
  const CopyRun* runs = nullptr;
  const uint64_t* first_chunk = nullptr;
  uint32_t num_runs = 0;
  uint64_t num_chunks = 0;
};

HXFER_HD inline uint64_t chunksOf(uint64_t bytes) {
  return (bytes + kChunkBytes - 1) / kChunkBytes;
}

// The index i of the entry that holds `item`: the last i < n with first[i] <= item.
// REQUIRES: first ascending, first[0] <= item < first[n].
HXFER_HD inline uint32_t entryOf(const uint64_t* first, uint32_t n, uint64_t item) {
  uint32_t lo = 0, hi = n;  // the answer is in [lo, hi)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (first[mid] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Copies n bytes from s to d, thread `thread` of `threads` taking every threads-th word of
// the widest size that s and d are both aligned to, and the tail bytes the same way.
struct alignas(16) Word16 {
  uint64_t lo, hi;
};

template <typename W>
HXFER_HD inline void copyWords(uint64_t s, uint64_t d, uint64_t n, uint32_t thread,
                               uint32_t threads) {
  const uint64_t words = n / sizeof(W);
  const W* from = reinterpret_cast<const W*>(s);
  W* to = reinterpret_cast<W*>(d);
  for (uint64_t w = thread; w < words; w += threads) to[w] = from[w];
  const uint8_t* fb = reinterpret_cast<const uint8_t*>(s);
  uint8_t* tb = reinterpret_cast<uint8_t*>(d);
  for (uint64_t i = words * sizeof(W) + thread; i < n; i += threads) tb[i] = fb[i];
}

HXFER_HD inline void copyBytes(uint64_t s, uint64_t d, uint64_t n, uint32_t thread,
                               uint32_t threads) {
  const uint64_t both = s | d;
  if ((both & 15) == 0) {
    copyWords<Word16>(s, d, n, thread, threads);
  } else if ((both & 7) == 0) {
    copyWords<uint64_t>(s, d, n, thread, threads);
  } else if ((both & 3) == 0) {
    copyWords<uint32_t>(s, d, n, thread, threads);
  } else if ((both & 1) == 0) {
    copyWords<uint16_t>(s, d, n, thread, threads);
  } else {
    copyWords<uint8_t>(s, d, n, thread, threads);
  }
}

// The [begin, end) bytes of its run that chunk `chunk` of `t` covers, and the run.
struct ChunkSpan {
  uint32_t run = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

HXFER_HD inline ChunkSpan chunkSpan(const CopyTable& t, uint64_t chunk) {
  ChunkSpan c;
  c.run = entryOf(t.first_chunk, t.num_runs, chunk);
  c.begin = (chunk - t.first_chunk[c.run]) * kChunkBytes;
  const uint64_t bytes = t.runs[c.run].bytes;
  c.end = c.begin + kChunkBytes < bytes ? c.begin + kChunkBytes : bytes;
  return c;
}

// What thread `thread` of the `threads` of the block for chunk `chunk` copies.
HXFER_HD inline void copyChunk(const CopyTable& t, uint64_t chunk, uint32_t thread,
                               uint32_t threads) {
  const ChunkSpan c = chunkSpan(t, chunk);
  const CopyRun& r = t.runs[c.run];
  copyBytes(r.src + c.begin, r.dst + c.begin, c.end - c.begin, thread, threads);
}

// ---- Pack ----

// The most dims a device box has (engine layouts need at most 5 after merging).
inline constexpr uint32_t kMaxPackDims = 8;

// One box: the elements of dims[0..ndims) (outermost first: size, stride in bytes at `src`,
// stride in bytes at `dst`), each `element_bytes`.
struct Pack {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint32_t element_bytes = 0;
  uint32_t ndims = 0;
  uint64_t size[kMaxPackDims] = {};
  uint64_t src_stride[kMaxPackDims] = {};
  uint64_t dst_stride[kMaxPackDims] = {};
};

// `num_packs` boxes; first_element[i] is box i's first element in the launch,
// first_element[num_packs] the number of elements.
struct PackTable {
  const Pack* packs = nullptr;
  const uint64_t* first_element = nullptr;
  uint32_t num_packs = 0;
  uint64_t num_elements = 0;
};

// The byte offsets of element `e` (row-major over the dims) in the box's source and destination.
HXFER_HD inline void elementOffsets(const Pack& p, uint64_t e, uint64_t* src_off,
                                    uint64_t* dst_off) {
  uint64_t a = 0, b = 0;
  for (uint32_t i = p.ndims; i-- > 0;) {
    const uint64_t k = e % p.size[i];
    e /= p.size[i];
    a += k * p.src_stride[i];
    b += k * p.dst_stride[i];
  }
  *src_off = a;
  *dst_off = b;
}

// Element `item` of the launch: one thread copies it whole.
HXFER_HD inline void packElement(const PackTable& t, uint64_t item) {
  const uint32_t i = entryOf(t.first_element, t.num_packs, item);
  const Pack& p = t.packs[i];
  uint64_t a = 0, b = 0;
  elementOffsets(p, item - t.first_element[i], &a, &b);
  copyBytes(p.src + a, p.dst + b, p.element_bytes, 0, 1);
}

}  // namespace hxfer::device
