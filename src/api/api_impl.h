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
  std::unique_ptr<HybridCacheManager> cache;
  std::atomic<bool> in_use{false};  // one Sender or Receiver at a time
};

}  // namespace hxfer
