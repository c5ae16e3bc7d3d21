// What the public handles (include/hxfer/hxfer.h) hold: internal, for src/api and its tests
// (which reach the rank layout and the page fences behind a Layout or Memory).
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/engine_layout.h"
#include "cache/layout.h"
#include "device/device_api.h"
#include "hxfer/hxfer.h"
#include "model/model.h"

namespace hxfer {

struct Layout::Impl {
  LayoutOptions options;
  ModelSpec model;
  ParallelConfig parallel;
  EngineLayout engine;
  RankLayout layout;
  std::vector<PoolInfo> pools;
  std::optional<LayoutDescription> description;  // fromRecords
};

struct Memory::Impl {
  explicit Impl(Layout l) : layout(std::move(l)) {}
  Layout layout;
  bool shareable = false;
  // Set when the pools are CUDA device memory: the runtime that owns them (deviceRuntime()).
  std::shared_ptr<device::DeviceApi> device;
  std::unique_ptr<HybridCacheManager> cache;
  std::atomic<bool> in_use{false};  // one Sender or Receiver at a time
};

// The device runtime Memory::wrap checks kCuda buffers with and the cuda transport moves them
// through: the CUDA one where this build has nvcc (createCudaDevice), made on first use; its
// error (Unavailable: no driver, no device, no CUDA in this build) is kept and returned again.
StatusOr<std::shared_ptr<device::DeviceApi>> deviceRuntime();
// Tests: use `device` (a FakeDevice) from now on; nullptr goes back to the CUDA one.
void setDeviceRuntimeForTesting(std::shared_ptr<device::DeviceApi> device);

}  // namespace hxfer
