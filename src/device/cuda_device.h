// CudaDevice: the device seam (device_api.h) over CUDA, for the cuda transport on a GPU. Built
// with the kernels (hxfer_device_cuda) where the CUDA toolkit is found. The runtime is linked
// statically and the driver's VMM calls are looked up at run time
// (cudaGetDriverEntryPointByVersion), so a program using it loads on a machine without a
// driver, where createCudaDevice says why it cannot be had.
//
//   owner        cudaPointerGetAttributes (device memory only) and cuMemGetAddressRange (the
//                allocation the range must fit).
//   exportRange  VMM memory (cuMemRetainAllocationHandle succeeds) as a POSIX fd
//                (cuMemExportToShareableHandle; the allocation must have been created with
//                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), anything else as a legacy IPC
//                handle of its allocation's base (cudaIpcGetMemHandle, 64 bytes).
//   importRange  posix fd: cuMemImportFromShareableHandle, then a reserved range the size of the
//                allocation, mapped and made readable and writable by the importing device;
//                legacy IPC: cudaIpcOpenMemHandle (lazy peer access). The importing device is
//                the one whose UUID the range names when this process sees it, else device 0.
//                Fabric handles are Incompatible in this version.
//   streams      a host thread per stream running each copy or pack as one launch on a
//                non-blocking CUDA stream of the device, waited for (worker_stream.h).
//   registerHost cudaHostRegister / cudaHostUnregister.
//
// None of this has run on a GPU yet: the GPU tests (label gpu) and the GPU check exercise it
// where one is.
#pragma once

#include <memory>

#include "device/device_api.h"

namespace hxfer::device {

// Unavailable naming CUDA's error where there is no driver or no device.
StatusOr<std::shared_ptr<DeviceApi>> createCudaDevice();

// The driver function `name` (CUDA 12 ABI), looked up at run time: nothing links libcuda.
// Unavailable naming the function and CUDA's error where the driver has none.
Status driverEntryPoint(const char* name, void** fn);
// The same into a typed pointer (a PFN_* of cudaTypedefs.h).
template <typename Fn>
Status driverEntryPoint(const char* name, Fn* fn) {
  void* p = nullptr;
  RETURN_IF_ERROR(driverEntryPoint(name, &p));
  *fn = reinterpret_cast<Fn>(p);
  return OkStatus();
}

}  // namespace hxfer::device
