#include "device/cuda_device.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "device/kernels.h"
#include "device/worker_stream.h"

namespace hxfer::device {
namespace {

std::string cudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

std::string driverText(CUresult r) { return "CUresult " + std::to_string(static_cast<int>(r)); }

// The driver calls of the VMM path, found at run time: the library links no libcuda.
struct Driver {
  PFN_cuMemGetAddressRange_v3020 getAddressRange = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 retainAllocationHandle = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 exportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 importFromShareableHandle = nullptr;
  PFN_cuMemAddressReserve_v10020 addressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 addressFree = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 setAccess = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;

  Status load() {
    auto get = [](const char* name, auto* fn) { return driverEntryPoint(name, fn); };
    RETURN_IF_ERROR(get("cuMemGetAddressRange", &getAddressRange));
    RETURN_IF_ERROR(get("cuMemRetainAllocationHandle", &retainAllocationHandle));
    RETURN_IF_ERROR(get("cuMemExportToShareableHandle", &exportToShareableHandle));
    RETURN_IF_ERROR(get("cuMemImportFromShareableHandle", &importFromShareableHandle));
    RETURN_IF_ERROR(get("cuMemAddressReserve", &addressReserve));
    RETURN_IF_ERROR(get("cuMemAddressFree", &addressFree));
    RETURN_IF_ERROR(get("cuMemMap", &map));
    RETURN_IF_ERROR(get("cuMemUnmap", &unmap));
    RETURN_IF_ERROR(get("cuMemSetAccess", &setAccess));
    RETURN_IF_ERROR(get("cuMemRelease", &release));
    return OkStatus();
  }
};

// A peer's legacy IPC handle opened here, in device `ordinal`'s context (closed there too:
// the last reference may go on any thread).
class IpcMapping : public Mapping {
 public:
  IpcMapping(int ordinal, void* base, uint64_t offset, uint64_t bytes)
      : ordinal_(ordinal), base_(base), offset_(offset), bytes_(bytes) {}
  ~IpcMapping() override {
    (void)cudaSetDevice(ordinal_);
    (void)cudaIpcCloseMemHandle(base_);
  }
  uint64_t address() const override { return reinterpret_cast<uint64_t>(base_) + offset_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  int ordinal_;
  void* base_;
  uint64_t offset_, bytes_;
};

// A peer's VMM allocation imported and mapped into a range reserved here. Holds the driver's
// calls by value: it may outlive the device object.
class VmmMapping : public Mapping {
 public:
  VmmMapping(const Driver& d, int ordinal, CUmemGenericAllocationHandle handle, CUdeviceptr va,
             uint64_t size, bool mapped, uint64_t offset, uint64_t bytes)
      : d_(d),
        ordinal_(ordinal),
        handle_(handle),
        va_(va),
        size_(size),
        mapped_(mapped),
        offset_(offset),
        bytes_(bytes) {}
  ~VmmMapping() override {
    (void)cudaSetDevice(ordinal_);
    if (mapped_) (void)d_.unmap(va_, size_);
    if (va_ != 0) (void)d_.addressFree(va_, size_);
    (void)d_.release(handle_);
  }
  uint64_t address() const override { return static_cast<uint64_t>(va_) + offset_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  const Driver d_;
  int ordinal_;
  CUmemGenericAllocationHandle handle_;
  CUdeviceptr va_;
  uint64_t size_;
  bool mapped_;
  uint64_t offset_, bytes_;
};

// cudaMalloc memory of hxfer's, freed in its device's context.
class CudaBuffer : public DeviceBuffer {
 public:
  CudaBuffer(void* data, uint64_t bytes, int ordinal)
      : data_(data), bytes_(bytes), ordinal_(ordinal) {}
  ~CudaBuffer() override {
    (void)cudaSetDevice(ordinal_);
    (void)cudaFree(data_);
  }
  uint8_t* data() const override { return static_cast<uint8_t*>(data_); }
  uint64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  uint64_t bytes_;
  int ordinal_;
};

class HostPin : public HostRegistration {
 public:
  explicit HostPin(void* ptr) : ptr_(ptr) {}
  ~HostPin() override { (void)cudaHostUnregister(ptr_); }

 private:
  void* ptr_;
};

// An event of hxfer's recorded on a capture stream behind the engine's event: done once the
// engine's work before it is, whatever the engine does with its own event afterwards.
class CapturedEvent : public Event {
 public:
  CapturedEvent(cudaEvent_t event, int ordinal) : event_(event), ordinal_(ordinal) {}
  ~CapturedEvent() override {
    (void)cudaSetDevice(ordinal_);
    (void)cudaEventDestroy(event_);
  }
  bool done() const override { return cudaEventQuery(event_) != cudaErrorNotReady; }
  Status status() const override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess || e == cudaErrorNotReady) return OkStatus();
    return Internal("cuda: the engine's event: " + cudaText(e));
  }
  Status wait(std::chrono::milliseconds timeout) const override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        return Timeout("cuda: the engine's event not done after " +
                       std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return status();
  }

 private:
  cudaEvent_t event_;
  int ordinal_;
};

class CudaDevice : public DeviceApi {
 public:
  CudaDevice(Driver driver, std::vector<DeviceId> devices)
      : d_(driver), devices_(std::move(devices)) {}
  ~CudaDevice() override {
    for (const auto& [ordinal, stream] : capture_streams_) {
      (void)cudaSetDevice(ordinal);
      (void)cudaStreamDestroy(stream);
    }
  }

  StatusOr<std::shared_ptr<const Event>> captureEvent(const void* engine_event) override {
    if (engine_event == nullptr) return InvalidArgument("cuda: a null engine event");
    int ordinal = 0;
    cudaError_t e = cudaGetDevice(&ordinal);
    if (e != cudaSuccess) return Internal("cuda: cudaGetDevice: " + cudaText(e));
    std::lock_guard lock(capture_mu_);
    cudaStream_t& stream = capture_streams_[ordinal];
    if (stream == nullptr) {
      e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      if (e != cudaSuccess) {
        stream = nullptr;
        return Internal("cuda: capture stream on device " + std::to_string(ordinal) + ": " +
                        cudaText(e));
      }
    }
    cudaEvent_t own = nullptr;
    e = cudaEventCreateWithFlags(&own, cudaEventDisableTiming);
    if (e != cudaSuccess) return Internal("cuda: cudaEventCreateWithFlags: " + cudaText(e));
    auto captured = std::make_shared<CapturedEvent>(own, ordinal);
    e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(const_cast<void*>(engine_event)), 0);
    if (e == cudaSuccess) e = cudaEventRecord(own, stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return InvalidArgument("cuda: the engine's event cannot be waited for: " + cudaText(e));
    }
    return std::shared_ptr<const Event>(std::move(captured));
  }

  std::string_view name() const override { return "cuda"; }

  StatusOr<DeviceId> owner(const void* ptr, uint64_t bytes) const override {
    uint64_t base = 0, size = 0;
    ASSIGN_OR_RETURN(DeviceId id, allocationOf(ptr, bytes, &base, &size));
    return id;
  }

  StatusOr<ExportedRange> exportRange(const void* ptr, uint64_t bytes) override {
    uint64_t base = 0, size = 0;
    ASSIGN_OR_RETURN(DeviceId id, allocationOf(ptr, bytes, &base, &size));
    RETURN_IF_ERROR(setDevice(id.ordinal));
    ExportedRange out;
    out.allocation_bytes = size;
    out.offset = reinterpret_cast<uint64_t>(ptr) - base;
    out.bytes = bytes;
    out.device = id;
    CUmemGenericAllocationHandle handle{};
    if (d_.retainAllocationHandle(&handle, const_cast<void*>(ptr)) == CUDA_SUCCESS) {
      int fd = -1;
      const CUresult r =
          d_.exportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      (void)d_.release(handle);
      if (r != CUDA_SUCCESS) {
        return Incompatible(
            "cuda: VMM memory without a POSIX fd handle (cuMemExportToShareableHandle: " +
            driverText(r) +
            "); allocate it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in its requested "
            "handle types");
      }
      out.kind = HandleKind::kPosixFd;
      out.fd = fd;
      return out;
    }
    cudaIpcMemHandle_t h{};
    const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) return Internal("cuda: cudaIpcGetMemHandle: " + cudaText(e));
    out.kind = HandleKind::kLegacyIpc;
    out.handle.assign(reinterpret_cast<const uint8_t*>(&h),
                      reinterpret_cast<const uint8_t*>(&h) + sizeof(h));
    return out;
  }

  StatusOr<std::unique_ptr<Mapping>> importRange(ExportedRange range,
                                                 int access_ordinal = -1) override {
    if (range.offset > range.allocation_bytes ||
        range.bytes > range.allocation_bytes - range.offset) {
      return InvalidArgument("cuda: range [" + std::to_string(range.offset) + ", +" +
                             std::to_string(range.bytes) + ") runs past its allocation of " +
                             std::to_string(range.allocation_bytes) + " bytes");
    }
    // The mapping is made for the device whose kernels write into it: opened in its context
    // (legacy, with lazy peer access) or made accessible to it (VMM).
    const int ordinal = access_ordinal >= 0 && access_ordinal < static_cast<int>(devices_.size())
                            ? access_ordinal
                            : localOrdinal(range.device);
    RETURN_IF_ERROR(setDevice(ordinal));
    switch (range.kind) {
      case HandleKind::kLegacyIpc: {
        cudaIpcMemHandle_t h{};
        if (range.handle.size() != sizeof(h)) {
          return InvalidArgument("cuda: a legacy IPC handle has " + std::to_string(sizeof(h)) +
                                 " bytes, not " + std::to_string(range.handle.size()));
        }
        std::memcpy(&h, range.handle.data(), sizeof(h));
        void* base = nullptr;
        const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) return Internal("cuda: cudaIpcOpenMemHandle: " + cudaText(e));
        auto mapping = std::make_unique<IpcMapping>(ordinal, base, range.offset, range.bytes);
        // The exporter's allocation_bytes is its word only: the range must fit what was opened.
        CUdeviceptr b = 0;
        size_t s = 0;
        const CUresult r = d_.getAddressRange(&b, &s, reinterpret_cast<CUdeviceptr>(base));
        if (r != CUDA_SUCCESS) return Internal("cuda: cuMemGetAddressRange: " + driverText(r));
        if (b != reinterpret_cast<CUdeviceptr>(base) || range.offset > s ||
            range.bytes > s - range.offset) {
          return InvalidArgument(
              "cuda: range [" + std::to_string(range.offset) + ", +" + std::to_string(range.bytes) +
              ") runs past the opened allocation of " + std::to_string(s) +
              " bytes (the peer announced " + std::to_string(range.allocation_bytes) + ")");
        }
        return std::unique_ptr<Mapping>(std::move(mapping));
      }
      case HandleKind::kPosixFd: {
        if (range.fd < 0) return InvalidArgument("cuda: posix-fd range without an fd");
        CUmemGenericAllocationHandle handle{};
        CUresult r = d_.importFromShareableHandle(
            &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(range.fd)),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r != CUDA_SUCCESS) {
          return Internal("cuda: cuMemImportFromShareableHandle: " + driverText(r));
        }
        // From here the mapping owns the handle and what is reserved and mapped.
        CUdeviceptr va = 0;
        r = d_.addressReserve(&va, range.allocation_bytes, 0, 0, 0);
        if (r != CUDA_SUCCESS) {
          VmmMapping undo(d_, ordinal, handle, 0, range.allocation_bytes, false, 0, 0);
          return ResourceExhausted("cuda: cuMemAddressReserve of " +
                                   std::to_string(range.allocation_bytes) +
                                   " bytes: " + driverText(r));
        }
        r = d_.map(va, range.allocation_bytes, 0, handle, 0);
        auto mapping = std::make_unique<VmmMapping>(d_, ordinal, handle, va, range.allocation_bytes,
                                                    r == CUDA_SUCCESS, range.offset, range.bytes);
        if (r != CUDA_SUCCESS) return Internal("cuda: cuMemMap: " + driverText(r));
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = ordinal;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = d_.setAccess(va, range.allocation_bytes, &access, 1);
        if (r != CUDA_SUCCESS) return Internal("cuda: cuMemSetAccess: " + driverText(r));
        return std::unique_ptr<Mapping>(std::move(mapping));
      }
      case HandleKind::kFabric:
        break;
    }
    return Incompatible("cuda: cannot import a " + std::string(handleKindName(range.kind)) +
                        " handle in this version (posix-fd and legacy-ipc only)");
  }

  StatusOr<std::unique_ptr<Stream>> createStream(int ordinal) override {
    if (ordinal < 0 || ordinal >= static_cast<int>(devices_.size())) {
      return InvalidArgument("cuda: no device " + std::to_string(ordinal) + " (this process has " +
                             std::to_string(devices_.size()) + ")");
    }
    auto stream = std::make_shared<cudaStream_t>(nullptr);
    StreamOps ops;
    ops.on_start = [ordinal, stream]() -> Status {
      cudaError_t e = cudaSetDevice(ordinal);
      if (e == cudaSuccess) e = cudaStreamCreateWithFlags(stream.get(), cudaStreamNonBlocking);
      if (e != cudaSuccess) {
        return Internal("cuda: stream on device " + std::to_string(ordinal) + ": " + cudaText(e));
      }
      return OkStatus();
    };
    ops.on_stop = [stream] {
      if (*stream != nullptr) (void)cudaStreamDestroy(*stream);
    };
    ops.copy = [stream](const HostCopyTable& t) { return copyOnDevice(t, *stream); };
    ops.pack = [stream](const HostPackTable& t) { return packOnDevice(t, *stream); };
    return makeWorkerStream(std::move(ops));
  }

  StatusOr<std::unique_ptr<DeviceBuffer>> allocateBuffer(int ordinal, uint64_t bytes) override {
    if (ordinal < 0 || ordinal >= static_cast<int>(devices_.size())) {
      return InvalidArgument("cuda: no device " + std::to_string(ordinal));
    }
    RETURN_IF_ERROR(setDevice(ordinal));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<uint64_t>(bytes, 1));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return ResourceExhausted("cuda: " + std::to_string(bytes) + " bytes on device " +
                               std::to_string(ordinal) + ": " + cudaText(e));
    }
    return std::unique_ptr<DeviceBuffer>(std::make_unique<CudaBuffer>(p, bytes, ordinal));
  }

  StatusOr<std::unique_ptr<HostRegistration>> registerHost(void* ptr, uint64_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return InvalidArgument("cuda: registering " + std::to_string(bytes) +
                             " bytes of host memory at a null pointer");
    }
    const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) return Internal("cuda: cudaHostRegister: " + cudaText(e));
    return std::unique_ptr<HostRegistration>(std::make_unique<HostPin>(ptr));
  }

 private:
  static Status setDevice(int ordinal) {
    const cudaError_t e = cudaSetDevice(ordinal);
    if (e != cudaSuccess) {
      return Internal("cuda: cudaSetDevice(" + std::to_string(ordinal) + "): " + cudaText(e));
    }
    return OkStatus();
  }

  // The device of [ptr, ptr + bytes) and the allocation that holds it (base, size).
  StatusOr<DeviceId> allocationOf(const void* ptr, uint64_t bytes, uint64_t* base,
                                  uint64_t* size) const {
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
    if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice || attr.device < 0 ||
        attr.device >= static_cast<int>(devices_.size())) {
      (void)cudaGetLastError();  // a failed query must not stick to the next call
      return NotFound("cuda: host memory, not device memory (cudaPointerGetAttributes: type " +
                      std::to_string(static_cast<int>(attr.type)) + ")");
    }
    RETURN_IF_ERROR(setDevice(attr.device));  // the driver call below needs its context
    CUdeviceptr b = 0;
    size_t s = 0;
    const CUresult r = d_.getAddressRange(&b, &s, reinterpret_cast<CUdeviceptr>(ptr));
    if (r != CUDA_SUCCESS) return Internal("cuda: cuMemGetAddressRange: " + driverText(r));
    *base = static_cast<uint64_t>(b);
    *size = s;
    const uint64_t p = reinterpret_cast<uint64_t>(ptr);
    if (bytes > *base + *size - p) {
      return InvalidArgument("cuda: " + std::to_string(bytes) + " bytes at offset " +
                             std::to_string(p - *base) + " run past the end of an allocation of " +
                             std::to_string(*size) + " bytes on device " +
                             std::to_string(attr.device));
    }
    return devices_[attr.device];
  }

  // The device of this process that `id` names by UUID; device 0 when none does.
  int localOrdinal(const DeviceId& id) const {
    for (const DeviceId& d : devices_) {
      if (d.uuid == id.uuid) return d.ordinal;
    }
    return 0;
  }

  const Driver d_;
  const std::vector<DeviceId> devices_;
  std::mutex capture_mu_;
  std::map<int, cudaStream_t> capture_streams_;  // guarded by capture_mu_; one per device
};

}  // namespace

Status driverEntryPoint(const char* name, void** fn) {
  cudaDriverEntryPointQueryResult found{};
  *fn = nullptr;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || *fn == nullptr) {
    (void)cudaGetLastError();
    return Unavailable(std::string("CUDA driver entry point ") + name +
                       " not found: " + cudaText(e));
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<DeviceApi>> createCudaDevice() {
  ASSIGN_OR_RETURN(int n, cudaDevices());
  Driver driver;
  RETURN_IF_ERROR(driver.load());
  std::vector<DeviceId> devices;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    const cudaError_t e = cudaGetDeviceProperties(&prop, i);
    if (e != cudaSuccess) {
      return Unavailable("cuda: properties of device " + std::to_string(i) + ": " + cudaText(e));
    }
    DeviceId id;
    id.ordinal = i;
    std::memcpy(id.uuid.data(), prop.uuid.bytes, id.uuid.size());
    devices.push_back(id);
  }
  return std::shared_ptr<DeviceApi>(std::make_shared<CudaDevice>(driver, std::move(devices)));
}

}  // namespace hxfer::device
