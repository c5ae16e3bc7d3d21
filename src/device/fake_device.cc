#include "device/fake_device.h"

#include <unistd.h>

#include <string>
#include <thread>

#include "device/worker_stream.h"

namespace hxfer::device {

std::string_view handleKindName(HandleKind kind) {
  switch (kind) {
    case HandleKind::kPosixFd:
      return "posix-fd";
    case HandleKind::kLegacyIpc:
      return "legacy-ipc";
    case HandleKind::kFabric:
      return "fabric";
  }
  return "unknown";
}

ExportedRange::ExportedRange(ExportedRange&& o) noexcept { *this = std::move(o); }

ExportedRange& ExportedRange::operator=(ExportedRange&& o) noexcept {
  if (this == &o) return *this;
  if (fd >= 0) close(fd);
  kind = o.kind;
  handle = std::move(o.handle);
  fd = o.fd;
  o.fd = -1;
  allocation_bytes = o.allocation_bytes;
  offset = o.offset;
  bytes = o.bytes;
  device = o.device;
  return *this;
}

ExportedRange::~ExportedRange() {
  if (fd >= 0) close(fd);
}

// ---- ManualEvent ----

void ManualEvent::signal(Status status) {
  {
    std::lock_guard lock(mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }
  cv_.notify_all();
}

bool ManualEvent::done() const {
  std::lock_guard lock(mu_);
  return done_;
}

Status ManualEvent::wait(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    return Timeout("device event not done after " + std::to_string(timeout.count()) + " ms");
  }
  return status_;
}

Status ManualEvent::status() const {
  std::lock_guard lock(mu_);
  return status_;
}

// ---- FakeDevice ----

namespace {

class FakeMapping : public Mapping {
 public:
  FakeMapping(std::unique_ptr<Region> region, uint64_t offset, uint64_t bytes)
      : region_(std::move(region)), offset_(offset), bytes_(bytes) {}
  uint64_t address() const override {
    return reinterpret_cast<uint64_t>(region_->data()) + offset_;
  }
  uint64_t bytes() const override { return bytes_; }

 private:
  std::unique_ptr<Region> region_;
  uint64_t offset_;
  uint64_t bytes_;
};

class FakeRegistration : public HostRegistration {};

}  // namespace

FakeDevice::FakeDevice(FakeDeviceOptions options) : options_(options) {}
FakeDevice::~FakeDevice() = default;

DeviceId FakeDevice::idOf(int device) const {
  DeviceId id;
  id.ordinal = device;
  id.uuid = {0xfa, 0x4e, 0xde, 0x71, 0xce, 0, 0, 0,
             0,    0,    0,    0,    0,    0, 0, static_cast<uint8_t>(device)};
  return id;
}

Status FakeDevice::checkDevice(int device) const {
  if (device < 0 || device >= options_.devices) {
    return InvalidArgument("fake device: no device " + std::to_string(device) + " (it has " +
                           std::to_string(options_.devices) + ")");
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<Region>> FakeDevice::allocate(int device, uint64_t bytes) {
  RETURN_IF_ERROR(checkDevice(device));
  ASSIGN_OR_RETURN(std::unique_ptr<Region> r,
                   Region::allocate(0, bytes, Region::Backing::kMemfd,
                                    "hxfer-fake-device-" + std::to_string(device)));
  std::shared_ptr<Region> region(std::move(r));
  std::lock_guard lock(mu_);
  std::erase_if(allocations_, [](const Allocation& a) { return a.region.expired(); });
  allocations_.push_back(
      Allocation{region, reinterpret_cast<uint64_t>(region->data()), bytes, device});
  return region;
}

StatusOr<DeviceId> FakeDevice::owner(const void* ptr, uint64_t bytes) const {
  const auto p = reinterpret_cast<uint64_t>(ptr);
  std::lock_guard lock(mu_);
  for (const Allocation& a : allocations_) {
    if (a.region.expired() || p < a.base || p >= a.base + a.bytes) continue;
    if (bytes > a.base + a.bytes - p) {
      return InvalidArgument("fake device: " + std::to_string(bytes) + " bytes at offset " +
                             std::to_string(p - a.base) + " run past the end of an allocation of " +
                             std::to_string(a.bytes) + " bytes on device " +
                             std::to_string(a.device));
    }
    return idOf(a.device);
  }
  return NotFound("fake device: host memory, not an allocation of the fake device");
}

StatusOr<ExportedRange> FakeDevice::exportRange(const void* ptr, uint64_t bytes) {
  ASSIGN_OR_RETURN(DeviceId id, owner(ptr, bytes));
  const auto p = reinterpret_cast<uint64_t>(ptr);
  std::shared_ptr<Region> region;
  uint64_t base = 0;
  {
    std::lock_guard lock(mu_);
    for (const Allocation& a : allocations_) {
      if (p >= a.base && p < a.base + a.bytes) {
        region = a.region.lock();
        base = a.base;
      }
    }
  }
  if (!region) return NotFound("fake device: the allocation was freed while exporting");
  ExportedRange out;
  out.kind = HandleKind::kPosixFd;
  out.fd = dup(region->fd());
  if (out.fd < 0) return ResourceExhausted("fake device: dup of the allocation's fd failed");
  out.allocation_bytes = region->length();
  out.offset = p - base;
  out.bytes = bytes;
  out.device = id;
  return out;
}

StatusOr<std::unique_ptr<Mapping>> FakeDevice::importRange(ExportedRange range,
                                                           int /*access_ordinal*/) {
  if (range.kind != HandleKind::kPosixFd) {
    return Incompatible("fake device: cannot import a " + std::string(handleKindName(range.kind)) +
                        " handle (the fake exports and maps posix-fd only)");
  }
  if (range.fd < 0) return InvalidArgument("fake device: posix-fd range without an fd");
  if (range.offset > range.allocation_bytes ||
      range.bytes > range.allocation_bytes - range.offset) {
    return InvalidArgument("fake device: range [" + std::to_string(range.offset) + ", +" +
                           std::to_string(range.bytes) + ") runs past its allocation of " +
                           std::to_string(range.allocation_bytes) + " bytes");
  }
  const int fd = range.fd;
  range.fd = -1;  // mapFd owns it from here, on error too
  ASSIGN_OR_RETURN(std::unique_ptr<Region> region, Region::mapFd(0, fd, range.allocation_bytes));
  return std::unique_ptr<Mapping>(
      std::make_unique<FakeMapping>(std::move(region), range.offset, range.bytes));
}

StatusOr<std::unique_ptr<Stream>> FakeDevice::createStream(int ordinal) {
  RETURN_IF_ERROR(checkDevice(ordinal));
  // An op: the options' delay, then the emulated launch, or the failure the options ask for.
  auto op = [this, ordinal](auto run) -> Status {
    if (options_.op_delay.count() > 0) std::this_thread::sleep_for(options_.op_delay);
    const uint64_t n = ++ops_;
    if (options_.fail_every != 0 && n % options_.fail_every == 0) {
      return Internal("fake device: op " + std::to_string(n) + " failed (device " +
                      std::to_string(ordinal) + ")");
    }
    run();
    return OkStatus();
  };
  StreamOps ops;
  ops.copy = [op](const HostCopyTable& t) { return op([&] { runOnHost(t.view()); }); };
  ops.pack = [op](const HostPackTable& t) { return op([&] { runOnHost(t.view()); }); };
  return makeWorkerStream(std::move(ops));
}

StatusOr<std::unique_ptr<HostRegistration>> FakeDevice::registerHost(void* ptr, uint64_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return InvalidArgument("fake device: registering " + std::to_string(bytes) +
                           " bytes of host memory at a null pointer");
  }
  return std::unique_ptr<HostRegistration>(std::make_unique<FakeRegistration>());
}

}  // namespace hxfer::device
