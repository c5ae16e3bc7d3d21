// hxfer's public API: what a serving engine includes to move the cache state of a hybrid model
// out of its own pools on a context (prefill) instance and into its own pools on a generation
// (decode) instance (docs/api.md). Everything outside include/hxfer/ is internal.
//
//   Layout    one rank's cache as the engine lays it out (an engine by name with options).
//   Memory    the engine's buffers for that layout, one per pool, registered without a copy.
//   Sender    the context rank: markReady(id, blocks, slot, aux) once prefill wrote the pages.
//   Receiver  the generation rank: start(id, num_tokens, blocks, slot), then wait/poll, release.
//
// Page lifetime contract (docs/api.md): hxfer never allocates or frees engine pages; it fences
// them. The blocks and slot named in markReady()/start() are hxfer's to touch from that call
// until hxfer reports the request released: holds(id) turns false and the on_released
// callback runs with the id. A cancelled, failed or timed-out request stays fenced until every
// write into or out of its pages has reached a terminal state. A page still fenced is refused
// (InvalidArgument naming it and its request) when the engine names it for another request
// on a Receiver; a Sender only reads, so its requests may share pages (a cached prefix).
//   Sender:   released once every generation rank that asked got its answer, or on cancel(),
//             lease expiry or shutdown(), each after the writes out of the pages ended.
//   Receiver: a request that succeeded (Result::ok) is the engine's to read; release(id)
//             releases its pages. A failed or cancelled one is released by hxfer itself once
//             no write into it can still land; release(id) then only forgets the result.
//
// Errors: every call returns Status/StatusOr (hxfer/status.h); messages name the field and the
// value. Thread-safety: every method of Sender and Receiver may be called from any thread;
// on_released runs on a thread of its own, without hxfer's locks held, and may call back into
// the Sender or Receiver (shutdown too, but must not destroy it); on_request runs on the
// progress thread, must not block for long and must not call shutdown. Layout and Memory are values
// (shared handles), safe to copy and share.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hxfer/record_dim.h"
#include "hxfer/status.h"

namespace hxfer {

inline constexpr int kApiVersion = 1;

// ---- Layout ----

struct LayoutOptions {
  // How the engine lays its cache out (docs/layouts.md): "hxfer", "trtllm-v1", "trtllm-v2",
  // "vllm", "sglang"; kv_layout "nhd" | "hnd" (vllm, trtllm-v2), conv_layout "sd" | "ds"
  // (vllm), state_layout "paged" | "layer-major" (hxfer), shared_tensors "on" | "off" (vllm:
  // the hybrid manager's tensors shared by one layer of every KV cache group, blocks and
  // states from one pool of num_blocks ids, a state id per group). Empty: the default.
  std::string engine = "hxfer";
  std::string kv_layout, conv_layout, state_layout, shared_tensors;
  // A preset name (`hxfer models`) or the path of a Hugging Face config.json; empty: the
  // default preset.
  std::string model;
  uint32_t tp = 1, tp_rank = 0, pp = 1, pp_rank = 0;
  // The engine's pool capacities on this rank: kv blocks and recurrent-state slots.
  uint32_t num_blocks = 0, num_slots = 0;
  uint32_t tokens_per_block = 32;
  // "fp32" | "fp16" | "bf16" | "fp8"; empty: the engine's default: the config's torch_dtype,
  // ssm fp32 for hxfer, sglang and (vllm) NemotronH, the model dtype for vllm's other models
  // and trtllm; sglang conv bf16 (docs/layouts.md).
  std::string kv_dtype, conv_dtype, ssm_dtype;
};

// One pool (region) of a rank's layout: the buffer the engine registers under `name`.
// `shape`/`strides` (bytes) describe it as rows of the pool's outermost index: blocks, slots
// or layers, whichever its records are strided by last.
struct PoolInfo {
  std::string name;  // "kv0", "layer.3", "k.5", "conv0", ... (stable per engine)
  uint64_t bytes = 0;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;
};

// Where one layer's records of one role lie in a pool, element by element: what an engine (or
// a test computing a real model) needs to read and write the cache in this layout. The record
// of index i (a block for kv, a slot for conv/ssm) starts at byte `offset + i * index_stride`
// of pool `pool`. Inside it, dims are named logically (kv: "kv", "head", "token", "dim"; conv:
// "channel", "window"; mamba2 ssm: "head", "head_dim", "state"; gdn ssm: "head", "key",
// "value"; mamba1 ssm: "channel", "state"), listed outermost first as the engine declares the
// tensor, each with its size on this rank and byte stride. The unit dim ("head" or "channel")
// holds the rank's units of every section; RecordSection places them: local unit u of the
// section starts at byte `base + u * unit_stride` of the record, and its element c along the
// unit dim (c < unit_len) at `+ c * within_stride`; inner dims add index x stride.
struct RecordSection {
  std::string name;         // "K", "V", "x", "B", "C", "Q", "heads", "channels"
  uint32_t first_unit = 0;  // the global unit of local unit 0 (TP sharding)
  uint32_t units = 0;       // units of the section on this rank
  uint32_t unit_len = 0;    // elements of one unit along the unit dim
  uint64_t base = 0, unit_stride = 0, within_stride = 0;
};
struct RecordPart {
  std::string pool;
  uint64_t offset = 0;
  uint64_t index_stride = 0;
  uint32_t num_indices = 0;
  // conv/ssm: which of a request's state ids indexes the record (0: RankPages::slot, g > 0:
  // group_slots[g - 1]); 0 for kv.
  uint32_t state_group = 0;
  std::string dtype;  // "fp32", "fp16", "bf16", "fp8"
  uint32_t element_bytes = 0;
  std::vector<RecordDim> dims;
  std::vector<RecordSection> sections;
};

// Global layer ids [first, first + count): a pp stage's layers (Layout::stageLayers), or the
// layers of a request that prefill has finished (streaming, Sender::markReady with layers).
struct LayerSpan {
  uint32_t first = 0;
  uint32_t count = 0;
};

// A layout described record by record, from the tensors an engine registers (its data pointer,
// shape, strides and dtype, and what each dim means): no engine version is hard-coded. It is
// Layout::records() read the other way: one RecordSpec per (global layer, role) of this rank
// (two for kv where K and V lie apart, each naming its section), in pools the engine owns.
struct PoolSpec {
  std::string name;  // the engine's name for the buffer (e.g. "shared.0", "kv_cache")
  uint64_t bytes = 0;
};
struct RecordSpec {
  uint32_t layer = 0;   // global layer id
  std::string role;     // "kv", "conv" or "ssm"
  std::string pool;     // a PoolSpec name
  uint64_t offset = 0;  // the record of index 0 starts at this byte of the pool
  // Bytes between the records of consecutive indices (blocks for kv, state ids for conv/ssm).
  uint64_t index_stride = 0;
  uint32_t state_group = 0;  // conv/ssm: which of a request's state ids indexes it (RecordPart)
  // kv only: "K" or "V" for a part holding one of them; empty: every section of the role.
  std::string section;
  // Logical dims (RecordPart::dims: kv "kv", "head", "token", "dim"; conv "channel", "window";
  // mamba2 ssm "head", "head_dim", "state"; gdn ssm "head", "key", "value"; mamba1 ssm
  // "channel", "state"), outermost first as the tensor is laid out, sizes on this rank, byte
  // strides; an inner dim may be split (named again, mixed radix: docs/layouts.md).
  std::vector<RecordDim> dims;
};
struct LayoutDescription {
  // model, tp, tp_rank, pp, pp_rank, num_blocks, num_slots, tokens_per_block and the dtypes
  // (empty: the config's; ssm: fp32); `engine` is a label for describe() ("vllm-tensors").
  LayoutOptions options;
  std::vector<PoolSpec> pools;
  std::vector<RecordSpec> records;
  // Layout::stateGroups() and jointIds(): vLLM's hybrid manager gives each group of Mamba
  // layers a state id of its own, drawn from the block pool (num_slots == num_blocks).
  uint32_t state_groups = 1;
  bool joint_ids = false;
};

class Layout {
 public:
  // Errors name the option and the value: an unknown engine or option, a model that is not a
  // preset or readable config, a tp/pp the model does not shard into, zero capacities where
  // the rank needs them, vllm with a Mamba page larger than the attention page.
  static StatusOr<Layout> engine(const LayoutOptions& options);
  // Errors name the record and the field: a pool that does not exist, a record of a layer or
  // role this rank does not hold, a section described twice or not at all, dims that are not
  // the role's or do not hold the rank's units (sizes at this tp), elements or records that
  // overlap or run past their pool.
  static StatusOr<Layout> fromRecords(const LayoutDescription& description);
  // The description a layout made by fromRecords was made from (nullptr for engine()).
  const LayoutDescription* description() const;

  const LayoutOptions& options() const;
  // Ids the engine never hands to a request (vllm: the null block 0; sglang: the dummy page 0
  // and slot 0); empty for hxfer's, TensorRT-LLM's and described layouts.
  std::vector<uint32_t> reservedBlocks() const;
  std::vector<uint32_t> reservedSlots() const;
  const std::vector<PoolInfo>& pools() const;
  // nullptr when no pool has that name.
  const PoolInfo* pool(std::string_view name) const;
  bool hasKv() const;     // the rank holds attention layers (blocks are used)
  bool hasState() const;  // the rank holds recurrent layers (a slot is used)
  // State ids a request has on this rank (RankPages::slot and group_slots): 1, or with vllm's
  // shared tensors one per group of Mamba layers, drawn from the block pool (jointIds()).
  uint32_t stateGroups() const;
  bool jointIds() const;  // block and state ids share one pool of num_blocks ids
  // Blocks that num_tokens tokens occupy on this rank (0 without attention layers).
  uint32_t blocksFor(uint32_t num_tokens) const;
  // The records of global layer `layer` for `role` ("kv", "conv" or "ssm") on this rank: one
  // part, or two where K and V live in pools of their own. NotFound when this rank holds no
  // such record (another pp stage, or a layer without that role); InvalidArgument for a role.
  StatusOr<std::vector<RecordPart>> records(uint32_t layer, std::string_view role) const;
  // Global layer ids this rank holds records of (its pp stage's layers with a cache).
  std::vector<uint32_t> layers() const;
  // Every global layer of this rank's pp stage, cache or not: the span streamed ranges cover.
  LayerSpan stageLayers() const;
  // "vllm(kv=nhd,conv=sd) nemotron-h-8b tp=2 rank 0 pp=1 rank 0, 64 blocks x 32 tokens, 8 slots"
  std::string describe() const;
  bool operator==(const Layout& other) const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  explicit Layout(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// ---- Plans: hxfer's planner for an engine (or a benchmark) that moves the bytes itself ----

// One rank's pages of one request: its kv blocks in token order and its state slot (needed
// where the rank holds recurrent layers), and the state ids of groups 1.. where the layout has
// several (Layout::stateGroups() - 1 of them; vllm shared tensors: one per Mamba group, in
// vLLM's KV cache group order, `slot` being the first Mamba group's).
struct RankPages {
  std::vector<uint32_t> blocks;
  std::optional<uint32_t> slot;
  std::vector<uint32_t> group_slots{};
};

// One copy: `bytes` from pool `src_pool` of source rank `source` at `src_offset` into pool
// `dst_pool` of the destination at `dst_offset`. Pools are indices into Layout::pools().
struct Fragment {
  uint32_t source = 0;  // index into planTransfer's `sources`
  uint32_t src_pool = 0;
  uint64_t src_offset = 0;
  uint32_t dst_pool = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

struct TransferPlan {
  std::vector<Fragment> fragments;  // by source, each source's in the order hxfer posts them
  uint64_t bytes = 0;               // sum of the fragments' bytes
};

// The copies that move one request from a context instance (`sources`: every rank of it, any
// order, with that rank's pages) into one generation rank: the same fragments a Sender writes
// (maximal runs contiguous on both sides), so that running them in any order writes every
// destination byte of the request's records exactly once (kv of the blocks past
// prefix_tokens, the slot's state) and nothing else. The destination needs
// destination.blocksFor(num_tokens) blocks. Errors name the field and value: layouts that are
// not compatible or not one whole instance (as a Receiver's handshake would refuse), page
// counts or ids that do not fit the pools, a missing slot; Incompatible where the two sides
// order elements differently inside a state record (vllm conv sd against ds): that plan needs
// a local staging copy on the context rank, which fragments do not express.
StatusOr<TransferPlan> planTransfer(std::span<const Layout> sources,
                                    std::span<const RankPages> source_pages,
                                    const Layout& destination, const RankPages& destination_pages,
                                    uint32_t num_tokens, uint32_t prefix_tokens = 0);

// ---- Memory ----

// An event the engine recorded on its CUDA stream (a cudaEvent_t; in Python a torch.cuda.Event),
// for pools in device memory. hxfer captures it when it is passed (its own stream waits for it
// and records an event of hxfer's), so the engine may record it again or destroy it after the
// call.
struct DeviceEvent {
  const void* cuda_event = nullptr;
};

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// One engine buffer: `bytes` at `data`. `fd` (-1: none) is a memfd whose offset 0 is `data`,
// sealed against shrinking and growing (SharedBuffer makes such); with it the shm transport can
// share the buffer with same-host peers, without it traffic goes through UCX.
//
// kCuda: `data` is CUDA device memory of the device whose ordinal in this process is `device`
// (as torch's tensor.device.index), `device_uuid` its UUID where the engine knows it (all
// zero: not given), and `fd` is -1. Such pools move between ranks on one host over the cuda
// backend (docs/gpu.md): a batched device copy into the peer's mapped pages, after a pack on
// the context rank's device where the two sides order a state record's elements differently.
// Not built for them yet: staging across hosts and checksums; each is refused naming what is
// missing.
struct Buffer {
  void* data = nullptr;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int fd = -1;
  int device = -1;                        // kCuda only
  std::array<uint8_t, 16> device_uuid{};  // kCuda only; as cudaDeviceProp::uuid
};

// Host memory the shm transport can share: a sealed memfd mapped here, pre-faulted. An engine
// that wants the same-host shm path takes its pools from these.
class SharedBuffer {
 public:
  // ResourceExhausted when the memory cannot be had.
  static StatusOr<std::shared_ptr<SharedBuffer>> allocate(uint64_t bytes,
                                                          std::string_view name = "pool");
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  void* data() const;
  uint64_t bytes() const;
  int fd() const;
  Buffer buffer() const { return Buffer{data(), bytes(), MemoryKind::kHost, fd()}; }

 private:
  struct Impl;
  explicit SharedBuffer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The engine's buffers for one Layout, one per pool by name, registered without a copy.
// REQUIRES: the buffers stay valid while any Sender or Receiver made from this Memory lives.
// One Sender or Receiver uses a Memory at a time (it holds the page fences).
class Memory {
 public:
  // InvalidArgument naming the pool: a pool without a buffer, a buffer for no pool, a buffer
  // smaller than its pool (both sizes), a null pointer, a kind that is neither kHost nor
  // kCuda, a kCuda buffer without a device ordinal or with an fd, one whose pool's bytes are
  // not memory of the device it names (or of another UUID), pools of both kinds in one
  // Memory, an fd that does not map the buffer from offset 0. Unavailable naming the pool and
  // the device: a kCuda buffer where there is no CUDA (no driver or device, or a build
  // without the toolkit). PermissionDenied: an fd that is not a memfd sealed against
  // shrinking and growing.
  static StatusOr<Memory> wrap(const Layout& layout, const std::map<std::string, Buffer>& buffers);

  const Layout& layout() const;
  // Every pool has an fd (shm can share it).
  bool shareable() const;
  // The pools are CUDA device memory (kCuda buffers): backend auto picks cuda.
  bool device() const;

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  explicit Memory(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// ---- Shared by both sides ----

struct Metrics {
  uint64_t requests_started = 0, requests_ok = 0, requests_failed = 0, requests_cancelled = 0;
  uint64_t bytes = 0, ops = 0, leases_expired = 0, quarantined_requests = 0, peers_lost = 0;
  uint64_t handshakes_ok = 0, handshakes_refused = 0, accounting_errors = 0;
  // Requests whose pages hxfer fences now (markReady/start up to released).
  uint64_t requests_held = 0;
  double latency_p50_us = 0, latency_p99_us = 0;
  std::string json;  // every counter of the rank, one JSON object
};

struct TransportOptions {
  // "auto" | "shm" | "ucx" | "inproc" (same process only) | "cuda" (device memory, same
  // host). auto: cuda when the memory is device memory, shm when it is shareable (Sender),
  // the backend the peers' addresses name (Receiver). routing() says which was chosen and why.
  std::string backend = "auto";
  // Where to listen (Sender): ucx "ip:port" (port 0 picks one), shm an abstract socket name;
  // empty, or an ip:port when shm was chosen: a generated name.
  std::string listen;
  // Both sides prove they hold it before any memory or message crosses; empty: no token
  // (anyone who can reach the address may connect; a warning is logged).
  std::string token;
  // Names this serving instance in logs and the handshake; every rank of an instance gives the
  // same name. Empty (the default): a name unique to this process, for an instance of one rank
  // only (a context rank holds each request id for one generation instance, so two instances
  // must never share a name; an instance of several ranks must name itself).
  std::string instance;
  // Hash every request's bytes on the sender, verify on the receiver. Host memory only:
  // create() refuses it with device memory (Incompatible).
  bool checksum = false;
  // UCX settings applied on top of UCX_* environment variables, e.g. {"TLS", "tcp"}.
  std::vector<std::pair<std::string, std::string>> ucx_options;
  // Called with the id of every request whose pages hxfer released (see the contract above).
  std::function<void(uint64_t request_id)> on_released;
};

// ---- Sender (context rank) ----

struct SenderOptions : TransportOptions {
  // Pages marked ready that not every overlapping generation rank asked for within this time
  // are released (Metrics::leases_expired); between two windows of a staged part (device
  // pools behind ucx) it runs from the last window answered. Positive (create() refuses 0 or
  // less).
  std::chrono::milliseconds lease_timeout{30000};
  // A write to a generation rank (or, device pools behind ucx, the device's copy of a part into
  // host memory, counted from when the copies queued ahead of it are done) that made no
  // progress within this time is cancelled and its request part answered Timeout
  // (`writes_stalled` in Metrics::json). Positive (create() refuses 0 or less).
  std::chrono::milliseconds stall_timeout{30000};
  // Streamed requests (markReady with layers) shorter than this many tokens go whole after
  // their last range: below it, per-write overheads outweigh what streaming hides.
  uint64_t stream_min_tokens = 512;
  // Called when the first generation rank asks for a request id, with its prompt length and
  // aux bytes; it may call markReady().
  std::function<void(uint64_t request_id, uint64_t num_tokens, const std::string& aux)> on_request;
};

class Sender {
 public:
  // Errors: `memory` made for another layout; a backend the memory or build cannot use (shm
  // with private memory names both); listen failures; a timeout option of 0 or less.
  static StatusOr<std::unique_ptr<Sender>> create(const Layout& layout, const Memory& memory,
                                                  SenderOptions options);
  // shutdown(), then waits for an on_released callback still running (one that called
  // shutdown() may go on using the Sender).
  ~Sender();
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // "shm:<name>", "ucx:<ip>:<port>", "inproc:<name>" or "cuda:<name>": what a Receiver's
  // peers list holds.
  std::string address() const;
  std::string backend() const;
  std::string routing() const;  // the backend choice and its reason, one line

  // Prefill state of `request_id` is in `blocks` (the request's block table, in token order)
  // and `slot`: hxfer fences them until it releases the request. `aux` (at most 16 KiB,
  // e.g. the first sampled token) reaches every generation rank with the result.
  // Pages are only read here, so requests may share them (a cached prompt prefix): a page
  // stays fenced until the last request naming it is released.
  // InvalidArgument: a page outside its pool or listed twice (naming it), a known id, aux too
  // large, no slot on a rank with recurrent layers. Unavailable after shutdown(). Either
  // answer means the call took nothing: no release of its pages follows.
  // Cancelled / Timeout: cancelled before, or every asker gave up (the pages are released).
  Status markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                   std::optional<uint32_t> slot, std::string_view aux = {});
  // Streaming: `layers` of the request are final while prefill still writes the later ones;
  // hxfer sends them as soon as the request is asked for (requests of at least stream_min_tokens;
  // shorter ones go whole after the last range). Ranges come in order without gaps from this
  // rank's first layer (they may overlap); the one reaching its last layer ends the marking,
  // and its `aux` is the one sent. The first call fences `blocks` and `slot` as markReady
  // does; later calls name the same pages (InvalidArgument naming the difference otherwise).
  // The pages stay fenced at least until the last range (or cancel()), even when the request
  // ends before: never released under a running prefill. InvalidArgument naming the range
  // (empty, past this rank's layers, marked already, leaving a gap). A request that ended
  // between ranges (timed out) is reported, and released, at the next call.
  Status markReady(uint64_t request_id, std::span<const uint32_t> blocks,
                   std::optional<uint32_t> slot, LayerSpan layers, std::string_view aux = {});
  // Both forms with the pages as one value, the form for layouts whose requests have several
  // state ids (Layout::stateGroups() > 1: `pages.group_slots`); the forms above give none.
  // InvalidArgument also for the wrong number of group slots, or a state id that is also a
  // block (jointIds()), naming it.
  Status markReady(uint64_t request_id, const RankPages& pages, std::string_view aux = {});
  Status markReady(uint64_t request_id, const RankPages& pages, LayerSpan layers,
                   std::string_view aux = {});
  // Device pools: markReady with `ready`, the engine's event after the kernels that write the
  // request's pages (all its layers, or `layers`). No byte of them moves before the event is
  // done, so the engine need not synchronize its stream first; a later range's event stands
  // for every layer up to that range. InvalidArgument: pools in host memory, a null event, one
  // the device cannot wait for; otherwise as the forms above.
  Status markReady(uint64_t request_id, const RankPages& pages, DeviceEvent ready,
                   std::string_view aux = {});
  Status markReady(uint64_t request_id, const RankPages& pages, LayerSpan layers, DeviceEvent ready,
                   std::string_view aux = {});
  // Cancels at any point; always ok; idempotent.
  Status cancel(uint64_t request_id);
  // Whether hxfer still fences the pages of `request_id`.
  bool holds(uint64_t request_id) const;
  size_t connectedPeers() const;
  Metrics metrics() const;
  // Ends every request (its pages released once its writes stopped) and disconnects; releases
  // up to its return are reported, later ones not (holds() still tells). Other calls racing
  // it return Unavailable. Idempotent; may be called from on_released (the Sender must then
  // not be destroyed inside the callback).
  void shutdown();

  struct Impl;

 private:
  explicit Sender(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- Receiver (generation rank) ----

struct ReceiverOptions : TransportOptions {
  // The context instance's ranks, index pp_rank * peer_tp + tp_rank, as Sender::address()
  // gives them ("ip:port" alone is read as ucx).
  std::vector<std::string> peers;
  uint32_t peer_tp = 0;  // 0: peers.size() / peer_pp
  uint32_t peer_pp = 1;
  // A request not complete this long after start() fails (Timeout); a context rank not through
  // its handshake this long after connecting is dropped and tried again. Both positive
  // (create() refuses 0 or less).
  std::chrono::milliseconds request_timeout{30000};
  std::chrono::milliseconds handshake_timeout{10000};
  // Storm control: a registered region of this many bytes into which a context rank writes a
  // request part of many small ops (NHD or token-major kv at TP mismatch) as one write, which
  // this rank then scatters into the pages; only over transports whose per-op cost is above a
  // memcpy call (ucx), never over cuda. Device pools behind ucx take every part through it:
  // whole, or window by window for a part larger than the region; 0 is refused there
  // (docs/engine.md). 0: never.
  uint64_t staging_bytes = 64ull << 20;
};

struct Result {
  enum class State : uint8_t { kInProgress, kDone, kFailed };
  State state = State::kInProgress;
  Status status;                        // ok when kDone; why when kFailed
  uint64_t bytes = 0;                   // bytes received (kDone)
  std::string aux;                      // what the context side gave markReady (kDone)
  std::chrono::nanoseconds latency{0};  // start() to the end (kDone, kFailed)
  // Of latency, the time before the request's first ask went to a context rank (all of it when
  // none went): waiting for a context rank's connection, for the engine's pages-free event, or
  // for staging room. latency - queued is the transfer, from the first ask to the end.
  std::chrono::nanoseconds queued{0};
  bool ok() const { return state == State::kDone; }
  bool terminal() const { return state != State::kInProgress; }
};

class Receiver {
 public:
  // Errors: `memory` made for another layout; peers that do not match peer_tp x peer_pp;
  // addresses of mixed or unknown backends; shm peers with private memory; a timeout option of
  // 0 or less.
  static StatusOr<std::unique_ptr<Receiver>> create(const Layout& layout, const Memory& memory,
                                                    ReceiverOptions options);
  ~Receiver();  // as ~Sender()
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  std::string backend() const;
  std::string routing() const;
  // Waits until every context rank this rank reads from completed its handshake: Timeout when
  // `timeout` passes first (0: only looks), a context rank's refusal as soon as it is known,
  // Unavailable after (or racing) shutdown().
  Status waitForPeers(std::chrono::milliseconds timeout);

  // Asks the context ranks for `request_id`'s state of `num_tokens` tokens, into `blocks`
  // (the request's block table; only the first blocksFor(num_tokens) are touched) and `slot`.
  // `prefix_tokens` (whole blocks) are already here and not sent; those blocks are never
  // written, so requests sharing a cached prefix may name them together. Errors: as
  // Sender::markReady for the pages (and a block still fenced by another request, naming it);
  // Unavailable / Incompatible when a needed context rank is down or refused (nothing stays
  // fenced).
  Status start(uint64_t request_id, uint32_t num_tokens, std::span<const uint32_t> blocks,
               std::optional<uint32_t> slot, uint32_t prefix_tokens = 0, std::string_view aux = {});
  // start() with the pages as one value (with `pages.group_slots` where the layout has several
  // state groups; errors as Sender::markReady's form of the same).
  Status start(uint64_t request_id, uint32_t num_tokens, const RankPages& pages,
               uint32_t prefix_tokens = 0, std::string_view aux = {});
  // Device pools: start() with `pages_free`, the engine's event after its last work on the
  // pages (the kernels of a request that held them before). No context rank is asked, so
  // nothing is written into them, before it is done: the engine need not synchronize first.
  // An event done with an error fails the request naming it; one never done fails it at
  // request_timeout. InvalidArgument: pools in host memory, a null event, one the device
  // cannot wait for; otherwise as start().
  Status start(uint64_t request_id, uint32_t num_tokens, const RankPages& pages,
               DeviceEvent pages_free, uint32_t prefix_tokens = 0, std::string_view aux = {});
  // The request's state now; NotFound for an unknown or released id.
  StatusOr<Result> poll(uint64_t request_id) const;
  // Waits for a terminal state; the in-progress result when `timeout` passes first.
  StatusOr<Result> wait(uint64_t request_id, std::chrono::milliseconds timeout);
  // Fails an in-progress request with Cancelled; its pages are released once no write into
  // them can still land. A no-op for a terminal request; NotFound for an unknown id.
  Status cancel(uint64_t request_id);
  // Forgets a terminal request and releases its pages (see the contract). InvalidArgument
  // while in progress, NotFound for an unknown id.
  Status release(uint64_t request_id);
  bool holds(uint64_t request_id) const;
  Metrics metrics() const;
  // As Sender::shutdown(); requests that succeeded and were not released stay the engine's
  // (release() still works; that release is not reported to on_released).
  void shutdown();

  struct Impl;

 private:
  explicit Receiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hxfer
