// hxfer-gpu-check's rows for the cuda transport between two processes: the check re-executes
// itself as a child (CUDA is not fork-safe), which allocates a source of the given kind (legacy
// cudaMalloc memory, or VMM memory exportable as a POSIX fd), connects to the parent's cuda
// agent and writes the parent's region of the same kind, timed, then another pattern behind a
// fence. The parent checks every byte: the first pattern while the fence is pending (nothing of
// the fenced write may have landed), the second once it is done.
#include "device/gpu_check_ipc.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cache/region.h"
#include "device/cuda_device.h"
#include "device/fake_device.h"
#include "transport/transport.h"

extern char** environ;

namespace hxfer::device {
namespace {

using namespace std::chrono_literals;
using transport::Agent;
using transport::AgentConfig;
using TEvent = transport::Event;  // device::Event is the device's

constexpr char kToken[] = "hxfer-gpu-check";
constexpr uint32_t kRegionId = 7;

// The bytes both processes agree on: pseudo-random patterns, by number.
std::vector<uint8_t> pattern(uint64_t bytes, uint64_t which) {
  std::vector<uint8_t> p(bytes);
  std::mt19937_64 rng(1234 + which);
  for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t w = rng();
    std::memcpy(p.data() + i, &w, 8);
  }
  return p;
}

// Device memory of one kind: "legacy" (cudaMalloc), "vmm" (cuMemCreate with a POSIX fd handle
// type, mapped read-write for device 0) or "fake" (FakeDevice memory, for running the rows'
// two-process logic without a GPU). Null data() when it could not be had; why() says why.
class KindBuffer {
 public:
  KindBuffer(const std::string& kind, uint64_t bytes, DeviceApi& dev) : bytes_(bytes) {
    if (kind == "fake") {
      auto a = static_cast<FakeDevice&>(dev).allocate(0, bytes);
      if (!a.isOk()) why_ = a.status().toString();
      if (a.isOk()) fake_ = std::move(a).value();
      ptr_ = fake_ ? fake_->data() : nullptr;
      return;
    }
    if (kind == "legacy") {
      const cudaError_t e = cudaMalloc(&ptr_, bytes);
      if (e != cudaSuccess) why_ = std::string("cudaMalloc: ") + cudaGetErrorName(e);
      return;
    }
    if (!load()) return;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (granularity_(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) {
      why_ = "cuMemGetAllocationGranularity failed";
      return;
    }
    size_ = (bytes + granularity - 1) / granularity * granularity;
    if (create_(&handle_, size_, &prop, 0) != CUDA_SUCCESS) {
      why_ = "cuMemCreate failed";
      return;
    }
    created_ = true;
    if (reserve_(&va_, size_, 0, 0, 0) != CUDA_SUCCESS ||
        map_(va_, size_, 0, handle_, 0) != CUDA_SUCCESS) {
      why_ = "cuMemAddressReserve/cuMemMap failed";
      return;
    }
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (access_(va_, size_, &access, 1) != CUDA_SUCCESS) {
      why_ = "cuMemSetAccess failed";
      return;
    }
    ptr_ = reinterpret_cast<void*>(va_);
  }
  ~KindBuffer() {
    if (fake_) return;
    if (va_ == 0) {
      if (ptr_ != nullptr) cudaFree(ptr_);
      if (created_) release_(handle_);
      return;
    }
    if (mapped_) unmap_(va_, size_);
    free_(va_, size_);
    if (created_) release_(handle_);
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t bytes() const { return bytes_; }
  const std::string& why() const { return why_; }

  bool fill(const std::vector<uint8_t>& host) {
    if (fake_) return std::memcpy(ptr_, host.data(), host.size()) != nullptr;
    return cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess;
  }
  bool read(std::vector<uint8_t>* host) {
    host->resize(bytes_);
    if (fake_) return std::memcpy(host->data(), ptr_, bytes_) != nullptr;
    return cudaMemcpy(host->data(), ptr_, bytes_, cudaMemcpyDeviceToHost) == cudaSuccess;
  }

 private:
  bool load() {
    auto get = [&](const char* name, auto* fn) {
      const Status s = driverEntryPoint(name, fn);
      if (!s.isOk()) why_ = s.message();
      return s.isOk();
    };
    return get("cuMemGetAllocationGranularity", &granularity_) && get("cuMemCreate", &create_) &&
           get("cuMemAddressReserve", &reserve_) && get("cuMemMap", &map_) &&
           get("cuMemSetAccess", &access_) && get("cuMemUnmap", &unmap_) &&
           get("cuMemAddressFree", &free_) && get("cuMemRelease", &release_);
  }

  uint64_t bytes_;
  uint64_t size_ = 0;
  void* ptr_ = nullptr;
  std::string why_;
  std::shared_ptr<Region> fake_;
  CUmemGenericAllocationHandle handle_{};
  CUdeviceptr va_ = 0;
  bool created_ = false, mapped_ = false;
  PFN_cuMemGetAllocationGranularity_v10020 granularity_ = nullptr;
  PFN_cuMemCreate_v10020 create_ = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve_ = nullptr;
  PFN_cuMemMap_v10020 map_ = nullptr;
  PFN_cuMemSetAccess_v10020 access_ = nullptr;
  PFN_cuMemUnmap_v10020 unmap_ = nullptr;
  PFN_cuMemAddressFree_v10020 free_ = nullptr;
  PFN_cuMemRelease_v10020 release_ = nullptr;
};

StatusOr<std::shared_ptr<DeviceApi>> deviceFor(const std::string& kind) {
  if (kind == "fake") return std::shared_ptr<DeviceApi>(std::make_shared<FakeDevice>());
  return createCudaDevice();
}

std::unique_ptr<Agent> cudaAgent(std::shared_ptr<DeviceApi> dev, const std::string& label,
                                 std::string* why) {
  AgentConfig c;
  c.backend = "cuda";
  c.device = std::move(dev);
  c.label = label;
  c.auth_token = kToken;
  c.connect_timeout = 30s;
  auto a = transport::createAgent(c);
  if (!a.isOk()) {
    *why = a.status().toString();
    return nullptr;
  }
  return std::move(a).value();
}

std::optional<TEvent> waitFor(Agent& a, TEvent::Kind kind, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto e = a.pollEvent(100ms);
    if (e && e->kind == kind) return e;
    if (e && e->kind == TEvent::Kind::kPeerLost) return std::nullopt;
  }
  return std::nullopt;
}

std::vector<uint8_t> text(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

// The child: argv = --ipc-child ADDRESS KIND BYTES. Writes pattern 1 five times (timed), then
// pattern 2 behind a fence: once the fenced write has waited 100 ms it asks the parent to look
// ("check"), and signals the fence only after the parent's answer. Ends with "ok <best ms>
// <held>" or "error <why>", then waits for the parent to hang up.
int ipcChild(int argc, char** argv) {
  if (argc < 5) return 64;
  const std::string address = argv[2], kind = argv[3];
  const uint64_t bytes = std::stoull(argv[4]);
  std::string why;
  auto dev = deviceFor(kind);
  if (!dev.isOk()) return 3;
  // The memory before the agent: the agent, destroyed first, never holds a freed region.
  KindBuffer src(kind, bytes, **dev);
  auto region = Region::borrow(1, src.data(), bytes);
  auto agent = cudaAgent(*dev, "gpu-check-child", &why);
  if (!agent) return 4;
  auto peer = agent->connect(address);
  if (!peer.isOk()) return 5;
  auto report = [&](const std::string& s) {
    (void)agent->sendMessage(*peer, text(s));
    (void)waitFor(*agent, TEvent::Kind::kMessage, 60s);  // the parent's goodbye
    return 0;
  };
  if (src.data() == nullptr) return report("error allocating the source: " + src.why());
  if (!src.fill(pattern(bytes, 1))) return report("error filling the source");
  if (!region.isOk()) return report("error " + region.status().toString());
  auto reg = agent->registerRegion(**region, transport::RegionAccess::kLocalSource);
  if (!reg.isOk()) return report("error registering: " + reg.status().toString());
  if (!waitFor(*agent, TEvent::Kind::kMessage, 60s)) return report("error: no go from the parent");
  Status added = agent->addRemoteRegion(*peer, kRegionId, bytes, {});
  if (!added.isOk()) return report("error adding the parent's region: " + added.toString());
  const std::vector<transport::WriteOp> ops = {{1, 0, kRegionId, 0, bytes}};
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto t = agent->postWrite(*peer, ops);
    if (!t.isOk()) return report("error posting: " + t.status().toString());
    Status s = t->wait(std::chrono::steady_clock::now() + 60s);
    if (!s.isOk()) return report("error writing: " + s.toString());
    best = std::min(
        best,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (!src.fill(pattern(bytes, 2))) return report("error refilling the source");
  auto fence = std::make_shared<ManualEvent>();
  auto fenced = agent->postWriteAfter(*peer, ops, fence);
  if (!fenced.isOk()) {
    return report("error posting the fenced write: " + fenced.status().toString());
  }
  std::this_thread::sleep_for(100ms);
  const bool held = fenced->poll() == transport::TransferState::kInProgress;
  (void)agent->sendMessage(*peer, text("check"));
  if (!waitFor(*agent, TEvent::Kind::kMessage, 120s)) {
    fence->signal(Cancelled("the parent did not answer"));
    return report("error: the parent did not check");
  }
  fence->signal();
  Status s = fenced->wait(std::chrono::steady_clock::now() + 60s);
  if (!s.isOk()) return report("error in the fenced write: " + s.toString());
  char buf[128];
  std::snprintf(buf, sizeof(buf), "ok %.6f %d", best, held ? 1 : 0);
  return report(buf);
}

IpcResult ipcCheck(const std::string& kind, uint64_t bytes) {
  IpcResult r;
  auto dev = deviceFor(kind);
  if (!dev.isOk()) {
    r.why = dev.status().toString();
    return r;
  }
  // The memory before the agent: the agent, destroyed first, never holds a freed region.
  KindBuffer dst(kind, bytes, **dev);
  if (dst.data() == nullptr) {
    r.why = "allocating the destination: " + dst.why();
    return r;
  }
  if (!dst.fill(std::vector<uint8_t>(bytes, 0))) {
    r.why = "clearing the destination";
    return r;
  }
  auto region = Region::borrow(kRegionId, dst.data(), bytes);
  if (!region.isOk()) {
    r.why = region.status().toString();
    return r;
  }
  auto agent = cudaAgent(*dev, "gpu-check", &r.why);
  if (!agent) return r;
  auto reg = agent->registerRegion(**region, transport::RegionAccess::kRemoteWritable);
  if (!reg.isOk()) {
    r.why = "registering the destination: " + reg.status().toString();
    return r;
  }
  const std::string address = agent->localAddress(), size = std::to_string(bytes);
  const char* args[] = {"hxfer-gpu-check", "--ipc-child", address.c_str(),
                        kind.c_str(),      size.c_str(),  nullptr};
  pid_t child = 0;
  if (posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, const_cast<char**>(args), environ) !=
      0) {
    r.why = "posix_spawn of the child failed";
    return r;
  }
  auto finish = [&](std::string why) {
    r.why = std::move(why);
    int status = 0;
    for (int i = 0; i < 600 && waitpid(child, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(100ms);
    }
    if (waitpid(child, &status, WNOHANG) == 0) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
    }
    return r;
  };
  auto connected = waitFor(*agent, TEvent::Kind::kPeerConnected, 120s);
  if (!connected) return finish("the child did not connect");
  (void)agent->sendMessage(connected->peer, text("go"));
  std::vector<uint8_t> got;
  bool untouched = false;
  for (;;) {
    auto answer = waitFor(*agent, TEvent::Kind::kMessage, 300s);
    if (!answer) return finish("no answer from the child");
    const std::string said(answer->payload.begin(), answer->payload.end());
    if (said == "check") {
      // The fenced write waits for its event: pattern 1 of the timed writes must be all there
      // is, every byte of it.
      untouched = dst.read(&got) && got == pattern(bytes, 1);
      (void)agent->sendMessage(connected->peer, text("checked"));
      continue;
    }
    (void)agent->sendMessage(connected->peer, text("bye"));
    int held = 0;
    if (std::sscanf(said.c_str(), "ok %lf %d", &r.best_ms, &held) != 2) return finish(said);
    r.fence_held = held == 1 && untouched;
    break;
  }
  r.exact = untouched && dst.read(&got) && got == pattern(bytes, 2);
  r.ran = true;
  return finish("");
}

}  // namespace hxfer::device
