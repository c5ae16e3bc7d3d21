#include <cuda_runtime.h>

#include <algorithm>

#include "device/copy_table.h"
#include "device/launch.h"

namespace hxfer::device::cuda {
namespace {

constexpr unsigned kThreads = 256;      // kChunkBytes / 16: one 16-byte word per thread
constexpr uint64_t kMaxBlocks = 65535;  // blocks stride over the rest

__global__ void copyKernel(CopyTable t) {
  for (uint64_t c = blockIdx.x; c < t.num_chunks; c += gridDim.x) {
    copyChunk(t, c, threadIdx.x, blockDim.x);
  }
}

__global__ void packKernel(PackTable t) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t e = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < t.num_elements;
       e += stride) {
    packElement(t, e);
  }
}

// Device memory holding `a` (a_bytes) and then `b` (b_bytes, at a 16-byte boundary), freed on
// the stream once what was queued before the free is done.
class DeviceTable {
 public:
  explicit DeviceTable(cudaStream_t stream) : stream_(stream) {}
  ~DeviceTable() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  cudaError_t upload(const void* a, size_t a_bytes, const void* b, size_t b_bytes,
                     const char** what) {
    b_offset_ = (a_bytes + 15) / 16 * 16;
    *what = "cudaMallocAsync for the launch table";
    cudaError_t e = cudaMallocAsync(&ptr_, b_offset_ + b_bytes, stream_);
    if (e != cudaSuccess) return e;
    *what = "cudaMemcpyAsync of the launch table";
    e = cudaMemcpyAsync(ptr_, a, a_bytes, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return e;
    return cudaMemcpyAsync(static_cast<char*>(ptr_) + b_offset_, b, b_bytes, cudaMemcpyHostToDevice,
                           stream_);
  }
  template <typename T>
  const T* a() const {
    return static_cast<const T*>(ptr_);
  }
  template <typename T>
  const T* b() const {
    return reinterpret_cast<const T*>(static_cast<const char*>(ptr_) + b_offset_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  size_t b_offset_ = 0;
};

int finish(cudaStream_t stream, const char* kernel, const char** what) {
  *what = kernel;
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(stream);
}

}  // namespace

int deviceCount(int* n) { return cudaGetDeviceCount(n); }

int launchCopy(const CopyRun* runs, uint32_t num_runs, const uint64_t* first_chunk,
               uint64_t num_chunks, void* stream_arg, const char** what) {
  if (num_chunks == 0) return cudaSuccess;
  auto stream = static_cast<cudaStream_t>(stream_arg);
  DeviceTable table(stream);
  cudaError_t e = table.upload(runs, num_runs * sizeof(CopyRun), first_chunk,
                               (size_t{num_runs} + 1) * sizeof(uint64_t), what);
  if (e != cudaSuccess) return e;
  const CopyTable view{table.a<CopyRun>(), table.b<uint64_t>(), num_runs, num_chunks};
  copyKernel<<<static_cast<unsigned>(std::min(num_chunks, kMaxBlocks)), kThreads, 0, stream>>>(
      view);
  return finish(stream, "the batched copy kernel", what);
}

int launchPack(const Pack* packs, uint32_t num_packs, const uint64_t* first_element,
               uint64_t num_elements, void* stream_arg, const char** what) {
  if (num_elements == 0) return cudaSuccess;
  auto stream = static_cast<cudaStream_t>(stream_arg);
  DeviceTable table(stream);
  cudaError_t e = table.upload(packs, num_packs * sizeof(Pack), first_element,
                               (size_t{num_packs} + 1) * sizeof(uint64_t), what);
  if (e != cudaSuccess) return e;
  const PackTable view{table.a<Pack>(), table.b<uint64_t>(), num_packs, num_elements};
  const uint64_t want = (num_elements + kThreads - 1) / kThreads;
  packKernel<<<static_cast<unsigned>(std::min(want, kMaxBlocks)), kThreads, 0, stream>>>(view);
  return finish(stream, "the pack kernel", what);
}

const char* errorName(int error) { return cudaGetErrorName(static_cast<cudaError_t>(error)); }
const char* errorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace hxfer::device::cuda
