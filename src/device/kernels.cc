#include "device/kernels.h"

#include <string>

#include "device/launch.h"

namespace hxfer::device {
namespace {

std::string cudaText(int e) {
  return std::string(cuda::errorName(e)) + " (" + cuda::errorString(e) + ")";
}

}  // namespace

StatusOr<int> cudaDevices() {
  int n = 0;
  const int e = cuda::deviceCount(&n);
  if (e != 0) return Unavailable("no CUDA device: " + cudaText(e));
  if (n == 0) return Unavailable("no CUDA device: the driver reports none");
  return n;
}

Status copyOnDevice(const HostCopyTable& t, void* stream) {
  const CopyTable v = t.view();
  const char* what = "";
  const int e = cuda::launchCopy(v.runs, v.num_runs, v.first_chunk, v.num_chunks, stream, &what);
  if (e != 0) return Internal(std::string(what) + ": " + cudaText(e));
  return OkStatus();
}

Status packOnDevice(const HostPackTable& t, void* stream) {
  const PackTable v = t.view();
  const char* what = "";
  const int e =
      cuda::launchPack(v.packs, v.num_packs, v.first_element, v.num_elements, stream, &what);
  if (e != 0) return Internal(std::string(what) + ": " + cudaText(e));
  return OkStatus();
}

}  // namespace hxfer::device
