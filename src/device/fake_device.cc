#include "device/fake_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <map>
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

// Device address ranges and the writable host mapping behind each.
class FakeDevice::Aliases {
 public:
  void add(uint64_t base, uint64_t bytes, uint8_t* view) {
    std::lock_guard lock(mu_);
    ranges_[base] = Range{bytes, view};
  }
  void remove(uint64_t base) {
    std::lock_guard lock(mu_);
    ranges_.erase(base);
  }
  // The writable address of device address `a`; `a` itself where no range holds it.
  uint64_t translate(uint64_t a) const {
    std::lock_guard lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return a;
    --it;
    if (a - it->first >= it->second.bytes) return a;
    return reinterpret_cast<uint64_t>(it->second.view) + (a - it->first);
  }
  // A copy or pack table (HostCopyTable, HostPackTable) with every run's addresses translated.
  template <typename Table>
  Table translate(Table t) const {
    auto each = [&](auto& items) {
      for (auto& item : items) {
        item.src = translate(item.src);
        item.dst = translate(item.dst);
      }
    };
    if constexpr (requires { t.runs; }) {
      each(t.runs);
    } else {
      each(t.packs);
    }
    return t;
  }

 private:
  struct Range {
    uint64_t bytes;
    uint8_t* view;
  };
  mutable std::mutex mu_;
  std::map<uint64_t, Range> ranges_;
};

namespace {

// `bytes` of `fd` mapped PROT_NONE: a device address the host cannot touch.
StatusOr<uint8_t*> mapInaccessible(int fd, uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return ResourceExhausted("fake device: mapping " + std::to_string(bytes) +
                             " bytes without access failed");
  }
  return static_cast<uint8_t*>(p);
}

class FakeMapping : public Mapping {
 public:
  // `address`: the imported range's device address; `guard` (host_inaccessible) the
  // PROT_NONE mapping that holds it, registered in `aliases`.
  FakeMapping(std::unique_ptr<Region> region, uint64_t offset, uint64_t bytes,
              std::shared_ptr<FakeDevice::Aliases> aliases = nullptr, uint8_t* guard = nullptr)
      : region_(std::move(region)),
        offset_(offset),
        bytes_(bytes),
        aliases_(std::move(aliases)),
        guard_(guard) {}
  ~FakeMapping() override {
    if (guard_ == nullptr) return;
    aliases_->remove(reinterpret_cast<uint64_t>(guard_));
    munmap(guard_, region_->length());
  }
  uint64_t address() const override {
    return reinterpret_cast<uint64_t>(guard_ != nullptr ? guard_ : region_->data()) + offset_;
  }
  uint64_t bytes() const override { return bytes_; }

 private:
  std::unique_ptr<Region> region_;
  uint64_t offset_;
  uint64_t bytes_;
  std::shared_ptr<FakeDevice::Aliases> aliases_;
  uint8_t* guard_;
};

class FakeRegistration : public HostRegistration {};

class FakeBuffer : public DeviceBuffer {
 public:
  explicit FakeBuffer(std::shared_ptr<Region> region) : region_(std::move(region)) {}
  uint8_t* data() const override { return region_->data(); }
  uint64_t bytes() const override { return region_->length(); }

 private:
  std::shared_ptr<Region> region_;
};

}  // namespace

FakeDevice::FakeDevice(FakeDeviceOptions options)
    : options_(options), aliases_(std::make_shared<Aliases>()) {}
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
  if (options_.host_inaccessible) {
    // The caller gets the PROT_NONE mapping (a borrowed region over it); the writable one
    // lives as long as it, registered for the streams.
    ASSIGN_OR_RETURN(uint8_t * guard, mapInaccessible(region->fd(), bytes));
    auto borrowed = Region::borrow(0, guard, bytes, region->fd());
    if (!borrowed.isOk()) {
      munmap(guard, bytes);
      return borrowed.status();
    }
    const auto base = reinterpret_cast<uint64_t>(guard);
    aliases_->add(base, bytes, region->data());
    region = std::shared_ptr<Region>(borrowed->release(),
                                     [view = region, aliases = aliases_, base, bytes](Region* r) {
                                       aliases->remove(base);
                                       munmap(reinterpret_cast<void*>(base), bytes);
                                       delete r;
                                     });
  }
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
  if (!options_.host_inaccessible) {
    return std::unique_ptr<Mapping>(
        std::make_unique<FakeMapping>(std::move(region), range.offset, range.bytes));
  }
  ASSIGN_OR_RETURN(uint8_t * guard, mapInaccessible(region->fd(), range.allocation_bytes));
  aliases_->add(reinterpret_cast<uint64_t>(guard), range.allocation_bytes, region->data());
  return std::unique_ptr<Mapping>(
      std::make_unique<FakeMapping>(std::move(region), range.offset, range.bytes, aliases_, guard));
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
  if (!options_.host_inaccessible) {
    ops.copy = [op](const HostCopyTable& t) { return op([&] { runOnHost(t.view()); }); };
    ops.pack = [op](const HostPackTable& t) { return op([&] { runOnHost(t.view()); }); };
  } else {
    ops.copy = [op, a = aliases_](const HostCopyTable& t) {
      return op([&] { runOnHost(a->translate(t).view()); });
    };
    ops.pack = [op, a = aliases_](const HostPackTable& t) {
      return op([&] { runOnHost(a->translate(t).view()); });
    };
  }
  return makeWorkerStream(std::move(ops));
}

StatusOr<std::shared_ptr<const Event>> FakeDevice::captureEvent(const void* engine_event) {
  std::lock_guard lock(mu_);
  auto it = events_.find(engine_event);
  std::shared_ptr<ManualEvent> e = it == events_.end() ? nullptr : it->second.lock();
  if (!e) {
    return InvalidArgument(
        "fake device: " + std::to_string(reinterpret_cast<uint64_t>(engine_event)) +
        " is not an engine event of this device");
  }
  return std::shared_ptr<const Event>(std::move(e));
}

std::shared_ptr<ManualEvent> FakeDevice::engineEvent() {
  auto e = std::make_shared<ManualEvent>();
  std::lock_guard lock(mu_);
  std::erase_if(events_, [](const auto& kv) { return kv.second.expired(); });
  events_[e.get()] = e;
  return e;
}

StatusOr<std::unique_ptr<DeviceBuffer>> FakeDevice::allocateBuffer(int ordinal, uint64_t bytes) {
  ASSIGN_OR_RETURN(std::shared_ptr<Region> r, allocate(ordinal, bytes));
  return std::unique_ptr<DeviceBuffer>(std::make_unique<FakeBuffer>(std::move(r)));
}

uint8_t* FakeDevice::hostView(const void* ptr) const {
  return reinterpret_cast<uint8_t*>(aliases_->translate(reinterpret_cast<uint64_t>(ptr)));
}

StatusOr<std::unique_ptr<HostRegistration>> FakeDevice::registerHost(void* ptr, uint64_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return InvalidArgument("fake device: registering " + std::to_string(bytes) +
                           " bytes of host memory at a null pointer");
  }
  return std::unique_ptr<HostRegistration>(std::make_unique<FakeRegistration>());
}

}  // namespace hxfer::device
