// The CUDA side of kernels.h, in C++17 for nvcc: launches over host tables, CUDA's error code
// back (0: success). kernels.cc turns these into Status.
#pragma once

#include <cstdint>

#include "device/copy_table.h"

namespace hxfer::device::cuda {

// cudaGetDeviceCount.
int deviceCount(int* n);
// Uploads the table, launches once, waits for the launch. On failure `*what` names the step.
int launchCopy(const CopyRun* runs, uint32_t num_runs, const uint64_t* first_chunk,
               uint64_t num_chunks, void* stream, const char** what);
int launchPack(const Pack* packs, uint32_t num_packs, const uint64_t* first_element,
               uint64_t num_elements, void* stream, const char** what);
// cudaGetErrorName / cudaGetErrorString.
const char* errorName(int error);
const char* errorString(int error);

}  // namespace hxfer::device::cuda
