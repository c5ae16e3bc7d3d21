// hxfer-gpu-check's engine row: a vllm context rank and an sglang generation rank of one
// hybrid model in this process, their pools device memory of device 0 (cudaMalloc through the
// device runtime, or the fake's), joined by a Sender and a Receiver over the cuda backend.
//
// Request 1 goes behind the engine's events: the context's "layers ready" and the generation's
// "pages free" both wait on a gate (over CUDA, a host function on an engine stream that blocks
// until the check opens it; over the fake, its engine events). For 100 ms nothing may land;
// then the gate opens and the oracle checks every generation byte. Request 2 goes without
// events and is timed. The pair orders conv state differently (vllm sd, sglang ds), so both
// go through the device pack.
#include "device/gpu_check_api.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "api/api_impl.h"
#include "device/fake_device.h"
#include "hxfer/hxfer.h"
#include "plan/oracle.h"

namespace hxfer::device {
namespace {

using namespace std::chrono_literals;

// A rank's pools: device buffers by pool name, the Memory over them, and host copies for the
// oracle.
struct Rank {
  std::optional<Layout> layout;
  std::optional<Memory> memory;
  std::map<std::string, std::unique_ptr<DeviceBuffer>> device;
  std::map<std::string, std::vector<uint8_t>> host;

  const RankLayout& rankLayout() const { return layout->impl().layout; }
  RankMemory hostMemory() {
    const RankLayout& l = rankLayout();
    RankMemory mem(l.regions.size());
    for (const RegionSpec& spec : l.regions) {
      mem[spec.id] = RegionMemory{host.at(spec.name).data(), spec.length};
    }
    return mem;
  }
};

Status copyBytes(bool fake, void* dst, const void* src, uint64_t n, cudaMemcpyKind kind) {
  if (fake) {
    std::memcpy(dst, src, n);
    return OkStatus();
  }
  const cudaError_t e = cudaMemcpy(dst, src, n, kind);
  if (e != cudaSuccess) return Internal(std::string("cudaMemcpy: ") + cudaGetErrorString(e));
  return OkStatus();
}

StatusOr<Rank> makeRank(bool fake, DeviceApi& device, const LayoutOptions& o) {
  Rank r;
  ASSIGN_OR_RETURN(Layout l, Layout::engine(o));
  r.layout = l;
  std::map<std::string, Buffer> buffers;
  for (const PoolInfo& p : l.pools()) {
    ASSIGN_OR_RETURN(r.device[p.name], device.allocateBuffer(0, p.bytes));
    r.host[p.name].assign(p.bytes, 0);
    RETURN_IF_ERROR(copyBytes(fake, r.device[p.name]->data(), r.host[p.name].data(), p.bytes,
                              cudaMemcpyHostToDevice));
    Buffer b{r.device[p.name]->data(), p.bytes, MemoryKind::kCuda};
    b.device = 0;
    buffers[p.name] = b;
  }
  ASSIGN_OR_RETURN(Memory m, Memory::wrap(l, buffers));
  r.memory = m;
  return r;
}

Status toDevice(bool fake, Rank& r) {
  for (auto& [name, bytes] : r.host) {
    RETURN_IF_ERROR(copyBytes(fake, r.device.at(name)->data(), bytes.data(), bytes.size(),
                              cudaMemcpyHostToDevice));
  }
  return OkStatus();
}

Status toHost(bool fake, Rank& r) {
  for (auto& [name, bytes] : r.host) {
    RETURN_IF_ERROR(copyBytes(fake, bytes.data(), r.device.at(name)->data(), bytes.size(),
                              cudaMemcpyDeviceToHost));
  }
  return OkStatus();
}

// The engine's work the check holds back: over CUDA a host function on an engine stream that
// waits for open(), then an event recorded behind it; over the fake an engine event.
class Gate {
 public:
  static StatusOr<std::unique_ptr<Gate>> make(FakeDevice* fake) {
    auto g = std::unique_ptr<Gate>(new Gate);
    if (fake != nullptr) {
      g->fake_event_ = fake->engineEvent();
      return g;
    }
    cudaError_t e = cudaStreamCreateWithFlags(&g->stream_, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->event_, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaLaunchHostFunc(g->stream_, &Gate::hold, g.get());
    if (e == cudaSuccess) e = cudaEventRecord(g->event_, g->stream_);
    if (e != cudaSuccess) {
      g->open();
      return Internal(std::string("the engine's gate: ") + cudaGetErrorString(e));
    }
    return g;
  }
  ~Gate() {
    open();
    if (stream_ != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }
  DeviceEvent event() const {
    return DeviceEvent{fake_event_ ? static_cast<const void*>(fake_event_.get()) : event_};
  }
  void open() {
    if (fake_event_) fake_event_->signal();
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  Gate() = default;
  static void CUDART_CB hold(void* self) {
    auto* g = static_cast<Gate*>(self);
    std::unique_lock lock(g->mu_);
    g->cv_.wait(lock, [&] { return g->open_; });
  }
  std::shared_ptr<ManualEvent> fake_event_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

Status checkRequest(bool fake, Rank& gen, const RankPages& pages, uint64_t id, uint32_t tokens) {
  RETURN_IF_ERROR(toHost(fake, gen));
  ASSIGN_OR_RETURN(
      OracleReport report,
      checkRank(gen.rankLayout(), gen.hostMemory(), RankIds{pages.blocks, *pages.slot}, id,
                BlockRange{0, static_cast<uint32_t>(pages.blocks.size()), tokens}, tokens));
  if (!report.ok()) return Corruption("request " + std::to_string(id) + ": " + report.toString());
  return OkStatus();
}

Status run(bool fake, const std::string& model, uint32_t tokens, const std::string& backend,
           uint64_t staging_bytes, ApiResult* out) {
  ASSIGN_OR_RETURN(std::shared_ptr<DeviceApi> device, deviceRuntime());
  auto* fake_device = fake ? dynamic_cast<FakeDevice*>(device.get()) : nullptr;
  LayoutOptions o;
  o.model = model;
  o.tokens_per_block = 1040;  // what vLLM 0.32 picks for this model with FlashAttention
  const uint32_t blocks = (tokens + o.tokens_per_block - 1) / o.tokens_per_block;
  o.num_blocks = blocks + 2;
  o.num_slots = 2;
  o.kv_dtype = "bf16";
  o.conv_dtype = "bf16";
  o.ssm_dtype = "fp32";
  LayoutOptions ctx_o = o, gen_o = o;
  ctx_o.engine = "vllm";
  ctx_o.conv_layout = "sd";
  gen_o.engine = "sglang";
  ASSIGN_OR_RETURN(Rank ctx, makeRank(fake, *device, ctx_o));
  ASSIGN_OR_RETURN(Rank gen, makeRank(fake, *device, gen_o));
  RankPages ctx_pages, gen_pages;
  for (uint32_t b = 0; b < blocks; ++b) {
    ctx_pages.blocks.push_back(blocks - b);  // scattered, none the reserved 0
    gen_pages.blocks.push_back(b + 1);
  }
  ctx_pages.slot = 1;
  gen_pages.slot = 1;
  {
    std::vector<Layout> from{*ctx.layout};
    std::vector<RankPages> from_pages{ctx_pages};
    auto plan = planTransfer(from, from_pages, *gen.layout, gen_pages, tokens);
    out->packed = plan.status().code() == StatusCode::kIncompatible;
  }

  SenderOptions so;
  so.instance = "gpu-check-ctx";
  so.token = "gpu-check";
  so.backend = backend;
  ReceiverOptions ro;
  ro.instance = "gpu-check-gen";
  ro.token = "gpu-check";
  ro.backend = backend;
  if (backend == "ucx") {
    so.ucx_options = ro.ucx_options = {{"TLS", "tcp"}};  // as between hosts
    ro.staging_bytes = staging_bytes;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Sender> tx, Sender::create(*ctx.layout, *ctx.memory, so));
  ro.peers = {tx->address()};
  ASSIGN_OR_RETURN(std::unique_ptr<Receiver> rx, Receiver::create(*gen.layout, *gen.memory, ro));
  RETURN_IF_ERROR(rx->waitForPeers(20s));
  if (rx->backend() != backend) return Internal("routed to " + rx->backend() + ", not " + backend);

  // Request 1, behind the gate.
  RETURN_IF_ERROR(fillRank(ctx.rankLayout(), ctx.hostMemory(), RankIds{ctx_pages.blocks, 1}, 1));
  RETURN_IF_ERROR(toDevice(fake, ctx));
  ASSIGN_OR_RETURN(std::unique_ptr<Gate> gate, Gate::make(fake_device));
  RETURN_IF_ERROR(tx->markReady(1, ctx_pages, gate->event()));
  RETURN_IF_ERROR(toHost(fake, gen));
  const auto before = gen.host;
  RETURN_IF_ERROR(rx->start(1, tokens, gen_pages, gate->event()));
  std::this_thread::sleep_for(100ms);
  ASSIGN_OR_RETURN(Result pending, rx->poll(1));
  RETURN_IF_ERROR(toHost(fake, gen));
  out->fence_held = pending.state == Result::State::kInProgress && gen.host == before;
  gate->open();
  ASSIGN_OR_RETURN(Result first, rx->wait(1, 60s));
  if (!first.ok()) return first.status.withContext("request 1");
  Status exact = checkRequest(fake, gen, gen_pages, 1, tokens);
  RETURN_IF_ERROR(rx->release(1));
  for (int i = 0; i < 500 && tx->holds(1); ++i) std::this_thread::sleep_for(10ms);

  // Request 2, timed.
  RETURN_IF_ERROR(fillRank(ctx.rankLayout(), ctx.hostMemory(), RankIds{ctx_pages.blocks, 1}, 2));
  RETURN_IF_ERROR(toDevice(fake, ctx));
  RETURN_IF_ERROR(tx->markReady(2, ctx_pages));
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(rx->start(2, tokens, gen_pages));
  ASSIGN_OR_RETURN(Result second, rx->wait(2, 60s));
  out->ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!second.ok()) return second.status.withContext("request 2");
  out->bytes = second.bytes;
  if (exact.isOk()) exact = checkRequest(fake, gen, gen_pages, 2, tokens);
  out->exact = exact.isOk();
  if (!exact.isOk()) out->why = exact.toString();
  RETURN_IF_ERROR(rx->release(2));
  rx.reset();
  tx.reset();
  out->ran = true;
  return OkStatus();
}

// The two processes of fakeAcross: a vllm context rank (conv sd) and an sglang generation
// rank, `requests` requests of kAcrossTokens tokens, request i in pages of its own on each side.
constexpr uint32_t kAcrossTokens = 60;

LayoutOptions acrossOptions(bool context, uint32_t requests) {
  LayoutOptions o;
  o.engine = context ? "vllm" : "sglang";
  if (context) o.conv_layout = "sd";
  o.num_blocks = 2 * requests + 2;
  o.num_slots = requests + 1;
  o.conv_dtype = "bf16";
  o.ssm_dtype = "fp32";
  return o;
}

RankPages acrossPages(bool context, uint64_t id) {
  const auto b = static_cast<uint32_t>(2 * id);
  // Each side's blocks in another order, so that no run merges by accident.
  return context ? RankPages{{b + 1, b}, static_cast<uint32_t>(id)}
                 : RankPages{{b, b + 1}, static_cast<uint32_t>(id)};
}

// Both sides' transport: ucx over tcp, as between two hosts.
void acrossTransport(TransportOptions& o, const char* instance) {
  o.instance = instance;
  o.token = "gpu-check";
  o.backend = "ucx";
  o.ucx_options = {{"TLS", "tcp"}};
}

Status acrossContext(DeviceApi& device, const std::string& listen, uint32_t requests) {
  ASSIGN_OR_RETURN(Rank ctx, makeRank(true, device, acrossOptions(true, requests)));
  SenderOptions so;
  acrossTransport(so, "across-ctx");
  so.listen = listen;
  ASSIGN_OR_RETURN(std::unique_ptr<Sender> tx, Sender::create(*ctx.layout, *ctx.memory, so));
  for (uint64_t id = 1; id <= requests; ++id) {
    const RankPages pages = acrossPages(true, id);
    RETURN_IF_ERROR(
        fillRank(ctx.rankLayout(), ctx.hostMemory(), RankIds{pages.blocks, *pages.slot}, id));
  }
  RETURN_IF_ERROR(toDevice(true, ctx));
  for (uint64_t id = 1; id <= requests; ++id) {
    RETURN_IF_ERROR(tx->markReady(id, acrossPages(true, id)));
  }
  std::printf("context listening on %s (%s)\n", tx->address().c_str(), tx->routing().c_str());
  std::fflush(stdout);
  uint32_t answered = 0;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (std::chrono::steady_clock::now() < deadline) {
    answered = 0;
    for (uint64_t id = 1; id <= requests; ++id) answered += tx->holds(id) ? 0 : 1;
    if (answered == requests) break;
    std::this_thread::sleep_for(20ms);
  }
  std::printf("context: %u of %u answered\n", answered, requests);
  return answered == requests ? OkStatus() : Timeout("not every request was answered");
}

Status acrossGeneration(DeviceApi& device, const std::string& peer, uint32_t requests) {
  ASSIGN_OR_RETURN(Rank gen, makeRank(true, device, acrossOptions(false, requests)));
  // The first half of the requests staged whole, the rest (by a receiver started again, with a
  // 4 KiB staging region) window by window.
  const uint64_t whole = (requests + 1) / 2;
  std::unique_ptr<Receiver> rx;
  uint32_t exact = 0;
  uint64_t bytes = 0;
  for (uint64_t id = 1; id <= requests; ++id) {
    if (id == 1 || id == whole + 1) {
      rx.reset();
      ReceiverOptions ro;
      acrossTransport(ro, "across-gen");
      ro.peers = {peer};
      if (id > whole) ro.staging_bytes = 4096;
      ASSIGN_OR_RETURN(rx, Receiver::create(*gen.layout, *gen.memory, ro));
      RETURN_IF_ERROR(rx->waitForPeers(30s));
    }
    const RankPages pages = acrossPages(false, id);
    RETURN_IF_ERROR(rx->start(id, kAcrossTokens, pages));
    ASSIGN_OR_RETURN(Result r, rx->wait(id, 60s));
    if (!r.ok()) return r.status.withContext("request " + std::to_string(id));
    bytes += r.bytes;
    Status s = checkRequest(true, gen, pages, id, kAcrossTokens);
    if (s.isOk()) {
      ++exact;
    } else {
      std::fprintf(stderr, "%s\n", s.toString().c_str());
    }
    RETURN_IF_ERROR(rx->release(id));
  }
  std::printf(
      "generation: %u of %u exact, %llu bytes, %llu staged whole, %llu in 1 KiB windows (%s)\n",
      exact, requests, static_cast<unsigned long long>(bytes),
      static_cast<unsigned long long>(std::min<uint64_t>(whole, requests)),
      static_cast<unsigned long long>(requests - std::min<uint64_t>(whole, requests)),
      rx ? rx->routing().c_str() : "");
  return exact == requests ? OkStatus() : Corruption("not every request arrived exact");
}

}  // namespace

int fakeAcross(const std::string& side, const std::string& address, uint32_t requests) {
  auto fake = std::make_shared<FakeDevice>();
  setDeviceRuntimeForTesting(fake);
  Status s = side == "ctx"   ? acrossContext(*fake, address, requests)
             : side == "gen" ? acrossGeneration(*fake, address, requests)
                             : InvalidArgument("--fake-across " + side + ": not ctx or gen");
  setDeviceRuntimeForTesting(nullptr);
  if (!s.isOk()) std::printf("fake across %s: %s\n", side.c_str(), s.toString().c_str());
  return s.isOk() ? 0 : 1;
}

ApiResult apiCheck(bool fake, const std::string& model, uint32_t tokens, const std::string& backend,
                   uint64_t staging_bytes) {
  ApiResult out;
  if (fake) setDeviceRuntimeForTesting(std::make_shared<FakeDevice>());
  Status s = run(fake, model, tokens, backend, staging_bytes, &out);
  if (fake) setDeviceRuntimeForTesting(nullptr);
  if (!s.isOk()) {
    out.ran = false;
    out.why = s.toString();
  }
  return out;
}

}  // namespace hxfer::device
