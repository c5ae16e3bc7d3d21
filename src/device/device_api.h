// The seam between hxfer and a device runtime: which device owns a pointer, exporting a range
// of device memory for a peer and mapping a peer's, queues of device work (the batched copy and
// the pack of copy_table.h) and the events that order them against each other and against the
// engine's own work, and host memory registered for staging.
//
// Two implementations: FakeDevice (fake_device.h), host memory behind the same interface, so
// that everything above the seam (handshake, handle frames, region lifetime, fences, cancel,
// peer loss) runs in CI without a GPU; and the CUDA one, which comes with the same-host cuda
// transport (docs/gpu.md says what is built).
//
// Thread-safety: a DeviceApi is thread-safe. A Stream is used by one thread at a time; its
// work runs in the order it was queued. Events are thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "device/copy_table_builder.h"

namespace hxfer::device {

// A device: its ordinal in this process and its UUID (which names it across processes).
struct DeviceId {
  int ordinal = -1;
  std::array<uint8_t, 16> uuid{};
  bool operator==(const DeviceId&) const = default;
};

// How a peer maps an exported range: a POSIX fd passed over a Unix socket (CUDA VMM memory
// exported as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; the fake's memfds), a legacy CUDA IPC
// handle (cudaMalloc memory, 64 bytes) or a fabric handle (VMM memory on NVLink fabrics, 64
// bytes).
enum class HandleKind : uint8_t { kPosixFd = 1, kLegacyIpc = 2, kFabric = 3 };
std::string_view handleKindName(HandleKind kind);

// What a peer needs to map `bytes` of this process's device memory: the handle of the
// allocation that holds them and their offset in it. Owns `fd` (closed with the object).
struct ExportedRange {
  ExportedRange() = default;
  ExportedRange(ExportedRange&& o) noexcept;
  ExportedRange& operator=(ExportedRange&& o) noexcept;
  ~ExportedRange();

  HandleKind kind = HandleKind::kPosixFd;
  std::vector<uint8_t> handle;  // kLegacyIpc, kFabric: the runtime's handle bytes
  int fd = -1;                  // kPosixFd
  uint64_t allocation_bytes = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  DeviceId device;
};

// A peer's range mapped here; unmapped when destroyed.
class Mapping {
 public:
  virtual ~Mapping() = default;
  virtual uint64_t address() const = 0;  // of the exported range's first byte
  virtual uint64_t bytes() const = 0;
};

// A point in a stream's work: done once everything queued before it finished. status() is
// the first error of that work (Cancelled when the stream was destroyed first).
class Event {
 public:
  virtual ~Event() = default;
  virtual bool done() const = 0;
  // Waits until done or `timeout`; Timeout naming the wait when it is not done by then,
  // otherwise status().
  virtual Status wait(std::chrono::milliseconds timeout) const = 0;
  virtual Status status() const = 0;
};

// An in-order queue of device work on one device.
class Stream {
 public:
  virtual ~Stream() = default;
  // Queues one batched copy or one pack; the event is done when it finished. The table itself
  // is taken at the call; the memory its addresses name must stay valid until then.
  virtual StatusOr<std::shared_ptr<Event>> copy(const HostCopyTable& table) = 0;
  virtual StatusOr<std::shared_ptr<Event>> pack(const HostPackTable& table) = 0;
  // Work queued after this call starts only once `event` is done (another stream's, or one the
  // engine records: "these pages are free"). Its error does not stop the stream.
  virtual Status waitFor(std::shared_ptr<const Event> event) = 0;
  // An event that is done when everything queued so far finished.
  virtual StatusOr<std::shared_ptr<Event>> record() = 0;
};

// Device memory hxfer allocated for itself (a pack's staging area); freed when destroyed.
// REQUIRES: no device work that uses it is still queued or running then.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual uint8_t* data() const = 0;
  virtual uint64_t bytes() const = 0;
};

// Host memory registered with the device for staging; unregistered when destroyed.
class HostRegistration {
 public:
  virtual ~HostRegistration() = default;
};

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;
  virtual std::string_view name() const = 0;  // "fake", "cuda"
  // The device whose memory [ptr, ptr + bytes) is. NotFound when it is host memory the device
  // does not own; InvalidArgument naming the allocation when the range runs past its end.
  virtual StatusOr<DeviceId> owner(const void* ptr, uint64_t bytes) const = 0;
  // A handle for [ptr, ptr + bytes) that a peer process can map (owner()'s errors).
  virtual StatusOr<ExportedRange> exportRange(const void* ptr, uint64_t bytes) = 0;
  // Maps a range a peer exported, for the kernels of local device `access_ordinal` to write
  // (-1: the device the range's UUID names where this process sees it, else device 0).
  // InvalidArgument naming the field for a range that does not fit its allocation,
  // Incompatible for a handle kind this device cannot import.
  virtual StatusOr<std::unique_ptr<Mapping>> importRange(ExportedRange range,
                                                         int access_ordinal = -1) = 0;
  virtual StatusOr<std::unique_ptr<Stream>> createStream(int ordinal) = 0;
  // `bytes` of device `ordinal`'s memory. ResourceExhausted when it cannot be had.
  virtual StatusOr<std::unique_ptr<DeviceBuffer>> allocateBuffer(int ordinal, uint64_t bytes) = 0;
  virtual StatusOr<std::unique_ptr<HostRegistration>> registerHost(void* ptr, uint64_t bytes) = 0;
  // The engine's event `engine_event` (a cudaEvent_t; the fake's: one of its engineEvent()s)
  // as recorded at this call: done once the work recorded before it on the engine's stream
  // is. The engine may record it again or destroy it after the call. InvalidArgument for one
  // this device cannot wait for.
  virtual StatusOr<std::shared_ptr<const Event>> captureEvent(const void* engine_event) = 0;
};

}  // namespace hxfer::device
