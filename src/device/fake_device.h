// FakeDevice: DeviceApi over host memory, for CI without a GPU. Its "device memory" is memfd
// regions it allocates (so ranges export as fds and a peer process maps them), its streams are
// a worker thread each that runs the batched copy and the pack as a launch's threads would
// (runOnHost), and engine events are ManualEvents a test signals when it likes. Faults: a
// delay before each op, and ops that fail.
//
// With `host_inaccessible`, device memory is as out of the host's reach as a GPU's: its
// addresses (allocations and imported ranges) are PROT_NONE mappings, so host code that reads
// or writes them faults, while the streams copy and pack through a second, writable mapping of
// the same memfd. Tests read and fill it through hostView().
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cache/region.h"
#include "device/device_api.h"

namespace hxfer::device {

struct FakeDeviceOptions {
  int devices = 1;
  std::chrono::microseconds op_delay{0};  // before each copy or pack runs
  // Ops whose number (counted from 1 over all streams) is a multiple of this fail with
  // Internal ("fake device: op N failed"); 0: none fail.
  uint64_t fail_every = 0;
  bool host_inaccessible = false;
};

// An event the engine side records and signals (a fence a test controls).
class ManualEvent : public Event {
 public:
  void signal(Status status = OkStatus());
  bool done() const override;
  Status wait(std::chrono::milliseconds timeout) const override;
  Status status() const override;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

class FakeDevice : public DeviceApi {
 public:
  explicit FakeDevice(FakeDeviceOptions options = {});
  ~FakeDevice() override;

  // "Device memory" of `device`: `bytes` in a memfd region, freed with the returned region.
  // REQUIRES: the region outlives every range exported from it that is still mapped here.
  StatusOr<std::shared_ptr<Region>> allocate(int device, uint64_t bytes);

  std::string_view name() const override { return "fake"; }
  StatusOr<DeviceId> owner(const void* ptr, uint64_t bytes) const override;
  StatusOr<ExportedRange> exportRange(const void* ptr, uint64_t bytes) override;
  StatusOr<std::unique_ptr<Mapping>> importRange(ExportedRange range,
                                                 int access_ordinal = -1) override;
  StatusOr<std::unique_ptr<Stream>> createStream(int ordinal) override;
  // allocate()'s memory as a DeviceBuffer.
  StatusOr<std::unique_ptr<DeviceBuffer>> allocateBuffer(int ordinal, uint64_t bytes) override;
  StatusOr<std::unique_ptr<HostRegistration>> registerHost(void* ptr, uint64_t bytes) override;
  // One of engineEvent()'s, by its address while it lives.
  StatusOr<std::shared_ptr<const Event>> captureEvent(const void* engine_event) override;

  // An engine event: its address is what the engine passes (as it would a cudaEvent_t), and
  // the test signals it.
  std::shared_ptr<ManualEvent> engineEvent();

  uint64_t opsRun() const { return ops_.load(); }

  // Where the host reaches the device byte at `ptr` (an allocation's or an imported range's):
  // the writable mapping behind it with host_inaccessible, `ptr` itself otherwise or for
  // memory that is not the device's.
  uint8_t* hostView(const void* ptr) const;

  // The writable mappings behind device addresses (host_inaccessible), shared with the
  // streams and the imported ranges.
  class Aliases;

 private:
  struct Allocation {
    std::weak_ptr<Region> region;
    uint64_t base = 0;
    uint64_t bytes = 0;
    int device = 0;
  };
  DeviceId idOf(int device) const;
  Status checkDevice(int device) const;

  const FakeDeviceOptions options_;
  mutable std::mutex mu_;
  std::vector<Allocation> allocations_;  // live ones (expired entries are skipped)
  std::map<const void*, std::weak_ptr<ManualEvent>> events_;  // engineEvent()s
  std::atomic<uint64_t> ops_{0};
  std::shared_ptr<Aliases> aliases_;
};

}  // namespace hxfer::device
