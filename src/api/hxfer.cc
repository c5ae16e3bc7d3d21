// The public API (include/hxfer/hxfer.h) over the engine layer: a Layout is an engine layout
// built with buildEngineLayout, a Memory a HybridCacheManager over borrowed regions (the
// engine's buffers; the manager only fences pages the engine names), a Sender a
// ContextSender and a Receiver a GenerationReceiver. Release notifications leave the
// manager's lock through a Dispatcher thread, so engine callbacks may call back into hxfer.
#include "hxfer/hxfer.h"

#include "api/api_impl.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <thread>
#include <tuple>

#include "cache/cache_manager.h"
#include "cache/engine_layout.h"
#include "cache/record_layout.h"
#include "cache/region.h"
#include "common/status.h"
#ifdef HXFER_HAVE_CUDA_DEVICE
#include "device/cuda_device.h"
#endif
#include "engine/context_sender.h"
#include "engine/generation_receiver.h"
#include "engine/handshake.h"
#include "engine/model_source.h"
#include "engine/routing.h"
#include "model/presets.h"
#include "plan/planner.h"
#include "transport/transport.h"
#include "wire/messages.h"

namespace hxfer {

namespace {

std::string str(uint64_t v) { return std::to_string(v); }

// Delivers release notifications to the engine's callback on a thread of its own: the cache
// manager reports them with its lock (and often the transceiver's) held. The thread owns its
// state (shared), so stop() and the destructor may run on it, from inside the callback (a
// shutdown called back in): they then leave the thread to end after the callback returns.
class Dispatcher {
 public:
  explicit Dispatcher(std::function<void(uint64_t)> callback) : state_(std::make_shared<State>()) {
    state_->callback = std::move(callback);
    if (state_->callback) {
      std::lock_guard lock(state_->mu);  // thread_id is read under it (onThread)
      thread_ = std::thread([st = state_] { run(*st); });
      state_->thread_id = thread_.get_id();
    } else {
      state_->finished = true;
    }
  }
  ~Dispatcher() { finish(); }

  // stop(), then waits until the thread delivered its last id, unless this is that thread (a
  // callback that dropped the last reference to its Sender or Receiver). A thread left to end
  // by stop() on itself may still be in its callback: this waits for that too.
  void finish() {
    stop();
    if (onThread()) return;
    std::unique_lock lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->finished; });
  }

  bool onThread() const { return state_->thread_id == std::this_thread::get_id(); }

  // After stop(), ids are dropped: nobody is listening any more.
  void push(uint64_t id) {
    if (!state_->callback) return;
    std::lock_guard lock(state_->mu);
    if (state_->stop) return;
    state_->queue.push_back(id);
    state_->cv.notify_one();
  }
  // Delivers what is queued, then ends the thread (joined unless this is that thread).
  // Idempotent.
  void stop() {
    {
      std::lock_guard lock(state_->mu);
      state_->stop = true;
      state_->cv.notify_one();
    }
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }

 private:
  struct State {
    std::function<void(uint64_t)> callback;  // fixed at construction
    std::mutex mu;
    std::condition_variable cv;
    std::deque<uint64_t> queue;  // guarded by mu
    bool stop = false;           // guarded by mu
    bool finished = false;       // guarded by mu: run() returned
    std::thread::id thread_id;   // set once, before run() looks at anything
  };

  static void run(State& st) {
    std::unique_lock lock(st.mu);
    for (;;) {
      st.cv.wait(lock, [&] { return st.stop || !st.queue.empty(); });
      if (st.queue.empty()) {  // stopped and drained
        st.finished = true;
        st.cv.notify_all();
        return;
      }
      const uint64_t id = st.queue.front();
      st.queue.pop_front();
      lock.unlock();
      st.callback(id);
      lock.lock();
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
};

// The pool as rows of its strided indices (PoolInfo): blocks or slots and layers, outermost
// first, down to one record's pitch in bytes, when they tile the pool exactly.
void describePool(const RankLayout& l, const RegionSpec& spec, PoolInfo* out) {
  out->shape = {spec.length};
  out->strides = {1};
  for (const PoolView& v : l.views) {
    if (v.region_id != spec.id) continue;
    std::vector<std::pair<uint64_t, uint64_t>> dims;  // (size, stride)
    if (v.num_indices > 1 && v.index_stride != 0) dims.push_back({v.num_indices, v.index_stride});
    if (v.layers.size() > 1 && v.layer_stride != 0)
      dims.push_back({v.layers.size(), v.layer_stride});
    std::sort(dims.begin(), dims.end(), [](auto& a, auto& b) { return a.second > b.second; });
    if (dims.empty() || dims[0].first * dims[0].second != spec.length) return;
    out->shape = {dims[0].first};
    out->strides = {dims[0].second};
    if (dims.size() == 2 && dims[1].first * dims[1].second == dims[0].second) {
      out->shape.push_back(dims[1].first);
      out->strides.push_back(dims[1].second);
    }
    out->shape.push_back(out->strides.back());
    out->strides.push_back(1);
    return;
  }
}

Status applyDType(std::string_view field, const std::string& value, DType* out) {
  if (value.empty()) return OkStatus();
  auto d = parseDType(value);
  if (!d.isOk()) return d.status().withContext(field);
  *out = *d;
  return OkStatus();
}

// A request whose pages this thread hands back unreported (freeUnreported); the release
// listener runs on the freeing thread, inside free().
thread_local std::optional<uint64_t> t_unreported;

// The page lifetime hook shared by both sides: a Memory used by one transceiver at a time.
Status claim(const Layout& layout, const Memory& memory,
             const std::shared_ptr<Dispatcher>& dispatcher, uint64_t owner,
             HybridCacheManager::FenceMode mode) {
  if (!(memory.layout() == layout)) {
    return InvalidArgument("memory was registered for another layout: " +
                           memory.layout().describe() + ", not " + layout.describe());
  }
  Memory::Impl& m = memory.impl();
  if (m.in_use.exchange(true)) {
    return InvalidArgument("memory is already used by another Sender or Receiver");
  }
  // A Sender only reads its pages, so requests may share them (a cached prompt prefix); a
  // Receiver writes them, so each page is one request's.
  if (Status s = m.cache->setFenceMode(mode); !s.isOk()) {
    m.in_use.store(false);
    return s.withContext("memory");
  }
  // Only this transceiver's requests (adopted with its owner tag): a late release of an
  // earlier user's is not reported here.
  m.cache->setReleaseListener([dispatcher, owner](uint64_t id, uint64_t tag) {
    if (tag == owner && t_unreported != id) dispatcher->push(id);
  });
  return OkStatus();
}

// Releases after this are not reported (the callback is dropped, and with it whatever the
// engine's callback holds).
void unclaim(Memory::Impl& m) {
  m.cache->setReleaseListener(nullptr);
  m.in_use.store(false);
}

// Hands back the pages of a request taken by a call that then failed: to the engine that call
// took nothing, so no release is reported (docs/api.md, the page contract's rule 4); an engine
// that frees the pages on the error must not hear of them again in on_released.
// REQUIRES: nothing was posted out of or into the pages (free() releases them at once).
void freeUnreported(HybridCacheManager& cache, uint64_t request_id) {
  t_unreported = request_id;
  (void)cache.free(request_id);
  t_unreported.reset();
}

uint64_t nextOwner() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

// Deadlines far in the future saturate instead of overflowing the clock.
// REQUIRES: t >= 0 where 0 means "do not wait" (a poll); options are checked (positiveTimeout).
std::chrono::milliseconds clampTimeout(std::chrono::milliseconds t) {
  constexpr std::chrono::milliseconds kMax = std::chrono::hours(24 * 365);
  return std::clamp(t, std::chrono::milliseconds(0), kMax);
}

// An option's timeout of 0 or less would end every lease, request or handshake at once:
// InvalidArgument naming the option, its value and `what` it bounds.
Status positiveTimeout(std::string_view name, std::chrono::milliseconds t, std::string_view what) {
  if (t > std::chrono::milliseconds(0)) return OkStatus();
  return InvalidArgument(std::string(name) + "=" + std::to_string(t.count()) +
                         " ms: " + std::string(what) + "; it must be positive");
}

struct Routed {
  engine::BackendKind backend;
  std::string reason;
};

StatusOr<Routed> route(const std::string& requested, std::optional<engine::BackendKind> implied,
                       const Memory& memory) {
  auto asked = engine::parseBackendRequest(requested);
  if (!asked.isOk()) return asked.status().withContext("backend");
  std::optional<engine::BackendKind> want = *asked ? *asked : implied;
  engine::RoutingEnvironment env = engine::probeRoutingEnvironment();
  env.memory_shareable = memory.shareable();
  env.memory_device = memory.device();
  env.single_process = want == engine::BackendKind::kInproc;
  engine::RoutingExplanation e = engine::explainRouting({want, std::nullopt}, env, std::nullopt);
  if (e.decisions.empty() || e.decisions[0].setting != "backend") return e.status;
  const auto& d = e.decisions[0];
  return Routed{e.routing ? e.routing->backend : *engine::parseBackendRequest(d.value).value(),
                "backend=" + d.value + ": " + d.reason};
}

StatusOr<std::unique_ptr<transport::Agent>> makeAgent(const TransportOptions& o,
                                                      const Memory& memory,
                                                      engine::BackendKind backend,
                                                      std::string listen, std::string label) {
  transport::AgentConfig c;
  c.backend = std::string(engine::backendName(backend));
  c.device = memory.impl().device;
  c.listen = std::move(listen);
  c.label = std::move(label);
  c.ucx_options = o.ucx_options;
  c.auth_token = o.token;
  return transport::createAgent(c);
}

// The engine's event for `what`, captured by the Memory's device runtime. InvalidArgument for
// host pools, a null event, or one the runtime cannot wait for.
StatusOr<std::shared_ptr<const device::Event>> captureEngineEvent(const Memory& memory,
                                                                  const DeviceEvent& e,
                                                                  const std::string& what) {
  if (!memory.device()) {
    return InvalidArgument(what + ": a DeviceEvent given with pools in host memory");
  }
  if (e.cuda_event == nullptr) return InvalidArgument(what + ": DeviceEvent::cuda_event is null");
  auto captured = memory.impl().device->captureEvent(e.cuda_event);
  if (!captured.isOk()) return captured.status().withContext(what);
  return std::move(captured).value();
}

Metrics toMetrics(const engine::MetricsSnapshot& s, const HybridCacheManager& cache) {
  Metrics m;
  m.requests_started = s.requests_started;
  m.requests_ok = s.requests_ok;
  m.requests_failed = s.requests_failed;
  m.requests_cancelled = s.requests_cancelled;
  m.bytes = s.bytes;
  m.ops = s.ops;
  m.leases_expired = s.leases_expired;
  m.quarantined_requests = s.quarantined_requests;
  m.peers_lost = s.peers_lost;
  m.handshakes_ok = s.handshakes_ok;
  m.handshakes_refused = s.handshakes_refused;
  m.accounting_errors = s.accounting_errors;
  const CacheCounters c = cache.counters();
  m.requests_held = uint64_t{c.live_requests} + c.quarantined_requests;
  m.latency_p50_us = std::chrono::duration<double, std::micro>(s.latency.quantile(0.5)).count();
  m.latency_p99_us = std::chrono::duration<double, std::micro>(s.latency.quantile(0.99)).count();
  std::string json = s.toJson();
  // One more counter, in the same object: the fenced requests.
  if (!json.empty() && json.back() == '}') {
    json.pop_back();
    json += ",\"requests_held\":" + str(m.requests_held) + "}";
  }
  m.json = std::move(json);
  return m;
}

}  // namespace

// ---- Layout ----

namespace {

// The model of a layout's options: preset or config, dtypes, tokens per block; tp/pp ranks.
Status loadLayoutModel(const LayoutOptions& o, ModelSpec* out) {
  const std::string name = o.model.empty() ? std::string(kDefaultPreset) : o.model;
  auto model = engine::loadModel(name);
  if (!model.isOk()) return model.status().withContext("model");
  ModelSpec& m = *model;
  RETURN_IF_ERROR(applyDType("kv_dtype", o.kv_dtype, &m.kv_dtype));
  RETURN_IF_ERROR(applyDType("conv_dtype", o.conv_dtype, &m.conv_dtype));
  RETURN_IF_ERROR(applyDType("ssm_dtype", o.ssm_dtype, &m.ssm_dtype));
  if (o.tokens_per_block == 0) return InvalidArgument("tokens_per_block=0; it must be >= 1");
  m.tokens_per_block = o.tokens_per_block;
  RETURN_IF_ERROR(m.validate());
  if (o.tp_rank >= o.tp) {
    return InvalidArgument("tp_rank=" + str(o.tp_rank) + " is not below tp=" + str(o.tp));
  }
  if (o.pp_rank >= o.pp) {
    return InvalidArgument("pp_rank=" + str(o.pp_rank) + " is not below pp=" + str(o.pp));
  }
  *out = std::move(m);
  return OkStatus();
}

// "records[3] (layer 5 kv)": record i of a description, as fromRecords' errors name it.
std::string recordWords(const LayoutDescription& d, size_t i) {
  return "records[" + str(i) + "] (layer " + str(d.records[i].layer) + " " + d.records[i].role +
         ")";
}

void fillPools(Layout::Impl& impl) {
  for (const RegionSpec& spec : impl.layout.regions) {
    PoolInfo p;
    p.name = spec.name;
    p.bytes = spec.length;
    describePool(impl.layout, spec, &p);
    impl.pools.push_back(std::move(p));
  }
}

}  // namespace

StatusOr<Layout> Layout::engine(const LayoutOptions& o) {
  auto impl = std::make_shared<Impl>();
  impl->options = o;
  ModelSpec m;
  RETURN_IF_ERROR(loadLayoutModel(o, &m));
  auto el =
      parseEngineLayout(o.engine, o.kv_layout, o.conv_layout, o.state_layout, o.shared_tensors);
  if (!el.isOk()) return el.status();
  applyEngineDtypes(*el, !o.conv_dtype.empty(), !o.ssm_dtype.empty(), &m);
  impl->parallel.tp = o.tp;
  impl->parallel.pp = o.pp;
  auto layout =
      buildEngineLayout(m, impl->parallel, o.tp_rank, o.pp_rank, *el, o.num_blocks, o.num_slots);
  if (!layout.isOk()) return layout.status();
  impl->model = std::move(m);
  impl->engine = *el;
  impl->layout = std::move(*layout);
  fillPools(*impl);
  return Layout(std::move(impl));
}

StatusOr<Layout> Layout::fromRecords(const LayoutDescription& d) {
  auto impl = std::make_shared<Impl>();
  impl->options = d.options;
  impl->description = d;
  RETURN_IF_ERROR(loadLayoutModel(d.options, &impl->model));
  const ModelSpec& m = impl->model;
  impl->parallel.tp = d.options.tp;
  impl->parallel.pp = d.options.pp;
  // The rank's records in hxfer's own layout: which (layer, role) it holds, their sections
  // and kinds. The description then places every one of them.
  ASSIGN_OR_RETURN(RankLayout base,
                   buildRankLayout(m, impl->parallel, d.options.tp_rank, d.options.pp_rank,
                                   StateLayout::kPaged, d.options.num_blocks,
                                   d.joint_ids ? d.options.num_blocks : d.options.num_slots));
  RankLayout out = base;
  out.regions.clear();
  out.views.clear();
  out.state_groups = d.state_groups;
  out.joint_ids = d.joint_ids;
  for (size_t i = 0; i < d.pools.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (d.pools[j].name == d.pools[i].name) {
        return InvalidArgument("pools: '" + d.pools[i].name + "' named twice");
      }
    }
    out.regions.push_back({static_cast<uint32_t>(i), d.pools[i].bytes, d.pools[i].name});
  }
  std::set<std::tuple<uint32_t, Role, std::string>> placed;
  for (size_t i = 0; i < d.records.size(); ++i) {
    const RecordSpec& r = d.records[i];
    const std::string what = recordWords(d, i);
    std::optional<Role> role;
    for (Role c : {Role::kKv, Role::kConv, Role::kSsm}) {
      if (roleName(c) == r.role) role = c;
    }
    if (!role) return InvalidArgument(what + ": role is not one of: kv, conv, ssm");
    const PoolView* held = nullptr;
    for (const PoolView& v : base.views) {
      if (v.role == *role && std::binary_search(v.layers.begin(), v.layers.end(), r.layer)) {
        held = &v;
      }
    }
    if (held == nullptr) {
      const LayerRange stage = base.stageLayers();
      return InvalidArgument(what + ": this rank holds no such record (its pp stage holds " +
                             "layers [" + str(stage.first) + ", " + str(stage.end()) + "), and " +
                             r.role + " records only of layers with that state)");
    }
    PoolView v = *held;
    v.layers = {r.layer};
    if (!r.section.empty()) {
      if (*role != Role::kKv) return InvalidArgument(what + ": section is for kv parts only");
      auto it = std::find_if(v.sections.begin(), v.sections.end(),
                             [&](const Section& s) { return s.name == r.section; });
      if (it == v.sections.end()) {
        return InvalidArgument(what + ": section '" + r.section + "' is not K or V");
      }
      v.sections = {*it};
    }
    for (const Section& s : v.sections) {
      if (!placed.insert({r.layer, *role, s.name}).second) {
        return InvalidArgument(what + ": section " + s.name + " is described twice");
      }
    }
    ASSIGN_OR_RETURN(v.record_bytes, localRecordBytes(v.sections, out.tp, out.tp_rank));
    auto pool = std::find_if(d.pools.begin(), d.pools.end(),
                             [&](const PoolSpec& p) { return p.name == r.pool; });
    if (pool == d.pools.end())
      return InvalidArgument(what + ": pool '" + r.pool + "' is not one of the pools");
    v.region_id = static_cast<uint32_t>(pool - d.pools.begin());
    v.base = r.offset;
    v.index_stride = r.index_stride;
    v.layer_stride = 0;
    v.num_indices = *role == Role::kKv ? out.num_blocks : out.num_slots;
    v.state_group = *role == Role::kKv ? 0 : r.state_group;
    RecordLayout rec;
    rec.element_bytes = static_cast<uint32_t>(dtypeSize(out.dtypeOf(*role)));
    rec.dims = r.dims;
    v.record = std::move(rec);
    out.views.push_back(std::move(v));
  }
  for (const PoolView& v : base.views) {
    for (uint32_t layer : v.layers) {
      for (const Section& s : v.sections) {
        if (!placed.count({layer, v.role, s.name})) {
          return InvalidArgument("layer " + str(layer) + " " + std::string(roleName(v.role)) +
                                 " section " + s.name + " is not described (every record " +
                                 "this rank holds needs one)");
        }
      }
    }
  }
  // View i is records[i], region n pools[n]: errors name what the engine described
  // ("records[0] (layer 0 conv) and records[1] (layer 0 ssm) overlap in pool 'layer.0'
  // (pools[0])"), as the header promises.
  RankLayout::Names names;
  names.view = [&d](size_t i) { return recordWords(d, i); };
  names.region = [&d](uint32_t n) {
    return "pool '" + d.pools[n].name + "' (pools[" + str(n) + "])";
  };
  RETURN_IF_ERROR(out.validate(names).withContext("described layout"));
  impl->engine = EngineLayout{};
  impl->layout = std::move(out);
  fillPools(*impl);
  return Layout(std::move(impl));
}

const LayoutDescription* Layout::description() const {
  return impl_->description ? &*impl_->description : nullptr;
}

const LayoutOptions& Layout::options() const { return impl_->options; }

std::vector<uint32_t> Layout::reservedBlocks() const {
  return impl_->description ? std::vector<uint32_t>{} : reservedIds(impl_->engine).blocks;
}
std::vector<uint32_t> Layout::reservedSlots() const {
  return impl_->description ? std::vector<uint32_t>{} : reservedIds(impl_->engine).slots;
}
const std::vector<PoolInfo>& Layout::pools() const { return impl_->pools; }

const PoolInfo* Layout::pool(std::string_view name) const {
  for (const PoolInfo& p : impl_->pools) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

bool Layout::hasKv() const { return impl_->layout.num_blocks > 0; }
bool Layout::hasState() const { return impl_->layout.num_slots > 0; }
uint32_t Layout::stateGroups() const { return impl_->layout.state_groups; }
bool Layout::jointIds() const { return impl_->layout.joint_ids; }

uint32_t Layout::blocksFor(uint32_t num_tokens) const {
  if (!hasKv()) return 0;
  const uint64_t t = impl_->layout.tokens_per_block;
  return static_cast<uint32_t>((uint64_t{num_tokens} + t - 1) / t);
}

StatusOr<std::vector<RecordPart>> Layout::records(uint32_t layer, std::string_view role) const {
  std::optional<Role> r;
  for (Role c : {Role::kKv, Role::kConv, Role::kSsm}) {
    if (roleName(c) == role) r = c;
  }
  if (!r) return InvalidArgument("role '" + std::string(role) + "' is not one of: kv, conv, ssm");
  const RankLayout& l = impl_->layout;
  const ModelSpec& model = impl_->model;
  std::vector<RecordPart> parts;
  for (const PoolView& v : l.views) {
    if (v.role != *r) continue;
    auto it = std::find(v.layers.begin(), v.layers.end(), layer);
    if (it == v.layers.end()) continue;
    const uint64_t local_layer = static_cast<uint64_t>(it - v.layers.begin());
    const uint32_t element_bytes = static_cast<uint32_t>(dtypeSize(l.dtypeOf(*r)));
    ASSIGN_OR_RETURN(std::vector<uint32_t> local, localUnitCounts(v.sections, l.tp, l.tp_rank));
    const LogicalDims ld = logicalDims(v.kind, v.role);
    StatusOr<RecordLayout> rec = Status(StatusCode::kInternal, "no record layout");
    if (v.record) {
      rec = *v.record;
    } else if (*r == Role::kKv) {
      rec = kvRecordLayout(l, v);
    } else {
      rec = canonicalRecordLayout(v.kind, v.role, v.sections, local, element_bytes,
                                  innerSizes(model, model.layers.at(layer), v.role));
    }
    if (!rec.isOk()) return rec.status();
    RecordPart part;
    part.pool = l.findRegion(v.region_id)->name;
    part.offset = v.base + local_layer * v.layer_stride;
    part.index_stride = v.index_stride;
    part.num_indices = v.num_indices;
    part.state_group = v.state_group;
    part.dtype = std::string(dtypeName(l.dtypeOf(*r)));
    part.element_bytes = element_bytes;
    for (const auto& d : rec->dims) part.dims.push_back({d.name, d.size, d.stride});
    const std::vector<uint32_t> inner = innerSizesOf(*rec, ld);
    for (size_t s = 0; s < v.sections.size(); ++s) {
      const Section& sec = v.sections[s];
      ASSIGN_OR_RETURN(UnitRange units, shardUnits(sec.units, l.tp, l.tp_rank, sec.name));
      ASSIGN_OR_RETURN(uint32_t len, unitLength(sec, element_bytes, inner));
      const SectionPlacement p = placeSection(*rec, ld, v.sections, local, s, len);
      part.sections.push_back(
          {sec.name, units.first, local[s], len, p.base, p.unit_stride, p.within_stride});
    }
    parts.push_back(std::move(part));
  }
  if (parts.empty()) {
    return NotFound("layer " + str(layer) + " has no " + std::string(role) +
                    " record on this rank (" + describe() + ")");
  }
  return parts;
}

std::vector<uint32_t> Layout::layers() const {
  std::vector<uint32_t> out;
  for (const PoolView& v : impl_->layout.views)
    out.insert(out.end(), v.layers.begin(), v.layers.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

LayerSpan Layout::stageLayers() const {
  const LayerRange stage = impl_->layout.stageLayers();
  return {stage.first, stage.count};
}

std::string Layout::describe() const {
  const RankLayout& l = impl_->layout;
  const std::string engine =
      impl_->description
          ? (impl_->options.engine.empty() ? std::string("described") : impl_->options.engine)
          : impl_->engine.toString();
  return engine + " " + impl_->model.name + " tp=" + str(l.tp) + " rank " + str(l.tp_rank) +
         " pp=" + str(l.pp) + " rank " + str(l.pp_rank) + ", " + str(l.num_blocks) + " blocks x " +
         str(l.tokens_per_block) + " tokens, " +
         (l.joint_ids ? "states from the blocks, " + str(l.state_groups) + " per request"
                      : str(l.num_slots) + " slots");
}

bool Layout::operator==(const Layout& other) const {
  return impl_ == other.impl_ ||
         (impl_->layout == other.impl_->layout && impl_->engine == other.impl_->engine);
}

// ---- Plans ----

namespace {
StatusOr<RankIds> rankIds(const Layout& l, const RankPages& pages, const std::string& who) {
  if (l.hasState() && !pages.slot) {
    return InvalidArgument(who + " (" + l.describe() +
                           ") holds recurrent state: its pages need a slot");
  }
  return RankIds{pages.blocks, pages.slot.value_or(0), pages.group_slots};
}

// Region id -> index into Layout::pools() (the layout's regions, in order).
std::vector<uint32_t> poolIndex(const RankLayout& l) {
  uint32_t max_id = 0;
  for (const RegionSpec& r : l.regions) max_id = std::max(max_id, r.id);
  std::vector<uint32_t> index(l.regions.empty() ? 0 : max_id + 1, 0);
  for (uint32_t i = 0; i < l.regions.size(); ++i) index[l.regions[i].id] = i;
  return index;
}
}  // namespace

StatusOr<TransferPlan> planTransfer(std::span<const Layout> sources,
                                    std::span<const RankPages> source_pages,
                                    const Layout& destination, const RankPages& destination_pages,
                                    uint32_t num_tokens, uint32_t prefix_tokens) {
  if (sources.size() != source_pages.size()) {
    return InvalidArgument("source_pages has " + str(source_pages.size()) + " entries for " +
                           str(sources.size()) + " sources");
  }
  const uint32_t need = destination.blocksFor(num_tokens);
  if (destination_pages.blocks.size() != need) {
    return InvalidArgument("destination_pages.blocks has " + str(destination_pages.blocks.size()) +
                           " blocks; " + str(num_tokens) + " tokens need " + str(need) + " on " +
                           destination.describe());
  }
  std::vector<RankLayout> ctx;
  std::vector<RankIds> ctx_ids;
  for (size_t i = 0; i < sources.size(); ++i) {
    ctx.push_back(sources[i].impl().layout);
    ASSIGN_OR_RETURN(RankIds ids, rankIds(sources[i], source_pages[i], "source " + str(i)));
    ctx_ids.push_back(std::move(ids));
  }
  ASSIGN_OR_RETURN(RankIds dst, rankIds(destination, destination_pages, "destination"));
  ASSIGN_OR_RETURN(Planner planner, Planner::create(std::move(ctx), destination.impl().layout));
  const uint32_t tpb = destination.impl().layout.tokens_per_block;
  const uint32_t first = std::min<uint32_t>(prefix_tokens / tpb, need);
  ASSIGN_OR_RETURN(RequestPlan plan, planner.plan(ctx_ids, dst, {first, need - first, num_tokens}));

  TransferPlan out;
  const std::vector<uint32_t> dst_pool = poolIndex(destination.impl().layout);
  for (const RankPlan& rp : plan.ranks) {
    if (!rp.pack_ops.empty()) {
      return Incompatible("source " + str(rp.ctx_index) + " (" + sources[rp.ctx_index].describe() +
                          ") and the destination (" + destination.describe() +
                          ") order state elements differently: the plan needs a staging copy "
                          "on the context rank, which fragments do not express");
    }
    const std::vector<uint32_t> src_pool = poolIndex(sources[rp.ctx_index].impl().layout);
    for (const CopyOp& op : rp.ops) {
      out.fragments.push_back({rp.ctx_index, src_pool[op.src_region], op.src_offset,
                               dst_pool[op.dst_region], op.dst_offset, op.bytes});
      out.bytes += op.bytes;
    }
  }
  return out;
}

// ---- SharedBuffer ----

struct SharedBuffer::Impl {
  std::unique_ptr<Region> region;
};

SharedBuffer::SharedBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SharedBuffer::~SharedBuffer() = default;

StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::allocate(uint64_t bytes,
                                                               std::string_view name) {
  auto region = Region::allocate(0, bytes, Region::Backing::kMemfd, "hxfer-" + std::string(name));
  if (!region.isOk()) return region.status().withContext("shared buffer " + std::string(name));
  auto impl = std::make_unique<Impl>();
  impl->region = std::move(*region);
  return std::shared_ptr<SharedBuffer>(new SharedBuffer(std::move(impl)));
}

void* SharedBuffer::data() const { return impl_->region->data(); }
uint64_t SharedBuffer::bytes() const { return impl_->region->length(); }
int SharedBuffer::fd() const { return impl_->region->fd(); }

// ---- Memory ----

namespace {

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" as nvidia-smi prints it, or "" when all zero.
std::string uuidText(const std::array<uint8_t, 16>& u) {
  if (std::all_of(u.begin(), u.end(), [](uint8_t b) { return b == 0; })) return "";
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text = "GPU-";
  for (size_t i = 0; i < u.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    text += kDigits[u[i] >> 4];
    text += kDigits[u[i] & 15];
  }
  return text;
}

std::string deviceWords(const Buffer& b) {
  const std::string uuid = uuidText(b.device_uuid);
  return "CUDA device " + std::to_string(b.device) + (uuid.empty() ? "" : " (" + uuid + ")");
}

// A kCuda buffer checked against the device runtime: InvalidArgument for a malformed one or
// one that is not memory of the device it names, Unavailable where no runtime is, each naming
// the pool and the device.
Status checkDeviceBuffer(const std::string& pool, const Buffer& b, uint64_t bytes) {
  if (b.device < 0) {
    return InvalidArgument("pool " + pool + ": CUDA buffer without a device (Buffer::device is " +
                           std::to_string(b.device) + "; give the CUDA device ordinal)");
  }
  const std::string device = deviceWords(b);
  if (b.fd != -1) {
    return InvalidArgument("pool " + pool + ": fd " + std::to_string(b.fd) +
                           " given with memory of " + device +
                           " (an fd names host memory only; give -1)");
  }
  auto rt = deviceRuntime();
  if (!rt.isOk()) {
    return Unavailable("pool " + pool + ": memory of " + device +
                       " cannot be moved here: " + rt.status().message());
  }
  auto owner = (*rt)->owner(b.data, bytes);
  if (!owner.isOk()) {
    return InvalidArgument("pool " + pool + ": the buffer is not " + str(bytes) +
                           " bytes of device memory (" + device + "): " + owner.status().message());
  }
  if (owner->ordinal != b.device) {
    return InvalidArgument("pool " + pool + ": Buffer::device is " + std::to_string(b.device) +
                           ", and the memory is CUDA device " + std::to_string(owner->ordinal) +
                           "'s");
  }
  const std::string given = uuidText(b.device_uuid);
  if (!given.empty() && owner->uuid != b.device_uuid) {
    return InvalidArgument("pool " + pool + ": Buffer::device_uuid is " + given + ", and device " +
                           std::to_string(b.device) + " is " + uuidText(owner->uuid));
  }
  return OkStatus();
}

struct RuntimeHolder {
  std::mutex mu;
  std::shared_ptr<device::DeviceApi> testing;                        // guarded by mu
  std::optional<StatusOr<std::shared_ptr<device::DeviceApi>>> made;  // guarded by mu
};

RuntimeHolder& runtimeHolder() {
  static RuntimeHolder* h = new RuntimeHolder;  // never destroyed: used until exit
  return *h;
}

}  // namespace

StatusOr<Memory> Memory::wrap(const Layout& layout, const std::map<std::string, Buffer>& buffers) {
  const RankLayout& l = layout.impl().layout;
  for (const auto& [name, buffer] : buffers) {
    if (layout.pool(name) == nullptr) {
      std::string names;
      for (const PoolInfo& p : layout.pools()) names += (names.empty() ? "" : ", ") + p.name;
      return InvalidArgument("buffer '" + name +
                             "' names no pool of the layout (its pools: " + names + ")");
    }
  }
  auto impl = std::make_shared<Impl>(layout);
  impl->shareable = true;
  std::vector<std::unique_ptr<Region>> regions;
  std::string host_pool, device_pool;  // one of each kind, to name a mix
  for (const RegionSpec& spec : l.regions) {
    auto it = buffers.find(spec.name);
    if (it == buffers.end()) return InvalidArgument("pool " + spec.name + " has no buffer");
    const Buffer& b = it->second;
    if (b.data == nullptr) return InvalidArgument("pool " + spec.name + ": null buffer");
    if (b.kind != MemoryKind::kHost && b.kind != MemoryKind::kCuda) {
      return InvalidArgument("pool " + spec.name + ": unknown MemoryKind " +
                             str(static_cast<unsigned>(b.kind)) + " (kHost 0, kCuda 1)");
    }
    if (b.bytes < spec.length) {
      return InvalidArgument("pool " + spec.name + ": buffer is " + str(b.bytes) +
                             " bytes, the pool needs " + str(spec.length));
    }
    if (b.kind == MemoryKind::kCuda) {
      RETURN_IF_ERROR(checkDeviceBuffer(spec.name, b, spec.length));
      if (!impl->device) {
        ASSIGN_OR_RETURN(impl->device, deviceRuntime());
      }
      if (device_pool.empty()) device_pool = spec.name + " (" + deviceWords(b) + ")";
    } else if (host_pool.empty()) {
      host_pool = spec.name;
    }
    if (!host_pool.empty() && !device_pool.empty()) {
      return InvalidArgument("pool " + device_pool + " is device memory and pool " + host_pool +
                             " host memory: a Memory's pools are all host or all device memory");
    }
    auto r = Region::borrow(spec.id, static_cast<uint8_t*>(b.data), spec.length, b.fd);
    if (!r.isOk()) return r.status().withContext("pool " + spec.name);
    impl->shareable = impl->shareable && b.fd >= 0;
    regions.push_back(std::move(*r));
  }
  // Each pool needs memory of its own: two that overlap would have hxfer write one pool's
  // pages through the other's (and fence them as different pages).
  std::vector<std::pair<const Region*, const std::string*>> spans;
  for (size_t i = 0; i < regions.size(); ++i)
    spans.emplace_back(regions[i].get(), &l.regions[i].name);
  std::sort(spans.begin(), spans.end(),
            [](const auto& a, const auto& b) { return a.first->data() < b.first->data(); });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Region& lo = *spans[i - 1].first;
    const Region& hi = *spans[i].first;
    if (lo.data() + lo.length() > hi.data()) {
      return InvalidArgument("pools " + *spans[i - 1].second + " and " + *spans[i].second +
                             " overlap: " + *spans[i].second + " starts " +
                             str(static_cast<uint64_t>(hi.data() - lo.data())) + " bytes into " +
                             *spans[i - 1].second + ", which is " + str(lo.length()) +
                             " bytes; each pool needs memory of its own");
    }
  }
  auto cache = HybridCacheManager::wrap(l, std::move(regions));
  if (!cache.isOk()) return cache.status();
  impl->cache = std::move(*cache);
  return Memory(std::move(impl));
}

const Layout& Memory::layout() const { return impl_->layout; }
bool Memory::shareable() const { return impl_->shareable; }
bool Memory::device() const { return impl_->device != nullptr; }

StatusOr<std::shared_ptr<device::DeviceApi>> deviceRuntime() {
  RuntimeHolder& h = runtimeHolder();
  std::lock_guard lock(h.mu);
  if (h.testing) return h.testing;
  if (!h.made) {
#ifdef HXFER_HAVE_CUDA_DEVICE
    h.made = device::createCudaDevice();
#else
    h.made = StatusOr<std::shared_ptr<device::DeviceApi>>(
        Unavailable("this build of hxfer has no CUDA (it was built without the CUDA toolkit)"));
#endif
  }
  return *h.made;
}

void setDeviceRuntimeForTesting(std::shared_ptr<device::DeviceApi> device) {
  RuntimeHolder& h = runtimeHolder();
  std::lock_guard lock(h.mu);
  h.testing = std::move(device);
}

// ---- Sender ----

namespace {

// What a Sender and a Receiver share: the Memory they fence, the release thread, and the
// shutdown protocol. `T` is the transceiver (ContextSender or GenerationReceiver).
template <typename T>
struct Endpoint {
  Layout layout;
  Memory memory;
  std::shared_ptr<Dispatcher> dispatcher;
  bool claimed = false;  // the Memory is this endpoint's (claim() succeeded)
  std::unique_ptr<T> transceiver;
  engine::BackendKind backend = engine::BackendKind::kUcx;
  std::string routing;
  const uint64_t owner = nextOwner();  // tags the pages this endpoint adopts
  // Calls that touch the pages hold it shared; shutdown() takes it once, exclusively, to mark
  // the end, so no call is half-way through when the memory is handed back.
  mutable std::shared_mutex mu;
  bool stopped = false;  // guarded by mu
  std::mutex shutdown_mu;
  std::condition_variable shutdown_cv;
  bool shutdown_started = false, shutdown_done = false;  // guarded by shutdown_mu

  Endpoint(Layout l, Memory m) : layout(std::move(l)), memory(std::move(m)) {}
  HybridCacheManager& cache() const { return *memory.impl().cache; }
  // The transceiver stays until the endpoint dies: a call racing shutdown() reaches a stopped
  // one. A second caller waits for the first, except on the release thread (a callback calling
  // back in while another thread shuts down, which waits for that callback): it returns.
  void shutdown() {
    {
      std::unique_lock lock(shutdown_mu);
      if (shutdown_started) {
        if (dispatcher && dispatcher->onThread()) return;
        shutdown_cv.wait(lock, [&] { return shutdown_done; });
        return;
      }
      shutdown_started = true;
    }
    if (transceiver) transceiver->shutdown();
    {
      std::unique_lock lock(mu);
      stopped = true;
    }
    if (dispatcher) dispatcher->stop();
    if (claimed) unclaim(memory.impl());
    std::lock_guard lock(shutdown_mu);
    shutdown_done = true;
    shutdown_cv.notify_all();
  }
  // The destructors' shutdown(): it also waits for the release thread to end (unless this is
  // it). A callback that called shutdown() left that thread running in it, and may still use
  // the endpoint; nothing of it may be destroyed before the callback returns.
  void close() {
    shutdown();
    if (dispatcher) dispatcher->finish();
  }
};

}  // namespace

struct Sender::Impl : Endpoint<engine::ContextSender> {
  using Endpoint::Endpoint;
  ~Impl() { close(); }
  // Both markReady forms; kAllLayers: the whole request at once.
  Status markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                   std::optional<uint32_t> slot, std::span<const uint32_t> group_slots,
                   LayerRange layers, std::string_view aux, const DeviceEvent* ready = nullptr);
};

Sender::Sender(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
// Before any member goes: a callback still running may use the Sender (close()).
Sender::~Sender() { impl_->close(); }

StatusOr<std::unique_ptr<Sender>> Sender::create(const Layout& layout, const Memory& memory,
                                                 SenderOptions o) {
  RETURN_IF_ERROR(positiveTimeout("lease_timeout", o.lease_timeout,
                                  "pages no generation rank asked for this long are released"));
  RETURN_IF_ERROR(positiveTimeout("stall_timeout", o.stall_timeout,
                                  "a write that makes no progress this long is cancelled"));
  auto impl = std::make_unique<Impl>(layout, memory);
  ASSIGN_OR_RETURN(Routed routed, route(o.backend, std::nullopt, memory));
  impl->backend = routed.backend;
  impl->routing = routed.reason;
  std::string listen = o.listen;
  if (routed.backend != engine::BackendKind::kUcx &&
      engine::addressBackend(listen) == engine::BackendKind::kUcx) {
    listen.clear();
  }
  if (routed.backend == engine::BackendKind::kUcx && listen.empty()) listen = "127.0.0.1:0";
  const RankLayout& l = layout.impl().layout;
  ASSIGN_OR_RETURN(o.instance,
                   engine::instanceName(o.instance, "ctx", uint64_t{l.tp} * l.pp, "instance"));
  auto agent = makeAgent(o, memory, routed.backend, listen,
                         o.instance + "-ctx" + str(l.pp_rank * l.tp + l.tp_rank));
  if (!agent.isOk()) return agent.status();

  impl->dispatcher = std::make_shared<Dispatcher>(o.on_released);
  RETURN_IF_ERROR(claim(layout, memory, impl->dispatcher, impl->owner,
                        HybridCacheManager::FenceMode::kSharedReads));
  impl->claimed = true;
  engine::ContextSender::Options so;
  so.instance_id = o.instance;
  so.model = layout.impl().model;
  so.parallel = layout.impl().parallel;
  so.tp_rank = l.tp_rank;
  so.pp_rank = l.pp_rank;
  so.checksum = o.checksum;
  so.lease_timeout = clampTimeout(o.lease_timeout);
  so.stall_timeout = clampTimeout(o.stall_timeout);
  so.stream_min_tokens = o.stream_min_tokens;
  so.device = memory.impl().device;
  if (o.on_request) {
    so.on_request = [cb = o.on_request](uint64_t id, uint64_t tokens, const Bytes& aux) {
      cb(id, tokens, std::string(aux.begin(), aux.end()));
    };
  }
  auto sender = engine::ContextSender::create(std::move(so), &impl->cache(), std::move(*agent));
  if (!sender.isOk()) return sender.status();  // ~Impl hands the memory back
  impl->transceiver = std::move(*sender);
  return std::unique_ptr<Sender>(new Sender(std::move(impl)));
}

std::string Sender::address() const { return impl_->transceiver->address(); }
std::string Sender::backend() const { return std::string(engine::backendName(impl_->backend)); }
std::string Sender::routing() const { return impl_->routing; }

Status Sender::markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                         std::optional<uint32_t> slot, std::string_view aux) {
  return impl_->markReady(request_id, blocks, slot, {}, kAllLayers, aux);
}

Status Sender::markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                         std::optional<uint32_t> slot, LayerSpan layers, std::string_view aux) {
  return impl_->markReady(request_id, blocks, slot, {}, LayerRange{layers.first, layers.count},
                          aux);
}

Status Sender::markReady(uint64_t request_id, const RankPages& pages, std::string_view aux) {
  return impl_->markReady(request_id, pages.blocks, pages.slot, pages.group_slots, kAllLayers, aux);
}

Status Sender::markReady(uint64_t request_id, const RankPages& pages, LayerSpan layers,
                         std::string_view aux) {
  return impl_->markReady(request_id, pages.blocks, pages.slot, pages.group_slots,
                          LayerRange{layers.first, layers.count}, aux);
}

Status Sender::markReady(uint64_t request_id, const RankPages& pages, DeviceEvent ready,
                         std::string_view aux) {
  return impl_->markReady(request_id, pages.blocks, pages.slot, pages.group_slots, kAllLayers, aux,
                          &ready);
}

Status Sender::markReady(uint64_t request_id, const RankPages& pages, LayerSpan layers,
                         DeviceEvent ready, std::string_view aux) {
  return impl_->markReady(request_id, pages.blocks, pages.slot, pages.group_slots,
                          LayerRange{layers.first, layers.count}, aux, &ready);
}

Status Sender::Impl::markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                               std::optional<uint32_t> slot, std::span<const uint32_t> group_slots,
                               LayerRange layers, std::string_view aux, const DeviceEvent* ready) {
  std::shared_lock lock(mu);
  if (stopped) return Unavailable("sender is shut down");
  std::shared_ptr<const device::Event> event;
  if (ready != nullptr) {
    ASSIGN_OR_RETURN(event, captureEngineEvent(memory, *ready, "request " + str(request_id)));
  }
  if (aux.size() > wire::kMaxAuxBytes) {
    return InvalidArgument("aux is " + str(aux.size()) + " bytes, limit " +
                           str(wire::kMaxAuxBytes));
  }
  HybridCacheManager& pages = cache();
  const Bytes aux_bytes(aux.begin(), aux.end());
  if (layers != kAllLayers) {
    // A later range of a streamed request: the pages are fenced already and must be the same.
    if (auto held = pages.find(request_id); held.isOk()) {
      const bool same_blocks =
          std::equal(blocks.begin(), blocks.end(), held->blocks.begin(), held->blocks.end());
      const bool same_groups = std::equal(group_slots.begin(), group_slots.end(),
                                          held->group_slots.begin(), held->group_slots.end());
      if (!same_blocks || (slot.has_value() && held->slot != slot) ||
          (slot.has_value() && !same_groups)) {
        return InvalidArgument("request " + str(request_id) + ": layers [" + str(layers.first) +
                               ", " + str(layers.end()) + ") name other pages than its first " +
                               "range (" + str(held->blocks.size()) + " blocks, slot " +
                               (held->slot ? str(*held->slot) : std::string("none")) + ", " +
                               str(held->group_slots.size()) + " group slots)");
      }
      return transceiver->markReady(request_id, layers, aux_bytes, std::move(event));
    }
  }
  const uint64_t tokens = uint64_t{blocks.size()} * pages.layout().tokens_per_block;
  if (tokens > UINT32_MAX) return InvalidArgument("too many blocks: " + str(blocks.size()));
  auto alloc =
      pages.adopt(request_id, static_cast<uint32_t>(tokens), blocks, slot, owner, 0, group_slots);
  if (!alloc.isOk()) return alloc.status();
  Status s = transceiver->markReady(request_id, layers, aux_bytes, std::move(event));
  // InvalidArgument (the range, the id) / Unavailable (shut down) leave the pages with the
  // caller: hand them back, unreported (nothing was posted).
  if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kUnavailable) {
    freeUnreported(pages, request_id);
  }
  return s;
}

Status Sender::cancel(uint64_t request_id) { return impl_->transceiver->cancel(request_id); }

bool Sender::holds(uint64_t request_id) const { return impl_->cache().find(request_id).isOk(); }

size_t Sender::connectedPeers() const { return impl_->transceiver->connectedPeers(); }

Metrics Sender::metrics() const { return toMetrics(impl_->transceiver->metrics(), impl_->cache()); }

void Sender::shutdown() { impl_->shutdown(); }

// ---- Receiver ----

struct Receiver::Impl : Endpoint<engine::GenerationReceiver> {
  using Endpoint::Endpoint;
  ~Impl() {
    close();
    if (!transceiver) return;
    std::lock_guard lock(started_mu);
    for (uint64_t id : started) (void)transceiver->release(id);
  }
  Status start(uint64_t request_id, uint32_t num_tokens, const RankPages& rank_pages,
               uint32_t prefix_tokens, std::string_view aux, const DeviceEvent* pages_free);
  // Requests started and not yet released, released when the Receiver is destroyed (nobody
  // could release them afterwards).
  std::mutex started_mu;
  std::set<uint64_t> started;  // guarded by started_mu
};

Receiver::Receiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Receiver::~Receiver() { impl_->close(); }  // as ~Sender

StatusOr<std::unique_ptr<Receiver>> Receiver::create(const Layout& layout, const Memory& memory,
                                                     ReceiverOptions o) {
  RETURN_IF_ERROR(positiveTimeout("request_timeout", o.request_timeout,
                                  "a request not complete this long fails"));
  RETURN_IF_ERROR(positiveTimeout("handshake_timeout", o.handshake_timeout,
                                  "a context rank not through its handshake this long is down"));
  if (o.peers.empty()) return InvalidArgument("peers is empty: name every context rank");
  if (o.peer_pp == 0) return InvalidArgument("peer_pp=0; it must be >= 1");
  const uint32_t n = static_cast<uint32_t>(o.peers.size());
  const uint32_t peer_tp = o.peer_tp != 0 ? o.peer_tp : n / o.peer_pp;
  if (peer_tp == 0 || uint64_t{peer_tp} * o.peer_pp != n) {
    return InvalidArgument("peers has " + str(n) + " addresses, peer_tp=" + str(peer_tp) +
                           " x peer_pp=" + str(o.peer_pp) + " context ranks expected");
  }
  ASSIGN_OR_RETURN(engine::PeerAddresses named, engine::resolvePeerAddresses(o.peers));
  const std::optional<engine::BackendKind> implied = named.backend;
  std::vector<std::string> addresses = std::move(named.addresses);
  ASSIGN_OR_RETURN(Routed routed, route(o.backend, implied, memory));
  if (implied && routed.backend != *implied) {
    return InvalidArgument("backend=" + o.backend + " but the peer addresses are " +
                           std::string(engine::backendName(*implied)));
  }
  auto impl = std::make_unique<Impl>(layout, memory);
  impl->backend = routed.backend;
  impl->routing = routed.reason;
  const RankLayout& l = layout.impl().layout;
  ASSIGN_OR_RETURN(o.instance,
                   engine::instanceName(o.instance, "gen", uint64_t{l.tp} * l.pp, "instance"));
  auto agent = makeAgent(o, memory, routed.backend,
                         routed.backend == engine::BackendKind::kUcx ? "127.0.0.1:0" : "",
                         o.instance + "-gen" + str(l.pp_rank * l.tp + l.tp_rank));
  if (!agent.isOk()) return agent.status();

  impl->dispatcher = std::make_shared<Dispatcher>(o.on_released);
  RETURN_IF_ERROR(claim(layout, memory, impl->dispatcher, impl->owner,
                        HybridCacheManager::FenceMode::kExclusive));
  impl->claimed = true;
  engine::GenerationReceiver::Options ro;
  ro.instance_id = o.instance;
  ro.model = layout.impl().model;
  ro.parallel = layout.impl().parallel;
  ro.tp_rank = l.tp_rank;
  ro.pp_rank = l.pp_rank;
  ro.checksum = o.checksum;
  ro.ctx_parallel.tp = peer_tp;
  ro.ctx_parallel.pp = o.peer_pp;
  ro.ctx_addresses = std::move(addresses);
  ro.request_timeout = clampTimeout(o.request_timeout);
  ro.staging_bytes = o.staging_bytes;
  ro.handshake_timeout = clampTimeout(o.handshake_timeout);
  ro.device = memory.impl().device;
  auto receiver =
      engine::GenerationReceiver::create(std::move(ro), &impl->cache(), std::move(*agent));
  if (!receiver.isOk()) return receiver.status();  // ~Impl hands the memory back
  impl->transceiver = std::move(*receiver);
  return std::unique_ptr<Receiver>(new Receiver(std::move(impl)));
}

std::string Receiver::backend() const { return std::string(engine::backendName(impl_->backend)); }
std::string Receiver::routing() const { return impl_->routing; }

Status Receiver::waitForPeers(std::chrono::milliseconds timeout) {
  {
    std::shared_lock lock(impl_->mu);  // not held while waiting: shutdown() takes it
    if (impl_->stopped) return Unavailable("receiver is shut down");
  }
  // One racing shutdown() is woken by the transceiver's, and answers Unavailable too.
  return impl_->transceiver->waitForPeers(engine::Clock::now() + clampTimeout(timeout));
}

Status Receiver::start(uint64_t request_id, uint32_t num_tokens, std::span<const uint32_t> blocks,
                       std::optional<uint32_t> slot, uint32_t prefix_tokens, std::string_view aux) {
  return start(request_id, num_tokens,
               RankPages{std::vector<uint32_t>(blocks.begin(), blocks.end()), slot}, prefix_tokens,
               aux);
}

Status Receiver::start(uint64_t request_id, uint32_t num_tokens, const RankPages& rank_pages,
                       uint32_t prefix_tokens, std::string_view aux) {
  return impl_->start(request_id, num_tokens, rank_pages, prefix_tokens, aux, nullptr);
}

Status Receiver::start(uint64_t request_id, uint32_t num_tokens, const RankPages& rank_pages,
                       DeviceEvent pages_free, uint32_t prefix_tokens, std::string_view aux) {
  return impl_->start(request_id, num_tokens, rank_pages, prefix_tokens, aux, &pages_free);
}

Status Receiver::Impl::start(uint64_t request_id, uint32_t num_tokens, const RankPages& rank_pages,
                             uint32_t prefix_tokens, std::string_view aux,
                             const DeviceEvent* pages_free) {
  std::shared_lock lock(mu);
  if (stopped) return Unavailable("receiver is shut down");
  std::shared_ptr<const device::Event> event;
  if (pages_free != nullptr) {
    ASSIGN_OR_RETURN(event, captureEngineEvent(memory, *pages_free, "request " + str(request_id)));
  }
  engine::EnginePages pages{rank_pages.blocks, rank_pages.slot, owner, rank_pages.group_slots};
  auto alloc = transceiver->startRequest(request_id, num_tokens, prefix_tokens,
                                         Bytes(aux.begin(), aux.end()), &pages, std::move(event));
  if (alloc.isOk()) {
    std::lock_guard ids(started_mu);
    started.insert(request_id);
  }
  return alloc.status();
}

namespace {
Result toResult(const engine::RequestResult& r) {
  Result out;
  out.state = r.state == engine::RequestResult::State::kDone     ? Result::State::kDone
              : r.state == engine::RequestResult::State::kFailed ? Result::State::kFailed
                                                                 : Result::State::kInProgress;
  out.status = r.status;
  out.bytes = r.bytes;
  out.aux.assign(r.aux.begin(), r.aux.end());
  out.latency = r.latency;
  out.queued = r.queued;
  return out;
}
}  // namespace

StatusOr<Result> Receiver::poll(uint64_t request_id) const {
  ASSIGN_OR_RETURN(engine::RequestResult r, impl_->transceiver->poll(request_id));
  return toResult(r);
}

StatusOr<Result> Receiver::wait(uint64_t request_id, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(
      engine::RequestResult r,
      impl_->transceiver->wait(request_id, engine::Clock::now() + clampTimeout(timeout)));
  return toResult(r);
}

Status Receiver::cancel(uint64_t request_id) { return impl_->transceiver->cancel(request_id); }

Status Receiver::release(uint64_t request_id) {
  Status s = impl_->transceiver->release(request_id);
  if (s.isOk()) {
    std::lock_guard ids(impl_->started_mu);
    impl_->started.erase(request_id);
  }
  return s;
}

bool Receiver::holds(uint64_t request_id) const { return impl_->cache().find(request_id).isOk(); }

Metrics Receiver::metrics() const {
  return toMetrics(impl_->transceiver->metrics(), impl_->cache());
}

void Receiver::shutdown() { impl_->shutdown(); }

}  // namespace hxfer
