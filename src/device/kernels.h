// CUDA launches of the device tables (copy_table.h): the batched copy and the pack, each one
// launch whatever the number of runs or boxes. Built where the CUDA toolkit is found
// (HXFER_WITH_CUDA, the library hxfer_device_cuda); CUDA's runtime is linked statically, so a
// program using them loads on a machine without a driver, where every call is Unavailable.
//
// This version is synchronous (each call returns once its launch finished) and is used by the
// GPU tests and the GPU check only: no transport moves device memory yet.
#pragma once

#include "common/status.h"
#include "device/copy_table_builder.h"

namespace hxfer::device {

// The number of CUDA devices this process can use; Unavailable naming CUDA's error where
// there is no driver or no device.
StatusOr<int> cudaDevices();

// Runs `t` on `stream` (a cudaStream_t; nullptr: the default stream): its runs and first chunks
// go to device memory, one launch copies every run, and the call returns when it finished.
// The table's addresses must be device memory (or memory the device can reach). Internal
// naming CUDA's error when a call fails.
Status copyOnDevice(const HostCopyTable& t, void* stream = nullptr);

// The same for a pack: one launch, one thread per element.
Status packOnDevice(const HostPackTable& t, void* stream = nullptr);

}  // namespace hxfer::device
